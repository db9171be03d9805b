// Private: work a thread does when it exits, for per-thread state kept trivially destructible.
#pragma once

namespace handoff::detail {

/// Makes the calling thread call `Close` when it exits (once, however often this is called).
/// State that stays constant-initialized and trivially destructible is reached without a guard and
/// is still there for a thread-exit destructor that runs after `Close`; what it owns goes here.
template <void (*Close)() noexcept>
void call_at_thread_exit() noexcept
{
  struct closer {
    closer() noexcept = default;
    closer(const closer&) = delete;
    closer& operator=(const closer&) = delete;
    closer(closer&&) = delete;
    closer& operator=(closer&&) = delete;
    ~closer() { Close(); }
  };
  thread_local const closer close_at_exit;
  (void)close_at_exit;
}

}  // namespace handoff::detail
