#include <handoff/detail/spin_lock.hpp>

#include <thread>

namespace handoff::detail {

void spin_lock::wait() const noexcept
{
  while (locked_.load(std::memory_order_relaxed)) { std::this_thread::yield(); }
}

}  // namespace handoff::detail
