// Private: blocks of one size that a thread freed, kept for its next allocations of that size.
#pragma once

#include "core/thread_exit.hpp"

#include <array>
#include <cstddef>
#include <new>

namespace handoff::detail {

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HANDOFF_ADDRESS_SANITIZER 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(HANDOFF_ADDRESS_SANITIZER)
inline constexpr bool keep_freed_blocks = false;  // AddressSanitizer must see each use after free
#else
inline constexpr bool keep_freed_blocks = true;
#endif

/// What every import allocates and frees (a producer's state, an export's tensor) comes and goes
/// per call, where the allocator's round trip cost about a tenth of the exchange: a thread keeps up
/// to `Kept` blocks of `BlockSize` bytes it freed and hands them out again. A block may be freed on
/// another thread than the one that allocated it. What a thread keeps goes back to the allocator
/// when the thread exits; a block freed after that (by another thread-exit destructor) goes at once.
template <std::size_t BlockSize, std::size_t Kept = 16>
class thread_block_cache {
 public:
  /// A block of `BlockSize` bytes, aligned as operator new aligns. @throws std::bad_alloc.
  [[nodiscard]] static void* allocate()
  {
    if (void* block = local().take()) { return block; }
    return ::operator new(BlockSize);
  }
  /// Gives back a block allocate() returned, on any thread.
  static void deallocate(void* block) noexcept { local().keep_or_free(block); }

 private:
  // Constant-initialized and trivially destructible, so reaching it needs no guard, and a block
  // freed while the thread exits still finds it; the closer gives its blocks back.
  struct blocks {
    std::array<void*, Kept> kept{};
    std::size_t count{0};
    bool closer_made{false};
    bool closed{false};

    void* take() noexcept { return count == 0 ? nullptr : kept[--count]; }
    void keep_or_free(void* block) noexcept
    {
      if (keep_freed_blocks && !closed && count < Kept) {
        if (!closer_made) { make_closer(); }
        kept[count++] = block;
        return;
      }
      ::operator delete(block);
    }
    void close() noexcept
    {
      closed = true;
      while (count > 0) { ::operator delete(kept[--count]); }
    }
    void make_closer() noexcept
    {
      call_at_thread_exit<&close_local>();
      closer_made = true;
    }
    static void close_local() noexcept { local().close(); }
  };

  // Out of line: in a shared library each use of a thread-local is a call (__tls_get_addr), which
  // GCC makes again after every call in between; a reference returned by a call is kept instead.
  [[gnu::noinline]] static blocks& local() noexcept
  {
    thread_local blocks mine;
    return mine;
  }
};

}  // namespace handoff::detail
