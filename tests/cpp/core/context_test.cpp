// Stream-ordered release: a producer is released only once its consumer stream is done.
#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/stats.hpp>

#include "core/sim_fixture.hpp"
#include "service/service_thread.hpp"

#include <atomic>

namespace {

using namespace handoff;
using handoff::testing::SimTest;

class ContextTest : public SimTest {
 protected:
  context ctx{sim, std::make_unique<detail::service_thread>()};
};

TEST_F(ContextTest, ReleaseWaitsForTheConsumerStream)
{
  float* data = allocate_on(0);
  const auto consumer = stream_on(0);
  std::atomic<bool> released{false};
  std::atomic<float> seen_at_release{-1.0F};
  const auto before = stats();
  {
    producer_ref owner{[&] {
      seen_at_release = data[0];  // the consumer's write must be complete by now
      released = true;
    }};
    owner.release_after({&ctx, 0, consumer});
    sim.enqueue_fill(consumer, data, n, 5.0F, slow);  // consumer work still using the memory
  }
  EXPECT_FALSE(released.load()) << "released before the consumer stream was done";
  EXPECT_EQ(stats().deferred_releases, before.deferred_releases + 1);
  ctx.drain();
  EXPECT_TRUE(released.load());
  EXPECT_EQ(seen_at_release.load(), 5.0F);
}

TEST_F(ContextTest, AnIdleStreamReleasesAtOnce)
{
  const auto consumer = stream_on(0);
  bool released = false;
  const auto before = stats();
  {
    producer_ref owner{[&] { released = true; }};
    owner.release_after({&ctx, 0, consumer});
  }
  EXPECT_TRUE(released);
  EXPECT_EQ(stats().deferred_releases, before.deferred_releases);
}

TEST_F(ContextTest, ARecordFailureFallsBackToWaitingForTheStream)
{
  float* data = allocate_on(0);
  const auto consumer = stream_on(0);
  std::atomic<float> seen_at_release{-1.0F};
  sim.enqueue_fill(consumer, data, n, 7.0F, slow);
  sim.inject_fault("record_event", 1, "cudaErrorLaunchFailure");
  {
    producer_ref owner{[&] { seen_at_release = data[0]; }};
    owner.release_after({&ctx, 0, consumer});
  }
  ctx.drain();
  EXPECT_EQ(seen_at_release.load(), 7.0F);  // never early, even when the event path fails
}

}  // namespace
