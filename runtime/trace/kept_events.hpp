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
#include <optional>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

namespace handoff::trace::detail {

/// `bytes` mapped for themselves (whole pages; not zeroed: a mapping given back lately is reused).
/// @throws std::bad_alloc
[[nodiscard]] void* map_pages(std::size_t bytes);
/// Unmaps what map_pages(bytes) returned.
void unmap_pages(void* pages, std::size_t bytes) noexcept;

/// Asks the processor to bring the `bytes` at `at` into its cache for writing, and goes on without
/// waiting. A bounded session writes each event where it dropped one `limit` events before, long out
/// of the cache: fetched while the program runs on, the next event's memory is there when it comes.
/// A prefetch never faults, so `at` may lie past the end of a mapping.
inline void prefetch_for_write(const void* at, std::size_t bytes) noexcept
{
  if (bytes == 0) { return; }
  constexpr std::size_t line_bytes = 64;
  const auto from = reinterpret_cast<std::uintptr_t>(at);
  for (std::uintptr_t line = from & ~std::uintptr_t{line_bytes - 1}; line < from + bytes; line += line_bytes) {
    __builtin_prefetch(reinterpret_cast<const void*>(line), 1);
  }
}

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
  /// Prefetches (prefetch_for_write) where the next `bytes` will be allocated.
  void prefetch_next(std::size_t bytes) const noexcept;
  /// How many chunks are mapped.
  [[nodiscard]] std::size_t mapped_chunks() const noexcept { return mapped_; }

 private:
  void unmap(chunk* c) noexcept;

  chunk* newest_{nullptr};  // heads the list of every mapped chunk, newest first
  std::size_t mapped_{0};
};

/// An event as a session keeps it: its fixed-size fields in place, its variable-size ones (shape,
/// device buffers, a hazard's texts) copied into a payload_arena. Trivially destructible, and what a session
/// reads when it drops its oldest event (long out of the cache by then) comes first: dropping one
/// reads its first 16 bytes and its chunk's header, where a whole `event` would be destroyed field
/// by field, a cache miss each. A field added to `event` is added here and in expanded().
class kept_event {
 public:
  /// Keeps `e`: its fixed-size fields copied, its variable-size parts copied into `arena`.
  /// @throws std::bad_alloc, or std::length_error for a part of 4 GiB or more
  kept_event(const event& e, payload_arena& arena);

  /// The event as it was recorded. @throws std::bad_alloc
  [[nodiscard]] event expanded() const;
  /// Its hazard's name, or null.
  [[nodiscard]] const char* hazard() const noexcept { return hazard_; }
  /// Gives its room in `arena` back, when the session drops it.
  void release(payload_arena& arena) noexcept;

 private:
  // The lengths of the variable-size parts, in the order they lie in the arena.
  struct lengths {
    std::uint32_t shape{0};
    std::uint32_t buffers{0};
    std::uint32_t detail{0};
    std::uint32_t fix{0};
  };

  // Read when the session drops it.
  payload_arena::chunk* chunk_{nullptr};
  const char* hazard_{nullptr};
  const std::byte* payload_{nullptr};
  lengths lengths_;
  // The rest of the event's fixed-size fields, as `event` names them.
  event_kind kind_{event_kind::import_data};
  trace::action action_{action::none};
  bool has_other_{false};
  event_kind other_kind_{event_kind::launch};
  DLDevice device_{kDLCPU, 0};
  DLDataType dtype_{kDLFloat, 32, 1};
  std::string_view protocol_;
  std::int64_t time_ns_{0};
  std::uint64_t thread_{0};
  std::int64_t nbytes_{0};
  const char* producer_{nullptr};
  const char* consumer_{nullptr};
  std::optional<stream_id> producer_stream_;
  std::optional<stream_id> consumer_stream_;
  std::uint64_t buffer_{0};
  std::uint64_t view_{0};
  const char* interposed_{nullptr};
  std::optional<std::int64_t> stream_argument_;
  const char* op_{nullptr};
  std::optional<stream_id> stream_;
  const char* kernel_{nullptr};
  std::int64_t blocked_ns_{0};
  const char* library_{nullptr};
  const char* where_{nullptr};
  std::uint64_t seq_{0};
  // Its hazard's other side (has_other_).
  std::uint64_t other_seq_{0};
  const char* other_kernel_{nullptr};
  std::optional<stream_id> other_stream_;
  const char* other_library_{nullptr};
  const char* other_where_{nullptr};
  std::int64_t other_time_ns_{0};
};

static_assert(std::is_trivially_destructible_v<kept_event>, "a session drops kept events without destroying them");

}  // namespace handoff::trace::detail
