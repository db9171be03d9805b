// stream_view::wait on the simulated device: ordering, elision, devices, capture, faults.
#include <handoff/error.hpp>
#include <handoff/event_pool.hpp>
#include <handoff/stats.hpp>
#include <handoff/stream.hpp>

#include "core/sim_fixture.hpp"

#include <vector>

namespace {

using namespace handoff;
using handoff::testing::SimTest;

class StreamWaitTest : public SimTest {
 protected:
  event_pool events{sim};
  stream_view view(device::stream_handle s) { return stream_view{sim, s}; }
};

TEST_P(StreamWaitTest, ConsumerSeesTheProducersFinishedWrite)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  sim.enqueue_fill(producer, data, n, 1.0F, slow);
  const auto before = stats();
  view(consumer).wait(view(producer), 0, events);
  EXPECT_EQ(stats().waits_inserted, before.waits_inserted + 1);
  const auto seen = read(data, consumer);
  EXPECT_EQ(seen.front(), 1.0F);
  EXPECT_EQ(seen.back(), 1.0F);
}

TEST_P(StreamWaitTest, NegativeControlWithoutTheWaitSeesStaleData)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  sim.enqueue_fill(producer, data, n, 1.0F, slow);
  const auto seen = read(data, consumer);  // no wait: the race handoff exists to prevent
  EXPECT_EQ(seen.front(), 0.0F);
  sim.synchronize_device();
}

TEST_P(StreamWaitTest, TheWaitNeverBlocksTheHost)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  sim.enqueue_fill(producer, data, n, 1.0F, slow);
  const auto start = std::chrono::steady_clock::now();
  view(consumer).wait(view(producer), 0, events);
  EXPECT_LT(std::chrono::steady_clock::now() - start, slow / 2);
  sim.synchronize_device();
}

TEST_P(StreamWaitTest, SameStreamIsElided)
{
  const auto s = stream_on(0);
  const auto before = stats();
  view(s).wait(view(s), 0, events);
  EXPECT_EQ(stats().waits_elided, before.waits_elided + 1);
  EXPECT_EQ(stats().waits_inserted, before.waits_inserted);
}

TEST_P(StreamWaitTest, LegacyConsumerAfterBlockingProducerWaits)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0, /*non_blocking=*/false);
  sim.enqueue_fill(producer, data, n, 1.0F, slow);
  const auto before = stats();
  view(sim.legacy_default_stream()).wait(view(producer), 0, events);
  EXPECT_EQ(stats().waits_inserted, before.waits_inserted + 1);  // implicit synchronization is not relied on
  EXPECT_EQ(read(data, sim.legacy_default_stream()).front(), 1.0F);
}

// Implicit synchronization orders only work actually enqueued on the legacy stream: a hop through it
// with nothing enqueued there must still order the last stream after the producer.
TEST_P(StreamWaitTest, AHopThroughTheLegacyStreamKeepsTheOrder)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0, /*non_blocking=*/false);
  const auto last = stream_on(0, /*non_blocking=*/false);
  sim.enqueue_fill(producer, data, n, 1.0F, slow);
  view(sim.legacy_default_stream()).wait(view(producer), 0, events);
  view(last).wait(view(sim.legacy_default_stream()), 0, events);
  EXPECT_EQ(read(data, last).front(), 1.0F);
}

TEST_P(StreamWaitTest, NegativeControlAHopOrderedOnlyByImplicitSynchronizationSeesStaleData)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0, /*non_blocking=*/false);
  const auto last = stream_on(0, /*non_blocking=*/false);
  sim.enqueue_fill(producer, data, n, 1.0F, slow);
  // Both hops left to implicit synchronization enqueue nothing: the last stream follows only the
  // (empty) legacy stream, not the producer.
  EXPECT_EQ(read(data, last).front(), 0.0F);
  sim.synchronize_device();
}

TEST_P(StreamWaitTest, LegacyConsumerAfterNonBlockingProducerWaits)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0, /*non_blocking=*/true);
  sim.enqueue_fill(producer, data, n, 1.0F, slow);
  const auto before = stats();
  view(sim.legacy_default_stream()).wait(view(producer), 0, events);
  EXPECT_EQ(stats().waits_inserted, before.waits_inserted + 1);
  EXPECT_EQ(read(data, sim.legacy_default_stream()).front(), 1.0F);
}

