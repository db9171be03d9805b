// The CUDA backend's launch-trace source: CUPTI is found and loaded at run time, or the reason it
// cannot be is said; never a crash. On a machine without a driver the reason names the driver.
#include <gtest/gtest.h>

#ifdef HANDOFF_HAS_CUPTI
#include "device/cuda/cupti_activity.hpp"

#include <cuda.h>

#include <array>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>

namespace handoff::device::cuda {
namespace {

TEST(CuptiActivityTest, TheToolkitsCuptiIsAmongTheCandidates)
{
  const auto candidates = cupti_candidates();
  ASSERT_FALSE(candidates.empty());
  EXPECT_EQ(candidates.front(), std::getenv("HANDOFF_CUPTI_LIBRARY") != nullptr ? std::getenv("HANDOFF_CUPTI_LIBRARY")
                                                                                : std::string{"libcupti.so"});
  bool toolkit = false;
  for (const auto& candidate : candidates) {
    toolkit = toolkit || candidate.find("/lib64/libcupti.so") != std::string::npos;
  }
  EXPECT_TRUE(toolkit);
}

// Watching CUPTI's launches, checked: it starts, or it says why not and is never retried into a
// crash. Each failed check is said on stderr; returns how many failed.
int watching_failures()
{
  int failures = 0;
  const auto check = [&failures](bool holds, const char* what) {
    if (!holds) {
      std::fprintf(stderr, "failed: %s\n", what);
      ++failures;
    }
  };
  const std::string reason = watch_cupti(true);
  std::fprintf(stderr, "watch_cupti(true): %s\n", reason.empty() ? "watching" : reason.c_str());
  if (reason.empty()) {
    check(watch_cupti(true).empty(), "a nested start watches");
    check(watch_cupti(false).empty(), "the nested stop");
    check(watch_cupti(false).empty(), "the outer stop");
    return failures;
  }
  // No driver here: CUPTI loads (it is part of the toolkit) but the driver it would hook is missing.
  check(reason.find("CUPTI") != std::string::npos, "the reason names CUPTI");
  check(reason.find("driver") != std::string::npos || reason.find("not found") != std::string::npos,
        "the reason names the driver, or the library not found");
  check(watch_cupti(true) == reason, "the reason is said again, never retried into a crash");
  check(watch_cupti(false).empty(), "stopping what never started is harmless");
  return failures;
}

// In a process of its own (the death test's, started afresh), which leaves through std::_Exit and so
// without LeakSanitizer's check at exit: GCC 12's LeakSanitizer misreads the dynamic TLS of a library
// loaded by dlopen, libcupti's, and that check can crash on it (a DTLS block at a garbage address,
// depending on the process's layout). The child's exit code is its count of failed checks.
TEST(CuptiActivityTest, WatchingStartsOrSaysWhyNot)
{
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::_Exit(watching_failures()), ::testing::ExitedWithCode(0), "");
}

// The CUDA runtime may launch with its arguments packed into one buffer named in `extra` rather than
// with kernelParams: the detector reads the buffer to find the memory a launch touches.
TEST(CuptiActivityTest, ArgumentsPackedIntoOneBufferAreReadFromIt)
{
  std::array<std::byte, 24> buffer{};
  std::size_t size = buffer.size();
  std::array<void*, 5> extra{CU_LAUNCH_PARAM_BUFFER_POINTER, buffer.data(), CU_LAUNCH_PARAM_BUFFER_SIZE, &size,
                             CU_LAUNCH_PARAM_END};
  const std::span<const std::byte> packed = packed_arguments(extra.data());
  EXPECT_EQ(packed.data(), buffer.data());
  EXPECT_EQ(packed.size(), buffer.size());

  std::array<void*, 5> size_first{CU_LAUNCH_PARAM_BUFFER_SIZE, &size, CU_LAUNCH_PARAM_BUFFER_POINTER, buffer.data(),
                                  CU_LAUNCH_PARAM_END};
  EXPECT_EQ(packed_arguments(size_first.data()).size(), buffer.size()) << "the options come in any order";
}

TEST(CuptiActivityTest, NoBufferIsReadWhereNoneIsNamed)
{
  EXPECT_TRUE(packed_arguments(nullptr).empty()) << "a launch with kernelParams names no extra options";
  std::array<void*, 1> none{CU_LAUNCH_PARAM_END};
  EXPECT_TRUE(packed_arguments(none.data()).empty());
  std::array<std::byte, 8> buffer{};
  std::array<void*, 3> without_size{CU_LAUNCH_PARAM_BUFFER_POINTER, buffer.data(), CU_LAUNCH_PARAM_END};
  EXPECT_TRUE(packed_arguments(without_size.data()).empty()) << "without its size the buffer has no extent to read";
}

}  // namespace
}  // namespace handoff::device::cuda
#else
TEST(CuptiActivityTest, NotBuilt)
{
  GTEST_SKIP() << "this build has no CUPTI support (no CUDA toolkit with cupti.h at configure time)";
}
#endif
