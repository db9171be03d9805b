// The process's runtime: its exchange and device context are made with the embedding given before
// their first use, and never with another.
#include <handoff/embedding.hpp>
#include <handoff/exchange.hpp>
#include <handoff/runtime.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>

namespace {

using namespace handoff;

int deleters_run_given_first = 0;
int deleters_run_given_late = 0;

void run_deleter_given_first(void (*invoke)(void* tensor) noexcept, void* tensor) noexcept
{
  ++deleters_run_given_first;
  invoke(tensor);
}

void run_deleter_given_late(void (*invoke)(void* tensor) noexcept, void* tensor) noexcept
{
  ++deleters_run_given_late;
  invoke(tensor);
}

// Takes a host tensor through the process's exchange and lets it go: its deleter runs through the
// deleter runner the exchange was made with.
void import_and_release_a_host_tensor()
{
  static float data[4]{};
  static std::int64_t shape[1]{4};
  DLManagedTensorVersioned tensor{};
  tensor.version = {DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
  tensor.deleter = [](DLManagedTensorVersioned* /*self*/) {};
  tensor.dl_tensor = {.data = data,
                      .device = {kDLCPU, 0},
                      .ndim = 1,
                      .dtype = {kDLFloat, 32, 1},
                      .shape = shape,
                      .strides = nullptr,
                      .byte_offset = 0};
  static_cast<void>(process_exchange().take_tensor(&tensor));
}

// In a process of its own (the death test's, started afresh): the process's exchange is made once.
TEST(ProcessRuntimeTest, TakesTheEmbeddingGivenBeforeItsExchangeIsMadeAndNoLaterOne)
{
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
    {
      const bool before = embed_process({.run_deleter = &run_deleter_given_first});
      import_and_release_a_host_tensor();
      const bool after = embed_process({.run_deleter = &run_deleter_given_late});  // the negative control
      import_and_release_a_host_tensor();
      std::_Exit(before && !after && deleters_run_given_first == 2 && deleters_run_given_late == 0 ? 0 : 1);
    },
    ::testing::ExitedWithCode(0), "");
}

}  // namespace
