#include <handoff/device_guard.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/runtime.hpp>
#include <handoff/stats.hpp>
#include <handoff/stream.hpp>
#include <handoff/trace.hpp>

#include "log/logger.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace handoff {

namespace {

bool same_device(DLDevice a, DLDevice b) noexcept
{
  return a.device_type == b.device_type && a.device_id == b.device_id;
}

}  // namespace

std::optional<DLPackVersion> export_version(std::optional<DLPackVersion> consumer_max) noexcept
{
  if (!consumer_max || consumer_max->major < 1) { return std::nullopt; }
  const std::uint32_t minor = consumer_max->major == DLPACK_MAJOR_VERSION
                                ? std::min<std::uint32_t>(consumer_max->minor, DLPACK_MINOR_VERSION)
                                : DLPACK_MINOR_VERSION;
  return DLPackVersion{DLPACK_MAJOR_VERSION, minor};
}

namespace {

// The array API's rules for handing `view` over to `target` with `copy`, one for both directions;
// `verb` ("export", "import") names the direction in messages.
transfer plan_transfer(const array& view, std::optional<DLDevice> target, std::optional<bool> copy, const char* verb)
{
  const bool moves = target.has_value() && !same_device(*target, view.device());
  HANDOFF_EXPECTS(!moves || target->device_type == kDLCPU, buffer_error,
                  fmt::format("cannot {} an array on {} to {}: the device is unreachable from there", verb,
                              device_text(view.device()), device_text(*target)));
  // Host-accessible memory (pinned, managed) is reused, as the array API asks of copy=None.
  if (moves && is_host_accessible(view.device().device_type) && copy != true) { return transfer::host_view; }
  HANDOFF_EXPECTS(!(moves && copy == false), buffer_error,
                  fmt::format("to {} an array on {} to {} needs a copy, but copy=False", verb,
                              device_text(view.device()), device_text(*target)));
  if (moves) { return transfer::to_host; }
  return copy == true ? transfer::same_device : transfer::none;
}

}  // namespace

transfer plan_export(const array& view, std::optional<DLDevice> target, std::optional<bool> copy)
{
  return plan_transfer(view, target, copy, "export");
}

transfer plan_import(const array& view, std::optional<DLDevice> target, std::optional<bool> copy, bool producer_copied)
{
  const transfer how = plan_transfer(view, target, copy, "import");
  return how == transfer::same_device && producer_copied ? transfer::none : how;
}

producer_device_scope::producer_device_scope(DLDevice claimed)
{
  if (claimed.device_type != kDLCUDA && claimed.device_type != kDLROCM) { return; }  // pinned, managed: device 0
  context* ctx = active_context();
  if (ctx == nullptr || ctx->backend().device_type() != claimed.device_type) { return; }
  device::backend& b = ctx->backend();
  if (claimed.device_id < 0 || claimed.device_id >= b.device_count()) { return; }  // refused with the capsule
  guard_.emplace(b, claimed.device_id);
}

std::optional<device::stream_handle> resolve_stream(device::backend& backend, stream_request request)
{
  switch (request.order) {
    case stream_order::none:
      return std::nullopt;
    case stream_order::legacy_default:
    case stream_order::default_stream:
      return backend.legacy_default_stream();
    case stream_order::per_thread_default:
      return backend.per_thread_default_stream();
    case stream_order::handle:
      return static_cast<device::stream_handle>(request.handle);
  }
  return std::nullopt;
}

namespace {

// Blocks the host until the work enqueued so far on `where`'s stream is done, through a pooled event
// recorded there: the legacy default stream (where data bound to a per-thread default stream is
// bound) stands for the blocking streams' work only through an operation enqueued on it, and a
// stream synchronization is none.
void wait_on_host(const stream_binding& where)
{
  device::backend& b = where.ctx->backend();
  const device_guard on_owner{b, where.device};
  const pooled_event reached = where.ctx->events().record(where.device, where.stream);
  b.synchronize_event(reached.get());
}

}  // namespace

std::optional<device::stream_handle> published_ready_stream(const array& view)
{
  const auto ready = view.owner().ready_on();
  if (!ready) { return std::nullopt; }
  device::backend& b = ready->ctx->backend();
  if (ready->stream == b.legacy_default_stream()) {
    const device_guard on_owner{b, ready->device};
    if (b.stream_capture_status(ready->stream) == device::capture_status::none) {
      const pooled_event marker = ready->ctx->events().record(ready->device, ready->stream);
    }
  }
  return ready->stream;
}

