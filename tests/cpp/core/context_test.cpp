// Stream-ordered release: a producer is released only once its consumer stream is done.
#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/embedding.hpp>
#include <handoff/error.hpp>
#include <handoff/internal/device_memory.hpp>
#include <handoff/internal/sim.hpp>
#include <handoff/internal/transfer.hpp>
#include <handoff/stats.hpp>

#include "support/backend_fixture.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <optional>
#include <span>
#include <thread>

namespace {

using namespace handoff;
using ContextTest = handoff::testing::BackendContextTest;

TEST_P(ContextTest, ReleaseWaitsForTheConsumerStream)
{
  float* data = allocate_on(0);
  const auto consumer = stream_on(0);
  const auto reader = stream_on(0);
  std::atomic<bool> released{false};
  std::atomic<float> seen_at_release{-1.0F};
  const auto before = stats();
  {
    const auto consumer_works = hold(consumer);
    {
      shared_producer owner{[&] {
        // The consumer's write must be complete by now: any stream sees it.
        seen_at_release = read(data, reader).front();
        released = true;
      }};
      owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
      fill(consumer, data, 5.0F);  // consumer work still using the memory
    }
    EXPECT_FALSE(released.load()) << "released before the consumer stream was done";
    EXPECT_EQ(stats().deferred_releases, before.deferred_releases + 1);
  }
  ctx().drain();
  EXPECT_TRUE(released.load());
  EXPECT_EQ(seen_at_release.load(), 5.0F);
}

// What an embedding gives a context at construction is that context's: its batches of releases and
// its host waits (a copy to the host, a free that waits for the device) run in its hooks, while a
// context made without them (the fixture's, the negative control) runs the same work as it is.
std::atomic<int> batches_in_hooks{0};
std::atomic<int> waits_in_hooks{0};

TEST_P(ContextTest, AContextRunsItsReleasesAndHostWaitsInTheHooksItWasMadeWith)
{
  const embedding counting{
    .block_host =
      [](void (*body)(void*), void* state) {
        ++waits_in_hooks;
        body(state);
      },
    .run_releases =
      [](void (*body)(void*) noexcept, void* state) noexcept {
        ++batches_in_hooks;
        body(state);
      },
  };
  batches_in_hooks = 0;
  waits_in_hooks = 0;
  context embedded{b(), std::make_unique<detail::service_thread>(), counting};
  float* data = allocate_on(0);
  const auto consumer = stream_on(0);
  const DLDevice pinned{b().device_type() == kDLCUDA ? kDLCUDAHost : kDLROCMHost, 0};
  const std::array<std::int64_t, 1> shape{4};
  const auto release_copy_and_free = [&](context& on) {
    std::atomic<bool> released{false};
    {
      shared_producer owner{[&] { released = true; }};
      owner.release_after({.ctx = &on, .device = 0, .stream = consumer, .stream_owner = nullptr});
    }
    on.drain();
    EXPECT_TRUE(released.load());
    const array copied = transfer_array(&on, device_view(data, 0), transfer::to_host);
    EXPECT_EQ(copied.device().device_type, kDLCPU);
    const array host_accessible = allocate_host_accessible_array(
      {.ctx = &on, .device = 0, .stream = consumer, .stream_owner = nullptr}, pinned, {kDLFloat, 32, 1}, shape);
  };

  release_copy_and_free(embedded);
  EXPECT_GE(batches_in_hooks.load(), 1) << "the release ran outside the context's release section";
  EXPECT_EQ(waits_in_hooks.load(), 2) << "the copy to the host and the free must each wait in the blocking section";

  const int batches = batches_in_hooks.load();
  release_copy_and_free(ctx());
  EXPECT_EQ(batches_in_hooks.load(), batches) << "a context made without hooks ran another's";
  EXPECT_EQ(waits_in_hooks.load(), 2) << "a context made without hooks ran another's";
}

TEST_P(ContextTest, TheConsumerStreamsOwnerOutlivesTheRelease)
{
  const auto consumer = stream_on(0);
  std::atomic<bool> released{false};
  std::atomic<bool> owner_gone{false};
  std::atomic<bool> owner_gone_before_release{false};
  {
    const auto consumer_works = hold(consumer);
    {
      shared_producer owner{[&] {
        owner_gone_before_release = owner_gone.load();
        released = true;
      }};
      // Named first by a caller that holds nothing (an export to a bare handle): the owner named
      // next must still be kept (the first binding was, and the owner went at once).
      owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
      // The stream's owner (a Python stream object, say), held by nothing else.
      std::shared_ptr<const void> stream_owner{&owner_gone, [&](const void*) { owner_gone = true; }};
      owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = std::move(stream_owner)});
    }
    EXPECT_FALSE(owner_gone.load()) << "the stream's owner went while a release was still to run on it";
  }
  ctx().drain();
  EXPECT_TRUE(released.load());
  EXPECT_FALSE(owner_gone_before_release.load());
  EXPECT_TRUE(owner_gone.load());
}

