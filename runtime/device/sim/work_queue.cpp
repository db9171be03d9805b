#if defined(__SANITIZE_THREAD__) && !defined(BOOST_ASIO_DISABLE_FENCED_BLOCK)
// Asio's fenced blocks use std::atomic_thread_fence, which TSan does not model (-Wtsan). Handlers
// reach the workers through the io_context's mutex-protected queue, which TSan does see. (Every
// TU that includes Asio should agree on this; the build may define it for all of them.)
#define BOOST_ASIO_DISABLE_FENCED_BLOCK 1
#endif

#include "device/sim/work_queue.hpp"

#include "log/logger.hpp"

#include <handoff/internal/runtime_thread.hpp>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/strand.hpp>

#include <deque>
#include <exception>
#include <thread>
#include <unordered_set>
#include <utility>

namespace handoff::device::sim_detail {

namespace asio = boost::asio;
using std::chrono::nanoseconds;

namespace {

constexpr unsigned worker_threads = 8;  // host functions may block; keep a few spare workers

thread_local bool in_host_function = false;

}  // namespace

struct node {
  work what;
  bool trivial{false};                  // no body and no delay: completes where it becomes ready
  std::atomic<std::size_t> pending{1};  // unfinished dependencies, plus one held by submit()
  std::mutex mutex;
  std::condition_variable done_cv;
  bool done{false};                  // guarded by mutex
  std::vector<node_ptr> dependents;  // guarded by mutex; released when done
  // A gate: its holder, and whether it is still closed (it then holds one unit of `pending`).
  gate_holder holder{any_holder};
  std::atomic<bool> closed{false};
  // The dependencies it had at submission, recorded only while some gate was closed: a node
  // submitted while none was cannot wait for one (a gate closed now was closed since it was
  // submitted, and dependencies point to earlier nodes). Read by closed_gate_before.
  std::vector<std::weak_ptr<node>> waits_on;
};

class lane {
 public:
  explicit lane(asio::io_context& io) : strand_(asio::make_strand(io)) {}
  asio::strand<asio::io_context::executor_type>& strand() noexcept { return strand_; }

 private:
  asio::strand<asio::io_context::executor_type> strand_;
};

bool inside_host_function() noexcept
{
  return in_host_function;
}

bool is_closed_gate(const node_ptr& n)
{
  return n && n->closed.load(std::memory_order_acquire);
}

bool is_done(const node_ptr& n)
{
  if (!n) { return true; }
  std::lock_guard lock(n->mutex);
  return n->done;
}

void wait_for(const node_ptr& n)
{
  if (!n) { return; }
  std::unique_lock lock(n->mutex);
  n->done_cv.wait(lock, [&] { return n->done; });
}

struct worker_pool::state {
  state() : guard(asio::make_work_guard(io))
  {
    threads.reserve(worker_threads);
    for (unsigned i = 0; i < worker_threads; ++i) {
      threads.push_back(handoff::detail::start_runtime_thread([this] { io.run(); }));
    }
  }

  // Makes `n` wait for `deps`, and starts it if it waits for nothing more.
  void add(const node_ptr& n, const std::vector<node_ptr>& deps)
  {
    const bool traced = closed_gates.load(std::memory_order_acquire) > 0;
    {
      std::lock_guard lock(count_mutex);
      ++outstanding;
    }
    for (const auto& dep : deps) {
      if (!dep) { continue; }
      std::lock_guard lock(dep->mutex);
      if (!dep->done) {
        dep->dependents.push_back(n);
        n->pending.fetch_add(1, std::memory_order_relaxed);
        if (traced) { n->waits_on.push_back(dep); }
      }
    }
    if (n->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) { start(n); }
  }

  void start(const node_ptr& n)
  {
    if (n->trivial) {
      complete(n);
    } else if (n->what.delay > nanoseconds::zero()) {
      auto timer = std::make_shared<asio::steady_timer>(io, n->what.delay);
      timer->async_wait([this, n, timer](const boost::system::error_code&) { dispatch(n); });
    } else {
      dispatch(n);
    }
  }

  void dispatch(const node_ptr& n)
  {
    if (n->what.serial != nullptr) {
      asio::post(n->what.serial->strand(), [this, n] { run(n); });
    } else {
      asio::post(io, [this, n] { run(n); });
    }
  }

