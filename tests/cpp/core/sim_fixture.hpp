// A simulated backend, with one device or two (the test's parameter), and helpers to write and read
// device floats.
#pragma once

#include <handoff/context.hpp>
#include <handoff/sim.hpp>

#include "service/service_thread.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

// Skips a test that needs a second device when the simulator has only one.
#define HANDOFF_REQUIRE_TWO_DEVICES()                                                                \
  do {                                                                                               \
    if (sim.device_count() < 2) { GTEST_SKIP() << "needs a second device (the simulator has one)"; } \
  } while (false)

namespace handoff::testing {

using namespace std::chrono_literals;

/// Runs a suite with one simulated device (as on most GPU machines) and with two.
inline auto sim_device_counts()
{
  return ::testing::Values(1, 2);
}

/// "1_device", "2_devices": test names that say the device count.
inline std::string device_count_name(const ::testing::TestParamInfo<int>& info)
{
  return std::to_string(info.param) + (info.param == 1 ? "_device" : "_devices");
}

/// The parameter is the number of simulated devices.
class SimTest : public ::testing::TestWithParam<int> {
 protected:
  static constexpr std::size_t n = 1024;
  static constexpr auto slow = 200ms;  // long enough that an unordered reader always wins

  device::sim_backend sim{GetParam(), device::sim_flavour::cuda};

  void TearDown() override
  {
    const auto violations = sim.violations();
    EXPECT_TRUE(violations.empty()) << "uses CUDA leaves undefined: " << fmt::format("{}", fmt::join(violations, "; "));
  }

  float* allocate_on(int device)
  {
    const int previous = sim.current_device();
    sim.set_current_device(device);
    auto* p = static_cast<float*>(sim.allocate(n * sizeof(float), sim.legacy_default_stream()));
    sim.enqueue_fill(sim.legacy_default_stream(), p, n, 0.0F);
    sim.synchronize_device();
    sim.set_current_device(previous);
    return p;
  }

  device::stream_handle stream_on(int device, bool non_blocking = true)
  {
    const int previous = sim.current_device();
    sim.set_current_device(device);
    const auto s = sim.create_stream(non_blocking);
    sim.set_current_device(previous);
    return s;
  }

  // Copies the data to the host on `stream` and waits for that copy only.
  std::vector<float> read(const float* data, device::stream_handle stream)
  {
    std::vector<float> host(n);
    sim.copy_async(host.data(), data, n * sizeof(float), stream);
    sim.synchronize_stream(stream);
    return host;
  }
};

/// SimTest with the exchange context (event pool, deferred releases) of its backend.
class SimContextTest : public SimTest {
 protected:
  context ctx{sim, std::make_unique<detail::service_thread>()};
};

}  // namespace handoff::testing
