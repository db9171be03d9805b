// The CUDA rules the simulated device enforces where lifetime and teardown go wrong on a GPU:
// captured work runs per graph launch, sticky errors halt a device, destroyed handles are
// violations, host functions may not call the runtime and run one at a time per device.
#include "device/sim/sim_backend.hpp"

#include <handoff/error.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace handoff::device {
namespace {

using namespace std::chrono_literals;

// Flavour and device count: machines with a GPU usually have one.
class SimRulesTest : public ::testing::TestWithParam<std::tuple<sim_flavour, int>> {
 protected:
  sim_backend sim{std::get<1>(GetParam()), std::get<0>(GetParam())};
  static constexpr std::size_t n = 256;

  [[nodiscard]] bool rocm() const { return std::get<0>(GetParam()) == sim_flavour::rocm; }
  [[nodiscard]] std::string err(std::string_view cuda_name, std::string_view hip_name) const
  {
    return std::string(rocm() ? hip_name : cuda_name);
  }

  void TearDown() override
  {
    for (int d = 0; d < sim.device_count(); ++d) { sim.clear_sticky_fault(d); }
    sim.clear_violations();  // tests that make violations assert them themselves
  }

  float* zeros()
  {
    auto* p = static_cast<float*>(sim.allocate(n * sizeof(float), sim.legacy_default_stream()));
    sim.enqueue_fill(sim.legacy_default_stream(), p, n, 0.0F);
    sim.synchronize_device();
    return p;
  }

  float first(const float* data, stream_handle s)
  {
    float out = -1.0F;
    sim.copy_async(&out, data, sizeof out, s);
    sim.synchronize_stream(s);
    return out;
  }

