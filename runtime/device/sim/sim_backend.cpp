// The simulated device's backend interface: each call opens with impl::open (host-function and
// fault checks), looks its handles up under the state's mutex, then changes state or submits work.
#include "device/sim/sim_backend.hpp"

#include "device/sim/state.hpp"
#include "log/logger.hpp"

#include <handoff/error.hpp>

#include <fmt/format.h>

#include <fmt/ranges.h>
#include <set>

#include <algorithm>
#include <array>
#include <cctype>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace handoff::device {

using namespace sim_detail;
using std::chrono::nanoseconds;

namespace {}  // namespace

sim_backend::sim_backend(int device_count, sim_flavour flavour, std::vector<int> visible)
{
  HANDOFF_EXPECTS(device_count >= 1 && device_count <= max_devices, value_error,
                  fmt::format("a simulated backend has 1 to {} devices, not {}", max_devices, device_count));
  if (visible.empty()) {
    visible.resize(static_cast<std::size_t>(device_count));
    std::iota(visible.begin(), visible.end(), 0);
  }
  std::vector<int> sorted = visible;
  std::ranges::sort(sorted);
  HANDOFF_EXPECTS(
    std::cmp_equal(visible.size(), device_count) && sorted.front() >= 0 && sorted.back() < max_devices &&
      std::ranges::adjacent_find(sorted) == sorted.end(),
    value_error,
    fmt::format("a simulated backend of {} device{} sees {} distinct devices of its node (0 to {}), not {}",
                device_count, device_count == 1 ? "" : "s", device_count, max_devices - 1, fmt::join(visible, ",")));
  impl_ = std::make_unique<impl>(std::move(visible), flavour);
  HANDOFF_LOG_DEBUG("{}: {} simulated devices", impl_->backend_name(), device_count);
}

sim_backend::~sim_backend() = default;

std::string_view sim_backend::name() const noexcept
{
  return impl_->backend_name();
}

DLDeviceType sim_backend::device_type() const noexcept
{
  return impl_->flavour == sim_flavour::cuda ? kDLCUDA : kDLROCM;
}

int sim_backend::device_count()
{
  const call_with c{"device_count", ""};
  impl_->open(c);
  return impl_->device_count;
}

int sim_backend::current_device()
{
  const call_with c{"current_device", ""};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  return impl_->current_locked();
}

bool sim_backend::device_is_current(int device)
{
  const call_with c{"current_device", "{}", device};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  const auto it = impl_->current.find(this_thread_key());
  return it != impl_->current.end() && it->second == device;
}

void sim_backend::set_current_device(int device)
{
  impl_->make_current("set_current_device", device, /*push=*/false);
}

void sim_backend::push_current_device(int device)
{
  impl_->make_current("push_current_device", device, /*push=*/true);
}

void sim_backend::pop_current_device() noexcept
{
  if (!impl_->open_quiet(call_with{"pop_current_device", ""})) { return; }
  std::lock_guard lock(impl_->mutex);
  const auto self = this_thread_key();
  auto it = impl_->pushed.find(self);
  if (it == impl_->pushed.end() || it->second.empty()) {
    HANDOFF_LOG_ERROR("{}: pop_current_device without a push on this thread", impl_->backend_name());
    return;
  }
  if (const auto previous = it->second.back()) {
    impl_->current[self] = *previous;
  } else {
    impl_->current.erase(self);  // nothing was current: nothing is
  }
  it->second.pop_back();
  if (it->second.empty()) { impl_->pushed.erase(it); }
}

stream_handle sim_backend::legacy_default_stream() const noexcept
{
  return stream_handle{impl_->flavour == sim_flavour::cuda ? 1U : 0U};
}

stream_handle sim_backend::per_thread_default_stream() const noexcept
{
  if (impl_->flavour == sim_flavour::cuda) { return stream_handle{2}; }
  std::lock_guard lock(impl_->mutex);
  const auto self = this_thread_key();
  auto [it, inserted] = impl_->rocm_thread_streams.try_emplace(self, 0);
  if (inserted) {
    it->second = impl_->issue_handle();
    impl_->rocm_thread_stream_owner.emplace(it->second, self);
  }
  return stream_handle{it->second};
}

stream_handle sim_backend::create_stream(bool non_blocking)
{
  const call_with c{"create_stream", "flags={}", non_blocking ? "NonBlocking" : "Default"};
  impl_->open(c);
  activity_note note{activity::kind::stream_create};
  std::uintptr_t handle = 0;
  {
    std::lock_guard lock(impl_->mutex);
    auto s = std::make_unique<stream_state>();
    s->device = impl_->using_current(c);
    s->blocking = !non_blocking;
    handle = impl_->issue_handle();
    HANDOFF_LOG_DEBUG("{}: stream {:#x} created on device {} ({})", name(), handle, s->device,
                      non_blocking ? "non-blocking" : "blocking");
    note.on_stream(*s, handle, impl_->flavour);
    impl_->streams.emplace(handle, std::move(s));
  }
  note.send();
  return stream_handle{handle};
}