TEST_P(StreamWaitTest, RecordsOnTheDataDeviceAndRestoresTheCurrentOne)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  float* data = allocate_on(1);
  const auto producer = stream_on(1);
  const auto consumer = stream_on(1);
  sim.set_current_device(0);
  sim.enqueue_fill(producer, data, n, 2.0F, slow);
  view(consumer).wait(view(producer), 1, events);
  EXPECT_EQ(sim.current_device(), 0);
  EXPECT_EQ(read(data, consumer).front(), 2.0F);
}

TEST_P(StreamWaitTest, AProducerStreamOnAnotherDeviceIsAClearError)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  const auto producer = stream_on(0);
  const auto consumer = stream_on(1);
  EXPECT_THROW(view(consumer).wait(view(producer), 1, events), value_error);
  EXPECT_EQ(sim.current_device(), 0);
}

TEST_P(StreamWaitTest, ThreeHundredExchangesReuseTheirEvents)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  const auto before = stats();
  for (int i = 0; i < 300; ++i) {
    sim.enqueue_fill(producer, data, n, static_cast<float>(i));
    view(consumer).wait(view(producer), 0, events);
  }
  EXPECT_LE(stats().events_created - before.events_created, 16U);
  EXPECT_GE(stats().events_reused - before.events_reused, 284U);
  EXPECT_EQ(read(data, consumer).front(), 299.0F);
}

TEST_P(StreamWaitTest, CaptureNeverTouchesTheLegacyStream)
{
  const auto producer = stream_on(0, /*non_blocking=*/false);
  sim.begin_capture(producer);
  EXPECT_THROW(view(sim.legacy_default_stream()).wait(view(producer), 0, events), buffer_error);
  const auto outsider = stream_on(0);
  EXPECT_THROW(view(outsider).wait(view(producer), 0, events), buffer_error);
  (void)sim.end_capture(producer);  // not invalidated: the legacy stream was never used
}

TEST_P(StreamWaitTest, TwoCapturesIntoDifferentGraphsAreRefusedBeforeEitherIsInvalidated)
{
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  sim.begin_capture(producer);
  sim.begin_capture(consumer);
  EXPECT_NE(sim.stream_capture_id(producer), sim.stream_capture_id(consumer));
  EXPECT_THROW(view(consumer).wait(view(producer), 0, events), buffer_error);
  EXPECT_EQ(sim.stream_capture_status(producer), device::capture_status::active);
  EXPECT_EQ(sim.stream_capture_status(consumer), device::capture_status::active);
  (void)sim.end_capture(consumer);  // neither was invalidated
  (void)sim.end_capture(producer);

  // One capture that the consumer joined is ordered as usual.
  sim.begin_capture(producer);
  const auto fork = sim.create_event();
  sim.record_event(fork, producer);
  sim.stream_wait_event(consumer, fork);
  EXPECT_EQ(sim.stream_capture_id(producer), sim.stream_capture_id(consumer));
  EXPECT_NO_THROW(view(consumer).wait(view(producer), 0, events));
  const auto join = sim.create_event();
  sim.record_event(join, consumer);
  sim.stream_wait_event(producer, join);
  EXPECT_EQ(sim.end_capture(producer).size(), 6U);
  EXPECT_EQ(sim.stream_capture_id(producer), 0U);
  sim.destroy_event(fork);
  sim.destroy_event(join);
}

TEST_P(StreamWaitTest, FaultsLeaveNoLeakAndRestoreTheDevice)
{
  // With two devices the data is on device 1, so the switch to it (a push) is faulted too; with one,
  // the data's device is already current and nothing is pushed.
  const int device = sim.device_count() - 1;
  const auto producer = stream_on(device);
  const auto consumer = stream_on(device);
  std::vector<const char*> operations{"create_event", "record_event",
                                      "stream_wait_event"};  // create_event first: the pool starts empty
  if (device != sim.current_device()) { operations.push_back("push_current_device"); }
  for (const char* op : operations) {
    sim.inject_fault(op, 1, "cudaErrorLaunchFailure");
    try {
      view(consumer).wait(view(producer), device, events);
      ADD_FAILURE() << op << ": expected device_error";
    } catch (const device_error& e) {
      EXPECT_EQ(e.error_name(), "cudaErrorLaunchFailure") << op;
    }
    EXPECT_EQ(sim.current_device(), 0) << op;
    sim.clear_faults();
  }
  const auto idle = events.idle();
  view(consumer).wait(view(producer), device, events);  // works again, and the borrowed event came back
  EXPECT_EQ(events.idle(), idle);
}

INSTANTIATE_TEST_SUITE_P(Sim, StreamWaitTest, handoff::testing::sim_device_counts(),
                         handoff::testing::device_count_name);

}  // namespace
