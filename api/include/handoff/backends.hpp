// The device backends handoff has, chosen by name: what a C++ application exchanges through when it
// brings its own (the Python module's comes from HANDOFF_BACKEND, see runtime.hpp).
#pragma once

#include <handoff/device.hpp>

#include <memory>
#include <string_view>

namespace handoff::device {

/// A new backend: "cuda" (the machine's driver), or "sim" or "sim-rocm": a simulated device of
/// HANDOFF_SIM_DEVICES devices (default 2) whose memory is host memory and whose streams follow
/// CUDA's or HIP's rules, for programs and tests on machines without a GPU.
/// @throws handoff::value_error for any other name or an invalid HANDOFF_SIM_DEVICES;
///         handoff::device_error when "cuda" cannot start (no driver, no device, not compiled in).
[[nodiscard]] std::unique_ptr<backend> make_backend(std::string_view name);

}  // namespace handoff::device
