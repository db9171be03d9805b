// Exchange tracing: one event per import, export and release, recorded while someone listens.
#pragma once

#include <handoff/dlpack.h>
#include <handoff/activity.hpp>
#include <handoff/array.hpp>

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace handoff::trace {

enum class event_kind : std::uint8_t {
  import_data,
  export_data,
  release,
  held,  ///< not an exchange: a view an exchange made, still alive when the trace ended
  // Device activity, recorded by launch traces (begin_session(..., activity=true)):
  launch,  ///< a kernel launch
  copy,    ///< a copy or set on a stream
  sync,    ///< the host blocked on device work
  stream,  ///< a stream created or destroyed, an event recorded, a stream made to wait
  memory,  ///< an allocation or free
};

/// Whether events of `kind` are device activity rather than exchanges.
[[nodiscard]] constexpr bool is_activity(event_kind kind) noexcept
{
  return kind >= event_kind::launch;
}

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
/// "read", "write" or "read-write".
[[nodiscard]] std::string_view name(activity::access mode) noexcept;

/// A stream as the trace names it: its device and native handle.
struct stream_id {
  DLDevice device{kDLCPU, 0};
  std::uint64_t handle{0};
};

/// Memory a device activity touched, as the trace names it.
struct buffer_ref {
  std::uint64_t address{0};
  std::uint64_t nbytes{0};
  activity::access mode{activity::access::read_write};
  std::uint64_t buffer{0};  ///< the ownership graph's buffer when the memory was exchanged, else 0
};

/// The earlier side of an activity's hazard.
struct activity_side {
  std::uint64_t seq{0};
  event_kind kind{event_kind::launch};
  const char* kernel{nullptr};
  std::optional<stream_id> stream;
  const char* where{nullptr};  ///< interned, or null
  const char* library{nullptr};
  std::int64_t time_ns{0};
};

/// One exchange or device activity, as recorded.
struct event {
  event_kind kind{event_kind::import_data};
  std::string_view protocol;  ///< "dlpack", "dlpack-c-api", "cuda-array-interface", ... (static)
  std::int64_t time_ns{0};    ///< system clock, nanoseconds since the epoch
  std::uint64_t thread{0};    ///< the native thread id
  DLDevice device{kDLCPU, 0};
  extents shape;  ///< in place up to extents::inline_capacity dimensions: an event allocates nothing
  DLDataType dtype{kDLFloat, 32, 1};
  std::int64_t nbytes{0};
  const char* producer{nullptr};  ///< library names (static or interned strings), or null
  const char* consumer{nullptr};
  std::optional<stream_id> producer_stream;
  std::optional<stream_id> consumer_stream;
  trace::action action{action::none};
  const char* hazard{nullptr};  ///< a short name, or null
  std::string detail;           ///< what the hazard or refusal was
  /// "file:line" of the user code that caused it, or null. The event does not own it: it must live as
  /// long as the process (activity::intern's result, or a string literal), never a temporary's c_str().
  const char* where{nullptr};
  std::uint64_t buffer{0};  ///< ownership graph node ids
  std::uint64_t view{0};
  /// An exchange between two other libraries that handoff's hooks saw: "observed", or "ordered"
  /// when handoff ordered it; null for handoff's own exchanges.
  const char* interposed{nullptr};
  std::optional<std::int64_t> stream_argument;  ///< the `stream` the consumer passed to `__dlpack__`, when seen

  // Device activity only.
  const char* op{nullptr};          ///< what was done (static): "copy", "set", "record", "wait", "device", ...
  std::optional<stream_id> stream;  ///< the stream it was enqueued on (a sync: the one waited for)
  const char* kernel{nullptr};      ///< a launch's kernel (interned)
  std::vector<buffer_ref> buffers;
  std::int64_t blocked_ns{0};          ///< how long the host was blocked
  const char* library{nullptr};        ///< the library whose code did it (interned), or null for user code
  std::uint64_t seq{0};                ///< its number among the process's activity events, from 1
  std::string fix;                     ///< what would remove its hazard
  std::optional<activity_side> other;  ///< the earlier side of its hazard
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
/// recorded, on the thread of the exchange. Must not throw. The names it stores are not copied: each
/// must outlive every event (activity::intern's result, or a string literal).
using annotator = void (*)(event&) noexcept;
void set_annotator(annotator fill) noexcept;

/// Starts recording into a new session; returns its token. A session with a `limit` keeps the newest
/// `limit` events and, besides them, up to `limit` older hazards; the rest are counted as dropped
/// (a trace of a long job stays bounded). With `activity`, the backends' device activity is recorded
/// too, and checked for races (see handoff/activity.hpp). Thread-safe.
[[nodiscard]] std::uint64_t begin_session(std::size_t limit = 0, bool activity = false);
/// The events of a session so far, oldest first (a bounded session's older hazards first). Thread-safe.
[[nodiscard]] std::vector<event> session_events(std::uint64_t token);
/// How many events a bounded session no longer keeps. @throws value_error for an unknown token.
[[nodiscard]] std::uint64_t session_dropped(std::uint64_t token);
/// Ends a session and returns its events. @throws value_error for an unknown token.
[[nodiscard]] std::vector<event> end_session(std::uint64_t token);

/// Calls `listener` with every event until it is removed, on the exchange's thread; it must be
/// quick and must not throw. Returns its id. Thread-safe.
[[nodiscard]] std::uint64_t add_listener(std::function<void(const event&)> listener);
void remove_listener(std::uint64_t id) noexcept;

/// An ownership graph node as the trace names it: "buffer:7", "view:3".
struct node_ref {
  std::string_view kind;
  std::uint64_t id{0};
};

/// Text that the trace writes as null when empty (a hazard's detail, the user code's place).
struct optional_text {
  std::string_view text;
};

/// A name or null as optional_text.
inline optional_text optional_text_of(const char* text) noexcept
{
  return optional_text{text != nullptr ? text : ""};
}

/// Whether the event says which data it concerns. A release of a buffer that no running trace saw
/// exchanged (it was, before any trace began) does not: its device, shape, dtype and size are unknown,
/// and written as null rather than as an empty CPU array. A known release has a shape or a size (a
/// 0-d array has its item's, an empty array its zero extent).
[[nodiscard]] inline bool describes_data(const event& e) noexcept
{
  return e.kind != event_kind::release || e.nbytes != 0 || !e.shape.empty();
}

/// Calls `field(name, value)` for each field of an activity event, in the order the trace writes them.
template <class Field>
void for_each_activity_field(const event& e, Field&& field)
{
  field("kind", name(e.kind));
  field("op", optional_text_of(e.op));
  field("time_ns", e.time_ns);
  field("thread", e.thread);
  field("device", std::optional<DLDevice>{e.device});
  field("stream", e.stream);
  field("kernel", e.kernel);
  field("buffers", std::span<const buffer_ref>{e.buffers});
  field("nbytes", e.nbytes);
  field("blocked_ns", e.blocked_ns);
  field("library", e.library);
  field("where", optional_text_of(e.where));
  field("hazard", e.hazard);
  field("detail", optional_text{e.detail});
  field("fix", optional_text{e.fix});
  field("seq", e.seq);
  const activity_side* other = e.other ? &*e.other : nullptr;
  field("other_seq", other != nullptr ? std::optional<std::int64_t>{static_cast<std::int64_t>(other->seq)}
                                      : std::optional<std::int64_t>{});
  field("other_kind", optional_text{other != nullptr ? name(other->kind) : std::string_view{}});
  field("other_kernel", other != nullptr ? other->kernel : nullptr);
  field("other_stream", other != nullptr ? other->stream : std::optional<stream_id>{});
  field("other_where", optional_text_of(other != nullptr ? other->where : nullptr));
  field("other_library", other != nullptr ? other->library : nullptr);
  field("other_time_ns",
        other != nullptr ? std::optional<std::int64_t>{other->time_ns} : std::optional<std::int64_t>{});
}

/// Calls `field(name, value)` for each field of `e`, in the order the trace writes them: the one
/// place that names them, for every form of an event (JSON lines, Python dicts). The values are
/// std::string_view, std::int64_t, std::uint64_t, const char* (a library or hazard name; null: none),
/// optional_text, and std::optional of DLDevice, std::span<const std::int64_t> (the shape),
/// DLDataType, stream_id, node_ref and std::int64_t (empty: null), and, for device activity,
/// std::span<const buffer_ref>.
template <class Field>
void for_each_field(const event& e, Field&& field)
{
  if (is_activity(e.kind)) {
    for_each_activity_field(e, field);
    return;
  }
  field("kind", name(e.kind));
  field("protocol", e.protocol);
  field("time_ns", e.time_ns);
  field("thread", e.thread);
  const bool described = describes_data(e);
  field("device", described ? std::optional<DLDevice>{e.device} : std::nullopt);
  field("shape", described ? std::optional<std::span<const std::int64_t>>{e.shape} : std::nullopt);
  field("dtype", described ? std::optional<DLDataType>{e.dtype} : std::nullopt);
  field("nbytes", described ? std::optional<std::int64_t>{e.nbytes} : std::nullopt);
  field("producer", e.producer);
  field("consumer", e.consumer);
  field("producer_stream", e.producer_stream);
  field("consumer_stream", e.consumer_stream);
  field("action", name(e.action));
  field("hazard", e.hazard);
  field("detail", optional_text{e.detail});
  field("where", optional_text_of(e.where));
  field("buffer", e.buffer != 0 ? std::optional<node_ref>{node_ref{"buffer", e.buffer}} : std::nullopt);
  field("view", e.view != 0 ? std::optional<node_ref>{node_ref{"view", e.view}} : std::nullopt);
  field("interposed", e.interposed);
  field("stream_argument", e.stream_argument);
}

/// The event as one JSON object (no newline).
[[nodiscard]] std::string to_json(const event& e);

/// One `held` event for each view in `live_views` that an exchange among `events` made (an import,
/// or an export to another library: an export to handoff is held by the import that asked for it):
/// a copy of that exchange at `now_ns`, the view and buffer in its detail. No hazard: a program may
/// hold arrays until it ends.
[[nodiscard]] std::vector<event> held_events(const std::vector<event>& events,
                                             std::span<const std::uint64_t> live_views, std::int64_t now_ns);

/// Records a finished event: annotates, logs at debug, hands it to the sessions and listeners.
void record(event&& e) noexcept;

/// While one is alive, the exchanges of the calling thread are not recorded: they are the workings
/// of one exchange that the embedding records as a whole (between two other libraries, one of them
/// built on handoff). Nests.
class muted_scope {
 public:
  muted_scope() noexcept;
  muted_scope(const muted_scope&) = delete;
  muted_scope& operator=(const muted_scope&) = delete;
  muted_scope(muted_scope&&) = delete;
  muted_scope& operator=(muted_scope&&) = delete;
  ~muted_scope();

  /// Whether the calling thread's exchanges are muted now.
  [[nodiscard]] static bool active() noexcept;
};

}  // namespace handoff::trace
