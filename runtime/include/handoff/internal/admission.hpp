// Internal: which device owns memory, and whether a context's backend orders it; the door every view
// of device data passes, whichever protocol brought it.
#pragma once

#include <handoff/array.hpp>
#include <handoff/context.hpp>

namespace handoff {

/// True when `view` lives in memory ordered by the streams of `ctx`'s backend.
[[nodiscard]] bool is_stream_ordered(const context& ctx, const array& view) noexcept;

/// @throws device_error when `view` is not in memory ordered by `ctx`'s backend (a CUDA array with a
///         ROCm backend, or host memory).
void require_stream_ordered(const context& ctx, const array& view);

/// The device that owns `view`'s memory, from the pointer's attributes (not the current device).
/// @throws value_error when the view claims another device than the one its memory belongs to, or
///         device memory that the backend does not know.
[[nodiscard]] int owning_device(context& ctx, const array& view);

/// The door every view of device data passes, made by a library (make_view) or imported by any
/// protocol: data of the other device family is refused, and so is memory that is not device memory
/// of the device it claims, or that any byte of the view runs past. Returns the owning device. One
/// pointer query in the usual case (a view within its allocation), as owning_device.
/// @throws device_error for data `ctx`'s backend does not order (require_stream_ordered);
///         value_error for memory that is not the claimed device's, or that runs past its allocation.
[[nodiscard]] int admit(context& ctx, const array& view);

}  // namespace handoff
