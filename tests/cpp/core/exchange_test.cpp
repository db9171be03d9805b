// The exchange rules on every backend: export ordering, import binding, device copies,
// and many threads exchanging at once (run under ThreadSanitizer by the test command).
#include <handoff/device_guard.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/stats.hpp>

#include "core/backend_fixture.hpp"

#include <atomic>
#include <functional>
#include <latch>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

namespace {

using namespace handoff;
using handoff::testing::BackendContextTest;

class ExchangeTest : public BackendContextTest {
 protected:
  // A view of `data` (n floats on `device`) whose producer frees nothing: the fixture owns it.
  array view_of(float* data, int device)
  {
    array_layout layout;
    layout.data = data;
    layout.device = {kDLCUDA, device};
    layout.dtype = {kDLFloat, 32, 1};
    layout.shape = std::vector<std::int64_t>{static_cast<std::int64_t>(n)};
    layout.strides = std::vector<std::int64_t>{1};
    return array{std::move(layout), producer_ref{[] {}}};
  }

  static stream_request on(device::stream_handle s) { return {stream_order::handle, static_cast<std::uintptr_t>(s)}; }

  // A CUDA Array Interface import from `producer` onto `consumer`, whose work reads the data (zeros)
  // behind a delay; the view is then released (by `release`, given the view's only reference) and
  // the producer writes 7 on `write_on`. Returns what the consumer read: 0 when ordered.
  float read_after_release(stream_request producer, device::stream_handle consumer, device::stream_handle write_on,
                           std::shared_ptr<const void> producer_owner = {},
                           const std::function<void(std::optional<array>&)>& release = {})
  {
    float* data = allocate_on(0);
    float* seen = allocate_on(0);
    std::optional<array> view{view_of(data, 0)};
    bind_interface_import(ctx(), *view, 0, consumer, nullptr, producer, std::move(producer_owner));
    delay(consumer, slow);
    b().copy_async(seen, data, n * sizeof(float), consumer);
    if (release) {
      release(view);
    } else {
      view.reset();  // all of the consumer's work on the data is enqueued
    }
    fill(write_on, data, 7.0F);
    return read(seen, consumer).front();
  }
};

TEST_P(ExchangeTest, ExportOrdersTheStreamTheDataIsReadyOn)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  const array view = view_of(data, 0);
  fill(producer, data, 1.0F, slow);
  view.owner().set_ready_on({.ctx = &ctx(), .device = 0, .stream = producer, .stream_owner = nullptr});
  order_export(&ctx(), view, on(consumer));
  EXPECT_EQ(read(data, consumer).front(), 1.0F);
}

TEST_P(ExchangeTest, NegativeControlNoOrderingRequestedSeesStaleData)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  const array view = view_of(data, 0);
  fill(producer, data, 1.0F, slow);
  view.owner().set_ready_on({.ctx = &ctx(), .device = 0, .stream = producer, .stream_owner = nullptr});
  order_export(&ctx(), view, {stream_order::none, 0});
  EXPECT_EQ(read(data, consumer).front(), 0.0F);
  b().synchronize_device();
}

// The consumer lets go of the export (its deleter: PyTorch and CuPy call it at their refcount zero)
// while its stream still reads the data: the producer must wait for that stream.
TEST_P(ExchangeTest, AnExportKeepsItsProducerUntilTheDefaultConsumerStreamIsDone)
{
  const auto legacy = b().legacy_default_stream();
  std::atomic<int> released{0};
  {
    array_layout layout = view_of(allocate_on(0), 0).layout();
    const array view{std::move(layout), producer_ref{[&] { ++released; }}};
    order_export(&ctx(), view, {stream_order::legacy_default, 0});
    delay(legacy, slow);  // the consumer's work on the legacy stream
  }
  EXPECT_EQ(released.load(), 0) << "released while the consumer's stream still reads the data";
  ASSERT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
  EXPECT_EQ(released.load(), 1);
}

