// bound_stream::wait_for on every backend: ordering, elision, devices; capture and faults on the simulator.
#include <handoff/error.hpp>
#include <handoff/event_pool.hpp>
#include <handoff/stats.hpp>
#include <handoff/stream.hpp>

#include "support/backend_fixture.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace {

using namespace handoff;
using handoff::testing::BackendContextTest;

class StreamWaitTest : public BackendContextTest {
 protected:
  event_pool& events() { return ctx().events(); }

  // `consumer` waits, by an event of `device`, for `value` written to `data` on the held `producer`;
  // returns what it reads once the hold ends, having checked that the read waited for it.
  std::span<const float> ordered_read(float* data, device::stream_handle producer, device::stream_handle consumer,
                                      int device, float value)
  {
    auto held = hold(producer);
    fill(producer, data, value);
    bound(consumer, device).wait_for(producer);
    EXPECT_EQ(b().current_device(), 0) << "the wait did not restore the current device";
    return read_after(held, data, consumer);
  }
};

TEST_P(StreamWaitTest, ConsumerSeesTheProducersFinishedWrite)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  const auto before = stats();
  const auto seen = ordered_read(data, producer, consumer, 0, 1.0F);
  EXPECT_EQ(stats().waits_inserted, before.waits_inserted + 1);
  EXPECT_EQ(seen.front(), 1.0F);
  EXPECT_EQ(seen.back(), 1.0F);
}

TEST_P(StreamWaitTest, NegativeControlWithoutTheWaitSeesStaleData)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  {
    const auto held = hold(producer);
    fill(producer, data, 1.0F);
    const auto seen = read(data, consumer);  // no wait: the race handoff exists to prevent
    EXPECT_EQ(seen.front(), 0.0F);
  }
  b().synchronize_device();
}

TEST_P(StreamWaitTest, TheWaitNeverBlocksTheHost)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  {
    const auto held = hold(producer);
    fill(producer, data, 1.0F);
    // Returns while the producer is held: a host wait for it would never return (the simulator
    // refuses it, handoffErrorHoldDeadlock).
    bound(consumer).wait_for(producer);
    EXPECT_TRUE(held_back(consumer));
  }
  b().synchronize_device();
}

TEST_P(StreamWaitTest, AStreamOfAnotherContextIsRefused)
{
  const auto s = stream_on(0);
  const bound_stream elsewhere{.ctx = nullptr, .device = 0, .stream = stream_on(0), .stream_owner = nullptr};
  const auto before = stats();
  EXPECT_THROW(bound(s).wait_for(elsewhere), value_error);
  EXPECT_EQ(stats().waits_inserted, before.waits_inserted);
  EXPECT_NO_THROW(bound(s).wait_for(bound(elsewhere.stream)));  // the same stream bound on this context
}

TEST_P(StreamWaitTest, AReleaseAfterTheStreamWaitsForItsWorkAndKeepsItsOwnerUntilThen)
{
  const auto s = stream_on(0);
  auto owner = std::make_shared<int>(0);
  const std::weak_ptr<const void> watched = owner;
  std::atomic<bool> released{false};  // set on the context's service thread
  {
    auto held = hold(s);
    fill(s, allocate_on(0), 1.0F);  // work the release must wait for
    bound_stream on_s = bound(s);
    on_s.stream_owner = std::move(owner);
    on_s.release_after([&released]() noexcept { released = true; });
    on_s.stream_owner.reset();  // only the pending release keeps the owner now
    ctx().drain_for(std::chrono::milliseconds{0});
    EXPECT_FALSE(released) << "the release ran before the held work on its stream";
    EXPECT_FALSE(watched.expired()) << "the stream's owner went before the release that waits for it";
  }
  ctx().drain();
  EXPECT_TRUE(released);
  EXPECT_TRUE(watched.expired());
}

