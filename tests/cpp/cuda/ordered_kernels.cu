#include "ordered_kernels.hpp"

namespace handoff::testing::kernels {
namespace {

constexpr unsigned threads_per_block = 256;
constexpr unsigned blocks = 64;

__device__ unsigned long long global_timer()
{
  unsigned long long now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return now;
}

__global__ void spin_kernel(unsigned long long nanoseconds)
{
  const unsigned long long start = global_timer();
  while (global_timer() - start < nanoseconds) {}
}

__global__ void fill_kernel(float* data, std::size_t n, float value)
{
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    data[i] = value;
  }
}

__global__ void sum_kernel(const float* data, std::size_t n, float* total)
{
  __shared__ float partial[threads_per_block];
  float own = 0.0F;
  for (std::size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += std::size_t{gridDim.x} * blockDim.x) {
    own += data[i];
  }
  partial[threadIdx.x] = own;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) { partial[threadIdx.x] += partial[threadIdx.x + stride]; }
    __syncthreads();
  }
  if (threadIdx.x == 0) { atomicAdd(total, partial[0]); }
}

}  // namespace

cudaError_t spin(std::chrono::nanoseconds spin, cudaStream_t stream)
{
  spin_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long>(spin.count()));
  return cudaGetLastError();
}

cudaError_t spin_then_fill(float* data, std::size_t n, float value, std::chrono::nanoseconds spin_for,
                           cudaStream_t stream)
{
  if (const cudaError_t spun = spin(spin_for, stream); spun != cudaSuccess) { return spun; }
  fill_kernel<<<blocks, threads_per_block, 0, stream>>>(data, n, value);
  return cudaGetLastError();
}

cudaError_t sum(const float* data, std::size_t n, float* total, cudaStream_t stream)
{
  if (const cudaError_t zeroed = cudaMemsetAsync(total, 0, sizeof(float), stream); zeroed != cudaSuccess) {
    return zeroed;
  }
  sum_kernel<<<blocks, threads_per_block, 0, stream>>>(data, n, total);
  return cudaGetLastError();
}

}  // namespace handoff::testing::kernels