TEST_P(ExchangeTest, AnExportLeavesABareConsumerHandleUntouchedUnlessItsOwnerIsHeldOrThePolicySaysSo)
{
  const auto consumer = stream_on(0);
  const auto exported = [&](std::shared_ptr<const void> owner) {
    std::atomic<int> released{0};
    {
      array_layout layout = view_of(allocate_on(0), 0).layout();
      const array view{std::move(layout), producer_ref{[&] { ++released; }}};
      order_export(&ctx(), view, on(consumer), std::move(owner));
      delay(consumer, slow);
    }
    const int at_once = released.load();
    EXPECT_TRUE(ctx().drain_for(std::chrono::seconds{10}));
    return at_once;
  };
  EXPECT_EQ(exported(nullptr), 1) << "a bare handle may be destroyed by the release: it is not touched";
  EXPECT_EQ(exported(std::make_shared<int>(0)), 0) << "a held stream must be waited for";
  set_export_release(export_release::every_stream);
  EXPECT_EQ(exported(nullptr), 0) << "the application vouched for its streams";
  set_export_release(export_release::known_streams);
}

TEST_P(ExchangeTest, TheStreamPublishedForSynchronizingConsumersCoversTheBlockingStreamsWork)
{
  HANDOFF_REQUIRE_SIM("only the simulator shows a legacy synchronization that misses the blocking streams");
  float* data = allocate_on(0);
  const auto blocking = stream_on(0, /*non_blocking=*/false);
  const array view = view_of(data, 0);
  fill(blocking, data, 3.0F, slow);
  // Bound to a per-thread default stream: recorded as the legacy stream, which any thread can name.
  view.owner().set_ready_on({.ctx = &ctx(), .device = 0, .stream = b().legacy_default_stream(), .stream_owner = {}});
  const auto published = published_ready_stream(view);
  ASSERT_EQ(published, b().legacy_default_stream());
  b().synchronize_stream(*published);  // what a CUDA Array Interface consumer with sync=True does
  EXPECT_EQ(read(data, stream_on(0)).front(), 3.0F);
}

TEST_P(ExchangeTest, NegativeControlSynchronizingTheLegacyStreamAloneMissesTheBlockingStreamsWork)
{
  HANDOFF_REQUIRE_SIM("only the simulator shows a legacy synchronization that misses the blocking streams");
  float* data = allocate_on(0);
  const auto blocking = stream_on(0, /*non_blocking=*/false);
  fill(blocking, data, 3.0F, slow);
  b().synchronize_stream(b().legacy_default_stream());
  EXPECT_EQ(read(data, stream_on(0)).front(), 0.0F);
  b().synchronize_device();
}

TEST_P(ExchangeTest, WithoutAKnownProducerStreamTheDefaultStreamIsOrdered)
{
  float* data = allocate_on(0);
  const auto consumer = stream_on(0);
  const array view = view_of(data, 0);
  fill(b().legacy_default_stream(), data, 4.0F, slow);
  order_export(&ctx(), view, on(consumer));
  EXPECT_EQ(read(data, consumer).front(), 4.0F);
}

TEST_P(ExchangeTest, AViewClaimingAnotherDeviceIsRefused)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  float* data = allocate_on(1);
  const array lying = view_of(data, 0);  // the memory belongs to device 1
  EXPECT_THROW((void)owning_device(ctx(), lying), value_error);
  EXPECT_THROW(order_export(&ctx(), lying, on(stream_on(0))), value_error);
}

TEST_P(ExchangeTest, AnEmptyViewOnADeviceTheBackendDoesNotHaveIsRefused)
{
  // Nothing to look up: the claimed device is taken, and its streams would take the release.
  for (const int device : {-1, b().device_count(), 7}) {
    array_layout layout;
    layout.device = {kDLCUDA, device};
    layout.dtype = {kDLFloat, 32, 1};
    layout.shape = std::vector<std::int64_t>{0};
    layout.strides = std::vector<std::int64_t>{1};
    const array empty{std::move(layout), producer_ref{[] {}}};
    EXPECT_THROW((void)owning_device(ctx(), empty), value_error) << device;
  }
}

TEST_P(ExchangeTest, OrderingWithoutABackendIsADeviceError)
{
  const array view = view_of(allocate_on(0), 0);
  EXPECT_THROW(order_export(nullptr, view, {stream_order::legacy_default, 0}), device_error);
  EXPECT_NO_THROW(order_export(nullptr, view, {stream_order::none, 0}));
}

