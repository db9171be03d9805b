// The stream rules on every backend: export ordering, import binding, interface imports, device
// guards, and many threads exchanging at once (run under ThreadSanitizer by the test command).
#include <handoff/device_guard.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/internal/ordering.hpp>
#include <handoff/stats.hpp>

#include "support/backend_fixture.hpp"

#include <atomic>
#include <functional>
#include <latch>
#include <memory>
#include <optional>
#include <span>
#include <thread>
#include <vector>

namespace {

using namespace handoff;
using handoff::testing::BackendContextTest;

class OrderingTest : public BackendContextTest {
 protected:
  static stream_request on(device::stream_handle s) { return {stream_order::handle, static_cast<std::uintptr_t>(s)}; }

  // A CUDA Array Interface import from `producer` onto `consumer`, whose work reads the data (zeros)
  // while the consumer is held; the view is then released (by `release`, given the view's only
  // reference) and the producer writes 7 on `write_on`, which must wait for the consumer if the
  // release `orders` it, and is let land before the consumer reads otherwise. Returns what the
  // consumer read: 0 when ordered.
  float read_after_release(stream_request producer, device::stream_handle consumer, device::stream_handle write_on,
                           std::shared_ptr<const void> producer_owner = {},
                           const std::function<void(std::optional<array>&)>& release = {}, bool orders = true)
  {
    float* data = allocate_on(0);
    float* seen = allocate_on(0);
    std::optional<array> view{device_view(data, 0)};
    bind_interface_import(*view, bound(consumer), producer, std::move(producer_owner));
    {
      const auto consumer_works = hold(consumer);  // the consumer's read waits until the hold ends
      b().copy_async(seen, data, n * sizeof(float), consumer);
      if (release) {
        release(view);
      } else {
        view.reset();  // all of the consumer's work on the data is enqueued
      }
      fill(write_on, data, 7.0F);
      if (orders) {
        EXPECT_TRUE(held_back(write_on)) << "the producer's next write does not wait for the consumer";
      } else {
        b().synchronize_stream(write_on);  // unordered: the write lands before the consumer reads
      }
    }
    return read(seen, consumer).front();
  }
};

TEST_P(OrderingTest, ExportOrdersTheStreamTheDataIsReadyOn)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  auto held = hold(producer);
  const array view = pending_view(data, producer, 1.0F);
  order_export(&ctx(), view, on(consumer), export_release::known_streams);
  EXPECT_EQ(read_after(held, data, consumer).front(), 1.0F);
}

TEST_P(OrderingTest, NegativeControlNoOrderingRequestedSeesStaleData)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  {
    const auto held = hold(producer);
    const array view = pending_view(data, producer, 1.0F);
    order_export(&ctx(), view, {stream_order::none, 0}, export_release::known_streams);
    EXPECT_EQ(read(data, consumer).front(), 0.0F);
  }
  b().synchronize_device();
}

// The consumer lets go of the export (its deleter: PyTorch and CuPy call it at their refcount zero)
// while its stream still reads the data: the producer must wait for that stream.
TEST_P(OrderingTest, AnExportKeepsItsProducerUntilTheDefaultConsumerStreamIsDone)
{
  const auto legacy = b().legacy_default_stream();
  std::atomic<int> released{0};
  {
    const auto consumer_works = hold(legacy);  // the consumer's work on the legacy stream, until it ends
    {
      array_layout layout = device_view(allocate_on(0), 0).layout();
      const array view{std::move(layout), shared_producer{[&] { ++released; }}};
      order_export(&ctx(), view, {stream_order::legacy_default, 0}, export_release::known_streams);
    }
    EXPECT_EQ(released.load(), 0) << "released while the consumer's stream still reads the data";
  }
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1);
}

TEST_P(OrderingTest, AnExportLeavesABareConsumerHandleUntouchedUnlessItsOwnerIsHeldOrThePolicySaysSo)
{
  const auto consumer = stream_on(0);
  const auto exported = [&](std::shared_ptr<const void> owner, export_release policy) {
    std::atomic<int> released{0};
    int at_once = 0;
    {
      const auto consumer_works = hold(consumer);
      {
        array_layout layout = device_view(allocate_on(0), 0).layout();
        const array view{std::move(layout), shared_producer{[&] { ++released; }}};
        order_export(&ctx(), view, on(consumer), policy, std::move(owner));
      }
      at_once = released.load();
    }
    EXPECT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
    return at_once;
  };
  EXPECT_EQ(exported(nullptr, export_release::known_streams), 1)
    << "a bare handle may be destroyed by the release: it is not touched";
  EXPECT_EQ(exported(std::make_shared<int>(0), export_release::known_streams), 0) << "a held stream must be waited for";
  EXPECT_EQ(exported(nullptr, export_release::every_stream), 0) << "the application vouched for its streams";
}

