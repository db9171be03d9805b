// The list of tracked views behind handoff::tracked_view: inline, because every import and export
// joins and leaves it.
#pragma once

#include <atomic>

namespace handoff {
class tracked_view;
}

namespace handoff::detail {

/// An intrusive list under a test-and-set lock: joining or leaving is a handful of stores, shorter
/// than a mutex's own bookkeeping. A snapshot, the one long holder, is rare; waiters yield to it.
/// Trivially destructible, so that views may leave it after static destruction.
struct view_list {
  std::atomic<bool> locked{false};
  tracked_view* head{nullptr};

  void lock() noexcept
  {
    while (locked.exchange(true, std::memory_order_acquire)) { wait(); }
  }
  void unlock() noexcept { locked.store(false, std::memory_order_release); }

 private:
  void wait() noexcept;  // until the lock looks free
};

/// The process's tracked views.
extern view_list tracked_views;

}  // namespace handoff::detail