TEST_P(ContextTest, AReleaseWaitsForEveryStreamTheDataWasHandedTo)
{
  float* data = allocate_on(0);
  const auto first = stream_on(0);
  const auto second = stream_on(0);
  const auto reader = stream_on(0);
  std::atomic<int> releases{0};
  std::atomic<float> seen_at_release{-1.0F};
  {
    const auto second_works = hold(second);
    {
      const auto first_works = hold(first);
      shared_producer owner{[&] {
        seen_at_release = read(data, reader).front();
        ++releases;
      }};
      owner.release_after({.ctx = &ctx(), .device = 0, .stream = first, .stream_owner = nullptr});
      owner.release_after({.ctx = &ctx(), .device = 0, .stream = second, .stream_owner = nullptr});
      owner.release_after({.ctx = &ctx(), .device = 0, .stream = first, .stream_owner = nullptr});  // added once
      fill(second, data, 6.0F);  // the slower consumer still uses the memory
    }
    // The first consumer may be done; the second still works. (No wait for the first here: on a GPU,
    // the first hold's host function runs only after the second's, which this thread holds.)
    EXPECT_EQ(releases.load(), 0) << "released before both consumer streams were done";
  }
  ctx().drain();
  EXPECT_EQ(releases.load(), 1);
  EXPECT_EQ(seen_at_release.load(), 6.0F);
}
TEST_P(ContextTest, AReleaseDuringCapturePutsNothingIntoTheGraphAndRunsAfterIt)
{
  HANDOFF_REQUIRE_SIM("the device interface cannot begin or end a capture");
  const auto consumer = stream_on(0, /*non_blocking=*/false);
  std::atomic<int> released{0};
  sim().begin_capture(consumer);
  {
    shared_producer owner{[&] { ++released; }};
    owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
  }
  ASSERT_EQ(sim().end_capture(consumer).size(), 0U) << "the release's host function went into the graph";
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1);
}

TEST_P(ContextTest, AFailedPollIsAskedAgainAndTheProducerReleased)
{
  HANDOFF_REQUIRE_SIM("faults are injected into the simulator");
  const auto consumer = stream_on(0);
  std::atomic<int> released{0};
  {
    const auto consumer_works = hold(consumer);  // the release waits: its polls fail, then succeed
    {
      shared_producer owner{[&] { ++released; }};
      owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
    }
    sim().inject_fault("query_event", 2, "cudaErrorLaunchFailure");
  }
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1) << "a transient failure abandoned the release";
}

// The device could not be made current three times in a row: where the release is asked for, where
// its event would be recorded, and where the fallback waits for the stream. One that fails and then
// works again must neither abandon the release nor keep its producer.
TEST_P(ContextTest, ATransientFailureOfTheFallbackIsAskedAgainAndTheProducerReleased)
{
  HANDOFF_REQUIRE_SIM("faults are injected into the simulator");
  const auto consumer = stream_on(0);
  float* data = allocate_on(0);
  const auto reader = stream_on(0);
  std::atomic<int> released{0};
  std::atomic<float> seen_at_release{-1.0F};
  const auto pending_before = stats().pending_releases;
  fill(consumer, data, 4.0F, slow / 4);
  sim().inject_fault("push_current_device", 3, "cudaErrorLaunchFailure");
  std::thread([&] {  // a thread with no device current, as a Python thread dropping a view may be
    shared_producer owner{[&] {
      seen_at_release = read(data, reader).front();
      ++released;
    }};
    owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
  })
    .join();
  EXPECT_EQ(stats().pending_releases, pending_before + 1) << "a release being retried is pending";
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  sim().clear_faults();
  EXPECT_EQ(released.load(), 1) << "a transient failure abandoned the release";
  EXPECT_EQ(seen_at_release.load(), 4.0F) << "released before the consumer stream was done";
  EXPECT_EQ(stats().pending_releases, pending_before);
}

