#include "service/service_thread.hpp"

#include "log/logger.hpp"

#include <handoff/internal/runtime_thread.hpp>

#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include <memory>

#include <future>

namespace handoff::detail {

service_thread::service_thread()
    : guard_(boost::asio::make_work_guard(io_)), thread_(start_runtime_thread([this] {
        for (;;) {
          try {
            io_.run();
            return;
          } catch (const std::exception& e) {
            HANDOFF_LOG_ERROR("service thread: a task threw ({}); continuing", e.what());
          }
        }
      }))
{}

service_thread::~service_thread()
{
  guard_.reset();  // run() returns once the queue is empty
  if (thread_.joinable()) { thread_.join(); }
}

void service_thread::post(std::function<void()> work)
{
  boost::asio::post(io_, std::move(work));
}

void service_thread::post_after(std::chrono::nanoseconds delay, std::function<void()> work)
{
  auto timer = std::make_shared<boost::asio::steady_timer>(io_, delay);
  timer->async_wait([timer, work = std::move(work)](const boost::system::error_code&) { work(); });
}

bool service_thread::runs_on_this_thread() const noexcept
{
  return std::this_thread::get_id() == thread_.get_id();
}

void service_thread::drain()
{
  if (runs_on_this_thread()) { return; }
  std::promise<void> done;
  auto finished = done.get_future();
  post([&done] { done.set_value(); });
  finished.wait();
}

}  // namespace handoff::detail

namespace handoff {

std::unique_ptr<executor> make_service_thread()
{
  return std::make_unique<detail::service_thread>();
}

}  // namespace handoff
