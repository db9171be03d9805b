// A test-and-set lock for the few stores every exchange makes under a lock of its own.
#pragma once

#include <atomic>

namespace handoff::detail {

/// A lock held for a handful of loads and stores, taken far more often than contended: taking and
/// giving back a std::mutex costs about 60 instructions, this lock two atomic operations. A waiter
/// yields until the lock looks free. Trivially destructible and constant-initialised, so that it
/// may be used before and after static construction and destruction. BasicLockable (std::lock_guard).
class spin_lock {
 public:
  void lock() noexcept
  {
    while (locked_.exchange(true, std::memory_order_acquire)) { wait(); }
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  void wait() const noexcept;  // until the lock looks free

  std::atomic<bool> locked_{false};
};

}  // namespace handoff::detail