array host_view(context& ctx, const array& view)
{
  const DLDeviceType type = view.device().device_type;
  HANDOFF_EXPECTS(is_host_accessible(type), buffer_error,
                  fmt::format("{} memory is not accessible from the host", device_type_name(type)));
  if (const auto ready = view.owner().ready_on(); ready && ready->ctx == &ctx) { wait_on_host(*ready); }
  array_layout layout = view.layout();
  layout.device = {kDLCPU, 0};
  return array{std::move(layout), view.owner()};
}

namespace {

std::atomic<blocking_section> installed_section{nullptr};

// Runs `wait` (returning an array) in the installed blocking section.
template <typename Wait>
array blocking(Wait&& wait)
{
  const blocking_section section = installed_section.load(std::memory_order_acquire);
  if (section == nullptr) { return wait(); }
  struct state_type {
    Wait& wait;
    std::optional<array> result;
  } state{wait, std::nullopt};
  section([](void* raw) { static_cast<state_type*>(raw)->result.emplace(static_cast<state_type*>(raw)->wait()); },
          &state);
  return std::move(*state.result);
}

}  // namespace

void set_blocking_section(blocking_section section) noexcept
{
  installed_section.store(section, std::memory_order_release);
}

array transfer_array(const array& view, transfer how)
{
  if (how == transfer::none) { return view; }
  if (view.device().device_type == kDLCPU) { return copy_to_host(view); }
  context& ctx = require_context(how == transfer::host_view ? "exporting host-accessible device memory to the CPU"
                                                            : "copying device memory");
  if (how == transfer::host_view) {
    return blocking([&] { return host_view(ctx, view); });
  }
  HANDOFF_EXPECTS(is_stream_ordered(ctx, view), buffer_error,
                  fmt::format("the {} backend cannot copy {} memory", ctx.backend().name(),
                              device_type_name(view.device().device_type)));
  if (how == transfer::same_device) { return copy_device_array(ctx, view, false); }  // only enqueues
  return blocking([&] { return copy_device_array(ctx, view, true); });
}

namespace {

// The exchange being traced on this thread, if any.
trace::exchange_scope* traced() noexcept
{
  return trace::enabled() ? trace::exchange_scope::current() : nullptr;
}

// An export handed over with no ordering: the trace asks the producer's stream whether it is idle.
void note_unordered_export(const array& view)
{
  trace::exchange_scope* scope = traced();
  if (scope == nullptr || view.device().device_type == kDLCPU) { return; }
  scope->note_unordered();
  if (const auto ready = view.owner().ready_on()) { scope->set_producer_stream(*ready); }
}

// prepare_export with a transfer, kept out of line: the common export (the view itself) stays a few
// instructions.
[[gnu::noinline]] std::unique_ptr<const array> transferred_export(const array& view, stream_request consumer,
                                                                  transfer how, std::shared_ptr<const void> owner)
{
  auto made = std::make_unique<const array>(transfer_array(view, how));
  if (how == transfer::same_device) {
    if (consumer.order != stream_order::none) {
      order_export(active_context(), *made, consumer, std::move(owner));
    } else if (trace::enabled()) {
      note_unordered_export(*made);
    }
  }
  return made;
}

std::atomic<export_release> export_release_policy{export_release::known_streams};

// Whether the consumer stream of an export is certain to be alive when the export is released: a
// default stream always is; a stream handle when the export holds its owner, or the application
// vouches for every consumer stream.
bool alive_at_release(stream_request consumer, const std::shared_ptr<const void>& owner) noexcept
{
  if (consumer.order != stream_order::handle || owner) { return true; }
  return current_export_release() == export_release::every_stream;
}

}  // namespace

void set_export_release(export_release policy) noexcept
{
  export_release_policy.store(policy, std::memory_order_relaxed);
}

export_release current_export_release() noexcept
{
  return export_release_policy.load(std::memory_order_relaxed);
}

