// Host cost of the core's import and export of a DLPack tensor, and of the exchange's hand-over to
// a C consumer (the DLPack C exchange API's path), without Python. The ordered hand-over runs on
// HANDOFF_BENCH_BACKEND's backend (default "sim"; "cuda" on a GPU machine).
#include <handoff/array.hpp>
#include <handoff/backends.hpp>
#include <handoff/context.hpp>
#include <handoff/exchange.hpp>

#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <vector>

namespace {

struct producer {
  std::vector<float> storage = std::vector<float>(std::size_t{64} * 64);
  std::int64_t shape[2] = {64, 64};
  std::int64_t strides[2] = {64, 1};

  DLManagedTensorVersioned* make()
  {
    auto* t = new DLManagedTensorVersioned{};
    t->version = handoff::dlpack_version;
    t->deleter = [](DLManagedTensorVersioned* self) { delete self; };
    t->dl_tensor = DLTensor{storage.data(), {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, strides, 0};
    return t;
  }
};

void import_dlpack(benchmark::State& state)
{
  producer p;
  for (auto _ : state) {
    handoff::array view = handoff::import_dlpack(p.make());
    benchmark::DoNotOptimize(view.data());
  }
}
BENCHMARK(import_dlpack);

void export_versioned(benchmark::State& state)
{
  producer p;
  const handoff::array view = handoff::import_dlpack(p.make());
  for (auto _ : state) {
    DLManagedTensorVersioned* out = handoff::export_versioned(view);
    benchmark::DoNotOptimize(out);
    out->deleter(out);
  }
}
BENCHMARK(export_versioned);

void round_trip(benchmark::State& state)
{
  producer p;
  const handoff::array view = handoff::import_dlpack(p.make());
  for (auto _ : state) {
    handoff::array again = handoff::import_dlpack(handoff::export_versioned(view));
    benchmark::DoNotOptimize(again.data());
  }
}
BENCHMARK(round_trip);

// A tensor handed to a consumer that orders its own work (no stream to wait for): host data.
void hand_over_unordered(benchmark::State& state)
{
  producer p;
  handoff::exchange exchange{handoff::absent_backend{}};
  const handoff::array view = handoff::import_dlpack(p.make());
  for (auto _ : state) {
    DLManagedTensorVersioned* tensor = exchange.hand_over(view, {});
    benchmark::DoNotOptimize(tensor);
    tensor->deleter(tensor);
  }
}
BENCHMARK(hand_over_unordered);

// A device tensor ready on a producer stream, handed to a consumer stream: one pooled event
// recorded on the producer's stream and waited for on the consumer's, and the release bound to it.
void hand_over_ordered(benchmark::State& state)
{
  const char* chosen = std::getenv("HANDOFF_BENCH_BACKEND");
  std::unique_ptr<handoff::device::backend> device;
  try {
    device = handoff::device::make_backend(chosen != nullptr ? chosen : "sim");
  } catch (const std::exception& error) {
    state.SkipWithError(error.what());
    return;
  }
  {
    handoff::context context{*device, handoff::make_service_thread()};
    handoff::exchange exchange{context};
    const auto producer_stream = device->create_stream(/*non_blocking=*/true);
    const auto consumer_stream = device->create_stream(/*non_blocking=*/true);
    void* memory = device->allocate(sizeof(float) * 64 * 64, producer_stream);
    handoff::array_layout layout;
    layout.data = memory;
    layout.device = {device->device_type(), 0};
    layout.shape = std::vector<std::int64_t>{64, 64};
    layout.strides = std::vector<std::int64_t>{64, 1};
    {
      const handoff::array view =
        exchange.view(layout, handoff::shared_producer{[] {}},
                      handoff::named_stream::native(handoff::device::raw(producer_stream), {}));
      const auto consumer = handoff::named_stream::native(handoff::device::raw(consumer_stream), {});
      for (auto _ : state) {
        DLManagedTensorVersioned* tensor = exchange.hand_over(view, consumer);
        benchmark::DoNotOptimize(tensor);
        tensor->deleter(tensor);
      }
    }
    context.drain();
    device->deallocate(memory, producer_stream);
    device->synchronize_device();
    device->destroy_stream(consumer_stream);
    device->destroy_stream(producer_stream);
  }
  state.SetLabel(device->name().data());
}
BENCHMARK(hand_over_ordered);

}  // namespace
