// The CUDA driver's entry points, found through the runtime (nothing links libcuda): one lookup for
// the backend and the launch detector, each of which says in its own words what a failure means.
#pragma once

#include <cuda_runtime_api.h>

namespace handoff::device::cuda {

/// Sets `out` to the driver's `symbol` as CUDA `version` declares it: the version of the prototype
/// `F` is (a `PFN_cu..._vNNNN`'s NNNN; CUDA_VERSION for a `decltype(&cu...)` of these headers). A
/// version older than the one that introduced the symbol finds nothing (cuStreamGetFlags at 2000 on
/// a 13.0 driver, say).
/// @returns the runtime's status (cudaErrorInsufficientDriver without a driver, say); on success
///          `out` is null where the driver has no such entry point.
template <class F>
[[nodiscard]] cudaError_t find_driver_entry(const char* symbol, F& out, unsigned int version) noexcept
{
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t status = cudaGetDriverEntryPointByVersion(symbol, &address, version, cudaEnableDefault, &found);
  out = status == cudaSuccess && found == cudaDriverEntryPointSuccess ? reinterpret_cast<F>(address) : nullptr;
  return status;
}

}  // namespace handoff::device::cuda
