#include <handoff/event_pool.hpp>
#include <handoff/stats.hpp>

#include "core/sim_fixture.hpp"

#include <thread>

namespace {

using namespace handoff;
using handoff::testing::SimTest;

class EventPoolTest : public SimTest {};

TEST_P(EventPoolTest, ReturnedEventsAreReused)
{
  event_pool events{sim};
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
  event_pool events{sim};
  {
    const pooled_event e = events.acquire(0);
  }
  sim.set_current_device(1);
  const auto before = stats();
  const pooled_event on_one = events.acquire(1);  // device 0's idle event must not be handed out
  EXPECT_EQ(stats().events_created - before.events_created, 1U);
  const auto s = sim.create_stream(true);
  sim.record_event(on_one.get(), s);  // the sim refuses a cross-device record: this proves its device
  sim.set_current_device(0);
}

TEST_P(EventPoolTest, ConcurrentBorrowersGetDistinctEvents)
{
  event_pool events{sim};
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

INSTANTIATE_TEST_SUITE_P(Sim, EventPoolTest, handoff::testing::sim_device_counts(),
                         handoff::testing::device_count_name);

}  // namespace
