#include "device/sim/state.hpp"

#include "log/logger.hpp"

#include <handoff/error.hpp>

#include <fmt/format.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <set>
#include <utility>

namespace handoff::device {

using namespace sim_detail;

namespace sim_detail {

namespace {

// Every thread_state_owner alive, so that a thread's exit frees its state in each. Never destroyed:
// threads may end during static destruction.
struct owner_registry {
  std::mutex mutex;
  std::set<thread_state_owner*> live;
};

owner_registry& owners()
{
  static auto* registry = new owner_registry;
  return *registry;
}

// A thread's state is forgotten by a pthread key's destructor, as the CUDA runtime's is: after the
// thread's C++ thread_local objects are destroyed, so that their destructors (a runtime ordering
// the thread's last work) still find it. The main thread's is kept: the process ends with it.
void forget_ending_thread(void* key) noexcept
{
  std::lock_guard lock(owners().mutex);
  for (auto* owner : owners().live) { owner->forget_thread(thread_key{reinterpret_cast<std::uintptr_t>(key)}); }
}

pthread_key_t thread_exit_key() noexcept
{
  static const pthread_key_t key = [] {
    pthread_key_t made{};
    if (pthread_key_create(&made, &forget_ending_thread) != 0) { std::abort(); }  // no key: no thread model
    return made;
  }();
  return key;
}

}  // namespace

void watch_thread_exits(thread_state_owner& owner)
{
  std::lock_guard lock(owners().mutex);
  owners().live.insert(&owner);
}

void unwatch_thread_exits(thread_state_owner& owner) noexcept
{
  std::lock_guard lock(owners().mutex);
  owners().live.erase(&owner);
}

thread_key this_thread_key() noexcept
{
  static std::atomic<std::uint64_t> next{1};
  // Trivially destructible, so that it stays readable after the hook has run (the exit drain of
  // the main thread runs among static destructors, after its thread-local objects are gone).
  thread_local std::uint64_t key = 0;
  if (key == 0) {
    key = next.fetch_add(1, std::memory_order_relaxed);
    (void)pthread_setspecific(thread_exit_key(), reinterpret_cast<void*>(static_cast<std::uintptr_t>(key)));
  }
  return thread_key{key};
}

}  // namespace sim_detail

namespace {}  // namespace

sim_backend::impl::impl(std::vector<int> visible, sim_flavour f)
    : flavour(f),
      device_count(static_cast<int>(visible.size())),
      node_devices(std::move(visible)),
      devices(node_devices.size()),
      has_context(node_devices.size(), false)
{
  const int count = device_count;
  for (int d = 0; d < count; ++d) {
    auto& dev = devices[static_cast<std::size_t>(d)];
    dev.legacy = std::make_unique<stream_state>();
    dev.legacy->device = d;
    dev.legacy->kind = stream_kind::legacy;
    dev.legacy->blocking = true;
    dev.context_id = ++next_context_id;
    dev.host_functions = &pool.make_lane();
  }
  watch_thread_exits(*this);
}

void sim_backend::impl::forget_thread(thread_key owner) noexcept
try {
  std::lock_guard lock(mutex);
  for (auto& dev : devices) {
    auto it = dev.per_thread.find(owner);
    if (it == dev.per_thread.end()) { continue; }
    // As for a destroyed stream, work already enqueued still runs and is waited for.
    if (!is_done(it->second->tail)) { dev.retired.push_back(it->second->tail); }
    dev.per_thread.erase(it);
  }
  current.erase(owner);
  pushed.erase(owner);
  capture_modes.erase(owner);
  if (auto it = rocm_thread_streams.find(owner); it != rocm_thread_streams.end()) {
    rocm_thread_stream_owner.erase(it->second);
    destroyed_streams.insert(it->second);
    rocm_thread_streams.erase(it);
  }
} catch (...) {
  HANDOFF_LOG_ERROR("{}: the state of an ended thread could not be freed", backend_name());
}

sim_backend::impl::~impl()
{
  unwatch_thread_exits(*this);  // first: the pool's threads end below
  {
    std::lock_guard lock(mutex);
    for (const auto& hold : holds) {
      HANDOFF_LOG_ERROR("{}: a hold on stream {:#x} outlived the backend; its work runs now", backend_name(),
                        hold.stream);
      pool.open_gate(hold.gate);
    }
    holds.clear();
  }
  if (ipc_watcher) { ipc_watcher->stop(); }  // work held for other processes is let go
  pool.shutdown();                           // pending frees need the table, so drain before anything is destroyed
  for (auto& [base, info] : allocations) { free_memory(base, info); }
}

// --- opening a call --------------------------------------------------------------------------------

void sim_backend::impl::count_call(std::string_view op)
{
  if (counting_thread.load(std::memory_order_relaxed) != static_cast<std::uint64_t>(this_thread_key())) { return; }
  std::lock_guard lock(fault_mutex);
  ++call_counts[op];
}

void sim_backend::impl::open(const call& c)
{
  if (counting_thread.load(std::memory_order_relaxed) != 0) { count_call(c.op); }
  if (inside_host_function()) {
    {
      std::lock_guard lock(mutex);
      record_violation(fmt::format("{}({}) called from inside a host function", call_name(c.op, flavour), c.args()));
    }
    fail(c, sim_error::not_permitted);
  }
  std::string name;
  {
    std::lock_guard lock(fault_mutex);
    if (faults.empty()) { return; }
    auto it = faults.find(std::string(c.op));
    if (it == faults.end()) { return; }
    name = it->second.error_name;
    if (--it->second.remaining <= 0) { faults.erase(it); }
  }
  throw make_error(c, name, fmt::format("{} (injected fault)", error_text(std::string_view{name})));
}

bool sim_backend::impl::open_quiet(const call& c) noexcept
{
  if (counting_thread.load(std::memory_order_relaxed) != 0) {
    try {
      count_call(c.op);
    } catch (...) {}  // out of memory: the count is a test's, the call goes on
  }
  if (!inside_host_function()) { return true; }
  try {
    const auto what = fmt::format("{}({}) called from inside a host function", call_name(c.op, flavour), c.args());
    HANDOFF_LOG_ERROR("{}: {}: not permitted, ignored", backend_name(), what);
    std::lock_guard lock(mutex);
    record_violation(what);
  } catch (...) {}
  return false;
}

std::string_view sim_backend::impl::backend_name() const noexcept
{
  return flavour == sim_flavour::cuda ? "sim" : "sim-rocm";
}

device_error sim_backend::impl::make_error(const call& c, std::string_view error_name, std::string_view text) const
{
  return device_error(std::string(backend_name()), std::string(error_name),
                      fmt::format("{}({}) failed: {}: {}", call_name(c.op, flavour), c.args(), error_name, text));
}

void sim_backend::impl::fail(const call& c, sim_error code, std::string_view detail) const
{
  const auto name = error_name(code, flavour);
  if (detail.empty()) { throw make_error(c, name, error_text(code)); }
  throw make_error(c, name, fmt::format("{} ({})", error_text(code), detail));
}

void sim_backend::impl::check_alive(const call& c, int device) const
{
  const auto& dev = devices[static_cast<std::size_t>(device)];
  if (!dev.halted.load(std::memory_order_acquire)) { return; }
  throw make_error(c, dev.sticky_error,
                   fmt::format("{} (sticky: device {}'s context is unusable until the process exits)",
                               error_text(std::string_view{dev.sticky_error}), device));
}

void sim_backend::impl::record_violation(std::string what)
{
  HANDOFF_LOG_ERROR("{}: violation: {}", backend_name(), what);
  violations.push_back(std::move(what));
}

// --- lookups ---------------------------------------------------------------------------------------

int sim_backend::impl::current_locked() const
{
  auto it = current.find(this_thread_key());
  return it == current.end() ? 0 : it->second;
}

int sim_backend::impl::using_current(const call& c)
{
  const int device = current_locked();
  has_context[static_cast<std::size_t>(device)] = true;
  current.try_emplace(this_thread_key(), device);  // as the runtime makes that context current
  check_alive(c, device);
  return device;
}

void sim_backend::impl::make_current(std::string_view op, int device, bool push)
{
  const call_with c{op, "{}", device};
  open(c);
  if (device < 0 || device >= device_count) { fail(c, sim_error::invalid_device); }
  std::lock_guard lock(mutex);
  check_alive(c, device);
  const auto self = this_thread_key();
  if (push) {
    const auto it = current.find(self);
    pushed[self].push_back(it == current.end() ? std::nullopt : std::optional<int>{it->second});
  }
  current[self] = device;
  has_context[static_cast<std::size_t>(device)] = true;
}

stream_state& sim_backend::impl::per_thread_stream(thread_key owner, int device)
{
  auto& slot = devices[static_cast<std::size_t>(device)].per_thread[owner];
  if (!slot) {
    slot = std::make_unique<stream_state>();
    slot->device = device;
    slot->kind = stream_kind::per_thread;
    slot->blocking = true;
  }
  return *slot;
}

stream_state* sim_backend::impl::find_stream(std::uintptr_t h)
{
  // Default streams are the current device's.
  const auto current_device = [this] {
    const int device = current_locked();
    has_context[static_cast<std::size_t>(device)] = true;
    return device;
  };
  if (flavour == sim_flavour::cuda) {
    if (h == 0 || h == 1) { return devices[static_cast<std::size_t>(current_device())].legacy.get(); }
    if (h == 2) { return &per_thread_stream(this_thread_key(), current_device()); }
  } else {
    if (h == 0) { return devices[static_cast<std::size_t>(current_device())].legacy.get(); }
    if (h == 1 || h == 2) { return nullptr; }
    if (auto it = rocm_thread_stream_owner.find(h); it != rocm_thread_stream_owner.end()) {
      return &per_thread_stream(it->second, current_device());
    }
  }
  auto it = streams.find(h);
  return it == streams.end() ? nullptr : it->second.get();
}

stream_state& sim_backend::impl::stream(const call& c, stream_handle h)
{
  auto* s = find_stream(raw(h));
  // A handle that names no live stream, destroyed or never made, is refused as CUDA refuses one:
  // cudaErrorInvalidResourceHandle, "a resource handle passed to the API call was not valid.
  // Resource handles are opaque types like cudaStream_t and cudaEvent_t" (CUDA Runtime API, Error
  // Handling; hipErrorInvalidHandle in HIP). Not cudaErrorContextIsDestroyed: that names a context
  // destroyed while current to the calling thread (cuCtxDestroy), not a handle. A use after
  // destruction is undefined in CUDA (cuCtxDestroy: "doing so will result in undefined behavior"),
  // so it is also recorded, for the test fixtures to fail on.
  if (s == nullptr) {
    if (destroyed_streams.contains(raw(h))) {
      record_violation(
        fmt::format("{}({}) used stream {:#x} after it was destroyed", call_name(c.op, flavour), c.args(), raw(h)));
      fail(c, sim_error::invalid_handle, fmt::format("stream {:#x} was destroyed", raw(h)));
    }
    fail(c, sim_error::invalid_handle, fmt::format("no stream {:#x}", raw(h)));
  }
  check_alive(c, s->device);
  return *s;
}

event_state& sim_backend::impl::event(const call& c, event_handle h)
{
  // As for streams (above): cudaErrorInvalidResourceHandle, and a recorded violation when destroyed.
  auto it = events.find(raw(h));
  if (it == events.end()) {
    if (destroyed_events.contains(raw(h))) {
      record_violation(
        fmt::format("{}({}) used event {:#x} after it was destroyed", call_name(c.op, flavour), c.args(), raw(h)));
      fail(c, sim_error::invalid_handle, fmt::format("event {:#x} was destroyed", raw(h)));
    }
    fail(c, sim_error::invalid_handle, fmt::format("no event {:#x}", raw(h)));
  }
  check_alive(c, it->second->device);
  return *it->second;
}

std::uintptr_t sim_backend::impl::issue_handle() noexcept
{
  next_handle += 0x10;
  return next_handle;
}

// --- work ------------------------------------------------------------------------------------------

void sim_backend::impl::check_legacy_use(const call& c, const stream_state& s)
{
  if (s.kind != stream_kind::legacy) { return; }
  bool conflict = false;
  for_each_stream(s.device, [&](stream_state& other) {
    if (other.kind != stream_kind::legacy && other.blocking && other.capture) {
      other.capture->invalidated = true;
      conflict = true;
    }
  });
  if (conflict) { fail(c, sim_error::capture_implicit); }
}

void sim_backend::impl::check_unsafe_call(const call& c)
{
  if (open_captures.empty()) { return; }
  const auto self = this_thread_key();
  const auto it = capture_modes.find(self);
  const capture_mode mode = it == capture_modes.end() ? capture_mode::global : it->second;
  if (mode == capture_mode::relaxed) { return; }
  bool forbidden = false;
  for (auto& [id, open] : open_captures) {
    if (mode == capture_mode::global || open.owner == self) {
      open.info->invalidated = true;
      forbidden = true;
    }
  }
  if (forbidden) {
    fail(c, sim_error::capture_unsupported,
         "a capture in global mode is under way, and the calling thread's capture mode forbids calls that could "
         "wait on captured work");
  }
}

work sim_backend::impl::submission(int device, stream_work w)
{
  auto& dev = devices[static_cast<std::size_t>(device)];
  return work{.body = std::move(w.body),
              .delay = w.delay,
              .halted = &dev.halted,
              .serial = w.host_function ? dev.host_functions : nullptr};
}

std::vector<node_ptr> sim_backend::impl::next_deps_locked(stream_state& s, node_ptr extra)
{
  std::vector<node_ptr> deps;
  deps.push_back(s.tail);
  if (extra) { deps.push_back(std::move(extra)); }
  if (s.kind == stream_kind::legacy) {
    for_each_stream(s.device, [&](stream_state& other) {
      if (&other != &s && other.blocking && !is_done(other.tail)) { deps.push_back(other.tail); }
    });
  } else if (s.blocking) {
    deps.push_back(devices[static_cast<std::size_t>(s.device)].legacy->tail);
  }
  return deps;
}

node_ptr sim_backend::impl::enqueue_locked(stream_state& s, stream_work w, node_ptr extra)
{
  append_locked(s, pool.submit(submission(s.device, std::move(w)), next_deps_locked(s, std::move(extra))));
  return s.tail;
}

void sim_backend::impl::append_locked(stream_state& s, node_ptr n)
{
  // A stream's operations complete in order: those seen done leave from the front.
  while (!s.queued.empty() && is_done(s.queued.front())) { s.queued.pop_front(); }
  s.queued.push_back(n);
  s.tail = std::move(n);
}

std::size_t sim_backend::impl::capture_locked(stream_state& s, stream_work w, std::optional<std::size_t> extra)
{
  auto& ops = s.capture->graph.ops;
  captured_op op{.what = std::move(w), .device = s.device, .deps = {}};
  if (s.capture_tail) { op.deps.push_back(*s.capture_tail); }
  if (extra && extra != s.capture_tail) { op.deps.push_back(*extra); }
  ops.push_back(std::move(op));
  s.capture_tail = ops.size() - 1;
  return *s.capture_tail;
}

void sim_backend::impl::enqueue(const call& c, stream_handle h, stream_work w, activity_note* note)
{
  std::lock_guard lock(mutex);
  auto& s = stream(c, h);
  check_legacy_use(c, s);
  if (s.capture) {
    (void)capture_locked(s, std::move(w));  // a node of the graph: runs at each launch, not now
    if (note != nullptr) { note->armed = false; }
    return;
  }
  enqueue_locked(s, std::move(w));
  if (note != nullptr && note->armed) {
    note->on_stream(s, raw(h), flavour);
    if (note->record.kind == activity::kind::copy) { keep_device_memory(*note); }
  }
}

std::vector<node_ptr> sim_backend::impl::device_tails_locked(int device)
{
  std::vector<node_ptr> tails;
  for_each_stream(device, [&](stream_state& s) {
    if (s.tail) { tails.push_back(s.tail); }
  });
  auto& retired = devices[static_cast<std::size_t>(device)].retired;
  std::erase_if(retired, [](const node_ptr& n) { return is_done(n); });
  tails.insert(tails.end(), retired.begin(), retired.end());
  return tails;
}

const sim_backend::impl::open_hold* sim_backend::impl::own_hold_before(const std::vector<node_ptr>& targets)
{
  const auto self = this_thread_key();
  if (std::none_of(holds.begin(), holds.end(), [&](const open_hold& h) { return h.holder == self; })) {
    return nullptr;
  }
  for (const auto& target : targets) {
    if (const auto gate = pool.closed_gate_before(target, static_cast<gate_holder>(self))) {
      const auto it = std::find_if(holds.begin(), holds.end(), [&](const open_hold& h) { return h.gate == gate; });
      if (it != holds.end()) { return &*it; }
    }
  }
  return nullptr;
}

void sim_backend::impl::refuse_held_wait(const call& c, const std::vector<node_ptr>& targets)
{
  if (const auto* hold = own_hold_before(targets)) {
    throw make_error(
      c, sim_backend::hold_deadlock_error,
      fmt::format("it would wait for ever: it waits for work held by the hold on stream {:#x}, which this thread "
                  "began and cannot end while it waits; wait after the hold ends (from Python, "
                  "sim.to_numpy(..., wait=False) enqueues a read without waiting)",
                  hold->stream));
  }
}

void sim_backend::impl::wait_on_device(const call& c, int device, const std::vector<node_ptr>& targets)
{
  for (const auto& t : targets) { wait_for(t); }
  std::lock_guard lock(mutex);
  check_alive(c, device);
}

void* sim_backend::impl::allocate_locked(const call& c, std::size_t bytes, memory_kind kind)
{
  const int device = using_current(c);
  if (bytes == 0) { return nullptr; }
  if (kind == memory_kind::device) { return allocate_shareable_locked(c, bytes, device); }
  void* p = ::operator new(bytes, allocation_alignment, std::nothrow);
  if (p == nullptr) { fail(c, sim_error::memory_allocation); }
  allocation info;
  info.size = bytes;
  info.kind = kind;
  info.device = device;
  allocations.emplace(reinterpret_cast<std::uintptr_t>(p), std::move(info));
  HANDOFF_LOG_DEBUG("{}: {} bytes at {} on device {}", backend_name(), bytes, p, device);
  return p;
}

void sim_backend::impl::release_allocation(std::uintptr_t base) noexcept
{
  std::lock_guard lock(mutex);
  if (const auto it = allocations.find(base); it != allocations.end()) {
    free_memory(base, it->second);
    allocations.erase(it);
  }
}

}  // namespace handoff::device
