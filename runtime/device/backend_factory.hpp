// Private: what the runtime asks of the backends beyond make_backend (handoff/backends.hpp).
#pragma once

#include <handoff/backends.hpp>
#include <handoff/device.hpp>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace handoff::device {

/// Whether this build contains the CUDA backend (the toolkit was found at configure time).
[[nodiscard]] bool cuda_compiled_in() noexcept;

/// What the CUDA runtime compiled in needs of the machine.
struct cuda_runtime_requirement {
  std::string runtime_version;  ///< "13.0"
  int minimum_driver_branch{};  ///< the first NVIDIA driver branch that runs it, 580
};

/// The CUDA runtime's requirement; nullopt when the CUDA backend is not compiled in.
[[nodiscard]] std::optional<cuda_runtime_requirement> cuda_requirement();

/// The CUDA backend on the machine's driver.
/// @throws handoff::device_error (backend "cuda") saying why when it is not compiled in or no
///         device is usable, e.g. "no usable CUDA device: cudaGetDeviceCount failed:
///         cudaErrorInsufficientDriver: ...".
[[nodiscard]] std::unique_ptr<backend> make_cuda_backend();

/// The simulated devices a process sees: HANDOFF_SIM_DEVICES, an integer from 1 to
/// sim_backend::max_devices (2 when unset or empty), the first of the simulated node's; or
/// HANDOFF_SIM_VISIBLE_DEVICES, the node's devices listed as CUDA_VISIBLE_DEVICES lists them ("1,0").
struct sim_devices {
  int count{2};
  std::vector<int> visible;  // empty: the first `count`
};
/// @throws handoff::value_error for anything else, or for both set and disagreeing.
[[nodiscard]] sim_devices sim_devices_from_env();

}  // namespace handoff::device