  void run(const node_ptr& n) noexcept
  {
    const bool halted = n->what.halted != nullptr && n->what.halted->load(std::memory_order_acquire);
    if (n->what.body && !halted) {
      auto body = std::move(n->what.body);
      in_host_function = n->what.serial != nullptr;
      try {
        body();
      } catch (const std::exception& e) {
        HANDOFF_LOG_ERROR("sim: stream work threw: {}", e.what());
      } catch (...) {
        HANDOFF_LOG_ERROR("sim: stream work threw a non-standard exception");
      }
      in_host_function = false;
    }
    n->what.body = nullptr;  // a skipped body's captures go now, not with the last reference
    complete(n);
  }

  // Iterative so that a long chain of markers does not recurse.
  void complete(const node_ptr& first) noexcept
  {
    std::vector<node_ptr> ready{first};
    while (!ready.empty()) {
      node_ptr n = std::move(ready.back());
      ready.pop_back();
      std::vector<node_ptr> dependents;
      {
        std::lock_guard lock(n->mutex);
        n->done = true;
        dependents.swap(n->dependents);
        n->done_cv.notify_all();
      }
      for (auto& d : dependents) {
        if (d->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) {
          if (d->trivial) {
            ready.push_back(std::move(d));
          } else {
            start(d);
          }
        }
      }
      std::lock_guard lock(count_mutex);
      if (--outstanding == 0) { idle_cv.notify_all(); }
    }
  }

  asio::io_context io;
  asio::executor_work_guard<asio::io_context::executor_type> guard;
  std::vector<std::thread> threads;
  std::deque<lane> lanes;  // stable addresses
  std::mutex count_mutex;
  std::condition_variable idle_cv;
  std::size_t outstanding{0};  // guarded by count_mutex
  std::atomic<std::size_t> closed_gates{0};
};

worker_pool::worker_pool() : state_(std::make_unique<state>()) {}

worker_pool::~worker_pool()
{
  shutdown();
}

void worker_pool::shutdown() noexcept
{
  {
    std::unique_lock lock(state_->count_mutex);
    state_->idle_cv.wait(lock, [&] { return state_->outstanding == 0; });
  }
  state_->guard.reset();
  for (auto& t : state_->threads) {
    if (t.joinable()) { t.join(); }
  }
}

lane& worker_pool::make_lane()
{
  return state_->lanes.emplace_back(state_->io);
}

node_ptr worker_pool::submit(work w, const std::vector<node_ptr>& deps)
{
  auto n = std::make_shared<node>();
  n->trivial = !w.body && w.delay <= nanoseconds::zero();
  n->what = std::move(w);
  state_->add(n, deps);
  return n;
}

node_ptr worker_pool::submit_gate(gate_holder holder, const std::vector<node_ptr>& deps)
{
  auto n = std::make_shared<node>();
  n->trivial = true;
  n->holder = holder;
  n->closed.store(true, std::memory_order_release);
  n->pending.fetch_add(1, std::memory_order_relaxed);  // the unit open_gate gives back
  state_->add(n, deps);                                // traced when an earlier gate is closed
  state_->closed_gates.fetch_add(1, std::memory_order_acq_rel);
  return n;
}

void worker_pool::open_gate(const node_ptr& gate)
{
  if (!gate || !gate->closed.exchange(false, std::memory_order_acq_rel)) { return; }
  state_->closed_gates.fetch_sub(1, std::memory_order_acq_rel);
  if (gate->pending.fetch_sub(1, std::memory_order_acq_rel) == 1) { state_->start(gate); }
}

node_ptr worker_pool::closed_gate_before(const node_ptr& target, gate_holder holder)
{
  if (state_->closed_gates.load(std::memory_order_acquire) == 0) { return nullptr; }
  std::vector<node_ptr> unvisited{target};
  std::unordered_set<const node*> seen;
  while (!unvisited.empty()) {
    node_ptr n = std::move(unvisited.back());
    unvisited.pop_back();
    if (!n || !seen.insert(n.get()).second || is_done(n)) { continue; }
    if (is_closed_gate(n) && (holder == any_holder || n->holder == holder)) { return n; }
    for (const auto& dep : n->waits_on) {
      if (auto live = dep.lock()) { unvisited.push_back(std::move(live)); }
    }
  }
  return nullptr;
}

}  // namespace handoff::device::sim_detail
