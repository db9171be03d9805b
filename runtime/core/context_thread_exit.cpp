#include "core/context_impl.hpp"

#include <handoff/device_guard.hpp>
#include <handoff/internal/counters.hpp>

#include "log/logger.hpp"

#include <unistd.h>

#include <algorithm>

namespace handoff {

// The per-thread default streams the calling thread named to contexts, by device: when the thread
// ends, each context's legacy default stream of that device waits for that stream's work.
struct context::impl::thread_exit_orders {
  thread_exit_orders() = default;
  thread_exit_orders(const thread_exit_orders&) = delete;
  thread_exit_orders& operator=(const thread_exit_orders&) = delete;
  thread_exit_orders(thread_exit_orders&&) = delete;
  thread_exit_orders& operator=(thread_exit_orders&&) = delete;
  ~thread_exit_orders()
  {
    // A forked child's one thread is a copy of the parent's that forked: the contexts it named
    // streams to are the parent's, whose threads (and a mutex one of them may have held) the child
    // has not, nor may it use their device.
    if (getpid() != named_in) { return; }
    for (const auto& [shared, device] : streams) {
      std::unique_lock lock{shared->mutex};
      impl* owner = shared->owner;
      lock.unlock();  // not held across backend calls: a graph's release callback takes it from inside one
      if (owner != nullptr) { owner->order_legacy_after_this_thread(device); }
    }
  }

  std::vector<std::pair<std::shared_ptr<shared_state>, int>> streams;
  pid_t named_in{getpid()};  // the process whose thread named them
};

device::stream_handle context::impl::thread_independent(int device, device::stream_handle stream) noexcept
{
  if (stream != backend_.per_thread_default_stream()) { return stream; }
  try {
    thread_local thread_exit_orders orders;
    const auto named = std::find_if(orders.streams.begin(), orders.streams.end(), [&](const auto& entry) {
      return entry.first == shared_ && entry.second == device;
    });
    if (named == orders.streams.end()) { orders.streams.emplace_back(shared_, device); }
  } catch (...) {
    HANDOFF_LOG_WARN(
      "out of memory: the legacy default stream of device {} will not wait for this thread's "
      "per-thread default stream when the thread ends",
      device);
  }
  return backend_.legacy_default_stream();
}

void context::impl::order_legacy_after_this_thread(int device) noexcept
{
  try {
    device_guard on_device{backend_, device};
    const auto legacy = backend_.legacy_default_stream();
    // A wait on the legacy stream while a blocking stream of its device captures would invalidate
    // that capture; the ending thread's work is then ordered by the implicit rule alone.
    if (backend_.stream_capture_status(legacy) != device::capture_status::none) {
      HANDOFF_LOG_WARN(
        "a thread ended while device {} captures: its per-thread default stream's work is not "
        "explicitly ordered before the legacy default stream's",
        device);
      return;
    }
    const pooled_event ended = events_.record(device, backend_.per_thread_default_stream());
    backend_.stream_wait_event(legacy, ended.get());
    count(counter::waits_inserted);
  } catch (const std::exception& e) {
    HANDOFF_LOG_DEBUG(
      "a thread's end: its per-thread default stream of device {} could not be ordered before the "
      "legacy default stream ({})",
      device, e.what());
  }
}

}  // namespace handoff