TEST_P(ExchangeTest, ResolvesDlpackRequestsToStreams)
{
  EXPECT_EQ(resolve_stream(b(), {stream_order::none, 0}), std::nullopt);
  EXPECT_EQ(resolve_stream(b(), {stream_order::legacy_default, 0}), b().legacy_default_stream());
  EXPECT_EQ(resolve_stream(b(), {stream_order::per_thread_default, 0}), b().per_thread_default_stream());
  EXPECT_EQ(resolve_stream(b(), {stream_order::handle, 77}), static_cast<device::stream_handle>(77));
}

TEST_P(ExchangeTest, BindImportMakesTheConsumerTheReadyStreamAndDefersRelease)
{
  float* data = allocate_on(0);
  const auto consumer = stream_on(0);
  std::atomic<bool> released{false};
  {
    array_layout layout = view_of(data, 0).layout();
    const array view{std::move(layout), producer_ref{[&] { released = true; }}};
    bind_import(ctx(), view, 0, consumer);
    ASSERT_TRUE(view.owner().ready_on().has_value());
    EXPECT_EQ(view.owner().ready_on()->stream, consumer);
    delay(consumer, slow);
  }
  EXPECT_FALSE(released.load());
  ctx().drain();
  EXPECT_TRUE(released.load());
}

TEST_P(ExchangeTest, InterfaceImportMakesTheLegacyDefaultProducerWaitForTheConsumerAtRelease)
{
  const auto before = stats().waits_inserted;
  EXPECT_EQ(read_after_release({stream_order::legacy_default, 0}, stream_on(0), b().legacy_default_stream()), 0.0F);
  EXPECT_EQ(stats().waits_inserted - before, 2U);  // at import, and at release
}

TEST_P(ExchangeTest, InterfaceImportLeavesTheLegacyDefaultProducerOfABlockingConsumerToTheDevice)
{
  const auto before = stats();
  const auto consumer = stream_on(0, /*non_blocking=*/false);
  EXPECT_EQ(read_after_release({stream_order::legacy_default, 0}, consumer, b().legacy_default_stream()), 0.0F);
  EXPECT_EQ(stats().waits_inserted - before.waits_inserted, 1U);  // at import only
  EXPECT_EQ(stats().waits_elided - before.waits_elided, 1U);
}

TEST_P(ExchangeTest, InterfaceImportMakesThePerThreadProducerWaitWhereverTheViewIsReleased)
{
  const auto elsewhere = [](std::optional<array>& view) { std::thread{[&] { view.reset(); }}.join(); };
  EXPECT_EQ(read_after_release({stream_order::per_thread_default, 0}, stream_on(0), b().per_thread_default_stream(),
                               nullptr, elsewhere),
            0.0F);
}

TEST_P(ExchangeTest, InterfaceImportMakesAProducerStreamKeptAliveWaitForTheConsumerAtRelease)
{
  const auto producer = stream_on(0);
  EXPECT_EQ(read_after_release(on(producer), stream_on(0), producer, std::make_shared<int>(0)), 0.0F);
}

TEST_P(ExchangeTest, NegativeControlInterfaceImportLeavesAProducerStreamNothingKeepsAliveAlone)
{
  const auto producer = stream_on(0);
  EXPECT_EQ(read_after_release(on(producer), stream_on(0), producer), 7.0F);
  b().synchronize_device();
}

// CUDA creates a device's primary context when a thread uses the device (or selects it with
// cudaSetDevice); a library that switches devices must leave no context behind on the device a
// thread merely had as its default.
TEST_P(ExchangeTest, DeviceGuardRestoresWithoutSelectingTheDefaultDevice)
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
TEST_P(ExchangeTest, DeviceGuardOnAThreadWithNothingCurrentLeavesNothingCurrent)
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

TEST_P(ExchangeTest, OrderingDataOnAnotherDeviceCreatesNoContextOnTheCurrentOne)
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
    fill(producer, data, 2.0F, slow);
    const array view = view_of(data, 1);
    view.owner().set_ready_on({.ctx = &ctx(), .device = 1, .stream = producer, .stream_owner = nullptr});
    order_export(&ctx(), view, on(consumer));
    bind_import(ctx(), view, owning_device(ctx(), view), consumer);
    EXPECT_EQ(read(data, consumer).front(), 2.0F);
  });
  importer.join();
  ctx().drain();
  EXPECT_EQ(sim().devices_with_context(), std::vector<int>{1});
}

