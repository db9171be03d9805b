// The kernels of the ordered hand-off tests (ordered_kernels.cu), launched from plain C++: a
// producer that writes behind a spin, and a consumer that reads through shared memory.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>

namespace handoff::testing::kernels {

/// Enqueues on `stream` a kernel that spins for `spin` (the GPU's global timer), then one that sets
/// the `n` floats at `data` to `value`: a producer whose write is still running.
cudaError_t spin_then_fill(float* data, std::size_t n, float value, std::chrono::nanoseconds spin, cudaStream_t stream);

/// Enqueues on `stream` a spin of `spin`: a consumer stream still busy with earlier work.
cudaError_t spin(std::chrono::nanoseconds spin, cudaStream_t stream);

/// Enqueues on `stream` the sum of the `n` floats at `data` into `*total`: each block reduces its
/// part in shared memory (barriers between the steps), then adds it atomically.
cudaError_t sum(const float* data, std::size_t n, float* total, cudaStream_t stream);

}  // namespace handoff::testing::kernels
