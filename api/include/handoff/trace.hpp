// Exchange tracing: one event per import, export and release, recorded while someone listens.
#pragma once

#include <handoff/dlpack.h>
#include <handoff/device.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace handoff {

class array;
struct stream_binding;

namespace trace {

enum class event_kind : std::uint8_t { import_data, export_data, release };

/// How the consumer's stream was ordered after the producer's.
enum class action : std::uint8_t {
  none,       ///< host data: nothing to order
  wait,       ///< a wait was inserted (by handoff, or by a producer given the consumer's stream)
  elided,     ///< already ordered: the same stream
  unordered,  ///< no ordering was asked for (stream=-1, an interface without a stream)
  refused,    ///< the exchange failed
};

[[nodiscard]] std::string_view name(event_kind kind) noexcept;
[[nodiscard]] std::string_view name(action what) noexcept;

/// A stream as the trace names it: its device and native handle.
struct stream_id {
  DLDevice device{kDLCPU, 0};
  std::uint64_t handle{0};
};

/// One exchange, as recorded.
struct event {
  event_kind kind{event_kind::import_data};
  std::string_view protocol;  ///< "dlpack", "dlpack-c-api", "cuda-array-interface", ... (static)
  std::int64_t time_ns{0};    ///< system clock, nanoseconds since the epoch
  std::uint64_t thread{0};    ///< the native thread id
  DLDevice device{kDLCPU, 0};
  std::vector<std::int64_t> shape;
  DLDataType dtype{kDLFloat, 32, 1};
  std::int64_t nbytes{0};
  const char* producer{nullptr};  ///< library names (static or interned strings), or null
  const char* consumer{nullptr};
  std::optional<stream_id> producer_stream;
  std::optional<stream_id> consumer_stream;
  trace::action action{action::none};
  const char* hazard{nullptr};  ///< a short name, or null
  std::string detail;           ///< what the hazard or refusal was
  std::string where;            ///< "file:line" of the user code that caused it, when known
  std::uint64_t buffer{0};      ///< ownership graph node ids
  std::uint64_t view{0};
};

namespace detail {
extern std::atomic<bool> active;
}  // namespace detail

/// Whether exchanges are recorded now: a trace is open, a listener is attached, or the log level is
/// debug. One relaxed load; exchanges build events only when it is true.
[[nodiscard]] inline bool enabled() noexcept
{
  return detail::active.load(std::memory_order_relaxed);
}

/// Fills what only the embedding knows (`where`, the consumer's library) into an event about to be
/// recorded, on the thread of the exchange. Must not throw.
using annotator = void (*)(event&) noexcept;
void set_annotator(annotator fill) noexcept;

/// Starts recording into a new session; returns its token. Thread-safe.
[[nodiscard]] std::uint64_t begin_session();
/// The events of a session so far. Thread-safe.
[[nodiscard]] std::vector<event> session_events(std::uint64_t token);
/// Ends a session and returns its events. @throws value_error for an unknown token.
[[nodiscard]] std::vector<event> end_session(std::uint64_t token);

/// Calls `listener` with every event until it is removed, on the exchange's thread; it must be
/// quick and must not throw. Returns its id. Thread-safe.
[[nodiscard]] std::uint64_t add_listener(std::function<void(const event&)> listener);
void remove_listener(std::uint64_t id) noexcept;

/// The event as one JSON object (no newline).
[[nodiscard]] std::string to_json(const event& e);

/// Records a finished event: annotates, logs at debug, hands it to the sessions and listeners.
void record(event&& e) noexcept;

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
  void set_producer_stream(const stream_binding& producer) noexcept;
  void set_consumer_stream(const stream_binding& consumer) noexcept;
  /// A wait of `consumer` after `producer` (inserted or elided) on `backend`'s device `device`.
  void note_wait(device::backend& backend, int device, std::uint64_t producer, std::uint64_t consumer,
                 bool inserted) noexcept;
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

}  // namespace trace
}  // namespace handoff
