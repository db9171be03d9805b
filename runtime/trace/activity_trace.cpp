// Device activity into the trace: each record a backend reports becomes a launch, copy, sync, stream
// or memory event, named by the user's line and checked by the race detector, in the order the host
// issued them.
#include <handoff/activity.hpp>
#include <handoff/internal/activity_trace.hpp>
#include <handoff/internal/race_detector.hpp>
#include <handoff/trace.hpp>

#include "core/thread_exit.hpp"
#include "log/logger.hpp"
#include "trace/activity_kinds.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace handoff::activity {
namespace detail {
std::atomic<bool> recording{false};
}  // namespace detail

namespace {

// What a host wait's `op` says it waited for.
constexpr auto scope_ops = handoff::detail::make_enum_table<sync_scope, const char*>({{sync_scope::stream, "stream"},
                                                                                      {sync_scope::event, "event"},
                                                                                      {sync_scope::device, "device"},
                                                                                      {sync_scope::copy, "copy"}});

const char* op_of(const record& r) noexcept
{
  if (r.kind == kind::free && !r.stream_ordered) { return "free-sync"; }
  const char* op = trace::detail::facts(r.kind).op;
  return op != nullptr ? op : handoff::detail::look_up(scope_ops, r.scope, "?");
}

// Whether the record's stream field names a stream.
bool names_stream(const record& r) noexcept
{
  switch (r.kind) {
    case kind::allocate:
    case kind::free:
      return r.stream_ordered;
    case kind::host_sync:
    case kind::host_query:
      return r.scope == sync_scope::stream || r.scope == sync_scope::copy;
    default:
      return true;
  }
}

// The detector, the exchanged memory it names, and the activity events' numbering, under the
// recorder's lock (trace::detail::lock_recorder). Leaked, as backends may report while the process
// exits.
struct activity_state {
  std::map<std::uintptr_t, exchanged_memory> exchanged;  // by address
  std::unique_ptr<trace::race_detector> detector;        // while an activity session is open
  std::uint64_t next_seq{1};

  static activity_state& get()
  {
    static auto* state = new activity_state;  // NOLINT(cppcoreguidelines-owning-memory): leaked, see above
    return *state;
  }

  const exchanged_memory* exchanged_holding(std::uintptr_t address) const
  {
    auto it = exchanged.upper_bound(address);
    if (it == exchanged.begin()) { return nullptr; }
    --it;
    return address - it->second.address < it->second.bytes ? &it->second : nullptr;
  }

  // Memory allocated or freed is no longer the array it was.
  void forget_exchanged(std::uintptr_t address, std::size_t bytes)
  {
    for (auto it = exchanged.lower_bound(address); it != exchanged.end() && it->first < address + bytes;) {
      it = exchanged.erase(it);
    }
    if (const exchanged_memory* before = exchanged_holding(address)) {
      const std::uintptr_t key = before->address;
      exchanged.erase(key);
    }
  }

  void reset()
  {
    detector = std::make_unique<trace::race_detector>([this](std::uintptr_t address, std::size_t) {
      const exchanged_memory* held = exchanged_holding(address);
      return held != nullptr ? fmt::format("buffer:{}", held->buffer) : std::string{};
    });
    exchanged.clear();
  }
};

// The event report() fills: the thread's own, emptied but for its vectors' and strings' capacity, so
// that an activity event allocates nothing once the thread has recorded a few. A report made while
// another is being filled on the thread (the annotator may run a release), or once the thread gave
// its own back (a backend reporting while the thread or the process exits), gets a fresh one.
class reused_event {
 public:
  reused_event() : thread_(local())
  {
    if (thread_.taken || thread_.closed) {
      fresh_.emplace();
      return;
    }
    if (thread_.event == nullptr) {
      thread_.event = new trace::event;  // NOLINT(cppcoreguidelines-owning-memory): give_back deletes it
      handoff::detail::call_at_thread_exit<&give_back>();
    } else {
      empty(*thread_.event);
    }
    thread_.taken = true;
  }
  ~reused_event()
  {
    if (!fresh_) { thread_.taken = false; }
  }
  reused_event(const reused_event&) = delete;
  reused_event& operator=(const reused_event&) = delete;
  reused_event(reused_event&&) = delete;
  reused_event& operator=(reused_event&&) = delete;

