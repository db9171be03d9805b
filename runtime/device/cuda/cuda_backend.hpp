// The CUDA backend's constructor; the class itself stays in cuda_backend.cpp with the CUDA headers.
#pragma once

#include <handoff/device.hpp>

#include <memory>
#include <string>

namespace handoff::device::cuda {

/// A backend on the CUDA runtime (linked statically) and the driver found at run time.
/// @throws handoff::device_error when no device is usable, naming the runtime's error.
[[nodiscard]] std::unique_ptr<backend> make_backend();

/// The CUDA runtime linked in, "13.0".
[[nodiscard]] std::string runtime_version();

/// The first NVIDIA driver branch that runs the runtime linked in (580 for CUDA 13.x).
[[nodiscard]] int minimum_driver_branch() noexcept;

/// What the runtime linked in needs of the driver and what is installed, for error messages.
[[nodiscard]] std::string driver_floor_report();

}  // namespace handoff::device::cuda
