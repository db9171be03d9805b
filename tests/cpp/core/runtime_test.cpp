// The process's runtime: its exchange and device context are made with the embedding given before
// their first use, and never with another.
#include <handoff/embedding.hpp>
#include <handoff/exchange.hpp>
#include <handoff/runtime.hpp>

#include <gtest/gtest.h>

#include <cstdlib>

namespace {

using namespace handoff;

void run_deleter_counted(void (*invoke)(void* tensor) noexcept, void* tensor) noexcept
{
  invoke(tensor);
}

void run_deleter_too_late(void (*invoke)(void* tensor) noexcept, void* tensor) noexcept
{
  invoke(tensor);
}

// In a process of its own (the death test's, started afresh): the process's exchange is made once.
TEST(ProcessRuntimeTest, TakesTheEmbeddingGivenBeforeItsExchangeIsMadeAndNoLaterOne)
{
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
    {
      const bool before = embed_process({.run_deleter = &run_deleter_counted});
      const deleter_runner made_with = process_exchange().hooks().run_deleter;
      const bool after = embed_process({.run_deleter = &run_deleter_too_late});  // the negative control
      const deleter_runner still = process_exchange().hooks().run_deleter;
      std::_Exit(before && made_with == &run_deleter_counted && !after && still == &run_deleter_counted ? 0 : 1);
    },
    ::testing::ExitedWithCode(0), "");
}

}  // namespace
