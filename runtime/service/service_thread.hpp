// Private: the runtime's service thread, an Asio io_context run by one std::thread.
#pragma once

#include <handoff/context.hpp>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#include <thread>

namespace handoff::detail {

/// Runs posted work in order on one thread. The destructor lets pending work finish, then joins.
class service_thread final : public executor {
 public:
  service_thread();
  service_thread(const service_thread&) = delete;
  service_thread& operator=(const service_thread&) = delete;
  service_thread(service_thread&&) = delete;
  service_thread& operator=(service_thread&&) = delete;
  ~service_thread() override;

  void post(std::function<void()> work) override;
  void post_after(std::chrono::nanoseconds delay, std::function<void()> work) override;
  void drain() override;
  [[nodiscard]] bool runs_on_this_thread() const noexcept override;

  /// The io_context the thread runs, for services of its own (the trace socket).
  [[nodiscard]] boost::asio::io_context& io() noexcept { return io_; }

 private:
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> guard_;
  std::thread thread_;
};

}  // namespace handoff::detail
