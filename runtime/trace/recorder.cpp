#include <handoff/activity.hpp>
#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/internal/activity_trace.hpp>
#include <handoff/internal/enum_table.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/stream_value.hpp>
#include <handoff/trace.hpp>

#include "core/block_cache.hpp"
#include "log/logger.hpp"
#include "trace/kept_events.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <boost/container/deque.hpp>
#include <boost/container/options.hpp>

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <exception>
#include <map>
#include <mutex>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>

namespace handoff::trace {

namespace detail {
std::atomic<bool> active{false};
}  // namespace detail

namespace {

constexpr auto event_kind_names = handoff::detail::make_enum_table<event_kind>({{event_kind::import_data, "import"},
                                                                                {event_kind::export_data, "export"},
                                                                                {event_kind::release, "release"},
                                                                                {event_kind::held, "held"},
                                                                                {event_kind::launch, "launch"},
                                                                                {event_kind::copy, "copy"},
                                                                                {event_kind::sync, "sync"},
                                                                                {event_kind::stream, "stream"},
                                                                                {event_kind::memory, "memory"}});

constexpr auto action_names = handoff::detail::make_enum_table<action>({{action::none, "none"},
                                                                        {action::wait, "wait"},
                                                                        {action::elided, "elided"},
                                                                        {action::unordered, "unordered"},
                                                                        {action::refused, "refused"}});

constexpr auto access_names = handoff::detail::make_enum_table<activity::access>(
  {{activity::access::read, "read"}, {activity::access::write, "write"}, {activity::access::read_write, "read-write"}});

}  // namespace

std::string_view name(event_kind kind) noexcept
{
  return handoff::detail::look_up(event_kind_names, kind, "?");
}

std::string_view name(action what) noexcept
{
  return handoff::detail::look_up(action_names, what, "?");
}

std::string_view name(activity::access mode) noexcept
{
  return handoff::detail::look_up(access_names, mode, "?");
}

namespace {

// A session's events, in blocks of 64 (a kept event is about 330 bytes, and std::deque's blocks of
// 512 bytes were one allocation per event), mapped outside the program's heap as their payloads are.
using event_queue = boost::container::deque<detail::kept_event, detail::mapped_allocator<detail::kept_event>,
                                            boost::container::deque_options_t<boost::container::block_size<64U>>>;
// A bounded session's older hazards, mapped as its events are.
using hazard_list = std::vector<detail::kept_event, detail::mapped_allocator<detail::kept_event>>;

// Where events go: each open session keeps its own events (a bounded one, the newest of them and
// its hazards); listeners see each event as it is recorded. Leaked on purpose, as producers may be
// released at exit.
struct recorder {
  struct session {
    std::size_t limit{0};            // 0: unbounded
    detail::payload_arena payloads;  // the kept events' variable-size parts
    event_queue events;              // the newest `limit` events
    hazard_list hazards;             // hazards older than `events` (a bounded session's), at most `limit`
    std::uint64_t dropped{0};        // events no longer kept
    bool activity{false};            // device activity is recorded too

    void keep(const event& e)
    {
      if (is_activity(e.kind) && !activity) { return; }
      events.emplace_back(e, payloads);
      if (limit == 0) { return; }  // an unbounded session writes on into memory it has not used yet
      if (events.size() > limit) {
        detail::kept_event& oldest = events.front();
        if (oldest.hazard() != nullptr && hazards.size() < limit) {
          hazards.push_back(oldest);
        } else {
          oldest.release(payloads);
          ++dropped;
        }
        events.pop_front();
        __builtin_prefetch(&events.front());  // read when the next event drops it
      }
      // Where the next event goes, and its payload if it is the size of this one's (a launch's buffers).
      detail::prefetch_for_write(std::addressof(events.back()) + 1, sizeof(detail::kept_event));
      payloads.prefetch_next(e.buffers.size() * sizeof(buffer_ref));
    }
  };

