// Internal: collecting one exchange's trace event on its thread while the exchange runs.
#pragma once

#include <handoff/device.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/trace.hpp>

#include <cstdint>
#include <string_view>

namespace handoff {

class array;
struct bound_stream;

namespace trace {

/// Collects one exchange's event on its thread while the exchange runs, and records it when the
/// scope ends (as `refused`, with the error, when an exception leaves it). Inert unless enabled()
/// when constructed. Scopes nest: a producer's export inside a consumer's import is its own event.
class exchange_scope {
 public:
  exchange_scope(event_kind kind, std::string_view protocol) noexcept
  {
    if (enabled()) { begin(kind, protocol); }
  }
  exchange_scope(const exchange_scope&) = delete;
  exchange_scope& operator=(const exchange_scope&) = delete;
  exchange_scope(exchange_scope&&) = delete;
  exchange_scope& operator=(exchange_scope&&) = delete;
  ~exchange_scope()
  {
    if (state_ != nullptr) { end(); }
  }

  /// The innermost active scope of this thread, or null. Check enabled() first: it is cheaper.
  [[nodiscard]] static exchange_scope* current() noexcept;

  [[nodiscard]] bool active() const noexcept { return state_ != nullptr; }
  /// The event being collected. Only while active().
  [[nodiscard]] trace::event& event() noexcept;
  void set_protocol(std::string_view protocol) noexcept;
  /// The data exchanged, the view that holds it when one is tracked, and its producer's library
  /// when the caller knows it (else the tracked views are asked).
  void set_view(const array& view, std::uint64_t view_id = 0, const char* library = nullptr) noexcept;
  /// The producer's stream (its data is ready there): unordered hand-overs ask it whether it is idle.
  void set_producer_stream(const bound_stream& producer) noexcept;
  void set_consumer_stream(const bound_stream& consumer) noexcept;
  /// A wait of `consumer` after `producer` (inserted or elided) on `backend`'s device `device`.
  void note_wait(device::backend& backend, int device, std::uint64_t producer, std::uint64_t consumer,
                 bool inserted) noexcept;
  /// `consumer` waits for another process's work (an IPC share's event): the producer stream is not
  /// this process's to name.
  void note_wait_for_process(const bound_stream& consumer) noexcept;
  /// Forgets the streams and waits noted so far: they were the exchange's own preparation (an IPC
  /// share's stream ordered after the array's), not its hand-over.
  void forget_ordering() noexcept;
  /// No ordering was asked for: the consumer uses the data as soon as it has it.
  void note_unordered() noexcept;
  /// The producer was handed the consumer's stream and orders it itself (DLPack's __dlpack__).
  void note_ordered_by_producer() noexcept;

 private:
  struct collected;  // made only while tracing: an inactive scope is one pointer

  void begin(event_kind kind, std::string_view protocol) noexcept;
  void end() noexcept;
  void classify();  // the action and the hazards

  collected* state_{nullptr};
};

/// The exchange traced on this thread, or null: a handful of instructions when tracing is off.
[[nodiscard]] inline exchange_scope* traced() noexcept
{
  return enabled() ? exchange_scope::current() : nullptr;
}

}  // namespace trace
}  // namespace handoff