void sim_backend::destroy_stream(stream_handle stream) noexcept
{
  try {
    const call_with c{"destroy_stream", "{:#x}", raw(stream)};
    if (!impl_->open_quiet(c)) { return; }
    activity_note note{activity::kind::stream_destroy};
    std::unique_lock lock(impl_->mutex);
    auto it = impl_->streams.find(raw(stream));
    if (it == impl_->streams.end()) {
      if (impl_->destroyed_streams.contains(raw(stream))) {
        impl_->record_violation(
          fmt::format("{}({}): the stream was already destroyed", call_name(c.op, impl_->flavour), c.args()));
      } else {
        HANDOFF_LOG_ERROR("{}({}) failed: not a created stream", call_name(c.op, impl_->flavour), c.args());
      }
      return;
    }
    auto& dev = impl_->devices[static_cast<std::size_t>(it->second->device)];
    if (const auto& capture = it->second->capture; capture && capture->origin == it->second.get()) {
      impl_->open_captures.erase(capture->id);  // a capture that can never end forbids nothing
    }
    // Like CUDA, work already enqueued still runs; synchronize_device still waits for it.
    if (!is_done(it->second->tail)) { dev.retired.push_back(it->second->tail); }
    std::erase_if(dev.retired, [](const node_ptr& n) { return is_done(n); });
    note.on_stream(*it->second, raw(stream), impl_->flavour);
    impl_->streams.erase(it);
    impl_->destroyed_streams.insert(raw(stream));
    lock.unlock();
    note.send();
    HANDOFF_LOG_DEBUG("{}: stream {:#x} destroyed", name(), raw(stream));
  } catch (...) {
    HANDOFF_LOG_ERROR("{}: destroy_stream failed", name());
  }
}

