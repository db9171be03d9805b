// Choosing a backend by name, HANDOFF_SIM_DEVICES and HANDOFF_SIM_VISIBLE_DEVICES, and the CUDA
// backend's refusal to start without a driver.
#include "device/backend_factory.hpp"
#include "device/sim/sim_backend.hpp"

#include <handoff/error.hpp>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <array>
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>

namespace handoff::device {
namespace {

class DeviceFactoryTest : public ::testing::Test {
 protected:
  void SetUp() override
  {
    for (auto& [name, value] : saved_) {
      if (const char* set = std::getenv(name)) { value = set; }
    }
    ::unsetenv("HANDOFF_SIM_VISIBLE_DEVICES");
  }
  void TearDown() override
  {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name, value->c_str(), 1);
      } else {
        ::unsetenv(name);
      }
    }
  }

  std::array<std::pair<const char*, std::optional<std::string>>, 2> saved_{
    {{"HANDOFF_SIM_DEVICES", std::nullopt}, {"HANDOFF_SIM_VISIBLE_DEVICES", std::nullopt}}};
};

TEST_F(DeviceFactoryTest, MakesSimulatedBackendsByName)
{
  ::unsetenv("HANDOFF_SIM_DEVICES");
  auto sim = make_backend("sim");
  EXPECT_EQ(sim->name(), "sim");
  EXPECT_EQ(sim->device_type(), kDLCUDA);
  EXPECT_EQ(sim->device_count(), 2);
  EXPECT_NE(as_sim(*sim), nullptr);

  auto rocm = make_backend("sim-rocm");
  EXPECT_EQ(rocm->name(), "sim-rocm");
  EXPECT_EQ(rocm->device_type(), kDLROCM);
  EXPECT_EQ(as_sim(*rocm)->flavour(), sim_flavour::rocm);
}

TEST_F(DeviceFactoryTest, ReadsTheSimulatedDeviceCount)
{
  ::setenv("HANDOFF_SIM_DEVICES", "3", 1);
  EXPECT_EQ(make_backend("sim")->device_count(), 3);
  ::setenv("HANDOFF_SIM_DEVICES", "", 1);
  EXPECT_EQ(make_backend("sim-rocm")->device_count(), 2);
  for (const char* bad : {"0", "-1", "two", "2x", "65", "99999999999"}) {
    ::setenv("HANDOFF_SIM_DEVICES", bad, 1);
    try {
      (void)make_backend("sim");
      ADD_FAILURE() << "accepted HANDOFF_SIM_DEVICES=" << bad;
    } catch (const value_error& e) {
      EXPECT_NE(std::string(e.what()).find("HANDOFF_SIM_DEVICES"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(sim_backend(0, sim_flavour::cuda), value_error);
}

TEST_F(DeviceFactoryTest, ReadsTheSimulatedNodesDevicesAProcessSeesAsCudaVisibleDevicesLists)
{
  ::unsetenv("HANDOFF_SIM_DEVICES");
  auto all = make_backend("sim");
  ::setenv("HANDOFF_SIM_VISIBLE_DEVICES", "1,0,5", 1);
  auto listed = make_backend("sim");
  ASSERT_EQ(listed->device_count(), 3);
  EXPECT_EQ(listed->uuid(0), all->uuid(1));  // the node's device 1 is this process's 0
  EXPECT_EQ(listed->uuid(1), all->uuid(0));
  EXPECT_NE(listed->uuid(2), all->uuid(0));
  EXPECT_NE(listed->uuid(2), all->uuid(1));
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(all->uuid(0).data()), 11), "handoff-sim");
  EXPECT_THROW((void)listed->uuid(3), device_error);

  ::setenv("HANDOFF_SIM_DEVICES", "3", 1);  // both, alike
  EXPECT_EQ(make_backend("sim-rocm")->device_count(), 3);
  for (const char* bad : {"1,1", "0,,1", "-1", "64", "a", "0,"}) {
    ::unsetenv("HANDOFF_SIM_DEVICES");
    ::setenv("HANDOFF_SIM_VISIBLE_DEVICES", bad, 1);
    try {
      (void)make_backend("sim");
      ADD_FAILURE() << "accepted HANDOFF_SIM_VISIBLE_DEVICES=" << bad;
    } catch (const value_error& e) {
      EXPECT_NE(std::string(e.what()).find("HANDOFF_SIM_VISIBLE_DEVICES"), std::string::npos) << e.what();
    }
  }
  ::setenv("HANDOFF_SIM_VISIBLE_DEVICES", "0,1", 1);
  ::setenv("HANDOFF_SIM_DEVICES", "1", 1);
  EXPECT_THROW((void)make_backend("sim"), value_error);  // both, disagreeing
  EXPECT_THROW(sim_backend(2, sim_flavour::cuda, {0}), value_error);
}

TEST_F(DeviceFactoryTest, RejectsUnknownNamesListingTheAcceptedOnes)
{
  try {
    (void)make_backend("opencl");
    ADD_FAILURE() << "accepted an unknown backend";
  } catch (const value_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'opencl'"), std::string::npos) << what;
    EXPECT_NE(what.find("cuda, sim, sim-rocm"), std::string::npos) << what;
  }
}

TEST_F(DeviceFactoryTest, CudaRequirementNamesTheRuntimeAndItsDriverFloor)
{
  const auto requirement = cuda_requirement();
  ASSERT_EQ(requirement.has_value(), cuda_compiled_in());
  if (!requirement) { GTEST_SKIP() << "the CUDA backend is not compiled in"; }
  const int major = std::stoi(requirement->runtime_version);
  EXPECT_GE(major, 12) << requirement->runtime_version;
  EXPECT_EQ(requirement->minimum_driver_branch, major >= 13 ? 580 : 525);
}

TEST_F(DeviceFactoryTest, CudaSaysWhyItCannotStart)
{
  std::unique_ptr<backend> cuda;
  try {
    cuda = make_cuda_backend();
  } catch (const device_error& e) {
    EXPECT_EQ(e.backend(), "cuda");
    EXPECT_FALSE(e.error_name().empty());
    const std::string what = e.what();
    if (cuda_compiled_in()) {
      EXPECT_EQ(what.rfind("no usable CUDA device: ", 0), 0U) << what;
      EXPECT_NE(what.find(e.error_name()), std::string::npos) << what;
      const auto floor =
        fmt::format("runtime linked in needs an NVIDIA driver {} or later", cuda_requirement()->minimum_driver_branch);
      EXPECT_NE(what.find(floor), std::string::npos) << what;
    } else {
      EXPECT_NE(what.find("not compiled in"), std::string::npos) << what;
    }
    return;
  }
  ASSERT_TRUE(cuda_compiled_in());
  EXPECT_EQ(cuda->name(), "cuda");
  EXPECT_GE(cuda->device_count(), 1);
}

}  // namespace
}  // namespace handoff::device
