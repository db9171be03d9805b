// The CUDA backend's device activity for launch traces, through CUPTI's callback API on the driver
// API: CUPTI is loaded at run time (dlopen) when a launch trace first asks, and subscribed only while
// one runs. Nothing links it, and nothing is subscribed otherwise.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace handoff::device::cuda {

/// Starts (`on`) or stops reporting every launch, copy, set, stream and event operation, host
/// synchronization, allocation and free of the process through handoff::activity::report. Calls
/// pair up and nest. Returns why it cannot (CUPTI not found, no usable driver, another tool
/// subscribed), or an empty string when it does. Never throws.
[[nodiscard]] std::string watch_cupti(bool on) noexcept;

/// Where CUPTI is looked for, in order: $HANDOFF_CUPTI_LIBRARY, the loader's search path, then the
/// toolkit this build was made with (its lib64 next to the runtime, and extras/CUPTI/lib64).
[[nodiscard]] std::vector<std::string> cupti_candidates();

/// The buffer a launch's `extra` options packed its arguments into (CU_LAUNCH_PARAM_BUFFER_POINTER,
/// with its size under CU_LAUNCH_PARAM_BUFFER_SIZE), up to CU_LAUNCH_PARAM_END; empty when `extra`
/// is null or names no buffer and size.
[[nodiscard]] std::span<const std::byte> packed_arguments(void* const* extra) noexcept;

}  // namespace handoff::device::cuda