TEST_P(ExchangeTest, DeviceCopiesFollowThePendingWrite)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const array view = view_of(data, 0);
  fill(producer, data, 8.0F, slow);
  view.owner().set_ready_on({.ctx = &ctx(), .device = 0, .stream = producer, .stream_owner = nullptr});

  const array host = copy_device_array(ctx(), view, /*to_host=*/true);
  EXPECT_EQ(host.device().device_type, kDLCPU);
  EXPECT_EQ(static_cast<const float*>(host.data())[n - 1], 8.0F);

  const array copy = copy_device_array(ctx(), view, /*to_host=*/false);
  EXPECT_NE(copy.data(), view.data());
  EXPECT_EQ(copy.owner().ready_on()->stream, producer);
  EXPECT_EQ(read(static_cast<const float*>(copy.data()), producer).front(), 8.0F);
}

TEST_P(ExchangeTest, ManyThreadsExchangeAtOnce)
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
        const array view = view_of(data, device);
        fill(producer, data, static_cast<float>(round));
        view.owner().set_ready_on({.ctx = &ctx(), .device = device, .stream = producer, .stream_owner = nullptr});
        order_export(&ctx(), view, on(consumer));  // from the data's device, whatever is current
        bind_import(ctx(), view, device, consumer);
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

INSTANTIATE_TEST_SUITE_P(Backends, ExchangeTest, handoff::testing::sim_and_cuda(),
                         handoff::testing::backend_choice_name);

}  // namespace

// --- The exchange's pure decisions: no backend involved --------------------------------------

namespace {

handoff::array host_described(DLDevice device)
{
  static float data[4]{};
  handoff::array_layout layout;
  layout.data = data;
  layout.device = device;
  layout.dtype = {kDLFloat, 32, 1};
  layout.shape = std::vector<std::int64_t>{4};
  layout.strides = std::vector<std::int64_t>{1};
  return handoff::array{std::move(layout), handoff::producer_ref{[] {}}};
}

}  // namespace

TEST(ExportVersionTest, StampsTheConsumersMinorWhenOlderAndTheLegacyCapsuleBelowMajorOne)
{
  using handoff::export_version;
  EXPECT_EQ(export_version(std::nullopt), std::nullopt);
  EXPECT_EQ(export_version(DLPackVersion{0, 9}), std::nullopt);
  const auto older = export_version(DLPackVersion{1, 0});
  ASSERT_TRUE(older.has_value());
  EXPECT_EQ(older->major, 1U);
  EXPECT_EQ(older->minor, 0U);
  const auto newer = export_version(DLPackVersion{1, 99});
  ASSERT_TRUE(newer.has_value());
  EXPECT_EQ(newer->minor, static_cast<std::uint32_t>(DLPACK_MINOR_VERSION));
  const auto next_major = export_version(DLPackVersion{2, 0});
  ASSERT_TRUE(next_major.has_value());
  EXPECT_EQ(next_major->major, static_cast<std::uint32_t>(DLPACK_MAJOR_VERSION));
  EXPECT_EQ(next_major->minor, static_cast<std::uint32_t>(DLPACK_MINOR_VERSION));
}

TEST(PlanTransferTest, ExportsFollowTheArrayApisCopyRules)
{
  using handoff::plan_export;
  using handoff::transfer;
  const auto device = host_described({kDLCUDA, 0});
  const auto managed = host_described({kDLCUDAManaged, 0});
  constexpr DLDevice cpu{kDLCPU, 0};
  EXPECT_EQ(plan_export(device, std::nullopt, std::nullopt), transfer::none);
  EXPECT_EQ(plan_export(device, DLDevice{kDLCUDA, 0}, std::nullopt), transfer::none);
  EXPECT_EQ(plan_export(device, std::nullopt, true), transfer::same_device);
  EXPECT_EQ(plan_export(device, cpu, std::nullopt), transfer::to_host);
  EXPECT_EQ(plan_export(managed, cpu, std::nullopt), transfer::host_view);
  EXPECT_EQ(plan_export(managed, cpu, true), transfer::to_host);
  EXPECT_THROW((void)plan_export(device, cpu, false), handoff::buffer_error);
  EXPECT_THROW((void)plan_export(device, DLDevice{kDLCUDA, 1}, std::nullopt), handoff::buffer_error);
}

