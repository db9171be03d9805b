// Internal: device memory handoff owns or reads through a backend: allocations, copies, host views.
#pragma once

#include <handoff/array.hpp>
#include <handoff/context.hpp>

#include <optional>
#include <span>

namespace handoff {

/// The DLPack device of memory a backend (of `backend_type`, kDLCUDA or kDLROCM) describes by
/// `where`: the backend's type and device for device memory, kDLCUDAManaged (device 0) for managed
/// memory, kDLCUDAHost or kDLROCMHost (device 0) for pinned host memory; nullopt for memory the
/// backend does not know.
/// @throws buffer_error for managed memory on ROCm, which DLPack has no device type for.
[[nodiscard]] std::optional<DLDevice> dlpack_device_of(const device::pointer_attributes& where,
                                                       DLDeviceType backend_type);

/// A compact copy of device-resident `view`, made in order after the work pending on the stream it
/// is ready on: on the host (`to_host`, waited for, so the copy is usable when this returns) or on
/// the same device (stream-ordered: the copy is ready on that stream and returns at once), in the
/// same kind of memory (managed or pinned memory copies to managed or pinned memory).
/// @throws device_error when a device call fails; nothing is leaked.
[[nodiscard]] array copy_device_array(context& ctx, const array& view, bool to_host);

/// A new row-major array of `shape` and `dtype` in device memory handoff owns, allocated in stream
/// order on `on.stream` of device `on.device` of `on.ctx`'s backend: ready on that stream, and freed
/// there once its last view (and the work bound to it) is gone; `on.stream_owner` is kept until then.
/// @throws value_error for a negative or overflowing shape or a device the backend does not have;
///         buffer_error for a dtype DLPack does not define; device_error when the allocation fails.
[[nodiscard]] array allocate_device_array(const bound_stream& on, DLDataType dtype,
                                          std::span<const std::int64_t> shape);

/// A new row-major array in host-accessible memory handoff owns, of `kind`'s device type
/// (kDLCUDAManaged: managed memory; kDLCUDAHost or kDLROCMHost: pinned host memory), allocated on
/// device `on.device` and recorded as ready on `on.stream`. Not stream-ordered: freed, once its last
/// view is gone, when the device is idle.
/// @throws value_error as allocate_device_array, or for a `kind` the host cannot reach;
///         device_error when the allocation fails.
[[nodiscard]] array allocate_host_accessible_array(const bound_stream& on, DLDevice kind, DLDataType dtype,
                                                   std::span<const std::int64_t> shape);

/// The same host-accessible memory (pinned or managed) as a CPU array, once the work pending on
/// the stream it is ready on is done (waited for through an event: a CPU consumer has no stream).
/// @throws buffer_error for memory the host cannot reach; device_error when the wait fails.
[[nodiscard]] array host_view(context& ctx, const array& view);

}  // namespace handoff