std::unique_ptr<const array> prepare_export(const array& view, stream_request consumer, transfer how,
                                            std::shared_ptr<const void> consumer_owner)
{
  if (how != transfer::none) { return transferred_export(view, consumer, how, std::move(consumer_owner)); }
  if (consumer.order != stream_order::none) {
    order_export(active_context(), view, consumer, std::move(consumer_owner));
  } else if (trace::enabled()) {
    note_unordered_export(view);
  }
  return nullptr;
}

bool is_stream_ordered(const context& ctx, const array& view) noexcept
{
  const DLDeviceType type = view.device().device_type;
  return ctx.backend().device_type() == kDLROCM ? is_rocm_device(type) : is_cuda_device(type);
}

void require_stream_ordered(const context& ctx, const array& view)
{
  if (!is_stream_ordered(ctx, view)) {
    throw device_error(std::string{ctx.backend().name()}, "handoffErrorWrongBackend",
                       fmt::format("a {} array cannot be ordered by the {} backend",
                                   device_type_name(view.device().device_type), ctx.backend().name()));
  }
}

namespace {

// The device the array claims, where no allocation says otherwise. Work and releases are put on its
// streams later, so a device the backend does not have is refused now, not when a release fails.
int claimed_device(context& ctx, DLDevice claimed)
{
  const int count = ctx.backend().device_count();
  HANDOFF_EXPECTS(claimed.device_id >= 0 && claimed.device_id < count, value_error,
                  fmt::format("the array claims {} device {}, but the {} backend has {} device(s)",
                              device_type_name(claimed.device_type), claimed.device_id, ctx.backend().name(), count));
  return claimed.device_id;
}

// Refuses a view whose bytes run past the memory the backend knows: every reader would run off it.
// One allocation covers the usual view; a range its first byte's allocation does not cover (a
// mapping a virtual-memory allocator grew, as PyTorch's expandable segments) must end in memory of
// the same kind on the same device.
void require_known_range(context& ctx, const array& view)
{
  const auto range = byte_range_of(view.layout());  // validate_layout checked that it exists
  if (!range || range->high == range->low) { return; }
  const auto address = reinterpret_cast<std::uintptr_t>(view.data());
  std::uintptr_t first = 0;
  std::uintptr_t last = 0;
  const bool wraps =
    __builtin_add_overflow(address, range->low, &first) || __builtin_add_overflow(address, range->high - 1, &last);
  const auto extent = [&] {
    return fmt::format("the array's {} bytes from {:#x}", range->high - range->low, wraps ? address : first);
  };
  HANDOFF_EXPECTS(!wraps, value_error, fmt::format("{} wrap around the address space", extent()));
  device::backend& b = ctx.backend();
  const device::pointer_attributes start = b.attributes(reinterpret_cast<const void*>(first));
  HANDOFF_EXPECTS(start.kind != device::memory_kind::unregistered, value_error,
                  fmt::format("{} start outside any allocation of the {} backend", extent(), b.name()));
  const auto base = reinterpret_cast<std::uintptr_t>(start.base);
  if (last - base < start.size) { return; }
  const device::pointer_attributes end = b.attributes(reinterpret_cast<const void*>(last));
  HANDOFF_EXPECTS(end.kind == start.kind && end.device == start.device, value_error,
                  fmt::format("{} run past the end of their allocation ({} bytes from {:#x}) into memory the {} "
                              "backend does not know as the same device's",
                              extent(), start.size, base, b.name()));
}

}  // namespace

array make_view(context* ctx, array_layout layout, producer_ref owner, stream_request ready,
                std::shared_ptr<const void> ready_owner)
{
  array view{std::move(layout), std::move(owner)};
  const DLDeviceType type = view.device().device_type;
  if (ctx == nullptr || (!is_cuda_device(type) && !is_rocm_device(type))) { return view; }
  require_stream_ordered(*ctx, view);
  const int device = owning_device(*ctx, view);  // memory of the device it claims, on a device that exists
  require_known_range(*ctx, view);
  if (const auto stream = resolve_stream(ctx->backend(), ready)) {
    view.owner().set_ready_on(
      {.ctx = ctx, .device = device, .stream = *stream, .stream_owner = std::move(ready_owner)});
  }
  return view;
}