TEST_P(ContextTest, AFallbackThatKeepsFailingAbandonsTheReleaseAndKeepsTheProducer)
{
  HANDOFF_REQUIRE_SIM("faults are injected into the simulator");
  const auto consumer = stream_on(0);
  std::atomic<int> released{0};
  const auto pending_before = stats().pending_releases;
  sim().inject_fault("push_current_device", 1'000'000, "cudaErrorLaunchFailure");
  std::thread([&] {
    shared_producer owner{[&] { ++released; }};
    owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
  }).join();
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  sim().clear_faults();
  EXPECT_EQ(released.load(), 0) << "released although nothing said the consumer was done";
  EXPECT_EQ(stats().pending_releases, pending_before) << "an abandoned release is no longer pending";
}

TEST_P(ContextTest, AStreamThatKeepsFailingHasItsReleasesAbandonedAndTheProducerKept)
{
  HANDOFF_REQUIRE_SIM("faults are injected into the simulator");
  const auto consumer = stream_on(0);
  std::atomic<int> released{0};
  {
    const auto consumer_works = hold(consumer);  // the release waits, and every poll fails
    {
      shared_producer owner{[&] { ++released; }};
      owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
    }
    sim().inject_fault("query_event", 1'000'000, "cudaErrorLaunchFailure");
  }
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  sim().clear_faults();
  EXPECT_EQ(released.load(), 0) << "released although nothing said the consumer was done";
  EXPECT_EQ(stats().pending_releases, 0);
}

// A thread bound work to its per-thread default stream and ended before that work did: the legacy
// stream, which the binding names, must still be ordered after it, whatever the driver does with the
// ended thread's stream (the simulator drops it from the legacy stream's implicit synchronization).
TEST_P(ContextTest, AThreadsEndOrdersTheLegacyStreamAfterItsPerThreadStream)
{
  float* data = allocate_on(0);
  const auto gate = stream_on(0);
  const auto opened = b().create_event();
  std::span<const float> seen;
  {
    const auto held = hold(gate);
    b().record_event(opened, gate);  // done when the hold ends
    std::thread worker([&] {
      const auto named = ctx().thread_independent(0, b().per_thread_default_stream());
      EXPECT_EQ(named, b().legacy_default_stream());
      device_guard on{b(), 0};
      b().stream_wait_event(b().per_thread_default_stream(), opened);  // its stream waits for the hold
      fill(b().per_thread_default_stream(), data, 8.0F);
    });
    worker.join();
    seen = read_later(data, b().legacy_default_stream());
    EXPECT_TRUE(held_back(b().legacy_default_stream())) << "the legacy stream does not wait for the ended thread's";
  }
  b().synchronize_device();
  EXPECT_EQ(seen.front(), 8.0F);
  b().destroy_event(opened);
}

TEST_P(ContextTest, NegativeControlAnEndedThreadsStreamNotNamedToTheContextIsNotOrdered)
{
  HANDOFF_REQUIRE_SIM("only the simulator drops an ended thread's stream from the legacy stream's order");
  float* data = allocate_on(0);
  const auto gate = stream_on(0);
  const auto opened = b().create_event();
  {
    const auto held = hold(gate);
    b().record_event(opened, gate);
    std::thread worker([&] {
      device_guard on{b(), 0};
      b().stream_wait_event(b().per_thread_default_stream(), opened);
      fill(b().per_thread_default_stream(), data, 8.0F);
    });
    worker.join();
    EXPECT_EQ(read(data, b().legacy_default_stream()).front(), 0.0F);
  }
  b().synchronize_device();
  b().destroy_event(opened);
}

// torch.cuda.graph: the captured work reads the data at every launch, long after the capture ended.
TEST_P(ContextTest, AReleaseDuringCaptureWaitsUntilTheGraphIsDestroyedAndItsLaunchesAreDone)
{
  HANDOFF_REQUIRE_SIM("the device interface cannot begin or end a capture");
  float* data = allocate_on(0);
  const auto consumer = stream_on(0, /*non_blocking=*/false);
  std::atomic<int> released{0};
  sim().begin_capture(consumer);
  sim().enqueue_fill(consumer, data, n, 1.0F);  // a node of the graph: each launch writes the data
  {
    shared_producer owner{[&] { ++released; }};
    owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
  }
  std::optional<device::sim_graph> graph{sim().end_capture(consumer)};
  ASSERT_EQ(graph->size(), 1U) << "the release went into the graph";
  sim().launch_graph(*graph, consumer);
  b().synchronize_stream(consumer);
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));  // waits for no release bound to a graph
  EXPECT_EQ(released.load(), 0) << "released while the graph that writes the data can still be launched";
  {
    const auto held = hold(consumer);
    sim().launch_graph(*graph, consumer);
    graph.reset();  // the program lets go of the graph while a launch is still to run
    sim().synchronize_unheld();
    EXPECT_EQ(released.load(), 0) << "released while a launch of the graph still runs";
  }
  b().synchronize_stream(consumer);  // the launch is done: the graph is gone, drain() waits for its release
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1);
}