TEST_P(StreamWaitTest, ABoundStreamNamesItselfAsDLPackDoes)
{
  const auto s = stream_on(0);
  EXPECT_EQ(bound(s).dlpack_value(), static_cast<std::int64_t>(device::raw(s)));
  const bool cuda = b().device_type() == kDLCUDA;
  const auto legacy = bound(b().legacy_default_stream()).dlpack_value();
  if (cuda) {
    EXPECT_EQ(legacy, 1);  // cudaStreamLegacy, never the ambiguous 0
  } else {
    EXPECT_EQ(legacy, static_cast<std::int64_t>(device::raw(b().legacy_default_stream())));
  }
}

TEST_P(StreamWaitTest, SameStreamIsElided)
{
  const auto s = stream_on(0);
  const auto before = stats();
  bound(s).wait_for(s);
  EXPECT_EQ(stats().waits_elided, before.waits_elided + 1);
  EXPECT_EQ(stats().waits_inserted, before.waits_inserted);
}

TEST_P(StreamWaitTest, LegacyConsumerAfterBlockingProducerWaits)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0, /*non_blocking=*/false);
  const auto before = stats();
  EXPECT_EQ(ordered_read(data, producer, b().legacy_default_stream(), 0, 1.0F).front(), 1.0F);
  EXPECT_EQ(stats().waits_inserted, before.waits_inserted + 1);  // implicit synchronization is not relied on
}

// Implicit synchronization orders only work actually enqueued on the legacy stream: a hop through it
// with nothing enqueued there must still order the last stream after the producer.
TEST_P(StreamWaitTest, AHopThroughTheLegacyStreamKeepsTheOrder)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0, /*non_blocking=*/false);
  const auto last = stream_on(0, /*non_blocking=*/false);
  auto held = hold(producer);
  fill(producer, data, 1.0F);
  bound(b().legacy_default_stream()).wait_for(producer);
  bound(last).wait_for(b().legacy_default_stream());
  EXPECT_EQ(read_after(held, data, last).front(), 1.0F);
}

TEST_P(StreamWaitTest, NegativeControlAHopOrderedOnlyByImplicitSynchronizationSeesStaleData)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0, /*non_blocking=*/false);
  const auto last = stream_on(0, /*non_blocking=*/false);
  {
    const auto held = hold(producer);
    fill(producer, data, 1.0F);
    // Both hops left to implicit synchronization enqueue nothing: the last stream follows only the
    // (empty) legacy stream, not the producer.
    EXPECT_EQ(read(data, last).front(), 0.0F);
  }
  b().synchronize_device();
}

TEST_P(StreamWaitTest, LegacyConsumerAfterNonBlockingProducerWaits)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0, /*non_blocking=*/true);
  const auto before = stats();
  EXPECT_EQ(ordered_read(data, producer, b().legacy_default_stream(), 0, 1.0F).front(), 1.0F);
  EXPECT_EQ(stats().waits_inserted, before.waits_inserted + 1);
}

TEST_P(StreamWaitTest, RecordsOnTheDataDeviceAndRestoresTheCurrentOne)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  float* data = allocate_on(1);
  const auto producer = stream_on(1);
  const auto consumer = stream_on(1);
  b().set_current_device(0);
  EXPECT_EQ(ordered_read(data, producer, consumer, 1, 2.0F).front(), 2.0F);
}

// A peer writer: device 1's data written from a stream of device 0. The event is device 0's.
TEST_P(StreamWaitTest, AProducerStreamOfAPeerDeviceIsOrderedByAnEventOfItsOwnDevice)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  float* data = allocate_on(1);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(1);
  EXPECT_EQ(ordered_read(data, producer, consumer, 1, 4.0F).front(), 4.0F);
}

TEST_P(StreamWaitTest, NegativeControlAPeerWriterNotWaitedForIsSeenStale)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  float* data = allocate_on(1);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(1);
  {
    const auto held = hold(producer);
    fill(producer, data, 4.0F);
    EXPECT_EQ(read(data, consumer).front(), 0.0F);
  }
  b().synchronize_device();
}