  std::mutex mutex;
  std::map<std::uint64_t, session> sessions;  // by token
  std::size_t activity_sessions{0};
  std::uint64_t next_token{1};
  std::map<std::uint64_t, std::function<void(const event&)>> listeners;
  std::uint64_t next_listener{1};
  // What a buffer looked like when last exchanged: a release knows only the producer. The shape in
  // place up to 6 dimensions: kept from each import to its release, it would be a heap block each.
  struct layout {
    DLDevice device;
    extents shape;
    DLDataType dtype;
    std::int64_t nbytes;
    const char* library;
  };
  using layouts = std::unordered_map<std::uint64_t, layout>;
  layouts buffers;
  // The node of the layout a release last dropped, taken by the next import's: a buffer's layout is
  // kept from its import to its release, and each would allocate and free a node otherwise.
  layouts::node_type spare_layout;
  std::atomic<annotator> annotate{nullptr};
  bool debug_log{false};

  static recorder& get()
  {
    static auto* instance = [] {
      auto* r = new recorder;  // NOLINT(cppcoreguidelines-owning-memory): leaked, see above
      r->debug_log = handoff::detail::logger().should_log(spdlog::level::debug);
      r->update_active();
      return r;
    }();
    return *instance;
  }

  // Under `mutex`: whether anyone reads releases, which need the layout their buffer had.
  [[nodiscard]] bool keeps_layouts() const noexcept { return debug_log || !sessions.empty() || !listeners.empty(); }

