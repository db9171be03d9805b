#include <handoff/device_guard.hpp>
#include <handoff/error.hpp>
#include <handoff/event_pool.hpp>
#include <handoff/internal/sim.hpp>
#include <handoff/stats.hpp>

#include "support/backend_fixture.hpp"

#include <optional>
#include <span>
#include <thread>

namespace {

using namespace handoff;
using handoff::testing::BackendTest;

using EventPoolTest = BackendTest;

TEST_P(EventPoolTest, ReturnedEventsAreReused)
{
  event_pool events{b()};
  const auto before = stats();
  device::event_handle first{};
  {
    const pooled_event e = events.acquire(0);
    first = e.get();
  }
  const pooled_event again = events.acquire(0);
  EXPECT_EQ(again.get(), first);
  EXPECT_EQ(stats().events_created - before.events_created, 1U);
  EXPECT_EQ(stats().events_reused - before.events_reused, 1U);
}

TEST_P(EventPoolTest, PoolsArePerDevice)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  event_pool events{b()};
  {
    const pooled_event e = events.acquire(0);
  }
  b().set_current_device(1);
  const auto before = stats();
  const pooled_event on_one = events.acquire(1);  // device 0's idle event must not be handed out
  EXPECT_EQ(stats().events_created - before.events_created, 1U);
  // Backends refuse to record an event on another device's stream: this proves its device.
  b().record_event(on_one.get(), stream_on(1));
  b().set_current_device(0);
}

TEST_P(EventPoolTest, AnEventIsMadeInTheContextItIsPooledFor)
{
  // Pooled as device 1's, it was made in whatever context was current (device 0's): recording it
  // on device 1's stream then failed. It is made with device 1 current, and handed out where
  // device 1's context is.
  HANDOFF_REQUIRE_TWO_DEVICES();
  event_pool events{b()};
  const auto on_one = stream_on(1);
  b().set_current_device(0);
  {
    const pooled_event made = events.acquire(1);
    EXPECT_NO_THROW(b().record_event(made.get(), on_one)) << "the event is not device 1's";
  }
  const device_guard on{b(), 1};
  const auto before = stats();
  const pooled_event again = events.acquire(1);
  EXPECT_EQ(stats().events_reused - before.events_reused, 1U) << "device 1's context did not find its event";
  EXPECT_NO_THROW(b().record_event(again.get(), on_one));
}

TEST_P(EventPoolTest, ConcurrentBorrowersGetDistinctEvents)
{
  event_pool events{b()};
  std::vector<std::thread> threads;
  threads.reserve(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 200; ++i) {
        const pooled_event a = events.acquire(0);
        const pooled_event b = events.acquire(0);
        EXPECT_NE(a.get(), b.get());
      }
    });
  }
  for (auto& t : threads) { t.join(); }
  EXPECT_LE(events.idle(), 16U);
}

TEST_P(EventPoolTest, ARecordedEventCapturesTheStreamsWorkSoFar)
{
  event_pool events{b()};
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  auto held = hold(producer);
  fill(producer, data, 5.0F);
  const pooled_event reached = events.record(0, producer);
  b().stream_wait_event(consumer, reached.get());
  EXPECT_EQ(read_after(held, data, consumer).front(), 5.0F);
}

TEST_P(EventPoolTest, AnEventWhoseRecordFailedIsNotPooled)
{
  HANDOFF_REQUIRE_SIM("faults are injected into the simulator");
  event_pool events{b()};
  const auto s = stream_on(0);
  sim().inject_fault("record_event", 1, "cudaErrorLaunchFailure");
  EXPECT_THROW((void)events.record(0, s), device_error);
  EXPECT_EQ(events.idle(), 0U) << "the event went back to the pool";
  const auto before = stats();
  (void)events.record(0, s);
  EXPECT_EQ(stats().events_created - before.events_created, 1U);
}

// numba-cuda's cuda.close() resets the primary context: every event made in it is gone.
TEST_P(EventPoolTest, EventsOfAContextResetSinceAreNeitherHandedOutNorDestroyedAgain)
{
  HANDOFF_REQUIRE_SIM("the device interface cannot reset a context");
  event_pool events{b()};
  std::optional<pooled_event> lent{events.acquire(0)};
  {
    const pooled_event idle = events.acquire(0);
  }
  ASSERT_EQ(events.idle(), 1U);
  sim().reset_device(0);
  lent.reset();  // given back after the reset: forgotten
  const auto before = stats();
  const pooled_event fresh = events.record(0, b().legacy_default_stream());
  EXPECT_EQ(stats().events_created - before.events_created, 1U) << "an event of the old context was handed out";
  EXPECT_EQ(events.idle(), 0U);
  EXPECT_TRUE(sim().violations().empty()) << sim().violations().front();
}

INSTANTIATE_TEST_SUITE_P(Backends, EventPoolTest, handoff::testing::sim_and_cuda(),
                         handoff::testing::backend_choice_name);

}  // namespace