TEST_P(ContextTest, AReleaseOnAConsumerStreamOfAnotherDeviceWaitsForItByAnEventOfThatDevice)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  const auto consumer = stream_on(1);
  float* data = allocate_on(0);
  std::atomic<int> released{0};
  const auto before = stats();
  {
    const auto consumer_works = hold(consumer);
    fill(consumer, data, 3.0F);  // a peer reads or writes the data on device 1
    {
      shared_producer owner{[&] { ++released; }};
      owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
    }
    EXPECT_EQ(released.load(), 0);
  }
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1);
  EXPECT_EQ(stats().deferred_releases, before.deferred_releases + 1)
    << "the release fell back to synchronizing the stream";
}

TEST_P(ContextTest, AReleaseOnTheLegacyStreamWaitsForABlockingStreamsCaptureToEnd)
{
  // As CuPy captures, on a blocking stream: an event recorded on the legacy stream would join the
  // capture and invalidate it.
  HANDOFF_REQUIRE_SIM("the device interface cannot begin or end a capture");
  const auto capturing = stream_on(0, /*non_blocking=*/false);
  std::atomic<int> released{0};
  sim().begin_capture(capturing);
  {
    shared_producer owner{[&] { ++released; }};
    owner.release_after({.ctx = &ctx(), .device = 0, .stream = b().legacy_default_stream(), .stream_owner = nullptr});
  }
  std::this_thread::sleep_for(std::chrono::milliseconds{50});
  EXPECT_EQ(released.load(), 0) << "released during the capture that the legacy stream is part of";
  ASSERT_EQ(b().stream_capture_status(capturing), device::capture_status::active);
  ASSERT_EQ(sim().end_capture(capturing).size(), 0U) << "the release went into the graph";
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1);
}

