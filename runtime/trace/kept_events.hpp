// Private: the events a trace session keeps, in memory mapped for them, outside the program's heap.
//
// A trace keeps what it records while the program runs. Kept in the program's heap, an event's
// small blocks (its shape, its user line) are carved out of the holes the program's own freed
// temporaries leave there, so the program's next temporaries land on fresh pages, a page fault
// each, step after step: a traced NumPy and PyTorch loop grew its heap by about 150 KiB a step so,
// and ran 1.2-1.7 times slower than with the trace's events kept here (docs/benchmarks.md).
#pragma once

#include <handoff/trace.hpp>

#include <cstddef>
#include <cstdint>
#include <new>
#include <span>
#include <string_view>
#include <utility>

namespace handoff::trace::detail {

/// `bytes` mapped for themselves (whole pages; not zeroed: a mapping given back lately is reused).
/// @throws std::bad_alloc
[[nodiscard]] void* map_pages(std::size_t bytes);
/// Unmaps what map_pages(bytes) returned.
void unmap_pages(void* pages, std::size_t bytes) noexcept;

/// An allocator that maps each allocation for itself, for the containers a session keeps.
template <class T>
struct mapped_allocator {
  using value_type = T;
  mapped_allocator() noexcept = default;
  template <class U>
  mapped_allocator(const mapped_allocator<U>& /*other*/) noexcept  // NOLINT(google-explicit-constructor): rebinds
  {}
  // T is a pointer where a deque rebinds this allocator for its block map.
  [[nodiscard]] T* allocate(std::size_t count)
  {
    return static_cast<T*>(map_pages(count * sizeof(T)));  // NOLINT(bugprone-sizeof-expression)
  }
  void deallocate(T* block, std::size_t count) noexcept
  {
    unmap_pages(block, count * sizeof(T));  // NOLINT(bugprone-sizeof-expression)
  }
  friend bool operator==(const mapped_allocator& /*a*/, const mapped_allocator& /*b*/) noexcept { return true; }
};

/// Room for kept events' variable-size parts, in mapped chunks of at least 256 KiB; a chunk no kept
/// event uses any more is unmapped (the newest one is reused instead). Not thread-safe: a session is
/// used under the recorder's lock.
class payload_arena {
 public:
  struct chunk;

  payload_arena() = default;
  payload_arena(const payload_arena&) = delete;
  payload_arena& operator=(const payload_arena&) = delete;
  payload_arena(payload_arena&&) = delete;
  payload_arena& operator=(payload_arena&&) = delete;
  ~payload_arena();

  /// `bytes` (a multiple of 8), aligned to 8, in the newest chunk or a new one, which counts one more
  /// user. @throws std::bad_alloc
  [[nodiscard]] std::pair<std::byte*, chunk*> allocate(std::size_t bytes);
  /// One user of `in` fewer (null: nothing).
  void release(chunk* in) noexcept;
  /// How many chunks are mapped.
  [[nodiscard]] std::size_t mapped_chunks() const noexcept { return mapped_; }

 private:
  void unmap(chunk* c) noexcept;

  chunk* newest_{nullptr};  // heads the list of every mapped chunk, newest first
  std::size_t mapped_{0};
};

/// An event as a session keeps it: its fixed-size fields in place, its variable-size ones (shape,
/// texts, device buffers) copied into a payload_arena.
class kept_event {
 public:
  /// Keeps `e`: its fixed-size fields are moved, its variable-size parts copied into `arena` (and
  /// freed). @throws std::bad_alloc
  kept_event(event&& e, payload_arena& arena);
  /// Keeps a copy of `e`. @throws std::bad_alloc
  kept_event(const event& e, payload_arena& arena) : kept_event(event{e}, arena) {}

  /// The event as it was recorded. @throws std::bad_alloc
  [[nodiscard]] event expanded() const;
  /// Its fixed-size fields (the variable-size ones read empty).
  [[nodiscard]] const event& fixed() const noexcept { return fixed_; }
  /// Gives its room in `arena` back, when the session drops it.
  void release(payload_arena& arena) noexcept;

 private:
  event fixed_;
  std::span<const std::int64_t> shape_;
  std::span<const buffer_ref> buffers_;
  std::string_view where_;
  std::string_view detail_;
  std::string_view fix_;
  std::string_view other_where_;
  payload_arena::chunk* chunk_{nullptr};
};

}  // namespace handoff::trace::detail
