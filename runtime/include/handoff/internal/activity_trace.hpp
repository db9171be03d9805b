// Internal: what the trace recorder and the device activity layer (runtime/trace/activity_trace.cpp)
// share: recording an event already annotated, and the exchanged arrays that name device memory.
#pragma once

#include <handoff/trace.hpp>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>

namespace handoff::trace::detail {

/// Fills what the embedding's annotator knows into `e` (its `where` and library). Never throws.
void annotate(event& e) noexcept;
/// As trace::record, for an event annotate() has seen already.
void record_annotated(event&& e) noexcept;
/// The recorder's lock, which also guards the device activity layer's state (its race detector and
/// the exchanged memory it names): an activity event is checked and recorded under one lock, so
/// that the sessions keep events in the order the detector saw them. @throws std::system_error
[[nodiscard]] std::unique_lock<std::mutex> lock_recorder();
/// record_annotated(), under lock_recorder().
void record_annotated_locked(event&& e) noexcept;
/// Called under lock_recorder() when the first activity session begins or the last one ends.
void activity_sessions_changed(bool any) noexcept;
/// An exchanged array's memory, named by its ownership graph buffer while activity is recorded.
/// Not under lock_recorder().
void note_exchanged(const void* data, std::int64_t nbytes, std::uint64_t buffer) noexcept;
/// The calling thread's native id, as every event records it.
[[nodiscard]] std::uint64_t native_thread_id() noexcept;

}  // namespace handoff::trace::detail

namespace handoff::activity {

/// Memory that an exchange handed over, as a launch trace knows it.
struct exchanged_memory {
  std::uintptr_t address{0};
  std::size_t bytes{0};
  std::uint64_t buffer{0};  ///< the ownership graph's buffer
};

/// The exchanged array whose memory holds `address`, if a launch trace saw one: what a kernel's
/// pointer argument is matched against. Thread-safe.
[[nodiscard]] std::optional<exchanged_memory> exchanged_at(std::uintptr_t address) noexcept;

}  // namespace handoff::activity
