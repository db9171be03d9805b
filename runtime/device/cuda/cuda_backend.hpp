// The CUDA backend's constructor; the class itself stays in cuda_backend.cpp with the CUDA headers.
#pragma once

#include <handoff/device.hpp>

#include <memory>

namespace handoff::device::cuda {

/// A backend on the CUDA runtime (linked statically) and the driver found at run time.
/// @throws handoff::device_error when no device is usable, naming the runtime's error.
[[nodiscard]] std::unique_ptr<backend> make_backend();

}  // namespace handoff::device::cuda