TEST_P(OrderingTest, TheStreamPublishedForSynchronizingConsumersCoversTheBlockingStreamsWork)
{
  HANDOFF_REQUIRE_SIM("only the simulator shows a legacy synchronization that misses the blocking streams");
  float* data = allocate_on(0);
  const auto blocking = stream_on(0, /*non_blocking=*/false);
  const array view = device_view(data, 0);
  std::optional<device::stream_handle> published;
  {
    const auto held = hold(blocking);
    fill(blocking, data, 3.0F);
    // Bound to a per-thread default stream: recorded as the legacy stream, which any thread can name.
    mark_ready(view, b().legacy_default_stream());
    published = published_ready_stream(view);
    ASSERT_EQ(published, b().legacy_default_stream());
    // What a CUDA Array Interface consumer with sync=True does waits for the held write: for ever, here.
    try {
      b().synchronize_stream(*published);
      ADD_FAILURE() << "a synchronization of the published stream did not wait for the blocking stream's write";
    } catch (const device_error& e) {
      EXPECT_EQ(e.error_name(), device::sim_backend::hold_deadlock_error) << e.what();
    }
  }
  b().synchronize_stream(*published);
  EXPECT_EQ(read(data, stream_on(0)).front(), 3.0F);
}

TEST_P(OrderingTest, NegativeControlSynchronizingTheLegacyStreamAloneMissesTheBlockingStreamsWork)
{
  HANDOFF_REQUIRE_SIM("only the simulator shows a legacy synchronization that misses the blocking streams");
  float* data = allocate_on(0);
  const auto blocking = stream_on(0, /*non_blocking=*/false);
  {
    const auto held = hold(blocking);
    fill(blocking, data, 3.0F);
    b().synchronize_stream(b().legacy_default_stream());
    EXPECT_EQ(read(data, stream_on(0)).front(), 0.0F);
  }
  b().synchronize_device();
}

TEST_P(OrderingTest, WithoutAKnownProducerStreamTheDefaultStreamIsOrdered)
{
  float* data = allocate_on(0);
  const auto consumer = stream_on(0);
  const array view = device_view(data, 0);
  auto held = hold(b().legacy_default_stream());
  fill(b().legacy_default_stream(), data, 4.0F);
  order_export(&ctx(), view, on(consumer), export_release::known_streams);
  EXPECT_EQ(read_after(held, data, consumer).front(), 4.0F);
}

TEST_P(OrderingTest, AViewClaimingAnotherDeviceIsRefused)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  float* data = allocate_on(1);
  const array lying = device_view(data, 0);  // the memory belongs to device 1
  EXPECT_THROW((void)owning_device(ctx(), lying), value_error);
  EXPECT_THROW(order_export(&ctx(), lying, on(stream_on(0)), export_release::known_streams), value_error);
}

TEST_P(OrderingTest, AnEmptyViewOnADeviceTheBackendDoesNotHaveIsRefused)
{
  // Nothing to look up: the claimed device is taken, and its streams would take the release.
  for (const int device : {-1, b().device_count(), 7}) {
    array_layout layout;
    layout.device = {kDLCUDA, device};
    layout.dtype = {kDLFloat, 32, 1};
    layout.shape = std::vector<std::int64_t>{0};
    layout.strides = std::vector<std::int64_t>{1};
    const array empty{std::move(layout), shared_producer{[] {}}};
    EXPECT_THROW((void)owning_device(ctx(), empty), value_error) << device;
  }
}

TEST_P(OrderingTest, OrderingWithoutABackendIsADeviceError)
{
  const array view = device_view(allocate_on(0), 0);
  EXPECT_THROW(order_export(nullptr, view, {stream_order::legacy_default, 0}, export_release::known_streams),
               device_error);
  EXPECT_NO_THROW(order_export(nullptr, view, {stream_order::none, 0}, export_release::known_streams));
}

TEST_P(OrderingTest, ResolvesDlpackRequestsToStreams)
{
  EXPECT_EQ(resolve_stream(b(), {stream_order::none, 0}), std::nullopt);
  EXPECT_EQ(resolve_stream(b(), {stream_order::legacy_default, 0}), b().legacy_default_stream());
  EXPECT_EQ(resolve_stream(b(), {stream_order::per_thread_default, 0}), b().per_thread_default_stream());
  EXPECT_EQ(resolve_stream(b(), {stream_order::handle, 77}), static_cast<device::stream_handle>(77));
}