  trace::event& get() noexcept { return fresh_ ? *fresh_ : *thread_.event; }

 private:
  // Constant-initialized and trivially destructible: reached in one step, and still there for a
  // report made after the closer ran.
  struct per_thread {
    trace::event* event{nullptr};
    bool taken{false};
    bool closed{false};
  };
  static per_thread& local() noexcept
  {
    thread_local per_thread mine;
    return mine;
  }
  static void give_back() noexcept
  {
    per_thread& mine = local();
    mine.closed = true;
    delete std::exchange(mine.event, nullptr);  // NOLINT(cppcoreguidelines-owning-memory)
  }

  // What report() may leave set in an activity event and does not set on every report (the
  // exchange fields stay as constructed: nothing sets them here), emptied in place.
  static void empty(trace::event& e) noexcept
  {
    e.stream.reset();
    e.nbytes = 0;
    e.library = nullptr;
    e.where = nullptr;
    e.buffers.clear();
    e.hazard = nullptr;
    e.detail.clear();
    e.fix.clear();
    e.other.reset();
  }

  per_thread& thread_;
  std::optional<trace::event> fresh_;
};

// A query that saw work done orders later work; it is no event of its own, so nothing names it.
void observe_query(const record& r) noexcept
{
  try {
    activity_state& state = activity_state::get();
    const std::uint64_t thread = trace::detail::native_thread_id();
    const auto lock = trace::detail::lock_recorder();
    if (state.detector) { (void)state.detector->observe(r, thread, trace::access_site{}); }
  } catch (const std::exception& error) {
    HANDOFF_LOG_WARN("a device query was not traced ({})", error.what());
  }
}

// The names the thread interned lately, most recent first. Behind a call of its own: where the
// thread-local is named, the compiler asks for its address again (a call into the dynamic linker)
// after every comparison.
[[gnu::noinline]] std::array<std::string_view, 8>& recent_names() noexcept
{
  thread_local std::array<std::string_view, 8> recent{};
  return recent;
}

}  // namespace

const char* intern(std::string_view name)
{
  // Asked on every launch (its kernel) and every activity event (its user line), mostly with names
  // the thread asked lately: those are compared first, most recently asked first (a loop asks the
  // same few in turn), and a known name is found without a copy. Interned names are never freed, so
  // the views stay valid.
  std::array<std::string_view, 8>& recent = recent_names();
  const auto first = recent.begin();
  const auto last = recent.end();
  for (auto at = first; at != last; ++at) {
    if (at->data() != nullptr && *at == name) {
      std::rotate(first, at, at + 1);  // to the front
      return first->data();
    }
  }
  struct name_hash {
    using is_transparent = void;
    std::size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
  };
  using name_set = std::unordered_set<std::string, name_hash, std::equal_to<>>;
  static auto* mutex = new std::mutex;  // NOLINT(cppcoreguidelines-owning-memory): leaked
  static auto* names = new name_set;    // NOLINT(cppcoreguidelines-owning-memory): leaked
  std::lock_guard lock{*mutex};
  auto found = names->find(name);
  if (found == names->end()) { found = names->emplace(name).first; }
  std::rotate(first, last - 1, last);  // the least recent goes
  recent.front() = *found;
  return found->c_str();
}

std::optional<exchanged_memory> exchanged_at(std::uintptr_t address) noexcept
{
  const auto lock = trace::detail::lock_recorder();
  const exchanged_memory* held = activity_state::get().exchanged_holding(address);
  return held != nullptr ? std::optional{*held} : std::nullopt;
}

namespace {

// How deep the calling thread is in bookkeeping scopes.
[[gnu::noinline]] int& bookkeeping_depth() noexcept
{
  thread_local int depth = 0;
  return depth;
}

}  // namespace

bookkeeping::bookkeeping() noexcept
{
  ++bookkeeping_depth();
}

bookkeeping::~bookkeeping()
{
  --bookkeeping_depth();
}

