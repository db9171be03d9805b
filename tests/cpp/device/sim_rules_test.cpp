// The CUDA rules the simulated device enforces where lifetime and teardown go wrong on a GPU:
// captured work runs per graph launch, sticky errors halt a device, destroyed handles are refused
// and recorded, host functions may not call the runtime and run one at a time per device; and the
// hold a test orders its races with.
#include "device/sim/sim_backend.hpp"
#include "support/expect_device_error.hpp"

#include <handoff/error.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <future>
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

  const auto reader = sim.create_stream(true);
  {
    const auto held = sim.hold(s);  // the launch must wait for the stream's earlier work, this hold too
    sim.launch_graph(graph, s);
    sim.enqueue_fill(s, data, n, 4.0F);  // and this for the whole launch
    sim.synchronize_unheld();
    EXPECT_EQ(first(data, reader), 0.0F) << "the launch started before the stream's earlier work";
  }
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
  const auto e = sim.create_event();
  const std::string sticky = err("cudaErrorIllegalAddress", "hipErrorIllegalAddress");
  {
    const auto held = sim.hold(s);  // the host function is queued behind it when the fault comes
    sim.launch_host_func(s, &count, &calls);
    sim.inject_sticky_fault(0, sticky);
    EXPECT_DEVICE_ERROR(sim.synchronize_stream(s), sticky);
    EXPECT_DEVICE_ERROR(sim.synchronize_device(), sticky);
    EXPECT_DEVICE_ERROR(sim.record_event(e, s), sticky);
    EXPECT_DEVICE_ERROR((void)sim.create_stream(true), sticky);
    EXPECT_DEVICE_ERROR(sim.launch_host_func(s, &count, &calls), sticky);
    EXPECT_DEVICE_ERROR(sim.set_current_device(0), sticky);
  }
  sim.synchronize_unheld();  // past the hold the host function was queued behind
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

TEST_P(SimRulesTest, EveryCallThatTakesADestroyedStreamOrEventFailsAsCudaDoes)
{
  float* data = zeros();
  const auto live_stream = sim.create_stream(true);
  const auto live_event = sim.create_event();
  const auto s = sim.create_stream(true);
  const auto e = sim.create_event();
  sim.destroy_stream(s);
  sim.destroy_event(e);
  const std::vector<std::pair<std::string_view, std::function<void()>>> calls{
    {"stream_device", [&] { (void)sim.stream_device(s); }},
    {"stream_is_blocking", [&] { (void)sim.stream_is_blocking(s); }},
    {"stream_capture_status", [&] { (void)sim.stream_capture_status(s); }},
    {"stream_capture_id", [&] { (void)sim.stream_capture_id(s); }},
    {"query_stream", [&] { (void)sim.query_stream(s); }},
    {"synchronize_stream", [&] { sim.synchronize_stream(s); }},
    {"record_event (stream)", [&] { sim.record_event(live_event, s); }},
    {"record_event (event)", [&] { sim.record_event(e, live_stream); }},
    {"query_event", [&] { (void)sim.query_event(e); }},
    {"synchronize_event", [&] { sim.synchronize_event(e); }},
    {"stream_wait_event (stream)", [&] { sim.stream_wait_event(s, live_event); }},
    {"stream_wait_event (event)", [&] { sim.stream_wait_event(live_stream, e); }},
    {"allocate", [&] { (void)sim.allocate(64, s); }},
    {"copy_async", [&] { sim.copy_async(data, data + 1, sizeof(float), s); }},
    {"launch_host_func",
     [&] {
       sim.launch_host_func(
         s, [](void*) {}, nullptr);
     }},
    {"enqueue_fill", [&] { sim.enqueue_fill(s, data, n, 1.0F); }},
    {"enqueue_sleep", [&] { sim.enqueue_sleep(s, 1ms); }},
    {"begin_capture", [&] { sim.begin_capture(s); }},
    {"end_capture", [&] { (void)sim.end_capture(s); }},
    {"release_with_capture",
     [&] {
       sim.release_with_capture(
         s, [](void*) noexcept {}, nullptr);
     }},
    {"hold", [&] { (void)sim.hold(s); }},
    {"pending", [&] { (void)sim.pending(s); }},
    {"held", [&] { (void)sim.held(s); }},
    {"waits_for_hold", [&] { (void)sim.waits_for_hold(s); }},
  };
  const std::string invalid = err("cudaErrorInvalidResourceHandle", "hipErrorInvalidHandle");
  for (const auto& [name, call] : calls) {
    SCOPED_TRACE(std::string(name));
    sim.clear_violations();
    EXPECT_DEVICE_ERROR(call(), invalid);
    const auto violations = sim.violations();
    ASSERT_EQ(violations.size(), 1U);
    EXPECT_NE(violations[0].find("after it was destroyed"), std::string::npos) << violations[0];
  }
  // The noexcept calls cannot fail: each logs, keeps what it must, and records the use.
  sim.clear_violations();
  void* kept = sim.allocate(64, live_stream);
  sim.deallocate(kept, s);
  EXPECT_EQ(sim.violations().size(), 1U);
  sim.clear_violations();
  sim.destroy_event(live_event);
  sim.destroy_stream(live_stream);
}