TEST_P(OrderingTest, BindImportMakesTheConsumerTheReadyStreamAndDefersRelease)
{
  float* data = allocate_on(0);
  const auto consumer = stream_on(0);
  std::atomic<bool> released{false};
  {
    const auto consumer_works = hold(consumer);
    {
      array_layout layout = device_view(data, 0).layout();
      const array view{std::move(layout), shared_producer{[&] { released = true; }}};
      bind_import(view, bound(consumer));
      ASSERT_TRUE(view.owner().ready_on().has_value());
      EXPECT_EQ(view.owner().ready_on()->stream, consumer);
    }
    EXPECT_FALSE(released.load());
  }
  ctx().drain();
  EXPECT_TRUE(released.load());
}

// torch.cuda.graph: a view imported while its stream captures is read by every launch of the graph,
// however soon after the capture it is dropped.
TEST_P(OrderingTest, AViewImportedDuringACaptureIsKeptUntilTheGraphIsGoneThoughDroppedAfterIt)
{
  HANDOFF_REQUIRE_SIM("the device interface cannot begin or end a capture");
  const auto consumer = stream_on(0, /*non_blocking=*/false);
  std::atomic<int> released{0};
  std::optional<array> view{device_view(allocate_on(0), 0, [&] { ++released; })};
  sim().begin_capture(consumer);
  bind_import(*view, bound(consumer));
  delay(consumer, slow / 4);  // a node of the graph: each launch reads the data this long
  std::optional<device::sim_graph> graph{sim().end_capture(consumer)};
  view.reset();  // after the capture: the release's event is recorded outside the graph
  sim().launch_graph(*graph, consumer);
  b().synchronize_stream(consumer);
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 0) << "released while the graph that reads the data can still be launched";
  graph.reset();
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1);
}

TEST_P(OrderingTest, InterfaceImportMakesTheLegacyDefaultProducerWaitForTheConsumerAtRelease)
{
  const auto before = stats().waits_inserted;
  EXPECT_EQ(read_after_release({stream_order::legacy_default, 0}, stream_on(0), b().legacy_default_stream()), 0.0F);
  EXPECT_EQ(stats().waits_inserted - before, 2U);  // at import, and at release
}

TEST_P(OrderingTest, InterfaceImportLeavesTheLegacyDefaultProducerOfABlockingConsumerToTheDevice)
{
  const auto before = stats();
  const auto consumer = stream_on(0, /*non_blocking=*/false);
  EXPECT_EQ(read_after_release({stream_order::legacy_default, 0}, consumer, b().legacy_default_stream()), 0.0F);
  EXPECT_EQ(stats().waits_inserted - before.waits_inserted, 1U);  // at import only
  EXPECT_EQ(stats().waits_elided - before.waits_elided, 1U);
}

TEST_P(OrderingTest, InterfaceImportMakesThePerThreadProducerWaitWhereverTheViewIsReleased)
{
  const auto elsewhere = [](std::optional<array>& view) { std::thread{[&] { view.reset(); }}.join(); };
  EXPECT_EQ(read_after_release({stream_order::per_thread_default, 0}, stream_on(0), b().per_thread_default_stream(),
                               nullptr, elsewhere),
            0.0F);
}

TEST_P(OrderingTest, InterfaceImportMakesAProducerStreamKeptAliveWaitForTheConsumerAtRelease)
{
  const auto producer = stream_on(0);
  EXPECT_EQ(read_after_release(on(producer), stream_on(0), producer, std::make_shared<int>(0)), 0.0F);
}

TEST_P(OrderingTest, NegativeControlInterfaceImportLeavesAProducerStreamNothingKeepsAliveAlone)
{
  const auto producer = stream_on(0);
  EXPECT_EQ(read_after_release(on(producer), stream_on(0), producer, nullptr, {}, /*orders=*/false), 7.0F);
  b().synchronize_device();
}

// CUDA creates a device's primary context when a thread uses the device (or selects it with
// cudaSetDevice); a library that switches devices must leave no context behind on the device a
// thread merely had as its default.
TEST_P(OrderingTest, DeviceGuardRestoresWithoutSelectingTheDefaultDevice)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  HANDOFF_REQUIRE_SIM("which devices have a context is observable only there");
  std::thread fresh([&] {  // nothing current: device 0 by default, with no context
    {
      const device_guard on_one{b(), 1};
      EXPECT_EQ(b().current_device(), 1);
      {
        const device_guard again{b(), 1};  // already current: no push
        EXPECT_EQ(b().current_device(), 1);
      }
      EXPECT_EQ(b().current_device(), 1);
    }
    EXPECT_EQ(b().current_device(), 0);
  });
  fresh.join();
  EXPECT_EQ(sim().devices_with_context(), std::vector<int>{1});
}