TEST(PlanTransferTest, ImportsCopyOnlyWhatTheProducerDidNot)
{
  using handoff::plan_import;
  using handoff::transfer;
  const auto device = host_described({kDLCUDA, 0});
  constexpr DLDevice cpu{kDLCPU, 0};
  EXPECT_EQ(plan_import(device, std::nullopt, std::nullopt, false), transfer::none);
  EXPECT_EQ(plan_import(device, std::nullopt, true, false), transfer::same_device);
  EXPECT_EQ(plan_import(device, std::nullopt, true, true), transfer::none);
  EXPECT_EQ(plan_import(device, cpu, std::nullopt, false), transfer::to_host);
  EXPECT_THROW((void)plan_import(device, cpu, false, false), handoff::buffer_error);
  EXPECT_THROW((void)plan_import(device, DLDevice{kDLCUDA, 1}, std::nullopt, false), handoff::buffer_error);
  // Host-accessible memory a producer could not move is reused, as an export reuses it.
  const auto pinned = host_described({kDLCUDAHost, 0});
  EXPECT_EQ(plan_import(pinned, cpu, std::nullopt, false), transfer::host_view);
  EXPECT_EQ(plan_import(pinned, cpu, false, false), transfer::host_view);
  EXPECT_EQ(plan_import(pinned, cpu, true, false), transfer::to_host);
}

TEST(DlpackDeviceOfTest, EachMemoryKindHasOneDeviceTypePerBackendFamily)
{
  using handoff::dlpack_device_of;
  using handoff::device::memory_kind;
  const auto at = [](memory_kind kind, int device) {
    handoff::device::pointer_attributes where;
    where.kind = kind;
    where.device = device;
    return where;
  };
  const auto same = [](std::optional<DLDevice> a, DLDevice b) {
    return a && a->device_type == b.device_type && a->device_id == b.device_id;
  };
  EXPECT_TRUE(same(dlpack_device_of(at(memory_kind::device, 1), kDLCUDA), {kDLCUDA, 1}));
  EXPECT_TRUE(same(dlpack_device_of(at(memory_kind::device, 1), kDLROCM), {kDLROCM, 1}));
  EXPECT_TRUE(same(dlpack_device_of(at(memory_kind::managed, 1), kDLCUDA), {kDLCUDAManaged, 0}));
  EXPECT_TRUE(same(dlpack_device_of(at(memory_kind::pinned_host, 1), kDLCUDA), {kDLCUDAHost, 0}));
  EXPECT_TRUE(same(dlpack_device_of(at(memory_kind::pinned_host, 1), kDLROCM), {kDLROCMHost, 0}));
  EXPECT_FALSE(dlpack_device_of(at(memory_kind::unregistered, 0), kDLCUDA).has_value());
  EXPECT_THROW((void)dlpack_device_of(at(memory_kind::managed, 0), kDLROCM), handoff::buffer_error);
}

namespace {

TEST_P(ExchangeTest, BindingOnANamedStreamResolvesItByTheDevicesStreamTable)
{
  const auto stream = stream_on(0);
  const auto owner = std::make_shared<int>(0);
  const stream_binding on =
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

TEST_P(ExchangeTest, AnArrayAllocatedOnAThreadsDefaultStreamIsFreedAfterItsWorkFromAnyThread)
{
  HANDOFF_REQUIRE_SIM("whether memory is still allocated is observable only there");
  // The handle 2 names the calling thread's own stream: freed from another thread, the memory must
  // still wait for the work of the thread that allocated it.
  std::optional<array> allocated;
  std::latch filled{1};
  std::latch checked{1};
  std::thread allocating([&] {  // lives until the check: its default stream goes with it
    const std::array<std::int64_t, 1> shape{n};
    allocated.emplace(allocate_device_array(binding_on(ctx(), {b().device_type(), 0}, named_stream::dlpack(2)),
                                            {kDLFloat, 32, 1}, shape));
    fill(b().per_thread_default_stream(), static_cast<float*>(allocated->data()), 1.0F, slow);
    filled.count_down();
    checked.wait();
    b().synchronize_stream(b().per_thread_default_stream());
  });
  filled.wait();
  const void* data = allocated->data();
  std::thread([&] { allocated.reset(); }).join();
  EXPECT_EQ(b().attributes(data).kind, device::memory_kind::device) << "freed while its stream still wrote it";
  checked.count_down();
  allocating.join();
  ctx().drain();
}

}  // namespace