int sim_backend::stream_device(stream_handle stream,
                               std::optional<bool> /*capturing: a simulated stream always answers*/)
{
  const call_with c{"stream_device", "{:#x}", raw(stream)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  return impl_->stream(c, stream).device;
}

bool sim_backend::stream_is_blocking(stream_handle stream)
{
  const call_with c{"stream_is_blocking", "{:#x}", raw(stream)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  return impl_->stream(c, stream).blocking;
}

capture_status sim_backend::stream_capture_status(stream_handle stream)
{
  const call_with c{"stream_capture_status", "{:#x}", raw(stream)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  auto& s = impl_->stream(c, stream);
  if (s.kind == stream_kind::legacy) {
    bool conflict = false;
    impl_->for_each_stream(s.device, [&](const stream_state& other) {
      conflict = conflict || (other.kind != stream_kind::legacy && other.blocking && other.capture);
    });
    // CUDA's answer is cudaErrorStreamCaptureImplicit (asking invalidates nothing): the legacy
    // stream is as good as captured, since work on it would join the capture.
    return conflict ? capture_status::active : capture_status::none;
  }
  if (!s.capture) { return capture_status::none; }
  return s.capture->invalidated ? capture_status::invalidated : capture_status::active;
}

std::uint64_t sim_backend::stream_capture_id(stream_handle stream)
{
  const call_with c{"stream_capture_id", "{:#x}", raw(stream)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  auto& s = impl_->stream(c, stream);
  if (s.kind == stream_kind::legacy) {
    impl_->check_legacy_use(c, s);
    return 0;
  }
  return s.capture ? s.capture->id : 0;
}

bool sim_backend::query_stream(stream_handle stream)
{
  const call_with c{"query_stream", "{:#x}", raw(stream)};
  impl_->open(c);
  activity_note note{activity::kind::host_query};
  bool done = false;
  {
    std::lock_guard lock(impl_->mutex);
    auto& s = impl_->stream(c, stream);
    if (s.capture) { impl_->fail(c, sim_error::capture_unsupported); }
    impl_->check_legacy_use(c, s);
    impl_->check_unsafe_call(c);
    // The work enqueued on the stream itself, as cudaStreamQuery: the legacy stream's implicit
    // synchronization applies to work enqueued on it, not to the question.
    done = is_done(s.tail);
    note.on_stream(s, raw(stream), impl_->flavour);
  }
  if (done) { note.send(); }  // the host saw the work done: later work is ordered after it
  return done;
}

void sim_backend::synchronize_stream(stream_handle stream)
{
  const call_with c{"synchronize_stream", "{:#x}", raw(stream)};
  impl_->open(c);
  activity_note note{activity::kind::host_sync};
  node_ptr target;
  int device = 0;
  {
    std::lock_guard lock(impl_->mutex);
    auto& s = impl_->stream(c, stream);
    if (s.capture) {
      s.capture->invalidated = true;
      impl_->fail(c, sim_error::capture_unsupported);
    }
    impl_->check_legacy_use(c, s);
    impl_->check_unsafe_call(c);
    // The work enqueued on the stream itself, the legacy stream included: a synchronization is no
    // operation of the stream, so nothing says it waits for the blocking streams' work enqueued
    // after the legacy stream's last operation (which CUDA leaves open; the stricter reading).
    target = s.tail;
    device = s.device;
    impl_->refuse_held_wait(c, {target});
    note.on_stream(s, raw(stream), impl_->flavour);
  }
  const blocked_timer blocked{note};
  impl_->wait_on_device(c, device, {target});
}

capture_mode sim_backend::exchange_capture_mode(capture_mode mode)
{
  const call_with c{"exchange_capture_mode", "{}", static_cast<int>(mode)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  const auto self = this_thread_key();
  const auto it = impl_->capture_modes.find(self);
  const capture_mode previous = it == impl_->capture_modes.end() ? capture_mode::global : it->second;
  if (mode == capture_mode::global) {
    if (it != impl_->capture_modes.end()) { impl_->capture_modes.erase(it); }
  } else {
    impl_->capture_modes[self] = mode;
  }
  return previous;
}

void sim_backend::synchronize_device()
{
  const call_with c{"synchronize_device", ""};
  impl_->open(c);
  std::vector<node_ptr> tails;
  int device = 0;
  {
    std::lock_guard lock(impl_->mutex);
    device = impl_->using_current(c);
    bool capturing = false;
    impl_->for_each_stream(device, [&](stream_state& s) {
      if (s.capture) {
        s.capture->invalidated = true;
        capturing = true;
      }
    });
    if (capturing) { impl_->fail(c, sim_error::capture_unsupported); }
    impl_->check_unsafe_call(c);
    tails = impl_->device_tails_locked(device);
    impl_->refuse_held_wait(c, tails);
  }
  activity_note note{activity::kind::host_sync};
  note.record.scope = activity::sync_scope::device;
  note.on_device(device, impl_->flavour);
  const blocked_timer blocked{note};
  impl_->wait_on_device(c, device, tails);
}

event_handle sim_backend::create_event()
{
  const call_with c{"create_event", "flags=DisableTiming"};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  auto e = std::make_unique<event_state>();
  e->device = impl_->using_current(c);
  const auto handle = impl_->issue_handle();
  impl_->events.emplace(handle, std::move(e));
  return event_handle{handle};
}

void sim_backend::destroy_event(event_handle event) noexcept
{
  try {
    const call_with c{"destroy_event", "{:#x}", raw(event)};
    if (!impl_->open_quiet(c)) { return; }
    std::lock_guard lock(impl_->mutex);
    if (const auto it = impl_->events.find(raw(event)); it != impl_->events.end() && it->second->ipc) {
      if (it->second->ipc->exporter) { it->second->ipc->state->destroyed.store(1, std::memory_order_release); }
    }
    if (impl_->events.erase(raw(event)) != 0) {
      impl_->destroyed_events.insert(raw(event));
    } else if (impl_->destroyed_events.contains(raw(event))) {
      impl_->record_violation(
        fmt::format("{}({}): the event was already destroyed", call_name(c.op, impl_->flavour), c.args()));
    } else {
      HANDOFF_LOG_ERROR("{}({}) failed: not an event", call_name(c.op, impl_->flavour), c.args());
    }
  } catch (...) {
    HANDOFF_LOG_ERROR("{}: destroy_event failed", name());
  }
}

void sim_backend::record_event(event_handle event, stream_handle stream)
{
  const call_with c{"record_event", "{:#x}, {:#x}", raw(event), raw(stream)};
  impl_->open(c);
  std::unique_lock lock(impl_->mutex);
  auto& e = impl_->event(c, event);
  auto& s = impl_->stream(c, stream);
  if (e.device != s.device) {
    impl_->fail(c, sim_error::invalid_handle,
                fmt::format("the event belongs to device {}, the stream to device {}", e.device, s.device));
  }
  impl_->check_legacy_use(c, s);
  if (s.capture) {
    if (e.ipc) { impl_->fail(c, sim_error::capture_unsupported, "an interprocess event cannot be captured"); }
    e.capture = s.capture;
    e.captured_at = impl_->capture_locked(s, {});
    e.fence = nullptr;
    return;
  }
  e.capture = nullptr;
  e.captured_at.reset();
  e.fence = impl_->enqueue_locked(s, {});
  if (e.ipc) { impl_->signal_record(e, e.fence); }
  activity_note note{activity::kind::event_record};
  note.on_stream(s, raw(stream), impl_->flavour);
  note.record.event = raw(event);
  lock.unlock();
  note.send();
}

bool sim_backend::query_event(event_handle event)
{
  const call_with c{"query_event", "{:#x}", raw(event)};
  impl_->open(c);
  activity_note note{activity::kind::host_query};
  bool done = false;
  {
    std::lock_guard lock(impl_->mutex);
    auto& e = impl_->event(c, event);
    if (e.capture) { impl_->fail(c, sim_error::captured_event); }
    impl_->check_unsafe_call(c);
    done = impl_->recorded_elsewhere(c, e)
             ? impl::shared_record_reached(*e.ipc, e.ipc->state->recorded.load(std::memory_order_acquire))
             : is_done(e.fence);
    note.on_device(e.device, impl_->flavour);
  }
  note.record.scope = activity::sync_scope::event;
  note.record.event = raw(event);
  if (done) { note.send(); }
  return done;
}

void sim_backend::synchronize_event(event_handle event)
{
  const call_with c{"synchronize_event", "{:#x}", raw(event)};
  impl_->open(c);
  node_ptr fence;
  int device = 0;
  {
    std::lock_guard lock(impl_->mutex);
    auto& e = impl_->event(c, event);
    if (e.capture) { impl_->fail(c, sim_error::captured_event); }
    impl_->check_unsafe_call(c);
    if (impl_->recorded_elsewhere(c, e)) {
      const std::uint64_t record = e.ipc->state->recorded.load(std::memory_order_acquire);
      fence = impl_->watch().when([shared = e.ipc, record] { return impl::shared_record_reached(*shared, record); });
    } else {
      fence = e.fence;
    }
    device = e.device;
    impl_->refuse_held_wait(c, {fence});
  }
  activity_note note{activity::kind::host_sync};
  note.record.scope = activity::sync_scope::event;
  note.record.event = raw(event);
  note.on_device(device, impl_->flavour);
  const blocked_timer blocked{note};
  impl_->wait_on_device(c, device, {fence});
}

void sim_backend::stream_wait_event(stream_handle stream, event_handle event)
{
  const call_with c{"stream_wait_event", "{:#x}, {:#x}, 0", raw(stream), raw(event)};
  impl_->open(c);
  std::unique_lock lock(impl_->mutex);
  auto& s = impl_->stream(c, stream);
  auto& e = impl_->event(c, event);
  impl_->check_legacy_use(c, s);
  if (e.capture) {
    // Waiting on captured work forks the capture into this stream (CUDA's cross-stream capture).
    if (s.capture && s.capture != e.capture) { impl_->fail(c, sim_error::capture_isolation); }
    if (s.kind == stream_kind::legacy) { impl_->fail(c, sim_error::capture_implicit); }
    if (!s.capture) {
      s.capture = e.capture;
      s.capture_tail.reset();
    }
    (void)impl_->capture_locked(s, {}, e.captured_at);
    return;
  }
  if (s.capture) {
    (void)impl_->capture_locked(s, {});  // an external dependency of the graph: nothing to order at launch
    return;
  }
  if (impl_->recorded_elsewhere(c, e)) {
    // Another process's stream must reach the record the event holds now: a later record does not
    // change this wait, as for a local event.
    const std::uint64_t record = e.ipc->state->recorded.load(std::memory_order_acquire);
    if (impl::shared_record_reached(*e.ipc, record)) {
      impl_->enqueue_locked(s, {});
      return;
    }
    impl_->enqueue_locked(
      s, {}, impl_->watch().when([shared = e.ipc, record] { return impl::shared_record_reached(*shared, record); }));
    return;
  }
  // The fence is copied now: a later re-record of the event does not change this wait.
  impl_->enqueue_locked(s, {}, e.fence);
  activity_note note{activity::kind::stream_wait};
  note.on_stream(s, raw(stream), impl_->flavour);
  note.record.event = raw(event);
  lock.unlock();
  note.send();
}

pointer_attributes sim_backend::attributes(const void* ptr)
{
  const call_with c{"attributes", "{}", fmt::ptr(ptr)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  const auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  auto it = impl_->allocations.upper_bound(addr);
  if (it == impl_->allocations.begin()) { return {}; }
  --it;
  if (addr - it->first >= it->second.size) { return {}; }
  impl_->check_alive(c, it->second.device);
  pointer_attributes result;
  result.kind = it->second.kind;
  result.device = it->second.device;
  result.base = reinterpret_cast<const void*>(it->first);
  result.size = it->second.size;
  result.device_pointer = const_cast<void*>(ptr);  // one address space, as with CUDA's UVA
  return result;
}

void* sim_backend::allocate(std::size_t bytes, stream_handle stream)
{
  const call_with c{"allocate", "{}, {:#x}", bytes, raw(stream)};
  impl_->open(c);
  activity_note note{activity::kind::allocate};
  void* memory = nullptr;
  {
    std::lock_guard lock(impl_->mutex);
    auto& s = impl_->stream(c, stream);
    impl_->check_legacy_use(c, s);
    memory = impl_->allocate_locked(c, bytes, memory_kind::device);
    note.on_stream(s, raw(stream), impl_->flavour);
  }
  note.record.stream_ordered = true;
  note.buffers = {
    {.address = reinterpret_cast<std::uintptr_t>(memory), .bytes = bytes, .mode = activity::access::write}};
  if (memory != nullptr) { note.send(); }
  return memory;
}

void sim_backend::deallocate(void* ptr, stream_handle stream) noexcept
{
  if (ptr == nullptr) { return; }
  try {
    const call_with c{"deallocate", "{}, {:#x}", ptr, raw(stream)};
    if (!impl_->open_quiet(c)) { return; }
    activity_note note{activity::kind::free};
    std::unique_lock lock(impl_->mutex);
    const auto call = call_name(c.op, impl_->flavour);
    auto it = impl_->allocations.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == impl_->allocations.end() || it->second.free_pending) {
      HANDOFF_LOG_ERROR("{}({}) failed: not a live allocation", call, c.args());
      return;
    }
    auto* s = impl_->find_stream(raw(stream));
    if (s == nullptr) {
      if (impl_->destroyed_streams.contains(raw(stream))) {
        impl_->record_violation(
          fmt::format("{}({}) used stream {:#x} after it was destroyed", call, c.args(), raw(stream)));
      }
      // Kept in the table (freed with the backend) rather than freed under running work.
      HANDOFF_LOG_ERROR("{}({}) failed: invalid stream; the memory is kept", call, c.args());
      return;
    }
    it->second.free_pending = true;
    const auto base = it->first;
    impl_->enqueue_locked(
      *s,
      {.body = [state = impl_.get(), base] { state->release_allocation(base); }, .delay = {}, .host_function = false});
    note.on_stream(*s, raw(stream), impl_->flavour);
    note.record.stream_ordered = true;
    note.buffers = {{.address = base, .bytes = it->second.size, .mode = activity::access::write}};
    lock.unlock();
    note.send();
  } catch (...) {
    HANDOFF_LOG_ERROR("{}: deallocate failed", name());
  }
}

void sim_backend::copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream)
{
  const call_with c{"copy_async", "{}, {}, {}, cudaMemcpyDefault, {:#x}", dst, src, bytes, raw(stream)};
  impl_->open(c);
  if (bytes != 0 && (dst == nullptr || src == nullptr)) { impl_->fail(c, sim_error::invalid_value); }
  const nanoseconds duration{impl_->copy_duration.load(std::memory_order_relaxed)};
  const std::array<activity::buffer_use, 2> touched{
    {{.address = reinterpret_cast<std::uintptr_t>(src), .bytes = bytes, .mode = activity::access::read},
     {.address = reinterpret_cast<std::uintptr_t>(dst), .bytes = bytes, .mode = activity::access::write}}};
  activity_note note{activity::kind::copy, touched};
  if (duration == nanoseconds::zero() || bytes == 0) {
    impl_->enqueue(c, stream,
                   {.body =
                      [dst, src, bytes] {
                        if (bytes != 0) { std::memmove(dst, src, bytes); }
                      },
                    .delay = {},
                    .host_function = false},
                   &note);
    note.send();
    return;
  }
  // A copy that takes time reads its source when it starts and its bytes land when it ends.
  auto staged = std::make_shared<std::vector<std::byte>>();
  const auto* from = static_cast<const std::byte*>(src);
  impl_->enqueue(
    c, stream,
    {.body = [staged, from, bytes] { staged->assign(from, from + bytes); }, .delay = {}, .host_function = false},
    &note);
  impl_->enqueue(c, stream,
                 {.body = [staged, dst, bytes] { std::memcpy(dst, staged->data(), bytes); },
                  .delay = duration,
                  .host_function = false});
  note.send();
}

void sim_backend::launch_host_func(stream_handle stream, void (*fn)(void*), void* user_data)
{
  const call_with c{"launch_host_func", "{:#x}, {}, {}", raw(stream), reinterpret_cast<void*>(fn), user_data};
  impl_->open(c);
  if (fn == nullptr) { impl_->fail(c, sim_error::invalid_value); }
  impl_->enqueue(c, stream, {.body = [fn, user_data] { fn(user_data); }, .delay = {}, .host_function = true});
}

// --- simulation extras -----------------------------------------------------------------------------

sim_flavour sim_backend::flavour() const noexcept
{
  return impl_->flavour;
}

std::span<const std::string_view> sim_backend::fault_operations() noexcept
{
  return sim_detail::fault_operations();
}

namespace {

// An injected error is named as the runtimes name theirs: cudaErrorIllegalAddress, hipErrorLaunchFailure.
void check_error_name(std::string_view name, const char* where)
{
  const auto named_after = [name](std::string_view prefix) {
    if (!name.starts_with(prefix) || name.size() == prefix.size() ||
        std::isupper(static_cast<unsigned char>(name[prefix.size()])) == 0) {
      return false;
    }
    return std::all_of(name.begin() + static_cast<std::ptrdiff_t>(prefix.size()), name.end(),
                       [](char c) { return std::isalnum(static_cast<unsigned char>(c)) != 0; });
  };
  HANDOFF_EXPECTS(named_after("cudaError") || named_after("hipError"), value_error,
                  fmt::format("{}: '{}' is not the name of a CUDA or HIP error (such as cudaErrorIllegalAddress or "
                              "hipErrorLaunchFailure)",
                              where, name));
}

}  // namespace

void sim_backend::inject_fault(std::string operation, int count, std::string error_name)
{
  const auto keys = sim_detail::fault_operations();
  const bool known = std::find(keys.begin(), keys.end(), operation) != keys.end();
  HANDOFF_EXPECTS(
    known, value_error,
    fmt::format("inject_fault: unknown operation '{}'; expected one of: {}", operation, fmt::join(keys, ", ")));
  HANDOFF_EXPECTS(count >= 0, value_error, fmt::format("inject_fault: count must be >= 0, got {}", count));
  check_error_name(error_name, "inject_fault");
  std::lock_guard lock(impl_->fault_mutex);
  if (count == 0) {
    impl_->faults.erase(operation);
  } else {
    impl_->faults.insert_or_assign(std::move(operation), fault{count, std::move(error_name)});
  }
}

void sim_backend::clear_faults() noexcept
{
  std::lock_guard lock(impl_->fault_mutex);
  impl_->faults.clear();
}

void sim_backend::count_calls(bool on)
{
  std::lock_guard lock(impl_->fault_mutex);
  if (on) {
    HANDOFF_EXPECTS(impl_->counting_thread.load(std::memory_order_relaxed) == 0, value_error,
                    "the simulator counts calls already: one count at a time");
    impl_->call_counts.clear();
  }
  impl_->counting_thread.store(on ? static_cast<std::uint64_t>(this_thread_key()) : 0, std::memory_order_relaxed);
}

std::map<std::string, std::size_t, std::less<>> sim_backend::call_counts()
{
  std::lock_guard lock(impl_->fault_mutex);
  std::map<std::string, std::size_t, std::less<>> counts;
  for (const auto& [op, n] : impl_->call_counts) { counts.emplace(op, n); }
  return counts;
}

void sim_backend::inject_sticky_fault(int device, std::string error_name)
{
  HANDOFF_EXPECTS(
    device >= 0 && device < impl_->device_count, value_error,
    fmt::format("inject_sticky_fault: device {} does not exist (the backend has {})", device, impl_->device_count));
  check_error_name(error_name, "inject_sticky_fault");
  std::lock_guard lock(impl_->mutex);
  auto& dev = impl_->devices[static_cast<std::size_t>(device)];
  dev.sticky_error = std::move(error_name);
  dev.halted.store(true, std::memory_order_release);
  HANDOFF_LOG_DEBUG("{}: device {} halted by a sticky {}", name(), device, dev.sticky_error);
}

void sim_backend::clear_sticky_fault(int device)
{
  HANDOFF_EXPECTS(
    device >= 0 && device < impl_->device_count, value_error,
    fmt::format("clear_sticky_fault: device {} does not exist (the backend has {})", device, impl_->device_count));
  std::lock_guard lock(impl_->mutex);
  auto& dev = impl_->devices[static_cast<std::size_t>(device)];
  dev.halted.store(false, std::memory_order_release);
  dev.sticky_error.clear();
}

void sim_backend::reset_device(int device)
{
  HANDOFF_EXPECTS(
    device >= 0 && device < impl_->device_count, value_error,
    fmt::format("reset_device: device {} does not exist (the backend has {})", device, impl_->device_count));
  const call_with c{"cuDevicePrimaryCtxReset", "{}", device};  // a test's control: no fault is injected
  std::vector<node_ptr> tails;
  {
    std::lock_guard lock(impl_->mutex);
    tails = impl_->device_tails_locked(device);
    impl_->refuse_held_wait(c, tails);
  }
  impl_->wait_on_device(c, device, tails);
  std::lock_guard lock(impl_->mutex);
  auto& dev = impl_->devices[static_cast<std::size_t>(device)];
  std::erase_if(impl_->streams, [&](const auto& entry) {
    if (entry.second->device != device) { return false; }
    impl_->destroyed_streams.insert(entry.first);
    return true;
  });
  std::erase_if(impl_->events, [&](const auto& entry) {
    if (entry.second->device != device) { return false; }
    impl_->destroyed_events.insert(entry.first);
    return true;
  });
  std::erase_if(impl_->allocations, [&](const auto& entry) {
    if (entry.second.device != device || entry.second.registered) { return false; }
    impl::free_memory(entry.first, entry.second);
    return true;
  });
  dev.per_thread.clear();
  dev.retired.clear();
  dev.legacy = std::make_unique<stream_state>();
  dev.legacy->device = device;
  dev.legacy->kind = stream_kind::legacy;
  dev.legacy->blocking = true;
  dev.context_id = ++impl_->next_context_id;
  impl_->has_context[static_cast<std::size_t>(device)] = false;
}

std::uint64_t sim_backend::context_id(int device)
{
  const call_with c{"context_id", "{}", device};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  if (device < 0 || device >= impl_->device_count) { impl_->fail(c, sim_error::invalid_device); }
  return impl_->devices[static_cast<std::size_t>(device)].context_id;
}

std::uint64_t sim_backend::current_context_id()
{
  const call_with c{"current_device", ""};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  const auto it = impl_->current.find(this_thread_key());
  return it == impl_->current.end() ? 0 : impl_->devices[static_cast<std::size_t>(it->second)].context_id;
}

std::vector<std::string> sim_backend::violations()
{
  std::lock_guard lock(impl_->mutex);
  return impl_->violations;
}

void sim_backend::clear_violations() noexcept
{
  std::lock_guard lock(impl_->mutex);
  impl_->violations.clear();
}

void sim_backend::enqueue_fill_bytes(stream_handle stream, void* dst, std::size_t bytes,
                                     std::span<const std::byte> pattern, nanoseconds delay)
{
  const call_with c{
    "enqueue_fill", "{:#x}, {}, {}, pattern of {} bytes, delay {}ns", raw(stream), dst, bytes, pattern.size(),
    delay.count()};
  impl_->open(c);
  if (pattern.empty() || bytes % pattern.size() != 0 || (bytes != 0 && dst == nullptr) || delay < nanoseconds::zero()) {
    impl_->fail(c, sim_error::invalid_value,
                "bytes must be a multiple of a non-empty pattern, dst non-null, delay >= 0");
  }
  std::vector<std::byte> copy(pattern.begin(), pattern.end());
  const activity::buffer_use written{
    .address = reinterpret_cast<std::uintptr_t>(dst), .bytes = bytes, .mode = activity::access::write};
  activity_note note{activity::kind::set, {&written, 1}};
  impl_->enqueue(c, stream,
                 {.body =
                    [dst, bytes, p = std::move(copy)] {
                      auto* out = static_cast<std::byte*>(dst);
                      for (std::size_t at = 0; at < bytes; at += p.size()) {
                        std::memcpy(out + at, p.data(), p.size());
                      }
                    },
                  .delay = delay,
                  .host_function = false},
                 &note);
  note.send();
}

void sim_backend::enqueue_sleep(stream_handle stream, nanoseconds duration)
{
  const call_with c{"enqueue_sleep", "{:#x}, {}ns", raw(stream), duration.count()};
  impl_->open(c);
  if (duration < nanoseconds::zero()) { impl_->fail(c, sim_error::invalid_value, "negative duration"); }
  impl_->enqueue(c, stream, {.body = {}, .delay = duration, .host_function = false});
}

void sim_backend::launch_kernel(stream_handle stream, const char* kernel, std::span<const activity::buffer_use> buffers,
                                nanoseconds delay)
{
  const call_with c{"launch_kernel", "{:#x}, {}, {} buffers, delay {}ns",
                    raw(stream),     kernel != nullptr ? kernel : "?",
                    buffers.size(),  delay.count()};
  impl_->open(c);
  if (kernel == nullptr || delay < nanoseconds::zero()) {
    impl_->fail(c, sim_error::invalid_value, "a kernel needs a name and a delay >= 0");
  }
  activity_note note{activity::kind::launch, buffers};
  if (note.armed) { note.record.name = activity::intern(kernel); }  // kept only where a trace records
  impl_->enqueue(c, stream, {.body = {}, .delay = delay, .host_function = false}, &note);
  note.send();
}

// --- holds ------------------------------------------------------------------------------------------

sim_hold::sim_hold(sim_backend& sim, std::shared_ptr<sim_detail::node> gate) noexcept
    : sim_(&sim), gate_(std::move(gate))
{}

sim_hold::sim_hold(sim_hold&& other) noexcept : sim_(std::exchange(other.sim_, nullptr)), gate_(std::move(other.gate_))
{}

sim_hold& sim_hold::operator=(sim_hold&& other) noexcept
{
  if (this != &other) {
    release();
    sim_ = std::exchange(other.sim_, nullptr);
    gate_ = std::move(other.gate_);
  }
  return *this;
}

sim_hold::~sim_hold()
{
  release();
}

void sim_hold::release() noexcept
{
  if (gate_) { sim_->end_hold(std::exchange(gate_, nullptr)); }
}

sim_hold sim_backend::hold(stream_handle stream)
{
  const call_with c{"hold", "{:#x}", raw(stream)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  auto& s = impl_->stream(c, stream);
  impl_->check_legacy_use(c, s);
  if (s.capture) {
    impl_->fail(c, sim_error::capture_unsupported,
                "the work of a capturing stream runs when its graph is launched: hold the stream it is launched on");
  }
  const auto holder = this_thread_key();
  // In the stream's order, not counted by pending(): what follows waits for it.
  auto gate = impl_->pool.submit_gate(static_cast<gate_holder>(holder), impl_->next_deps_locked(s));
  s.tail = gate;
  std::erase_if(s.gates, [](const node_ptr& g) { return !is_closed_gate(g); });
  s.gates.push_back(gate);
  impl_->holds.push_back({.gate = gate, .stream = raw(stream), .holder = holder});
  HANDOFF_LOG_DEBUG("{}: stream {:#x} held", name(), raw(stream));
  return sim_hold{*this, std::move(gate)};
}

void sim_backend::end_hold(const std::shared_ptr<sim_detail::node>& gate) noexcept
{
  try {
    std::lock_guard lock(impl_->mutex);
    auto& holds = impl_->holds;
    const auto it = std::find_if(holds.begin(), holds.end(), [&](const auto& h) { return h.gate == gate; });
    if (it != holds.end()) {
      if (it->holder != this_thread_key()) {
        // Its thread's waits were refused for it: that thread was the one that would end it.
        impl_->record_violation(
          fmt::format("the hold on stream {:#x} ended on another thread than the one that began it", it->stream));
      }
      HANDOFF_LOG_DEBUG("{}: stream {:#x} released", name(), it->stream);
      holds.erase(it);
    }
    impl_->pool.open_gate(gate);
  } catch (...) {
    impl_->pool.open_gate(gate);  // never leave work held
  }
}

std::size_t sim_backend::pending(stream_handle stream)
{
  const call_with c{"pending", "{:#x}", raw(stream)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  auto& queued = impl_->stream(c, stream).queued;
  while (!queued.empty() && is_done(queued.front())) { queued.pop_front(); }
  return queued.size();
}

bool sim_backend::held(stream_handle stream)
{
  const call_with c{"held", "{:#x}", raw(stream)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  auto& gates = impl_->stream(c, stream).gates;
  std::erase_if(gates, [](const node_ptr& g) { return !is_closed_gate(g); });
  return !gates.empty();
}

bool sim_backend::waits_for_hold(stream_handle stream)
{
  const call_with c{"waits_for_hold", "{:#x}", raw(stream)};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  const auto& queued = impl_->stream(c, stream).queued;
  return !queued.empty() && impl_->pool.closed_gate_before(queued.back(), any_holder) != nullptr;
}

void sim_backend::synchronize_unheld()
{
  const call_with c{"synchronize_unheld", ""};
  impl_->open(c);
  std::vector<node_ptr> runnable;
  {
    std::lock_guard lock(impl_->mutex);
    impl_->check_unsafe_call(c);
    const auto collect = [&](const node_ptr& n) {
      if (!is_done(n) && !impl_->pool.closed_gate_before(n, any_holder)) { runnable.push_back(n); }
    };
    for (int d = 0; d < impl_->device_count; ++d) {
      impl_->for_each_stream(d,
                             [&](const stream_state& s) { std::for_each(s.queued.begin(), s.queued.end(), collect); });
      const auto& retired = impl_->devices[static_cast<std::size_t>(d)].retired;
      std::for_each(retired.begin(), retired.end(), collect);
    }
  }
  for (const auto& n : runnable) { wait_for(n); }
}

std::size_t sim_backend::holds_of_this_thread()
{
  std::lock_guard lock(impl_->mutex);
  const auto self = this_thread_key();
  return static_cast<std::size_t>(
    std::count_if(impl_->holds.begin(), impl_->holds.end(), [&](const auto& h) { return h.holder == self; }));
}

void sim_backend::set_copy_duration(nanoseconds duration)
{
  HANDOFF_EXPECTS(duration >= nanoseconds::zero(), value_error, "a copy cannot take a negative time");
  impl_->copy_duration.store(duration.count(), std::memory_order_relaxed);
}

void* sim_backend::allocate_pinned_host(std::size_t bytes)
{
  const call_with c{"allocate_pinned_host", "{}", bytes};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  return impl_->allocate_locked(c, bytes, memory_kind::pinned_host);
}

void* sim_backend::allocate_managed(std::size_t bytes)
{
  const call_with c{"allocate_managed", "{}, cudaMemAttachGlobal", bytes};
  impl_->open(c);
  std::lock_guard lock(impl_->mutex);
  return impl_->allocate_locked(c, bytes, memory_kind::managed);
}

void sim_backend::free_sync(void* ptr)
{
  const call_with c{"free_sync", "{}", ptr};
  impl_->open(c);
  if (ptr == nullptr) { return; }
  activity_note note{activity::kind::free};
  std::vector<node_ptr> tails;
  int device = 0;
  {
    std::lock_guard lock(impl_->mutex);
    auto it = impl_->allocations.find(reinterpret_cast<std::uintptr_t>(ptr));
    if (it == impl_->allocations.end() || it->second.free_pending) {
      impl_->fail(c, sim_error::invalid_value, "not a live allocation");
    }
    device = it->second.device;
    impl_->check_alive(c, device);
    it->second.free_pending = true;
    tails = impl_->device_tails_locked(device);
    const bool held = std::any_of(tails.begin(), tails.end(), [&](const node_ptr& t) {
      return impl_->pool.closed_gate_before(t, any_holder) != nullptr;
    });
    if (held) {
      // cudaFree's synchronization would wait for a test's hold: for ever on the thread that holds
      // it, and on another while it keeps what the holder needs to end the hold (a deleter run with
      // Python's GIL). The allocation goes once the device's work is done instead, without waiting
      // (and no host wait is reported: the host waited for nothing).
      const auto base = it->first;
      auto freed = impl_->pool.submit(
        impl_->submission(device, {.body = [state = impl_.get(), base] { state->release_allocation(base); },
                                   .delay = {},
                                   .host_function = false}),
        tails);
      impl_->devices[static_cast<std::size_t>(device)].retired.push_back(std::move(freed));  // device syncs wait
      return;
    }
    note.on_device(device, impl_->flavour);
    note.buffers = {{.address = it->first, .bytes = it->second.size, .mode = activity::access::write}};
  }
  {
    const blocked_timer blocked{note};  // cudaFree synchronizes the device first
    impl_->wait_on_device(c, device, tails);
  }
  impl_->release_allocation(reinterpret_cast<std::uintptr_t>(ptr));
}

std::vector<int> sim_backend::devices_with_context()
{
  std::lock_guard lock(impl_->mutex);
  std::vector<int> used;
  for (int d = 0; d < impl_->device_count; ++d) {
    if (impl_->has_context[static_cast<std::size_t>(d)]) { used.push_back(d); }
  }
  return used;
}

std::size_t sim_backend::live_allocations()
{
  std::lock_guard lock(impl_->mutex);
  return impl_->allocations.size();
}

std::size_t sim_backend::threads_with_state()
{
  std::lock_guard lock(impl_->mutex);
  std::set<thread_key> threads;
  for (const auto& [owner, device] : impl_->current) { threads.insert(owner); }
  for (const auto& [owner, devices] : impl_->pushed) { threads.insert(owner); }
  for (const auto& [owner, handle] : impl_->rocm_thread_streams) { threads.insert(owner); }
  for (const auto& dev : impl_->devices) {
    for (const auto& [owner, stream] : dev.per_thread) { threads.insert(owner); }
  }
  return threads.size();
}

sim_backend* as_sim(backend& b) noexcept
{
  return dynamic_cast<sim_backend*>(&b);
}

}  // namespace handoff::device
