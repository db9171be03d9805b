// What the simulated device calls things: each operation's runtime call and each error's CUDA and
// HIP names and text, so that its errors read like the runtime it imitates.
#pragma once

#include <handoff/internal/sim.hpp>

#include <span>
#include <string_view>

namespace handoff::device::sim_detail {

enum class sim_error {
  invalid_value,
  invalid_device,
  invalid_handle,
  memory_allocation,
  not_permitted,
  capture_unsupported,
  capture_invalidated,
  capture_implicit,
  capture_isolation,
  capture_unmatched,
  captured_event,
  illegal_state,
  device_uninitialized,
  map_failed,
  peer_access_unsupported,
};

/// The runtime's name of `code` ("cudaErrorInvalidValue", "hipErrorInvalidValue").
[[nodiscard]] std::string_view error_name(sim_error code, sim_flavour flavour) noexcept;
/// The runtime's description of `code`.
[[nodiscard]] std::string_view error_text(sim_error code) noexcept;
/// The description of an error named in either runtime's spelling ("injected fault" if unknown).
[[nodiscard]] std::string_view error_text(std::string_view name) noexcept;

/// The runtime call behind an operation key ("record_event" -> "cudaEventRecord").
[[nodiscard]] std::string_view call_name(std::string_view operation, sim_flavour flavour) noexcept;
/// The operations a fault can be injected into: every call that can fail.
[[nodiscard]] std::span<const std::string_view> fault_operations() noexcept;

}  // namespace handoff::device::sim_detail