int owning_device(context& ctx, const array& view)
{
  const DLDevice claimed = view.device();
  if (view.data() == nullptr) { return claimed_device(ctx, claimed); }  // empty: nothing to look up
  const device::pointer_attributes where = ctx.backend().attributes(view.data());
  const bool device_memory = claimed.device_type == kDLCUDA || claimed.device_type == kDLROCM;
  if (device_memory) {
    // Managed memory is device memory to its users: PyTorch with a managed allocator and RMM's
    // managed resource export it as kDLCUDA, on the device that uses it.
    if (where.kind == device::memory_kind::managed) { return claimed_device(ctx, claimed); }
    HANDOFF_EXPECTS(where.kind == device::memory_kind::device, value_error,
                    fmt::format("the array claims {} device {} memory, but {:#x} is not device memory of the {} "
                                "backend",
                                device_type_name(claimed.device_type), claimed.device_id,
                                reinterpret_cast<std::uintptr_t>(view.data()), ctx.backend().name()));
    HANDOFF_EXPECTS(
      where.device == claimed.device_id, value_error,
      fmt::format("the array claims device {}, but its memory belongs to device {}", claimed.device_id, where.device));
    return where.device;
  }
  // Pinned and managed memory report device 0 in DLPack; record where the allocation was made.
  return where.device >= 0 ? where.device : ctx.backend().current_device();
}

namespace {

// The export half's ordering: the consumer stream `consumer` asks for waits for the stream `view`
// is ready on. Returns that consumer stream, bound on the data's device; nullopt when nothing is
// asked (stream=-1).
std::optional<stream_binding> order_ready_stream(context* ctx, const array& view, stream_request consumer)
{
  if (consumer.order == stream_order::none) {
    note_unordered_export(view);
    return std::nullopt;
  }
  if (ctx == nullptr) {
    throw device_error(
      "none", "handoffErrorNoBackend",
      fmt::format("ordering {} memory for a consumer stream needs a device backend, and none is active",
                  device_type_name(view.device().device_type)));
  }
  require_stream_ordered(*ctx, view);
  device::backend& backend = ctx->backend();
  const int device = owning_device(*ctx, view);
  const auto ready = view.owner().ready_on();
  const auto producer = ready && ready->ctx == ctx ? ready->stream : backend.legacy_default_stream();
  const auto consumer_stream = *resolve_stream(backend, consumer);
  stream_view{backend, consumer_stream}.wait(stream_view{backend, producer}, device, ctx->events());
  return stream_binding{.ctx = ctx, .device = device, .stream = consumer_stream, .stream_owner = nullptr};
}

}  // namespace

void order_export(context* ctx, const array& view, stream_request consumer, std::shared_ptr<const void> consumer_owner)
{
  auto ordered = order_ready_stream(ctx, view, consumer);
  if (ordered && alive_at_release(consumer, consumer_owner)) {
    ordered->stream_owner = std::move(consumer_owner);
    view.owner().release_after(*ordered);
  }
}

array share_view(const array& source, const named_stream& consumer)
{
  array view{source.layout(), source.owner().derived()};
  const DLDeviceType type = view.device().device_type;
  if (!is_cuda_device(type) && !is_rocm_device(type)) { return view; }
  (void)order_ready_stream(active_context(), source, request_for(consumer, type));
  bind_to_consumer(view, consumer);
  return view;
}

