// Host cost of the core's import and export of a DLPack tensor, without Python.
#include <handoff/array.hpp>

#include <benchmark/benchmark.h>

#include <cstddef>
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

}  // namespace