void report(const record& r) noexcept
{
  if (!recording() || bookkeeping_depth() > 0) { return; }
  if (r.kind == kind::host_query) {
    observe_query(r);
    return;
  }
  try {
    reused_event scratch;
    trace::event& e = scratch.get();
    e.kind = trace::detail::facts(r.kind).event;
    e.op = op_of(r);
    e.time_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
    e.thread = trace::detail::native_thread_id();
    e.device = r.device;
    if (names_stream(r)) { e.stream = trace::stream_id{.device = r.device, .handle = r.stream}; }
    e.kernel = r.name;
    e.blocked_ns = r.blocked_ns;
    e.buffers.reserve(r.buffers.size());
    for (const buffer_use& use : r.buffers) {
      e.buffers.push_back({.address = use.address, .nbytes = use.bytes, .mode = use.mode, .buffer = 0});
      if (writes(use.mode) || r.kind == kind::free || r.kind == kind::allocate) {
        e.nbytes += static_cast<std::int64_t>(use.bytes);
      }
    }
    if (!r.library.empty()) { e.library = intern(r.library); }
    trace::detail::annotate(e);  // outside the lock: the embedding's annotator may run a release

    activity_state& state = activity_state::get();
    const auto lock = trace::detail::lock_recorder();
    if (!state.detector) { return; }  // the last launch trace ended meanwhile
    e.seq = state.next_seq++;
    for (trace::buffer_ref& b : e.buffers) {
      if (const exchanged_memory* held = state.exchanged_holding(b.address)) { b.buffer = held->buffer; }
    }
    const trace::access_site site{.seq = e.seq,
                                  .kind = r.kind,
                                  .kernel = r.name,
                                  .stream = {.device = r.device.device_id,
                                             .handle = r.stream,
                                             .thread = r.stream_class == stream_class::per_thread ? e.thread : 0},
                                  .stream_class = r.stream_class,
                                  .where = e.where,
                                  .library = e.library,
                                  .time_ns = e.time_ns};
    if (auto found = state.detector->observe(r, e.thread, site)) {
      e.hazard = found->name;
      e.detail = std::move(found->detail);
      e.fix = std::move(found->fix);
      const trace::access_site& other = found->other;
      e.other = trace::activity_side{.seq = other.seq,
                                     .kind = trace::detail::facts(other.kind).event,
                                     .kernel = other.kernel,
                                     .stream = trace::stream_id{.device = {r.device.device_type, other.stream.device},
                                                                .handle = other.stream.handle},
                                     .where = other.where,
                                     .library = other.library,
                                     .time_ns = other.time_ns};
    }
    if (r.kind == kind::allocate || r.kind == kind::free) {
      for (const buffer_use& use : r.buffers) { state.forget_exchanged(use.address, use.bytes); }
    }
    trace::detail::record_annotated_locked(std::move(e));  // which copies what it keeps: `e` is reused
  } catch (const std::exception& error) {
    HANDOFF_LOG_WARN("a device activity was not traced ({})", error.what());
  }
}

}  // namespace handoff::activity

namespace handoff::trace::detail {

void activity_sessions_changed(bool any) noexcept
{
  try {
    activity::activity_state& state = activity::activity_state::get();
    if (any) {
      state.reset();
    } else {
      state.detector.reset();
      state.exchanged.clear();
    }
  } catch (const std::exception& error) {
    HANDOFF_LOG_WARN("the race detector could not start ({})", error.what());
  }
  activity::detail::recording.store(any, std::memory_order_relaxed);
}

void note_exchanged(const void* data, std::int64_t nbytes, std::uint64_t buffer) noexcept
{
  if (data == nullptr || nbytes <= 0) { return; }
  try {
    activity::activity_state& state = activity::activity_state::get();
    const auto lock = trace::detail::lock_recorder();
    const auto address = reinterpret_cast<std::uintptr_t>(data);
    state.exchanged.insert_or_assign(
      address,
      activity::exchanged_memory{.address = address, .bytes = static_cast<std::size_t>(nbytes), .buffer = buffer});
  } catch (const std::exception&) {  // a name for messages: not worth failing an exchange
  }
}

}  // namespace handoff::trace::detail