namespace {

void bind_to(context& ctx, const array& view, int device, device::stream_handle consumer,
             std::shared_ptr<const void> consumer_owner, const std::optional<stream_binding>& producer)
{
  const stream_binding on_consumer{
    .ctx = &ctx, .device = device, .stream = consumer, .stream_owner = std::move(consumer_owner)};
  if (trace::exchange_scope* scope = traced()) { scope->set_consumer_stream(on_consumer); }
  view.owner().set_ready_on(on_consumer);
  view.owner().release_after(on_consumer, producer);
}

// The producer stream of an interface import that the release makes wait for the consumer's work:
// only one that cannot be destroyed by then, and only where the device's rules do not already
// order it (see bind_interface_import). The same stream as the consumer's needs nothing, as at import.
std::optional<stream_binding> stream_to_hold_back(context& ctx, int device, device::stream_handle consumer,
                                                  stream_request producer, std::shared_ptr<const void> owner)
{
  device::backend& b = ctx.backend();
  const device_guard on_owner{b, device};  // default streams resolve on the data's device
  const auto legacy = b.legacy_default_stream();
  std::optional<device::stream_handle> stream;
  bool ordered_by_the_device = false;
  switch (producer.order) {
    case stream_order::legacy_default:
    case stream_order::default_stream:
      stream = legacy;
      ordered_by_the_device = consumer != legacy && b.stream_is_blocking(consumer);
      break;
    case stream_order::per_thread_default:
      // Named through the legacy default stream, which is right from any thread; the importing
      // thread's per-thread stream is blocking, so it follows a legacy default consumer anyway.
      if (consumer == b.per_thread_default_stream()) { return std::nullopt; }
      stream = legacy;
      ordered_by_the_device = consumer == legacy;
      break;
    case stream_order::handle:
      if (!owner) { return std::nullopt; }  // nothing keeps it alive until the release
      stream = static_cast<device::stream_handle>(producer.handle);
      ordered_by_the_device = consumer == legacy && *stream != legacy && b.stream_is_blocking(*stream);
      break;
    case stream_order::none:
      break;
  }
  if (ordered_by_the_device) {
    count(counter::waits_elided);
    return std::nullopt;
  }
  if (!stream || *stream == consumer) { return std::nullopt; }
  return stream_binding{.ctx = &ctx, .device = device, .stream = *stream, .stream_owner = std::move(owner)};
}

}  // namespace

void bind_import(context& ctx, const array& view, int device, device::stream_handle consumer,
                 std::shared_ptr<const void> consumer_owner)
{
  bind_to(ctx, view, device, consumer, std::move(consumer_owner), std::nullopt);
}

std::optional<stream_binding> consumer_binding(const array& view, const named_stream& consumer)
{
  const DLDeviceType type = view.device().device_type;
  if (!is_cuda_device(type) && !is_rocm_device(type)) { return std::nullopt; }
  const stream_request request = request_for(consumer, type);
  if (request.order == stream_order::none) {  // the consumer orders its work itself
    if (trace::exchange_scope* scope = traced()) { scope->note_unordered(); }
    return std::nullopt;
  }
  require_ordering(type);
  context* ctx = active_context();
  if (ctx == nullptr || !is_stream_ordered(*ctx, view)) { return std::nullopt; }
  return stream_binding{.ctx = ctx,
                        .device = owning_device(*ctx, view),
                        .stream = *resolve_stream(ctx->backend(), request),
                        .stream_owner = consumer.owner};
}

void hand_over(const array& view, const named_stream& consumer)
{
  const DLDeviceType type = view.device().device_type;
  if (!is_cuda_device(type) && !is_rocm_device(type)) { return; }
  order_export(active_context(), view, request_for(consumer, type));
  if (const auto binding = consumer_binding(view, consumer)) { view.owner().release_after(*binding); }
}

stream_binding binding_on(context& ctx, DLDevice device, named_stream stream)
{
  const auto handle = resolve_stream(ctx.backend(), request_for(stream, device.device_type));
  HANDOFF_EXPECTS(handle.has_value(), value_error, "stream=-1 names no stream to work on");
  return {.ctx = &ctx, .device = device.device_id, .stream = *handle, .stream_owner = std::move(stream.owner)};
}

void bind_to_consumer(const array& view, const named_stream& consumer)
{
  if (auto binding = consumer_binding(view, consumer)) {
    bind_import(*binding->ctx, view, binding->device, binding->stream, std::move(binding->stream_owner));
  }
}

void bind_interface_import(context& ctx, const array& view, int device, device::stream_handle consumer,
                           std::shared_ptr<const void> consumer_owner, stream_request producer,
                           std::shared_ptr<const void> producer_owner)
{
  device::backend& backend = ctx.backend();
  if (const auto producer_stream = resolve_stream(backend, producer)) {
    stream_view{backend, consumer}.wait(stream_view{backend, *producer_stream}, device, ctx.events());
  }
  bind_to(ctx, view, device, consumer, std::move(consumer_owner),
          stream_to_hold_back(ctx, device, consumer, producer, std::move(producer_owner)));
}