  // Under `mutex`.
  void update_active() noexcept
  {
    detail::active.store(debug_log || !sessions.empty() || !listeners.empty(), std::memory_order_relaxed);
  }
};

// Events are wanted from the first exchange when the log level asks for them.
bool check_debug_logging() noexcept
{
  try {
    (void)recorder::get();
  } catch (...) {  // out of memory at load: no debug lines
  }
  return true;
}
const bool debug_logging_checked = check_debug_logging();

std::string stream_text(const std::optional<stream_id>& s)
{
  return s ? fmt::format("{}:{} stream {:#x}", device_type_name(s->device.device_type), s->device.device_id, s->handle)
           : std::string{"-"};
}

void log_activity(const event& e)
{
  const std::string hazard = e.hazard != nullptr ? fmt::format("; HAZARD {}: {}", e.hazard, e.detail) : std::string{};
  const std::string where = e.where == nullptr ? std::string{} : fmt::format(" at {}", e.where);
  HANDOFF_LOG_DEBUG("{} {}{}{} on {}{}{}", name(e.kind), e.op != nullptr ? e.op : "",
                    e.kernel != nullptr ? fmt::format(" '{}'", e.kernel) : std::string{},
                    e.blocked_ns != 0 ? fmt::format(" blocked {} ns", e.blocked_ns) : std::string{},
                    stream_text(e.stream), hazard, where);
}

void log_event(const event& e)
{
  if (is_activity(e.kind)) {
    log_activity(e);
    return;
  }
  const char* producer = e.producer != nullptr ? e.producer : "?";
  const char* consumer = e.consumer != nullptr ? e.consumer : "?";
  std::string data = !describes_data(e)
                       ? std::string{}
                       : fmt::format(" {}[{}] on {}:{} ({} B)", dtype_name(e.dtype), fmt::join(e.shape, ", "),
                                     device_type_name(e.device.device_type), e.device.device_id, e.nbytes);
  std::string change;
  switch (e.kind) {
    case event_kind::import_data:
    case event_kind::export_data:
      change = fmt::format("+view:{} view-of buffer:{}", e.view, e.buffer);
      if (e.consumer_stream) {
        change += fmt::format(", buffer:{} ready-on {}", e.buffer, stream_text(e.consumer_stream));
      }
      break;
    case event_kind::release:
      change = e.consumer_stream ? fmt::format("-buffer:{} released-after {}", e.buffer, stream_text(e.consumer_stream))
                                 : fmt::format("-buffer:{}", e.buffer);
      break;
    default:  // held: made at the trace's end, never logged; device activity: log_activity
      break;
  }
  const std::string hazard = e.hazard != nullptr ? fmt::format("; HAZARD {}: {}", e.hazard, e.detail) : std::string{};
  const std::string where = e.where == nullptr ? std::string{} : fmt::format(" at {}", e.where);
  if (e.kind == event_kind::release) {
    HANDOFF_LOG_DEBUG("release of {}{}: {}{}", producer, data, change, where);
    return;
  }
  HANDOFF_LOG_DEBUG("{} {} -> {} ({}){}: {}; {} after {}{}{}", name(e.kind), producer, consumer, e.protocol, data,
                    change, name(e.action), stream_text(e.producer_stream), hazard, where);
}

void append_json_string(std::string& out, std::string_view text)
{
  out += '"';
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          out += fmt::format("\\u{:04x}", static_cast<unsigned>(c));
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void append_json_name(std::string& out, const char* text)
{
  if (text == nullptr) {
    out += "null";
  } else {
    append_json_string(out, text);
  }
}

std::atomic<unsigned> forks{0};  // a forked child's one thread asks its id again

// What the trace keeps per thread, in one thread-local reached through one call: in a shared
// library each use of a thread-local is a call (__tls_get_addr), which GCC makes again after every
// call in between, and each event used several.
struct thread_state {
  exchange_scope* innermost{nullptr};
  int muted_depth{0};
  unsigned id_after_forks{~0U};  // the fork count when `id` was asked
  std::uint64_t id{0};
};

[[gnu::noinline]] thread_state& this_thread() noexcept
{
  thread_local thread_state mine;
  return mine;
}

// The thread's id, asked of the kernel once per thread: a system call (every event asks it), and a
// thread's id changes only in a forked child.
std::uint64_t thread_id(thread_state& thread) noexcept
{
  static const bool watching_forks =
    pthread_atfork(nullptr, nullptr, [] { forks.fetch_add(1, std::memory_order_relaxed); }) == 0;
  const unsigned now = forks.load(std::memory_order_relaxed);
  if (!watching_forks || thread.id_after_forks != now) {
    thread.id = static_cast<std::uint64_t>(::syscall(SYS_gettid));
    thread.id_after_forks = now;
  }
  return thread.id;
}

}  // namespace

muted_scope::muted_scope() noexcept
{
  ++this_thread().muted_depth;
}

muted_scope::~muted_scope()
{
  --this_thread().muted_depth;
}

bool muted_scope::active() noexcept
{
  return this_thread().muted_depth != 0;
}

void set_annotator(annotator fill) noexcept
{
  recorder::get().annotate.store(fill, std::memory_order_release);
}

std::uint64_t begin_session(std::size_t limit, bool activity)
{
  recorder& r = recorder::get();
  const std::lock_guard lock{r.mutex};
  if (r.sessions.empty() && !r.keeps_layouts()) { r.buffers.clear(); }
  const std::uint64_t token = r.next_token++;
  recorder::session& s = r.sessions[token];
  s.limit = limit;
  s.activity = activity;
  r.update_active();
  if (activity && r.activity_sessions++ == 0) { detail::activity_sessions_changed(true); }
  return token;
}

namespace {

recorder::session& open_session(recorder& r, std::uint64_t token)
{
  const auto found = r.sessions.find(token);
  HANDOFF_EXPECTS(found != r.sessions.end(), value_error, fmt::format("no open trace session {}", token));
  return found->second;
}

}  // namespace

std::vector<event> session_events(std::uint64_t token)
{
  recorder& r = recorder::get();
  std::lock_guard lock{r.mutex};
  const recorder::session& s = open_session(r, token);
  std::vector<event> events;
  events.reserve(s.hazards.size() + s.events.size());
  for (const detail::kept_event& kept : s.hazards) { events.push_back(kept.expanded()); }
  for (const detail::kept_event& kept : s.events) { events.push_back(kept.expanded()); }
  return events;
}

std::uint64_t session_dropped(std::uint64_t token)
{
  recorder& r = recorder::get();
  std::lock_guard lock{r.mutex};
  return open_session(r, token).dropped;
}

std::vector<event> end_session(std::uint64_t token)
{
  std::vector<event> events = session_events(token);
  recorder& r = recorder::get();
  const std::lock_guard lock{r.mutex};
  const auto ending = r.sessions.find(token);
  if (ending != r.sessions.end() && ending->second.activity && --r.activity_sessions == 0) {
    detail::activity_sessions_changed(false);
  }
  r.sessions.erase(token);
  if (!r.keeps_layouts()) { r.buffers.clear(); }
  r.update_active();
  return events;
}

std::uint64_t add_listener(std::function<void(const event&)> listener)
{
  recorder& r = recorder::get();
  std::lock_guard lock{r.mutex};
  const std::uint64_t id = r.next_listener++;
  r.listeners.emplace(id, std::move(listener));
  r.update_active();
  return id;
}

void remove_listener(std::uint64_t id) noexcept
{
  recorder& r = recorder::get();
  std::lock_guard lock{r.mutex};
  r.listeners.erase(id);
  r.update_active();
}

std::string to_json(const event& e)
{
  std::string out;
  out.reserve(512);
  char separator = '{';
  for_each_field(e, [&](std::string_view field, const auto& value) {
    using value_type = std::decay_t<decltype(value)>;
    out += separator;
    separator = ',';
    append_json_string(out, field);
    out += ':';
    if constexpr (std::is_same_v<value_type, std::string_view>) {
      append_json_string(out, value);
    } else if constexpr (std::is_same_v<value_type, const char*>) {
      append_json_name(out, value);
    } else if constexpr (std::is_integral_v<value_type>) {
      out += fmt::format("{}", value);
    } else if constexpr (std::is_same_v<value_type, std::optional<DLDevice>>) {
      out +=
        value ? fmt::format("[{},{}]", static_cast<int>(value->device_type), value->device_id) : std::string{"null"};
    } else if constexpr (std::is_same_v<value_type, std::optional<std::span<const std::int64_t>>>) {
      out += value ? fmt::format("[{}]", fmt::join(*value, ",")) : std::string{"null"};
    } else if constexpr (std::is_same_v<value_type, std::optional<DLDataType>>) {
      std::string_view text;  // empty: written as null
      try {
        if (value) { text = dtype_name(*value); }
      } catch (const std::exception&) {
        text = {};  // a dtype DLPack does not define (a hostile producer's)
      }
      if (text.empty()) {
        out += "null";
      } else {
        append_json_string(out, text);
      }
    } else if constexpr (std::is_same_v<value_type, std::optional<stream_id>>) {
      out += value ? fmt::format("{}", value->handle) : std::string{"null"};
    } else if constexpr (std::is_same_v<value_type, std::optional<std::int64_t>>) {
      out += value ? fmt::format("{}", *value) : std::string{"null"};
    } else if constexpr (std::is_same_v<value_type, optional_text>) {
      if (value.text.empty()) {
        out += "null";
      } else {
        append_json_string(out, value.text);
      }
    } else if constexpr (std::is_same_v<value_type, std::span<const buffer_ref>>) {
      char open = '[';
      for (const buffer_ref& b : value) {
        out += open;
        open = ',';
        out += fmt::format(R"({{"address":{},"nbytes":{},"access":"{}","buffer":)", b.address, b.nbytes, name(b.mode));
        out += b.buffer != 0 ? fmt::format(R"("buffer:{}")", b.buffer) : std::string{"null"};
        out += '}';
      }
      out += open == '[' ? "[]" : "]";
    } else {
      static_assert(std::is_same_v<value_type, std::optional<node_ref>>, "a field type to_json does not write");
      out += value ? fmt::format(R"("{}:{}")", value->kind, value->id) : std::string{"null"};
    }
  });
  out += '}';
  return out;
}

std::vector<event> held_events(const std::vector<event>& events, std::span<const std::uint64_t> live_views,
                               std::int64_t now_ns)
{
  std::unordered_map<std::uint64_t, const event*> made;  // by view
  for (const event& e : events) {
    const bool to_handoff = e.consumer != nullptr && std::string_view{e.consumer} == "handoff";
    if (e.view != 0 && (e.kind == event_kind::import_data || (e.kind == event_kind::export_data && !to_handoff))) {
      made.insert_or_assign(e.view, &e);
    }
  }
  std::vector<event> held;
  for (const std::uint64_t view : live_views) {
    const auto origin = made.find(view);
    if (origin == made.end()) { continue; }  // made before the trace began: not this trace's to report
    event& still = held.emplace_back(*origin->second);
    still.kind = event_kind::held;
    still.time_ns = now_ns;
    still.action = action::none;
    still.hazard = nullptr;
    still.detail = fmt::format("view:{} of buffer:{} was still held when the trace ended", view, still.buffer);
  }
  return held;
}

void record(event&& e) noexcept
{
  detail::annotate(e);
  detail::record_annotated(std::move(e));
}

std::uint64_t detail::native_thread_id() noexcept
{
  return thread_id(this_thread());
}

void detail::annotate(event& e) noexcept
{
  if (const annotator fill = recorder::get().annotate.load(std::memory_order_acquire)) { fill(e); }
}

std::unique_lock<std::mutex> detail::lock_recorder()
{
  return std::unique_lock{recorder::get().mutex};
}

void detail::record_annotated(event&& e) noexcept
{
  try {
    const std::lock_guard lock{recorder::get().mutex};
    record_annotated_locked(std::move(e));
  } catch (const std::exception& error) {
    HANDOFF_LOG_WARN("a trace event was lost ({})", error.what());
  }
}

void detail::record_annotated_locked(event&& e) noexcept
{
  recorder& r = recorder::get();
  try {
    if (r.keeps_layouts()) {
      if (e.kind == event_kind::release) {
        if (const auto known = r.buffers.find(e.buffer); known != r.buffers.end()) {
          e.device = known->second.device;
          e.shape = known->second.shape;
          e.dtype = known->second.dtype;
          e.nbytes = known->second.nbytes;
          if (e.producer == nullptr) { e.producer = known->second.library; }
          r.spare_layout = r.buffers.extract(known);
        }
      } else if (e.buffer != 0) {
        recorder::layout seen{
          .device = e.device, .shape = e.shape, .dtype = e.dtype, .nbytes = e.nbytes, .library = e.producer};
        if (const auto known = r.buffers.find(e.buffer); known != r.buffers.end()) {
          known->second = std::move(seen);
        } else if (r.spare_layout) {
          r.spare_layout.key() = e.buffer;
          r.spare_layout.mapped() = std::move(seen);
          r.buffers.insert(std::move(r.spare_layout));
        } else {
          r.buffers.emplace(e.buffer, std::move(seen));
        }
      }
    }
    if (r.debug_log) { log_event(e); }
    for (const auto& [_, listener] : r.listeners) { listener(e); }
    for (auto& [_, session] : r.sessions) { session.keep(e); }
  } catch (const std::exception& error) {
    HANDOFF_LOG_WARN("a trace event was lost ({})", error.what());
  }
}

// ---------------------------------------------------------------------------------------------
// exchange_scope

struct exchange_scope::collected {
  trace::event event;
  exchange_scope* outer{nullptr};
  thread_state* thread{nullptr};      // the scope's own: it ends on the thread that began it
  device::backend* backend{nullptr};  // of the streams, when any was named
  int uncaught{0};
  bool unordered{false};
  bool ordered_by_producer{false};
  bool waited{false};
  bool elided{false};
};

void exchange_scope::begin(event_kind kind, std::string_view protocol) noexcept
{
  thread_state& thread = this_thread();
  if (thread.muted_depth != 0) { return; }  // recorded as a whole by the embedding
  try {
    // Made and freed per traced exchange: from the thread's kept blocks. Owned until end().
    state_ = new (handoff::detail::thread_block_cache<sizeof(collected)>::allocate()) collected;
  } catch (const std::bad_alloc&) {
    return;  // this exchange goes untraced
  }
  collected& s = *state_;
  s.thread = &thread;
  s.outer = thread.innermost;
  thread.innermost = this;
  // An exchange failed when an exception leaves its scope (classify). A release is recorded by a
  // producer's noexcept destruction, which none leaves: it is not asked (a call into the C++ runtime).
  if (kind != event_kind::release) { s.uncaught = std::uncaught_exceptions(); }
  s.event.kind = kind;
  s.event.protocol = protocol;
  // A producer's export inside an import: the importer is its consumer.
  if (s.outer != nullptr && kind == event_kind::export_data && s.outer->event().kind == event_kind::import_data) {
    s.event.consumer = s.outer->event().consumer;
  }
  s.event.time_ns =
    std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  s.event.thread = thread_id(thread);
}

void exchange_scope::end() noexcept
{
  collected& s = *state_;
  s.thread->innermost = s.outer;
  try {
    classify();
  } catch (const std::exception& error) {
    HANDOFF_LOG_DEBUG("a trace hazard check failed ({})", error.what());
  }
  // The import of what this export handed over learns where the data was ready.
  if (s.outer != nullptr && s.event.kind == event_kind::export_data &&
      s.outer->event().kind == event_kind::import_data && !s.outer->event().producer_stream) {
    s.outer->event().producer_stream = s.event.producer_stream;
  }
  record(std::move(s.event));
  state_->~collected();
  handoff::detail::thread_block_cache<sizeof(collected)>::deallocate(state_);
  state_ = nullptr;
}

trace::event& exchange_scope::event() noexcept
{
  return state_->event;
}

void exchange_scope::set_protocol(std::string_view protocol) noexcept
{
  if (state_ != nullptr) { state_->event.protocol = protocol; }
}

void exchange_scope::note_unordered() noexcept
{
  if (state_ != nullptr) { state_->unordered = true; }
}

void exchange_scope::note_ordered_by_producer() noexcept
{
  if (state_ != nullptr) { state_->ordered_by_producer = true; }
}

exchange_scope* exchange_scope::current() noexcept
{
  return this_thread().innermost;
}

void exchange_scope::set_view(const array& view, std::uint64_t view_id, const char* library) noexcept
{
  if (state_ == nullptr) { return; }
  state_->event.device = view.device();
  state_->event.dtype = view.dtype();
  state_->event.nbytes = view.nbytes();
  state_->event.buffer = view.owner().id();
  if (activity::recording()) { detail::note_exchanged(view.data(), view.nbytes(), state_->event.buffer); }
  if (view_id != 0) { state_->event.view = view_id; }
  if (library != nullptr) {
    state_->event.producer = library;
  } else if (state_->event.producer == nullptr) {
    state_->event.producer = view.owner().library();
  }
  try {
    state_->event.shape = view.shape();
  } catch (const std::bad_alloc&) {
    state_->event.shape.clear();
  }
}

namespace {

stream_id id_of(const bound_stream& binding) noexcept
{
  const DLDeviceType type = binding.ctx != nullptr ? binding.ctx->backend().device_type() : kDLCUDA;
  return {.device = {type, binding.device}, .handle = static_cast<std::uint64_t>(binding.stream)};
}

}  // namespace

void exchange_scope::set_producer_stream(const bound_stream& producer) noexcept
{
  if (state_ == nullptr) { return; }
  state_->event.producer_stream = id_of(producer);
  if (producer.ctx != nullptr) { state_->backend = &producer.ctx->backend(); }
}

void exchange_scope::set_consumer_stream(const bound_stream& consumer) noexcept
{
  if (state_ == nullptr) { return; }
  state_->event.consumer_stream = id_of(consumer);
  if (consumer.ctx != nullptr) { state_->backend = &consumer.ctx->backend(); }
}

void exchange_scope::note_wait(device::backend& backend, int device, std::uint64_t producer, std::uint64_t consumer,
                               bool inserted) noexcept
{
  if (state_ == nullptr) { return; }
  const DLDeviceType type = backend.device_type();
  state_->backend = &backend;
  state_->event.producer_stream = stream_id{.device = {type, device}, .handle = producer};
  state_->event.consumer_stream = stream_id{.device = {type, device}, .handle = consumer};
  (inserted ? state_->waited : state_->elided) = true;
}

void exchange_scope::note_wait_for_process(const bound_stream& consumer) noexcept
{
  if (state_ == nullptr) { return; }
  set_consumer_stream(consumer);
  state_->waited = true;
}

void exchange_scope::forget_ordering() noexcept
{
  if (state_ == nullptr) { return; }
  collected& s = *state_;
  s.event.producer_stream.reset();
  s.event.consumer_stream.reset();
  s.backend = nullptr;
  s.waited = s.elided = s.unordered = s.ordered_by_producer = false;
}

void exchange_scope::classify()
{
  collected& s = *state_;
  trace::event& e = s.event;
  // An exchange the embedding classified itself (an interposed one it saw fail, or saw a hazard in).
  if (e.action == action::refused || e.hazard != nullptr) { return; }
  // What the embedding already said of the exchange (why it was unordered) follows the hazard's text.
  const auto with_reason = [&](std::string text) {
    return e.detail.empty() ? text : fmt::format("{} ({})", text, e.detail);
  };
  if (e.kind != event_kind::release && std::uncaught_exceptions() > s.uncaught) {
    e.action = action::refused;
    e.detail = "the exchange raised an error";
  } else if (e.kind == event_kind::release) {
    e.action = e.consumer_stream ? action::wait : action::none;
  } else if (e.device.device_type == kDLCPU) {
    e.action = action::none;
  } else if (!s.waited && s.elided) {
    e.action = action::elided;
  } else if (!s.waited && s.unordered) {
    e.action = action::unordered;
  } else if (s.waited || s.ordered_by_producer) {  // by handoff, or by the producer given the stream
    e.action = action::wait;
  }
  if (s.backend == nullptr || e.kind == event_kind::release) { return; }
  device::backend& backend = *s.backend;
  // Unordered is a hazard only while the producer still works on the data: ask its stream, unless
  // it captures (its work runs when the graph is launched; asking would invalidate the capture).
  // Relaxed, so that a capture under way on another thread neither fails nor loses the question.
  if (e.action == action::unordered && e.producer_stream) {
    const device_guard on_device{backend, e.producer_stream->device.device_id};
    const relaxed_capture_mode relaxed{backend};
    const activity::bookkeeping own;  // the trace's question, not the program's
    const auto producer = static_cast<device::stream_handle>(e.producer_stream->handle);
    if (backend.stream_capture_status(producer) == device::capture_status::none && !backend.query_stream(producer)) {
      e.hazard = "unordered";
      e.detail = with_reason(fmt::format(
        "handed over with no ordering while its producer stream {:#x} still had work pending: the consumer may "
        "read the data before it is written",
        e.producer_stream->handle));
      return;
    }
  }
  // A default stream names the current device's: only a created stream belongs to one device.
  const auto consumer =
    e.consumer_stream ? static_cast<device::stream_handle>(e.consumer_stream->handle) : backend.legacy_default_stream();
  if (e.device.device_type == backend.device_type() && consumer != backend.legacy_default_stream() &&
      consumer != backend.per_thread_default_stream()) {
    const int consumer_device = backend.stream_device(consumer);
    if (consumer_device != e.device.device_id) {
      e.hazard = "cross-device";
      e.detail = with_reason(fmt::format("data of device {} is consumed on stream {:#x} of device {}",
                                         e.device.device_id, e.consumer_stream->handle, consumer_device));
    }
  }
}

}  // namespace handoff::trace
