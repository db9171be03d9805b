// Device memory handoff owns or reads through a backend: allocations in stream order, copies after
// the producer's pending work, and host views waited for through an event.
#include <handoff/device_guard.hpp>
#include <handoff/embedding.hpp>
#include <handoff/error.hpp>
#include <handoff/event_pool.hpp>
#include <handoff/internal/device_memory.hpp>
#include <handoff/internal/ordering.hpp>

#include "log/logger.hpp"

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

namespace handoff {

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

namespace {

// Blocks the host until the work enqueued so far on `where`'s stream is done, through a pooled event
// recorded there: the legacy default stream (where data bound to a per-thread default stream is
// bound) stands for the blocking streams' work only through an operation enqueued on it, and a
// stream synchronization is none.
void wait_on_host(const bound_stream& where)
{
  device::backend& b = where.ctx->backend();
  const device_guard on_owner{b, where.device};
  const pooled_event reached = where.ctx->events().record(where.device, where.stream);
  b.synchronize_event(reached.get());
}

}  // namespace

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
    return array{std::move(empty), shared_producer{[] {}}};
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
    return copy_to_host(array{std::move(host), shared_producer{[raw]() noexcept { delete[] raw; }}});
  }
  HANDOFF_EXPECTS(view.is_c_contiguous(), buffer_error,
                  "a copy of non-contiguous device memory on the device is not supported; copy it to the host");
  // The copy lives on its source's stream: it frees there, so it keeps that stream alive too. A copy
  // of managed or pinned memory is of the same kind, on the same DLPack device, as its source.
  const bound_stream on{
    .ctx = &ctx, .device = device, .stream = stream, .stream_owner = ready ? ready->stream_owner : nullptr};
  array copy = is_host_accessible(view.device().device_type)
                 ? allocate_host_accessible_array(on, view.device(), view.dtype(), view.shape())
                 : allocate_device_array(on, view.dtype(), view.shape());
  backend.copy_async(copy.data(), source, span, stream);  // on failure, `copy` frees after the stream's work
  return copy;
}

array allocate_host_accessible_array(const bound_stream& on, DLDevice kind, DLDataType dtype,
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
  const auto release = [owner, block_host = on.ctx->hooks().block_host, data = layout.data, device = on.device,
                        stream_owner = on.stream_owner]() noexcept {
    if (data == nullptr) { return; }
    try {
      device_guard on_data{*owner, device};
      struct freeing {
        device::backend* backend;
        void* data;
      } freed{owner, data};
      // It waits for the device: a thread that holds the GIL lets go of it meanwhile.
      run_blocking(
        block_host, [](void* raw) { static_cast<freeing*>(raw)->backend->free_sync(static_cast<freeing*>(raw)->data); },
        &freed);
    } catch (const std::exception& e) {
      HANDOFF_LOG_ERROR("host-accessible memory could not be freed on device {} ({}); it is kept", device, e.what());
    }
  };
  array out{std::move(layout), shared_producer{release}};
  out.owner().set_ready_on(on);
  return out;
}

array allocate_device_array(const bound_stream& on, DLDataType dtype, std::span<const std::int64_t> shape)
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
  array out{std::move(layout), shared_producer{release}};
  out.owner().set_ready_on(on);
  return out;
}

}  // namespace handoff