std::optional<DLDevice> dlpack_device_of(const device::pointer_attributes& where, DLDeviceType backend_type)
{
  const bool rocm = backend_type == kDLROCM;
  switch (where.kind) {
    case device::memory_kind::device:
      return DLDevice{backend_type, where.device};
    case device::memory_kind::managed:
      HANDOFF_EXPECTS(!rocm, buffer_error, "managed memory on ROCm has no DLPack device type");
      return DLDevice{kDLCUDAManaged, 0};
    case device::memory_kind::pinned_host:
      return DLDevice{rocm ? kDLROCMHost : kDLCUDAHost, 0};
    case device::memory_kind::unregistered:
      return std::nullopt;
  }
  return std::nullopt;
}

array import_cuda_interface(cuda_interface interface, producer_ref owner, const named_stream& consumer,
                            std::shared_ptr<const void> producer_stream_owner)
{
  context& ctx = require_context("importing __cuda_array_interface__ data");
  device::backend& backend = ctx.backend();
  array_layout& layout = interface.layout;
  if (layout.data == nullptr) {  // an empty array (the interface asks for 0 then): on the current device
    layout.device = {backend.device_type(), backend.current_device()};
  } else {
    const device::pointer_attributes where = backend.attributes(layout.data);
    const auto device = dlpack_device_of(where, backend.device_type());
    HANDOFF_EXPECTS(device.has_value(), buffer_error,
                    "__cuda_array_interface__ 'data' points to memory the device does not know");
    layout.device = *device;
    if (where.device_pointer != nullptr) { layout.data = where.device_pointer; }
  }
  const DLDeviceType type = layout.device.device_type;
  array view{std::move(layout), std::move(owner)};
  const auto consumer_stream = resolve_stream(backend, request_for(consumer, type));
  // The interface numbers streams as CUDA does (1: legacy default, 2: per-thread default) on every
  // platform; the backend resolves those to its own default streams.
  const stream_request producer = interface.stream ? classify_stream(kDLCUDA, interface.stream) : stream_request{};
  if (!consumer_stream || !interface.stream) {  // no ordering asked for, or none possible
    if (trace::exchange_scope* scope = traced()) {
      scope->note_unordered();
      if (const auto written_on = resolve_stream(backend, producer)) {  // the trace asks it whether it is idle
        scope->set_producer_stream(
          {.ctx = &ctx, .device = owning_device(ctx, view), .stream = *written_on, .stream_owner = nullptr});
      }
    }
    if (!consumer_stream) { return view; }  // the consumer orders its work itself
  }
  bind_interface_import(ctx, view, owning_device(ctx, view), *consumer_stream, consumer.owner, producer,
                        std::move(producer_stream_owner));
  return view;
}

void bind_after_producer(const array& view, const stream_binding& consumer, stream_request producer)
{
  device::backend& backend = consumer.ctx->backend();
  if (const auto producer_stream = resolve_stream(backend, producer)) {
    stream_view{backend, consumer.stream}.wait(stream_view{backend, *producer_stream}, consumer.device,
                                               consumer.ctx->events());
  }
  bind_import(*consumer.ctx, view, consumer.device, consumer.stream, consumer.stream_owner);
}

namespace {

// The byte range [first, last) a strided view touches, relative to its data pointer.
std::pair<std::int64_t, std::int64_t> byte_extent(const array& view)
{
  const auto item = static_cast<std::int64_t>(view.itemsize());
  std::int64_t first = 0;
  std::int64_t last = item;
  for (std::size_t i = 0; i < view.shape().size(); ++i) {
    const std::int64_t reach = (view.shape()[i] - 1) * view.strides()[i] * item;
    (reach < 0 ? first : last) += reach;
  }
  return {first, last};
}

}  // namespace