TEST_P(StreamWaitTest, ThreeHundredExchangesReuseTheirEvents)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  const auto before = stats();
  for (int i = 0; i < 300; ++i) {
    fill(producer, data, static_cast<float>(i));
    bound(consumer).wait_for(producer);
  }
  EXPECT_LE(stats().events_created - before.events_created, 16U);
  EXPECT_GE(stats().events_reused - before.events_reused, 284U);
  EXPECT_EQ(read(data, consumer).front(), 299.0F);
}

TEST_P(StreamWaitTest, CaptureNeverTouchesTheLegacyStream)
{
  HANDOFF_REQUIRE_SIM("the device interface cannot begin or end a capture");
  const auto producer = stream_on(0, /*non_blocking=*/false);
  sim().begin_capture(producer);
  EXPECT_THROW(bound(b().legacy_default_stream()).wait_for(producer), buffer_error);
  const auto outsider = stream_on(0);
  EXPECT_THROW(bound(outsider).wait_for(producer), buffer_error);
  // Neither stream of this exchange captures, but the legacy stream is part of the blocking
  // stream's capture: recording on it would invalidate that capture.
  const auto bystander = stream_on(0);
  EXPECT_THROW(bound(bystander).wait_for(b().legacy_default_stream()), buffer_error);
  (void)sim().end_capture(producer);  // not invalidated: the legacy stream was never used
}

TEST_P(StreamWaitTest, TwoCapturesIntoDifferentGraphsAreRefusedBeforeEitherIsInvalidated)
{
  HANDOFF_REQUIRE_SIM("the device interface cannot begin or end a capture");
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  sim().begin_capture(producer);
  sim().begin_capture(consumer);
  EXPECT_NE(b().stream_capture_id(producer), b().stream_capture_id(consumer));
  EXPECT_THROW(bound(consumer).wait_for(producer), buffer_error);
  EXPECT_EQ(b().stream_capture_status(producer), device::capture_status::active);
  EXPECT_EQ(b().stream_capture_status(consumer), device::capture_status::active);
  (void)sim().end_capture(consumer);  // neither was invalidated
  (void)sim().end_capture(producer);

  // One capture that the consumer joined is ordered as usual.
  sim().begin_capture(producer);
  const auto fork = b().create_event();
  b().record_event(fork, producer);
  b().stream_wait_event(consumer, fork);
  EXPECT_EQ(b().stream_capture_id(producer), b().stream_capture_id(consumer));
  EXPECT_NO_THROW(bound(consumer).wait_for(producer));
  const auto join = b().create_event();
  b().record_event(join, consumer);
  b().stream_wait_event(producer, join);
  EXPECT_EQ(sim().end_capture(producer).size(), 6U);
  EXPECT_EQ(b().stream_capture_id(producer), 0U);
  b().destroy_event(fork);
  b().destroy_event(join);
}

TEST_P(StreamWaitTest, FaultsLeaveNoLeakAndRestoreTheDevice)
{
  HANDOFF_REQUIRE_SIM("fault injection");
  // With two devices the data is on device 1, so the switch to it (a push) is faulted too; with one,
  // the data's device is already current and nothing is pushed.
  const int device = b().device_count() - 1;
  const auto producer = stream_on(device);
  const auto consumer = stream_on(device);
  std::vector<const char*> operations{"create_event", "record_event",
                                      "stream_wait_event"};  // create_event first: the pool starts empty
  if (device != b().current_device()) { operations.push_back("push_current_device"); }
  for (const char* op : operations) {
    sim().inject_fault(op, 1, "cudaErrorLaunchFailure");
    try {
      bound(consumer, device).wait_for(producer);
      ADD_FAILURE() << op << ": expected device_error";
    } catch (const device_error& e) {
      EXPECT_EQ(e.error_name(), "cudaErrorLaunchFailure") << op;
    }
    EXPECT_EQ(b().current_device(), 0) << op;
    sim().clear_faults();
  }
  const auto idle = events().idle();
  bound(consumer, device).wait_for(producer);  // works again, and the borrowed event came back
  EXPECT_EQ(events().idle(), idle);
}

INSTANTIATE_TEST_SUITE_P(Backends, StreamWaitTest, handoff::testing::sim_and_cuda(),
                         handoff::testing::backend_choice_name);

}  // namespace
