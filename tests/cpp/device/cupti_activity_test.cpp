// The CUDA backend's launch-trace source: CUPTI is found and loaded at run time, or the reason it
// cannot be is said; never a crash. On a machine without a driver the reason names the driver.
#include <gtest/gtest.h>

#ifdef HANDOFF_HAS_CUPTI
#include "device/cuda/cupti_activity.hpp"

#include <cstdlib>
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

}  // namespace
}  // namespace handoff::device::cuda
#else
TEST(CuptiActivityTest, NotBuilt)
{
  GTEST_SKIP() << "this build has no CUPTI support (no CUDA toolkit with cupti.h at configure time)";
}
#endif