array copy_device_array(context& ctx, const array& view, bool to_host)
{
  device::backend& backend = ctx.backend();
  const int device = owning_device(ctx, view);
  const auto ready = view.owner().ready_on();
  device_guard on_owner{backend, device};
  const auto stream = ready && ready->ctx == &ctx ? ready->stream : backend.legacy_default_stream();
  if (view.size() == 0) {
    array_layout empty = view.layout();
    empty.data = nullptr;
    empty.readonly = false;
    empty.strides = contiguous_strides(empty.shape);
    if (to_host) { empty.device = {kDLCPU, 0}; }
    return array{std::move(empty), producer_ref{[] {}}};
  }
  const auto [first, last] = byte_extent(view);
  const auto span = static_cast<std::size_t>(last - first);
  const std::byte* source = static_cast<const std::byte*>(view.data()) + first;

  if (to_host) {
    // Bring the touched span over in stream order, wait for it, then compact it on the host.
    auto staging = std::make_unique<std::byte[]>(span);
    backend.copy_async(staging.get(), source, span, stream);
    try {
      backend.synchronize_stream(stream);
    } catch (...) {
      // The copy may still be queued: its destination is freed only once the stream is done.
      ctx.release_after(device, stream, [raw = staging.release()]() noexcept { delete[] raw; });
      throw;
    }
    array_layout host = view.layout();
    host.data = staging.get() - first;
    host.device = {kDLCPU, 0};
    std::byte* raw = staging.release();
    return copy_to_host(array{std::move(host), producer_ref{[raw]() noexcept { delete[] raw; }}});
  }
  HANDOFF_EXPECTS(view.is_c_contiguous(), buffer_error,
                  "a copy of non-contiguous device memory on the device is not supported; copy it to the host");
  // The copy lives on its source's stream: it frees there, so it keeps that stream alive too. A copy
  // of managed or pinned memory is of the same kind, on the same DLPack device, as its source.
  const stream_binding on{
    .ctx = &ctx, .device = device, .stream = stream, .stream_owner = ready ? ready->stream_owner : nullptr};
  array copy = is_host_accessible(view.device().device_type)
                 ? allocate_host_accessible_array(on, view.device(), view.dtype(), view.shape())
                 : allocate_device_array(on, view.dtype(), view.shape());
  backend.copy_async(copy.data(), source, span, stream);  // on failure, `copy` frees after the stream's work
  return copy;
}

array allocate_host_accessible_array(const stream_binding& on, DLDevice kind, DLDataType dtype,
                                     std::span<const std::int64_t> shape)
{
  HANDOFF_EXPECTS(is_host_accessible(kind.device_type), value_error,
                  fmt::format("{} memory is not host-accessible", device_type_name(kind.device_type)));
  device::backend& backend = on.ctx->backend();
  auto [layout, bytes] = row_major_layout(kind, dtype, shape);
  device_guard on_device{backend, on.device};
  if (bytes > 0) {
    layout.data =
      kind.device_type == kDLCUDAManaged ? backend.allocate_managed(bytes) : backend.allocate_pinned_host(bytes);
  }
  device::backend* owner = &backend;
  // Not stream-ordered: freed once the device is idle, which covers the work on `on.stream`.
  const auto release = [owner, data = layout.data, device = on.device, stream_owner = on.stream_owner]() noexcept {
    if (data == nullptr) { return; }
    try {
      device_guard on_data{*owner, device};
      owner->free_sync(data);
    } catch (const std::exception& e) {
      HANDOFF_LOG_ERROR("host-accessible memory could not be freed on device {} ({}); it is kept", device, e.what());
    }
  };
  array out{std::move(layout), producer_ref{release}};
  out.owner().set_ready_on(on);
  return out;
}

array allocate_device_array(const stream_binding& on, DLDataType dtype, std::span<const std::int64_t> shape)
{
  device::backend& backend = on.ctx->backend();
  auto [layout, bytes] = row_major_layout({backend.device_type(), on.device}, dtype, shape);
  HANDOFF_EXPECTS(on.device >= 0 && on.device < backend.device_count(), value_error,
                  fmt::format("device {} is not one of the {} device(s) of the {} backend", on.device,
                              backend.device_count(), backend.name()));
  device_guard on_device{backend, on.device};
  if (bytes > 0) { layout.data = backend.allocate(bytes, on.stream); }
  device::backend* owner = &backend;
  // Released on any thread, whatever device is current there: a default stream's handle names the
  // current device's stream, so the allocation's device is made current for the free.
  const auto release = [owner, data = layout.data, stream = on.ctx->thread_independent(on.device, on.stream),
                        device = on.device, stream_owner = on.stream_owner]() noexcept {
    if (data == nullptr) { return; }
    try {
      device_guard on_data{*owner, device};
      owner->deallocate(data, stream);
    } catch (const std::exception& e) {
      HANDOFF_LOG_ERROR("device memory could not be freed on device {} ({}); it is kept", device, e.what());
    }
  };
  array out{std::move(layout), producer_ref{release}};
  out.owner().set_ready_on(on);
  return out;
}

}  // namespace handoff