TEST_P(ContextTest, ReleasesPolledWhileAnotherThreadCapturesInGlobalModeLeaveTheCaptureIntact)
{
  // torch.cuda.graph captures in global mode: the service thread's queries of pending releases
  // must neither fail nor invalidate the capture (CUDA forbids them to a thread in global mode).
  HANDOFF_REQUIRE_SIM("the device interface cannot begin or end a capture");
  const auto consumer = stream_on(0);
  const auto capturing = stream_on(0, /*non_blocking=*/true);
  std::atomic<int> released{0};
  {
    const auto consumer_works = hold(consumer);  // the release is still pending when the capture begins
    {
      shared_producer owner{[&] { ++released; }};
      owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
    }
    sim().begin_capture(capturing);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{10};
  while (released.load() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  EXPECT_EQ(released.load(), 1) << "the release was never run: its stream could not be queried";
  EXPECT_EQ(b().stream_capture_status(capturing), device::capture_status::active);
  EXPECT_NO_THROW((void)sim().end_capture(capturing));
}

TEST_P(ContextTest, ExitWaitsOnlyForTheStreamsWithPendingReleases)
{
  HANDOFF_REQUIRE_SIM("fault injection");
  const int device = b().device_count() - 1;  // with two, a device other than the current one
  const auto consumer = stream_on(device);
  std::atomic<bool> released{false};
  {
    context exiting{b(), std::make_unique<detail::service_thread>()};
    const auto consumer_works = hold(consumer);  // ends first: the release is pending as the exit begins
    shared_producer owner{[&] { released = true; }};
    owner.release_after({.ctx = &exiting, .device = device, .stream = consumer, .stream_owner = nullptr});
    // Synchronizing a whole device would make a context on every device of a real GPU.
    sim().inject_fault("synchronize_device", 1, "cudaErrorLaunchFailure");
  }
  EXPECT_TRUE(released.load());
  EXPECT_THROW(b().synchronize_device(), device_error) << "exit synchronized a whole device";
  sim().clear_faults();
}

TEST_P(ContextTest, ExitAbandonsAtOnceTheReleasesOfADeviceWithAStickyError)
{
  HANDOFF_REQUIRE_SIM("a sticky error cannot be cleared on a real device");
  const auto consumer = stream_on(0);
  std::atomic<bool> released{false};
  const auto start = std::chrono::steady_clock::now();
  {
    context exiting{b(), std::make_unique<detail::service_thread>()};
    const auto consumer_works = hold(consumer);
    shared_producer owner{[&] { released = true; }};
    owner.release_after({.ctx = &exiting, .device = 0, .stream = consumer, .stream_owner = nullptr});
    // The release's event is queued behind the hold, and the device halts before it ends.
    sim().inject_sticky_fault(0, "cudaErrorIllegalAddress");
  }
  const auto took = std::chrono::steady_clock::now() - start;
  EXPECT_FALSE(released.load()) << "released although the consumer stream never got there";
  // Bounded by the device error, not by the exit limit (a hang before; 10 s after a bound alone).
  EXPECT_LT(took, context::exit_drain_limit / 2);
  sim().clear_sticky_fault(0);
}

// Daemon threads still exchanging at exit: the wait is for what was pending when it began, not
// for the releases that keep arriving (it took the whole limit, then blamed a capture).
TEST_P(ContextTest, ExitWaitsForWhatWasPendingWhenItBeganNotForReleasesThatKeepArriving)
{
  const auto slow_consumer = stream_on(0);
  const auto busy = stream_on(0);
  std::atomic<int> released{0};
  std::atomic<bool> stop{false};
  context exiting{b(), std::make_unique<detail::service_thread>()};
  delay(slow_consumer, slow);
  {
    shared_producer owner{[&] { ++released; }};
    owner.release_after({.ctx = &exiting, .device = 0, .stream = slow_consumer, .stream_owner = nullptr});
  }
  std::thread exchanging([&] {  // two releases pending at any time, each behind 1 ms of work
    std::atomic<int> outstanding{0};
    while (!stop.load()) {
      if (outstanding.load() >= 2) {
        std::this_thread::sleep_for(std::chrono::microseconds{100});
        continue;
      }
      delay(busy, std::chrono::milliseconds{1});
      ++outstanding;
      shared_producer owner{[&] { --outstanding; }};
      owner.release_after({.ctx = &exiting, .device = 0, .stream = busy, .stream_owner = nullptr});
    }
    exiting.drain();  // `outstanding` goes with this thread
  });
  const auto start = std::chrono::steady_clock::now();
  const bool drained = exiting.drain_at_exit(context::exit_drain_limit);
  const auto took = std::chrono::steady_clock::now() - start;
  stop = true;
  exchanging.join();
  EXPECT_TRUE(drained) << "a release pending when the wait began was left";
  EXPECT_EQ(released.load(), 1);
  EXPECT_LT(took, context::exit_drain_limit / 2) << "the exit waited for releases asked for meanwhile";
  b().synchronize_stream(busy);
}

// A release asked for after the exit's wait (a thread still exchanging) while as many were left
// as the wait left: it was taken for one of those and abandoned without a word.
TEST_P(ContextTest, AReleaseAskedForAfterTheExitsWaitIsWaitedForWhenTheContextGoes)
{
  const auto first = stream_on(0);
  const auto second = stream_on(0);
  std::atomic<int> released{0};
  {
    context exiting{b(), std::make_unique<detail::service_thread>()};
    delay(first, slow / 4);
    {
      shared_producer owner{[&] { ++released; }};
      owner.release_after({.ctx = &exiting, .device = 0, .stream = first, .stream_owner = nullptr});
    }
    EXPECT_FALSE(exiting.drain_at_exit(std::chrono::milliseconds{1})) << "the stream's work was done already";
    ASSERT_TRUE(exiting.drain_for(std::chrono::seconds{10}));
    delay(second, slow / 4);
    shared_producer owner{[&] { ++released; }};
    owner.release_after({.ctx = &exiting, .device = 0, .stream = second, .stream_owner = nullptr});
  }
  EXPECT_EQ(released.load(), 2) << "the release asked for after the exit's wait was left unrun";
}

TEST_P(ContextTest, AReleaseRunsWithItsStreamsDeviceCurrent)
{
  // A peer's finalizer that a release runs must find the device it frees on current, not bind
  // device 0 on the service thread.
  HANDOFF_REQUIRE_TWO_DEVICES();
  const auto consumer = stream_on(1);
  std::atomic<int> current_at_release{-1};
  delay(consumer, slow / 4);
  {
    shared_producer owner{[&] { current_at_release = b().device_is_current(1) ? 1 : 0; }};
    owner.release_after({.ctx = &ctx(), .device = 1, .stream = consumer, .stream_owner = nullptr});
  }
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(current_at_release.load(), 1) << "the release ran with another device current, or none";
}

// The thread that forks is the child's one thread: its end (at the child's exit) must not order the
// parent's legacy stream, on a device the child may not use, through a context whose threads (and a
// mutex one of them may have held) the child has not.
TEST_P(ContextTest, AForkedChildsExitOrdersNothingOnItsParentsDevice)
{
  HANDOFF_REQUIRE_SIM("the child tells the simulator's faults apart");
  (void)ctx().thread_independent(0, b().per_thread_default_stream());  // this thread's end orders device 0
  static device::sim_backend* parents = nullptr;
  parents = &sim();
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    parents->inject_fault("current_device", 1, "cudaErrorLaunchFailure");  // what the thread's end asks first
    std::atexit([] {                                                       // after the thread's end, which runs first
      bool untouched = false;
      try {
        (void)parents->current_device();
      } catch (const device_error&) {
        untouched = true;  // the fault was still there
      }
      std::_Exit(untouched ? 0 : 1);
    });
    std::exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "the child's exit used its parent's device";
}

TEST_P(ContextTest, ReleasesShareAndReuseTheirEvents)
{
  const auto consumer = stream_on(0);
  std::atomic<int> released{0};
  const auto release = [&] {
    shared_producer owner{[&] { ++released; }};
    owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
  };
  const auto before = stats();
  {
    const auto consumer_works = hold(consumer);  // all 300 pending at once, whatever the machine's load
    for (int i = 0; i < 300; ++i) { release(); }
  }
  ctx().drain();
  const auto burst = stats().events_created - before.events_created;
  EXPECT_GE(burst, 1U);
  EXPECT_LT(burst, 150U) << "a burst of releases on one stream took an event each";
  for (int i = 0; i < 100; ++i) {  // one at a time: the pool's events serve them all
    release();
    ctx().drain();
  }
  EXPECT_EQ(released.load(), 400);
  EXPECT_EQ(stats().events_created - before.events_created, burst) << "a release made a new event";
}

TEST_P(ContextTest, AReleaseNeverStallsItsStream)
{
  // A host function per release would hold the stream until a host thread ran it; an event does not.
  const auto consumer = stream_on(0);
  float* data = allocate_on(0);  // before the device is kept busy: it synchronizes the device
  std::atomic<bool> released{false};
  // Occupies the device's one host-function thread: a release's host function would wait behind it.
  const auto other = stream_on(0);
  std::atomic<bool> unblock{false};
  b().launch_host_func(
    other,
    [](void* flag) {
      while (!static_cast<std::atomic<bool>*>(flag)->load()) {
        std::this_thread::sleep_for(std::chrono::milliseconds{1});
      }
    },
    &unblock);
  {
    shared_producer owner{[&] { released = true; }};
    owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
  }
  fill(consumer, data, 3.0F);
  EXPECT_EQ(read(data, consumer).front(), 3.0F) << "the consumer stream waited for the release";
  unblock = true;
  ctx().drain();
  EXPECT_TRUE(released.load());
  b().synchronize_stream(other);
}

TEST_P(ContextTest, AnEnqueueFailureFallsBackToWaitingForTheStream)
{
  HANDOFF_REQUIRE_SIM("fault injection");
  float* data = allocate_on(0);
  const auto consumer = stream_on(0);
  const auto reader = stream_on(0);
  std::atomic<float> seen_at_release{-1.0F};
  {
    const auto consumer_works = hold(consumer);
    fill(consumer, data, 7.0F);
    sim().inject_fault("record_event", 1, "cudaErrorLaunchFailure");
    {
      shared_producer owner{[&] { seen_at_release = read(data, reader).front(); }};
      owner.release_after({.ctx = &ctx(), .device = 0, .stream = consumer, .stream_owner = nullptr});
    }
    EXPECT_EQ(seen_at_release.load(), -1.0F) << "released before the consumer stream was done";
  }
  ctx().drain();
  EXPECT_EQ(seen_at_release.load(), 7.0F);  // never early, even when the event path fails
}

INSTANTIATE_TEST_SUITE_P(Backends, ContextTest, handoff::testing::sim_and_cuda(),
                         handoff::testing::backend_choice_name);

}  // namespace
