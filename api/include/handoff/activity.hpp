// Device activity: what a backend reports while a launch trace runs (kernel launches with the memory
// they touch, copies and sets, stream and event operations, host synchronizations, allocations and
// frees), for the trace and its race detector.
#pragma once

#include <handoff/dlpack.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

namespace handoff::activity {

/// What a backend did.
enum class kind : std::uint8_t {
  launch,          ///< a kernel on `stream`, touching `buffers`
  copy,            ///< a copy on `stream`: `buffers` holds the source (read) and the destination (write)
  set,             ///< a memset on `stream` (one written buffer)
  stream_create,   ///< `stream` was created, of `stream_class`
  stream_destroy,  ///< `stream` was destroyed (work already enqueued still runs)
  event_record,    ///< `event` now captures the work enqueued on `stream` so far
  stream_wait,     ///< later work on `stream` waits for `event`'s latest record
  host_sync,       ///< the host waited (`scope`) for `blocked_ns`
  host_query,      ///< the host saw work done without waiting (a query that said so)
  allocate,        ///< `buffers` allocated; on `stream` when `stream_ordered`
  free,            ///< `buffers` freed: on `stream` when `stream_ordered`, else after `device` synchronized
};

/// How a launch or copy uses a buffer.
enum class access : std::uint8_t { read = 1, write = 2, read_write = 3 };

[[nodiscard]] constexpr bool writes(access mode) noexcept
{
  return (static_cast<unsigned>(mode) & static_cast<unsigned>(access::write)) != 0;
}

/// A range of memory an operation touches.
struct buffer_use {
  std::uintptr_t address{0};
  std::size_t bytes{0};
  access mode{access::read_write};
};

/// How a stream is ordered with the legacy default stream, as CUDA defines it.
enum class stream_class : std::uint8_t {
  blocking,      ///< created blocking: synchronizes with the legacy default stream
  non_blocking,  ///< created non-blocking: does not
  legacy,        ///< the legacy default stream: its work waits for every blocking stream's, and theirs for it
  per_thread,    ///< a thread's per-thread default stream: blocking, one per thread
};

/// What a host synchronization waited for.
enum class sync_scope : std::uint8_t {
  stream,  ///< the work enqueued on `stream`
  event,   ///< `event`'s latest record
  device,  ///< all work of `device`
  copy,    ///< a synchronous copy (on `stream`), and the work before it there
};

/// One thing a backend did, reported on the thread that did it.
struct record {
  activity::kind kind{kind::launch};
  DLDevice device{kDLCUDA, 0};
  std::uint64_t stream{0};  ///< the native handle (the legacy default stream as the backend names it)
  activity::stream_class stream_class{stream_class::blocking};
  std::uint64_t event{0};                ///< event_record, stream_wait, an event's host_sync
  const char* name{nullptr};             ///< a launch's kernel (static or interned), else null
  std::span<const buffer_use> buffers;   ///< what a launch, copy, set, allocation or free touches
  sync_scope scope{sync_scope::stream};  ///< host_sync and host_query
  std::int64_t blocked_ns{0};            ///< host_sync, and a free that synchronized
  bool stream_ordered{false};            ///< an allocation or free on `stream`
  std::string_view library;              ///< the library that did it when the backend knows, else empty
};

namespace detail {
extern std::atomic<bool> recording;
}  // namespace detail

/// Whether activity is recorded now (a launch trace is open). One relaxed load: a backend reports
/// only when it is true.
[[nodiscard]] inline bool recording() noexcept
{
  return detail::recording.load(std::memory_order_relaxed);
}

/// Hands `r` to the trace (its detector and sessions) on the calling thread. Cheap to call when
/// nothing records; never throws. Nothing is reported inside a bookkeeping scope.
void report(const record& r) noexcept;

/// Marks the calling thread's backend calls, while it lives, as handoff's own bookkeeping (the
/// service thread's polls of releases, the trace's question whether a producer still works): not
/// the program's. What such a query sees orders nothing the program does, so it is not reported: as
/// a host query, it would order every later operation after the work it saw done, and hide the
/// race that only timing then separates.
class bookkeeping {
 public:
  bookkeeping() noexcept;
  ~bookkeeping();
  bookkeeping(const bookkeeping&) = delete;
  bookkeeping& operator=(const bookkeeping&) = delete;
  bookkeeping(bookkeeping&&) = delete;
  bookkeeping& operator=(bookkeeping&&) = delete;
};

/// A name (a kernel's, a user line's) kept for the life of the process: records point at it.
/// Thread-safe.
[[nodiscard]] const char* intern(std::string_view name);

}  // namespace handoff::activity