  static void count(void* counter) { static_cast<std::atomic<int>*>(counter)->fetch_add(1); }
};

#define EXPECT_DEVICE_ERROR(statement, expected_name)                   \
  do {                                                                  \
    try {                                                               \
      statement;                                                        \
      ADD_FAILURE() << #statement " did not throw " << (expected_name); \
    } catch (const ::handoff::device_error& error_) {                   \
      EXPECT_EQ(error_.error_name(), (expected_name)) << error_.what(); \
    }                                                                   \
  } while (false)

// --- capture -------------------------------------------------------------------------------------

TEST_P(SimRulesTest, CapturedWorkRunsOncePerLaunchAndNeverUnlaunched)
{
  const auto s = sim.create_stream(true);
  float* data = zeros();
  std::atomic<int> calls{0};

  sim.begin_capture(s);
  sim.enqueue_fill(s, data, n, 1.0F);
  sim.launch_host_func(s, &count, &calls);
  const sim_graph graph = sim.end_capture(s);
  EXPECT_EQ(graph.size(), 2U);
  sim.synchronize_device();
  EXPECT_EQ(calls.load(), 0) << "a captured host function ran at enqueue time";
  EXPECT_EQ(first(data, s), 0.0F) << "captured work ran without a launch";

  sim.launch_graph(graph, s);
  sim.launch_graph(graph, s);
  sim.synchronize_stream(s);
  EXPECT_EQ(calls.load(), 2) << "once per launch";
  EXPECT_EQ(first(data, s), 1.0F);

  // Captured, never launched: never runs.
  std::atomic<int> never{0};
  sim.begin_capture(s);
  sim.launch_host_func(s, &count, &never);
  {
    const sim_graph dropped = sim.end_capture(s);
  }
  sim.synchronize_device();
  EXPECT_EQ(never.load(), 0);
  sim.destroy_stream(s);
  sim.deallocate(data, sim.legacy_default_stream());
}

TEST_P(SimRulesTest, ALaunchIsOrderedOnItsStreamAndKeepsForkedBranchesInOrder)
{
  const auto s = sim.create_stream(true);
  const auto side = sim.create_stream(true);
  const auto fork = sim.create_event();
  const auto join = sim.create_event();
  float* data = zeros();

  // s: record fork -> side: wait fork, slow fill 2 -> record join -> s: wait join, fill 3 over it.
  sim.begin_capture(s);
  sim.record_event(fork, s);
  sim.stream_wait_event(side, fork);
  sim.enqueue_fill(side, data, n, 2.0F, 50ms);
  sim.record_event(join, side);
  sim.stream_wait_event(s, join);
  sim.enqueue_fill(s, data, n, 3.0F);
  const sim_graph graph = sim.end_capture(s);

  sim.enqueue_sleep(s, 50ms);  // the launch must wait for this too
  sim.launch_graph(graph, s);
  sim.enqueue_fill(s, data, n, 4.0F);  // and this for the whole launch
  const auto reader = sim.create_stream(true);
  EXPECT_EQ(first(data, reader), 0.0F) << "the launch started before the stream's earlier work";
  sim.synchronize_stream(s);
  EXPECT_EQ(first(data, reader), 4.0F);

  sim.launch_graph(graph, s);
  sim.synchronize_stream(s);
  EXPECT_EQ(first(data, reader), 3.0F) << "the joined branch's slow fill overtook the node after the join";

  for (const auto st : {s, side, reader}) { sim.destroy_stream(st); }
  for (const auto e : {fork, join}) { sim.destroy_event(e); }
  sim.deallocate(data, sim.legacy_default_stream());
}

// --- sticky errors -------------------------------------------------------------------------------

TEST_P(SimRulesTest, AStickyErrorHaltsItsDeviceForGood)
{
  const auto s = sim.create_stream(true);
  std::atomic<int> calls{0};
  sim.enqueue_sleep(s, 50ms);
  sim.launch_host_func(s, &count, &calls);
  const auto e = sim.create_event();

  sim.inject_sticky_fault(0, err("cudaErrorIllegalAddress", "hipErrorIllegalAddress"));
  const std::string sticky = err("cudaErrorIllegalAddress", "hipErrorIllegalAddress");
  EXPECT_DEVICE_ERROR(sim.synchronize_stream(s), sticky);
  EXPECT_DEVICE_ERROR(sim.synchronize_device(), sticky);
  EXPECT_DEVICE_ERROR(sim.record_event(e, s), sticky);
  EXPECT_DEVICE_ERROR((void)sim.create_stream(true), sticky);
  EXPECT_DEVICE_ERROR(sim.launch_host_func(s, &count, &calls), sticky);
  EXPECT_DEVICE_ERROR(sim.set_current_device(0), sticky);
  std::this_thread::sleep_for(100ms);  // past the sleep the host function was queued behind
  EXPECT_EQ(calls.load(), 0) << "a host function queued before the fault ran";

  if (sim.device_count() > 1) {  // another device is not affected
    sim.set_current_device(1);
    const auto other = sim.create_stream(true);
    sim.launch_host_func(other, &count, &calls);
    sim.synchronize_stream(other);
    EXPECT_EQ(calls.load(), 1);
    sim.destroy_stream(other);
  }
  sim.clear_sticky_fault(0);
  sim.set_current_device(0);
  sim.destroy_event(e);
  sim.destroy_stream(s);
}

// --- destroyed handles ---------------------------------------------------------------------------

TEST_P(SimRulesTest, UsingADestroyedStreamOrEventIsAViolation)
{
  const auto s = sim.create_stream(true);
  const auto e = sim.create_event();
  sim.destroy_stream(s);
  sim.destroy_event(e);
  EXPECT_TRUE(sim.violations().empty());

  const std::string invalid = err("cudaErrorInvalidResourceHandle", "hipErrorInvalidHandle");
  EXPECT_DEVICE_ERROR(sim.synchronize_stream(s), invalid);
  EXPECT_DEVICE_ERROR((void)sim.query_event(e), invalid);
  sim.destroy_stream(s);
  sim.destroy_event(e);
  const auto violations = sim.violations();
  ASSERT_EQ(violations.size(), 4U);
  EXPECT_NE(violations[0].find("after it was destroyed"), std::string::npos) << violations[0];
  EXPECT_NE(violations[2].find("already destroyed"), std::string::npos) << violations[2];

  // A handle that never existed is a plain error, not a violation; handles are never reused.
  sim.clear_violations();
  EXPECT_DEVICE_ERROR(sim.synchronize_stream(stream_handle{0xdead0}), invalid);
  EXPECT_TRUE(sim.violations().empty());
  const auto again = sim.create_stream(true);
  EXPECT_NE(again, s);
  sim.destroy_stream(again);
}

// --- host functions ------------------------------------------------------------------------------

TEST_P(SimRulesTest, AThreadsStateEndsWithItButItsEnqueuedWorkStillRuns)
{
  float* data = zeros();
  const std::size_t before = sim.threads_with_state();
  stream_handle its_default{};
  std::size_t while_alive = 0;
  std::thread worker{[&] {
    sim.set_current_device(sim.device_count() - 1);
    sim.set_current_device(0);
    its_default = sim.per_thread_default_stream();
    sim.enqueue_sleep(its_default, 50ms);  // still running when the thread has ended
    sim.enqueue_fill(its_default, data, n, 3.0F);
    while_alive = sim.threads_with_state();
  }};
  worker.join();
  EXPECT_EQ(while_alive, before + 1);
  EXPECT_EQ(sim.threads_with_state(), before) << "the ended thread's state was kept";
  sim.synchronize_device();  // waits for the ended thread's work, as for a destroyed stream's
  EXPECT_EQ(first(data, sim.legacy_default_stream()), 3.0F);
  if (rocm()) {
    // HIP's per-thread stream has a handle of its own, destroyed with its thread.
    EXPECT_DEVICE_ERROR((void)sim.stream_device(its_default), "hipErrorInvalidHandle");
    const auto violations = sim.violations();
    ASSERT_EQ(violations.size(), 1U);
    EXPECT_NE(violations[0].find("destroyed"), std::string::npos) << violations[0];
    sim.clear_violations();
  }
  EXPECT_TRUE(sim.violations().empty());
}

TEST_P(SimRulesTest, AHostFunctionMayNotCallTheRuntime)
{
  struct probe {
    sim_backend* sim;
    std::string error;
  } p{&sim, {}};
  const auto s = sim.create_stream(true);
  sim.launch_host_func(
    s,
    [](void* arg) {
      auto* self = static_cast<probe*>(arg);
      try {
        (void)self->sim->create_event();
      } catch (const device_error& e) {
        self->error = e.error_name();
      }
    },
    &p);
  sim.synchronize_stream(s);
  EXPECT_EQ(p.error, err("cudaErrorNotPermitted", "hipErrorNotPermitted"));
  ASSERT_EQ(sim.violations().size(), 1U);
  EXPECT_NE(sim.violations()[0].find("inside a host function"), std::string::npos);
  sim.destroy_stream(s);
}

TEST_P(SimRulesTest, HostFunctionsOfADeviceRunOneAtATime)
{
  struct overlap {
    std::atomic<int> running{0};
    std::atomic<int> most{0};
  } o;
  const auto host_function = [](void* arg) {
    auto* self = static_cast<overlap*>(arg);
    const int now = self->running.fetch_add(1) + 1;
    int seen = self->most.load();
    while (now > seen && !self->most.compare_exchange_weak(seen, now)) {}
    std::this_thread::sleep_for(20ms);
    self->running.fetch_sub(1);
  };
  std::vector<stream_handle> streams;
  streams.reserve(4);
  for (int i = 0; i < 4; ++i) { streams.push_back(sim.create_stream(true)); }
  for (const auto s : streams) { sim.launch_host_func(s, host_function, &o); }
  float* data = zeros();
  sim.enqueue_fill(streams[0], data, n, 5.0F);  // later work on the stream waits for its host function
  EXPECT_EQ(first(data, streams[0]), 5.0F);
  sim.synchronize_device();
  EXPECT_EQ(o.most.load(), 1) << "host functions of one device overlapped";
  for (const auto s : streams) { sim.destroy_stream(s); }
  sim.deallocate(data, sim.legacy_default_stream());
}

INSTANTIATE_TEST_SUITE_P(Sim, SimRulesTest,
                         ::testing::Combine(::testing::Values(sim_flavour::cuda, sim_flavour::rocm),
                                            ::testing::Values(1, 2)),
                         [](const auto& param_info) {
                           return std::string(std::get<0>(param_info.param) == sim_flavour::cuda ? "sim" : "sim_rocm") +
                                  "_" + std::to_string(std::get<1>(param_info.param)) + "_devices";
                         });

}  // namespace
}  // namespace handoff::device