// --- host functions ------------------------------------------------------------------------------

TEST_P(SimRulesTest, AThreadsStateEndsWithItButItsEnqueuedWorkStillRuns)
{
  float* data = zeros();
  const std::size_t before = sim.threads_with_state();
  const auto gate = sim.create_stream(true);
  const auto opened = sim.create_event();
  stream_handle its_default{};
  std::size_t while_alive = 0;
  {
    const auto held = sim.hold(gate);
    sim.record_event(opened, gate);  // done when the hold ends
    std::thread worker{[&] {
      sim.set_current_device(sim.device_count() - 1);
      sim.set_current_device(0);
      its_default = sim.per_thread_default_stream();
      sim.stream_wait_event(its_default, opened);  // still queued when the thread has ended
      sim.enqueue_fill(its_default, data, n, 3.0F);
      while_alive = sim.threads_with_state();
    }};
    worker.join();
    EXPECT_EQ(while_alive, before + 1);
    EXPECT_EQ(sim.threads_with_state(), before) << "the ended thread's state was kept";
    EXPECT_EQ(data[0], 0.0F);
  }
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
  sim.destroy_event(opened);
  sim.destroy_stream(gate);
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

// --- holds: a test holds a stream's work exactly as long as its assertion needs ---------------------

TEST_P(SimRulesTest, AHoldKeepsWhatIsEnqueuedOnItsStreamFromRunningUntilItEnds)
{
  float* data = zeros();
  const auto s = sim.create_stream(true);
  EXPECT_FALSE(sim.held(s));
  auto hold = sim.hold(s);
  EXPECT_TRUE(sim.held(s));
  EXPECT_EQ(sim.pending(s), 0U) << "the hold itself is not an operation pending()";
  EXPECT_FALSE(sim.waits_for_hold(s)) << "nothing is enqueued after the hold yet";
  sim.enqueue_fill(s, data, n, 1.0F);
  EXPECT_EQ(sim.pending(s), 1U);
  EXPECT_TRUE(sim.waits_for_hold(s));
  EXPECT_FALSE(sim.query_stream(s));
  EXPECT_EQ(data[0], 0.0F) << "held work ran";
  hold.release();
  EXPECT_FALSE(hold.active());
  EXPECT_FALSE(sim.held(s));
  EXPECT_FALSE(sim.waits_for_hold(s));
  sim.synchronize_stream(s);
  EXPECT_EQ(sim.pending(s), 0U);
  EXPECT_EQ(data[n - 1], 1.0F);
  hold.release();  // idempotent
  sim.destroy_stream(s);
}

TEST_P(SimRulesTest, WorkEnqueuedBeforeAHoldIsNotHeld)
{
  float* data = zeros();
  const auto s = sim.create_stream(true);
  const auto before = sim.create_event();
  sim.enqueue_fill(s, data, n, 2.0F);
  sim.record_event(before, s);
  {
    const auto hold = sim.hold(s);  // an operation of the stream, after the fill
    sim.synchronize_event(before);  // not held: this thread may wait for it
    EXPECT_EQ(data[0], 2.0F);
  }
  sim.synchronize_stream(s);
  sim.destroy_event(before);
  sim.destroy_stream(s);
}

TEST_P(SimRulesTest, HoldsNestAndWorkRunsOnceEveryHoldItIsBehindHasEnded)
{
  float* data = zeros();
  float* more = zeros();
  const auto s = sim.create_stream(true);
  auto outer = sim.hold(s);
  sim.enqueue_fill(s, data, n, 1.0F);
  auto inner = sim.hold(s);
  sim.enqueue_fill(s, more, n, 2.0F);
  outer.release();  // not in nesting order: the second fill still waits for the inner hold
  EXPECT_TRUE(sim.held(s));
  const auto done = sim.create_event();
  sim.record_event(done, s);
  EXPECT_DEVICE_ERROR(sim.synchronize_event(done), sim_backend::hold_deadlock_error);
  EXPECT_EQ(more[0], 0.0F);
  inner.release();
  sim.synchronize_event(done);
  EXPECT_EQ(data[0], 1.0F);
  EXPECT_EQ(more[0], 2.0F);
  sim.destroy_event(done);
  sim.destroy_stream(s);
}

TEST_P(SimRulesTest, AHeldLegacyStreamHoldsWhatImplicitSynchronizationMakesWaitForIt)
{
  float* blocked = zeros();
  float* free_running = zeros();
  const auto blocking = sim.create_stream(false);
  const auto non_blocking = sim.create_stream(true);
  {
    const auto hold = sim.hold(sim.legacy_default_stream());
    sim.enqueue_fill(blocking, blocked, n, 1.0F);  // waits for the legacy stream's earlier work
    sim.enqueue_fill(non_blocking, free_running, n, 2.0F);
    EXPECT_EQ(sim.pending(blocking), 1U);
    EXPECT_TRUE(sim.waits_for_hold(blocking));
    EXPECT_FALSE(sim.waits_for_hold(non_blocking));
    EXPECT_FALSE(sim.held(blocking)) << "held() names the stream the hold was begun on";
    sim.synchronize_stream(non_blocking);
    EXPECT_EQ(free_running[0], 2.0F);
    EXPECT_EQ(blocked[0], 0.0F);
    EXPECT_DEVICE_ERROR(sim.synchronize_stream(blocking), sim_backend::hold_deadlock_error);
  }
  sim.synchronize_stream(blocking);
  EXPECT_EQ(blocked[0], 1.0F);
  sim.destroy_stream(blocking);
  sim.destroy_stream(non_blocking);
}

TEST_P(SimRulesTest, TheCallingThreadsPerThreadDefaultStreamCanBeHeld)
{
  float* data = zeros();
  const auto per_thread = sim.per_thread_default_stream();
  {
    const auto hold = sim.hold(per_thread);
    sim.enqueue_fill(per_thread, data, n, 4.0F);
    EXPECT_EQ(sim.pending(per_thread), 1U);
    EXPECT_EQ(data[0], 0.0F);
  }
  sim.synchronize_stream(per_thread);
  EXPECT_EQ(data[0], 4.0F);
}

TEST_P(SimRulesTest, AWaitForHeldWorkFailsOnTheHoldingThreadAndWaitsOnOthers)
{
  float* data = zeros();
  const auto s = sim.create_stream(true);
  const auto e = sim.create_event();
  void* memory = sim.allocate_managed(64);
  auto hold = sim.hold(s);
  sim.enqueue_fill(s, data, n, 5.0F);
  sim.record_event(e, s);
  const std::string deadlock = sim_backend::hold_deadlock_error;
  EXPECT_DEVICE_ERROR(sim.synchronize_stream(s), deadlock);
  EXPECT_DEVICE_ERROR(sim.synchronize_event(e), deadlock);
  EXPECT_DEVICE_ERROR(sim.synchronize_device(), deadlock);
  EXPECT_DEVICE_ERROR(sim.reset_device(0), deadlock);
  try {
    sim.synchronize_stream(s);
  } catch (const device_error& error) {
    EXPECT_NE(std::string(error.what()).find("wait for ever"), std::string::npos) << error.what();
  }
  EXPECT_EQ(sim.holds_of_this_thread(), 1U);
  sim.free_sync(memory);  // would wait for ever: returns at once, and frees once the held work is done
  EXPECT_EQ(sim.live_allocations(), 2U);

  std::atomic<bool> waited{false};
  std::thread other{[&] {
    sim.synchronize_stream(s);  // another thread's wait is no deadlock: it waits for the hold's end
    waited = true;
  }};
  EXPECT_FALSE(waited.load()) << "a wait for held work returned";
  hold.release();
  other.join();
  EXPECT_TRUE(waited.load());
  EXPECT_EQ(data[0], 5.0F);
  EXPECT_EQ(sim.holds_of_this_thread(), 0U);
  sim.synchronize_device();  // waits for the free too
  EXPECT_EQ(sim.live_allocations(), 1U);
  sim.destroy_event(e);
  sim.destroy_stream(s);
}

TEST_P(SimRulesTest, AFreeOnAnyThreadReturnsAtOnceWhileTheDevicesWorkWaitsForAHold)
{
  // A deleter on another thread may free while it keeps what the holding thread needs to end its
  // hold (Python's GIL): cudaFree's synchronization must not wait for the hold there either.
  float* data = zeros();
  const auto s = sim.create_stream(true);
  const std::size_t before = sim.live_allocations();
  void* memory = sim.allocate_managed(64);
  {
    const auto held = sim.hold(s);
    sim.enqueue_fill(s, data, n, 1.0F);
    auto freed = std::async(std::launch::async, [&] { sim.free_sync(memory); });
    ASSERT_EQ(freed.wait_for(std::chrono::seconds{60}), std::future_status::ready) << "the free waited for the hold";
    EXPECT_EQ(sim.live_allocations(), before + 1) << "freed before the device's work was done";
  }
  sim.synchronize_device();
  EXPECT_EQ(sim.live_allocations(), before);
  sim.destroy_stream(s);
}

TEST_P(SimRulesTest, AnEventWaitKeepsTheConsumerWaitingWhileTheProducerIsHeld)
{
  // The ordered exchange at the device's level: the consumer waits on an event recorded after the
  // producer's write. The negative control reads without the wait, and sees the old data.
  float* data = zeros();
  const auto producer = sim.create_stream(true);
  const auto consumer = sim.create_stream(true);
  const auto ready = sim.create_event();
  float ordered = -1.0F;
  float unordered = -1.0F;
  {
    const auto hold = sim.hold(producer);
    sim.enqueue_fill(producer, data, n, 6.0F);
    sim.record_event(ready, producer);
    sim.copy_async(&unordered, data, sizeof(float), consumer);
    EXPECT_FALSE(sim.waits_for_hold(consumer));
    sim.synchronize_stream(consumer);  // not behind the hold: this thread may wait
    EXPECT_EQ(unordered, 0.0F) << "the negative control must read the old data";
    sim.stream_wait_event(consumer, ready);
    sim.copy_async(&ordered, data, sizeof(float), consumer);
    EXPECT_TRUE(sim.waits_for_hold(consumer));
    EXPECT_EQ(sim.pending(consumer), 2U) << "the consumer's wait and read wait for the producer";
    EXPECT_FALSE(sim.query_stream(consumer));
    EXPECT_EQ(ordered, -1.0F);
  }
  sim.synchronize_stream(consumer);
  EXPECT_EQ(ordered, 6.0F);
  sim.destroy_event(ready);
  sim.destroy_stream(producer);
  sim.destroy_stream(consumer);
}

TEST_P(SimRulesTest, SynchronizeUnheldWaitsForWhatCanRunAndNotForWhatIsHeld)
{
  float* held_data = zeros();
  float* free_data = zeros();
  float* behind_data = zeros();
  const auto held = sim.create_stream(true);
  const auto free_running = sim.create_stream(true);
  const auto behind = sim.create_stream(true);
  const auto e = sim.create_event();
  {
    const auto hold = sim.hold(held);
    sim.enqueue_fill(held, held_data, n, 1.0F);
    sim.record_event(e, held);
    sim.stream_wait_event(behind, e);
    sim.enqueue_fill(behind, behind_data, n, 3.0F);  // waits for the hold through the event
    sim.enqueue_fill(free_running, free_data, n, 2.0F, 20ms);
    sim.synchronize_unheld();
    EXPECT_EQ(free_data[n - 1], 2.0F);
    EXPECT_EQ(sim.pending(free_running), 0U);
    EXPECT_EQ(held_data[0], 0.0F);
    EXPECT_EQ(behind_data[0], 0.0F);
    EXPECT_EQ(sim.pending(behind), 2U);
  }
  sim.synchronize_device();
  EXPECT_EQ(behind_data[0], 3.0F);
  sim.destroy_event(e);
  for (const auto st : {held, free_running, behind}) { sim.destroy_stream(st); }
}

TEST_P(SimRulesTest, AHoldIsRefusedOnADestroyedOrCapturingStream)
{
  const auto gone = sim.create_stream(true);
  sim.destroy_stream(gone);
  EXPECT_DEVICE_ERROR((void)sim.hold(gone), err("cudaErrorInvalidResourceHandle", "hipErrorInvalidHandle"));
  EXPECT_EQ(sim.violations().size(), 1U);
  sim.clear_violations();
  const auto capturing = sim.create_stream(true);
  sim.begin_capture(capturing);
  EXPECT_DEVICE_ERROR((void)sim.hold(capturing),
                      err("cudaErrorStreamCaptureUnsupported", "hipErrorStreamCaptureUnsupported"));
  (void)sim.end_capture(capturing);
  sim.destroy_stream(capturing);
}

TEST_P(SimRulesTest, AHoldEndedOnAnotherThreadIsAViolationAndStillEnds)
{
  float* data = zeros();
  const auto s = sim.create_stream(true);
  auto hold = sim.hold(s);
  sim.enqueue_fill(s, data, n, 7.0F);
  std::thread{[&] { hold.release(); }}.join();
  sim.synchronize_stream(s);
  EXPECT_EQ(data[0], 7.0F);
  const auto violations = sim.violations();
  ASSERT_EQ(violations.size(), 1U);
  EXPECT_NE(violations[0].find("another thread"), std::string::npos) << violations[0];
  sim.destroy_stream(s);
}

TEST_P(SimRulesTest, WorkHeldWhenTheStreamIsDestroyedRunsWhenTheHoldEnds)
{
  float* data = zeros();
  const auto s = sim.create_stream(true);
  auto hold = sim.hold(s);
  sim.enqueue_fill(s, data, n, 8.0F);
  sim.destroy_stream(s);  // as in CUDA, its enqueued work still runs
  EXPECT_DEVICE_ERROR(sim.synchronize_device(), sim_backend::hold_deadlock_error);
  hold.release();
  sim.synchronize_device();
  EXPECT_EQ(data[0], 8.0F);
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
