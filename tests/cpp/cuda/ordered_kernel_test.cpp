// An ordered hand-off between real kernels on the CUDA backend: a producer kernel still writing on
// its stream, handoff's export ordering the consumer's stream after it, and a consumer kernel that
// reads at once (a block reduction through shared memory, with barriers). compute-sanitizer's
// racecheck, synccheck and memcheck run this suite on a GPU (tools/gpu-check --extra); without a
// usable CUDA device each test skips and says why.
#include "cuda/ordered_kernels.hpp"

#include <handoff/array.hpp>
#include <handoff/exchange.hpp>
#include <handoff/runtime.hpp>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

namespace {

using namespace std::chrono_literals;
namespace kernels = handoff::testing::kernels;

#define HANDOFF_CUDA_CHECK(call)                                                 \
  do {                                                                           \
    const cudaError_t status = (call);                                           \
    ASSERT_EQ(status, cudaSuccess) << #call << ": " << cudaGetErrorName(status); \
  } while (false)

class OrderedKernelTest : public ::testing::Test {
 protected:
  static constexpr std::size_t n = 1 << 20;
  // The producer's head start: long against a kernel launch, short for a test.
  static constexpr auto slow = 150ms;

  void SetUp() override
  {
    const handoff::runtime_description runtime = handoff::describe_runtime();
    if (runtime.backend != "cuda" || runtime.device_count == 0) {
      GTEST_SKIP() << "needs the CUDA backend with a device (backend '" << runtime.backend << "'"
                   << (runtime.backend_error.empty() ? std::string{} : ": " + runtime.backend_error) << ")";
    }
    void* data = nullptr;
    void* total = nullptr;
    HANDOFF_CUDA_CHECK(cudaMalloc(&data, n * sizeof(float)));
    HANDOFF_CUDA_CHECK(cudaMalloc(&total, sizeof(float)));
    data_ = static_cast<float*>(data);
    total_ = static_cast<float*>(total);
    HANDOFF_CUDA_CHECK(cudaMemset(data_, 0, n * sizeof(float)));
    HANDOFF_CUDA_CHECK(cudaStreamCreateWithFlags(&producer_, cudaStreamNonBlocking));
    HANDOFF_CUDA_CHECK(cudaStreamCreateWithFlags(&consumer_, cudaStreamNonBlocking));
    // CUDA loads a kernel on its first launch (CUDA_MODULE_LOADING=LAZY, the default), and loading
    // may wait for the kernels running on the device: a consumer kernel launched for the first time
    // behind the producer's spin would be ordered after it by the loading alone. Each is launched
    // once here, on an idle device.
    HANDOFF_CUDA_CHECK(kernels::spin_then_fill(data_, n, 0.0F, 0ns, consumer_));
    HANDOFF_CUDA_CHECK(kernels::sum(data_, n, total_, consumer_));
    HANDOFF_CUDA_CHECK(cudaDeviceSynchronize());
  }

  void TearDown() override
  {
    if (IsSkipped()) { return; }
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(producer_), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(consumer_), cudaSuccess);
    EXPECT_EQ(cudaFree(total_), cudaSuccess);
    EXPECT_EQ(cudaFree(data_), cudaSuccess);
  }

  /// A view of the device memory, ready on the producer's stream, whose release sets `released`.
  handoff::array producer_view(std::atomic<bool>& released)
  {
    int device = 0;
    EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
    handoff::array_layout layout;
    layout.data = data_;
    layout.device = {kDLCUDA, device};
    layout.dtype = {kDLFloat, 32, 1};
    layout.shape = std::vector<std::int64_t>{static_cast<std::int64_t>(n)};
    layout.strides = std::vector<std::int64_t>{1};
    const auto ready = reinterpret_cast<std::uintptr_t>(producer_);
    return handoff::process_exchange().view(std::move(layout),
                                            handoff::shared_producer{[&released] { released = true; }},
                                            handoff::named_stream::native(ready, nullptr));
  }