// With nothing current, the runtime's next call would make device 0's context current on the
// thread for good: a guard for device 0 pushes it, so that its pop leaves nothing current again.
TEST_P(OrderingTest, DeviceGuardOnAThreadWithNothingCurrentLeavesNothingCurrent)
{
  HANDOFF_REQUIRE_SIM("whether a thread has a context current is observable only there");
  std::thread fresh([&] {
    EXPECT_FALSE(b().device_is_current(0));
    {
      const device_guard on_zero{b(), 0};
      EXPECT_TRUE(b().device_is_current(0));
      const auto s = b().create_stream(true);  // a call that uses the device
      b().destroy_stream(s);
    }
    EXPECT_FALSE(b().device_is_current(0)) << "the guard left device 0's context current on the thread";
  });
  fresh.join();
  std::thread used([&] {  // a thread that used its default device has its context current
    const auto s = b().create_stream(true);
    b().destroy_stream(s);
    EXPECT_TRUE(b().device_is_current(0));
    {
      const device_guard on_zero{b(), 0};  // current already: no push
    }
    EXPECT_TRUE(b().device_is_current(0));
  });
  used.join();
}

TEST_P(OrderingTest, OrderingDataOnAnotherDeviceCreatesNoContextOnTheCurrentOne)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  HANDOFF_REQUIRE_SIM("which devices have a context is observable only there");
  ASSERT_TRUE(sim().devices_with_context().empty()) << "the fixture used a device";
  float* data = nullptr;
  device::stream_handle producer{};
  device::stream_handle consumer{};
  std::thread owner([&] {  // the producing library uses device 1 only
    b().set_current_device(1);
    data = allocate_on(1);
    producer = stream_on(1);
    consumer = stream_on(1);
  });
  owner.join();
  std::thread importer([&] {  // a thread that never chose a device
    auto held = hold(producer);
    fill(producer, data, 2.0F);
    const array view = device_view(data, 1);
    mark_ready(view, producer, 1);
    order_export(&ctx(), view, on(consumer), export_release::known_streams);
    bind_import(view, bound(consumer, owning_device(ctx(), view)));
    EXPECT_EQ(read_after(held, data, consumer).front(), 2.0F);
  });
  importer.join();
  ctx().drain();
  EXPECT_EQ(sim().devices_with_context(), std::vector<int>{1});
}

TEST_P(OrderingTest, ManyThreadsExchangeAtOnce)
{
  constexpr int threads = 8;
  constexpr int rounds = 50;
  std::vector<float*> buffers;
  buffers.reserve(threads);
  for (int t = 0; t < threads; ++t) { buffers.push_back(allocate_on(t % b().device_count())); }
  const auto before = stats();
  std::atomic<int> wrong{0};
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const int device = t % b().device_count();
      const auto producer = stream_on(device);
      const auto consumer = stream_on(device);
      for (int round = 0; round < rounds; ++round) {
        float* data = buffers[static_cast<std::size_t>(t)];
        const array view = device_view(data, device);
        fill(producer, data, static_cast<float>(round));
        mark_ready(view, producer, device);
        order_export(&ctx(), view, on(consumer),
                     export_release::known_streams);  // from the data's device, whatever is current
        bind_import(view, bound(consumer, device));
        if (read(data, consumer).back() != static_cast<float>(round)) { ++wrong; }
      }
      b().synchronize_stream(producer);
    });
  }
  for (auto& w : workers) { w.join(); }
  ctx().drain();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(stats().waits_inserted - before.waits_inserted, static_cast<std::uint64_t>(threads * rounds));
  // Pooled: at most one per release pending at once (however slow the machine makes the service
  // thread) plus one per wait in flight, never one per wait and release (800).
  EXPECT_LE(stats().events_created - before.events_created, static_cast<std::uint64_t>(threads * rounds + threads));
}

TEST_P(OrderingTest, BindingOnANamedStreamResolvesItByTheDevicesStreamTable)
{
  const auto stream = stream_on(0);
  const auto owner = std::make_shared<int>(0);
  const bound_stream on =
    binding_on(ctx(), {kDLCUDA, 0}, named_stream::native(static_cast<std::uint64_t>(stream), owner));
  EXPECT_EQ(on.ctx, &ctx());
  EXPECT_EQ(on.device, 0);
  EXPECT_EQ(on.stream, stream);
  EXPECT_EQ(on.stream_owner, owner);
  EXPECT_EQ(binding_on(ctx(), {kDLCUDA, 0}, {}).stream, b().legacy_default_stream());
  EXPECT_EQ(binding_on(ctx(), {kDLCUDA, 0}, named_stream::dlpack(2)).stream, b().per_thread_default_stream());
  EXPECT_THROW((void)binding_on(ctx(), {kDLCUDA, 0}, named_stream::dlpack(-1)), value_error);
  EXPECT_THROW((void)binding_on(ctx(), {kDLCUDA, 0}, named_stream::dlpack(0)), value_error);
}

INSTANTIATE_TEST_SUITE_P(Backends, OrderingTest, handoff::testing::sim_and_cuda(),
                         handoff::testing::backend_choice_name);

}  // namespace
