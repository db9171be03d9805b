// The CUDA backend's launch-trace source: CUPTI is found and loaded at run time, or the reason it
// cannot be is said; never a crash. On a machine without a driver the reason names the driver.
#include <gtest/gtest.h>

#ifdef HANDOFF_HAS_CUPTI
#include "device/cuda/cupti_activity.hpp"

#include <cuda.h>

#include <array>
#include <cstddef>
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

TEST(CuptiActivityTest, WatchingStartsOrSaysWhyNot)
{
#ifdef __SANITIZE_ADDRESS__
  // GCC 12's LeakSanitizer misreads the dynamic TLS of a library loaded by dlopen, libcupti's, and
  // its leak check at exit crashes (a DTLS block at a garbage address, depending on the process's
  // layout). The unsanitized and thread-sanitized runs load CUPTI here.
  GTEST_SKIP() << "LeakSanitizer (GCC 12) crashes at exit on libcupti's dynamic TLS";
#endif
  const std::string reason = watch_cupti(true);
  RecordProperty("reason", reason);  // what a launch trace on this machine says
  if (reason.empty()) {
    EXPECT_EQ(watch_cupti(true), "");  // nested
    EXPECT_EQ(watch_cupti(false), "");
    EXPECT_EQ(watch_cupti(false), "");
    return;
  }
  // No driver here: CUPTI loads (it is part of the toolkit) but the driver it would hook is missing.
  EXPECT_NE(reason.find("CUPTI"), std::string::npos) << reason;
  EXPECT_TRUE(reason.find("driver") != std::string::npos || reason.find("not found") != std::string::npos) << reason;
  EXPECT_EQ(watch_cupti(true), reason);  // said again, never retried into a crash
  EXPECT_EQ(watch_cupti(false), "");     // stopping what never started is harmless
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