  /// Exports `view` to a consumer that names `stream` (a DLPack stream value). The release waits for
  /// that stream only when `stream_owner` vouches that the stream outlives it (HANDOFF_EXPORT_RELEASE).
  static DLManagedTensorVersioned* export_to(const handoff::array& view, std::int64_t stream,
                                             std::shared_ptr<const void> stream_owner = nullptr)
  {
    return handoff::process_exchange()
      .export_dlpack(view, {.stream = {handoff::named_stream::form::dlpack_value, stream, std::move(stream_owner)},
                            .max_version = DLPackVersion{1, 1},
                            .dl_device = std::nullopt,
                            .copy = std::nullopt})
      .versioned;
  }

  /// What the consumer's kernel, enqueued now on the consumer stream, sums the data to.
  float consumer_sum(const DLManagedTensorVersioned* tensor)
  {
    EXPECT_EQ(kernels::sum(static_cast<const float*>(tensor->dl_tensor.data), n, total_, consumer_), cudaSuccess);
    float total = -1.0F;
    EXPECT_EQ(cudaMemcpyAsync(&total, total_, sizeof(float), cudaMemcpyDeviceToHost, consumer_), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(consumer_), cudaSuccess);
    return total;
  }

  std::int64_t consumer_value() const { return static_cast<std::int64_t>(reinterpret_cast<std::uintptr_t>(consumer_)); }

  float* data_{nullptr};
  float* total_{nullptr};
  cudaStream_t producer_{nullptr};
  cudaStream_t consumer_{nullptr};
};

TEST_F(OrderedKernelTest, TheConsumerKernelReadsWhatTheProducerKernelWrote)
{
  std::atomic<bool> released{false};
  HANDOFF_CUDA_CHECK(kernels::spin_then_fill(data_, n, 1.0F, slow, producer_));
  const handoff::array view = producer_view(released);
  DLManagedTensorVersioned* tensor = export_to(view, consumer_value());
  EXPECT_EQ(consumer_sum(tensor), static_cast<float>(n));
  tensor->deleter(tensor);
}

TEST_F(OrderedKernelTest, NegativeControlWithoutOrderingTheConsumerKernelReadsUnfinishedData)
{
  std::atomic<bool> released{false};
  HANDOFF_CUDA_CHECK(kernels::spin_then_fill(data_, n, 1.0F, slow, producer_));
  const handoff::array view = producer_view(released);
  DLManagedTensorVersioned* tensor = export_to(view, -1);
  EXPECT_EQ(consumer_sum(tensor), 0.0F) << "the consumer's kernel ran after the producer's: no race was shown";
  tensor->deleter(tensor);
}

TEST_F(OrderedKernelTest, TheProducerIsKeptUntilTheConsumerKernelIsDone)
{
  std::atomic<bool> released{false};
  HANDOFF_CUDA_CHECK(kernels::spin_then_fill(data_, n, 1.0F, slow, producer_));
  {
    const handoff::array view = producer_view(released);
    // The fixture destroys the consumer's stream only after synchronizing it: the stream outlives the release.
    DLManagedTensorVersioned* tensor = export_to(view, consumer_value(), std::make_shared<int>(0));
    HANDOFF_CUDA_CHECK(kernels::spin(slow, consumer_));
    HANDOFF_CUDA_CHECK(kernels::sum(static_cast<const float*>(tensor->dl_tensor.data), n, total_, consumer_));
    tensor->deleter(tensor);  // the consumer let go while its kernel still reads the data
  }
  EXPECT_FALSE(released) << "the producer was released while the consumer's kernel still read its memory";
  HANDOFF_CUDA_CHECK(cudaStreamSynchronize(consumer_));
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (!released && std::chrono::steady_clock::now() < deadline) { std::this_thread::sleep_for(1ms); }
  EXPECT_TRUE(released) << "the producer was not released within 5 s of the consumer's stream being done";
}

}  // namespace
