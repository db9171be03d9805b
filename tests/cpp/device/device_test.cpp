// The device interface, run against every backend: "sim" and "sim-rocm" with one simulated device and
// with two, and "cuda" (skipped where no CUDA device is usable). Tests that need the simulation extras
// skip on "cuda"; tests that need a second device skip where there is one.
#include "device/backend_factory.hpp"
#include "device/sim/sim_backend.hpp"
#include "support/expect_device_error.hpp"
#include "support/test_device.hpp"

#include <handoff/device_guard.hpp>
#include <handoff/error.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace handoff::device {
namespace {

using namespace std::chrono_literals;

constexpr std::size_t count = 1024;

bool all_equal(std::span<const float> values, float expected)
{
  return std::all_of(values.begin(), values.end(), [&](float v) { return v == expected; });
}

using handoff::testing::backend_choice;

class DeviceTest : public ::testing::TestWithParam<backend_choice> {
 protected:
  void SetUp() override
  {
    try {
      device_.emplace(GetParam());
    } catch (const device_error& e) {
      if (backend_name() == "cuda") {
        GTEST_SKIP() << "no usable CUDA backend (" << e.error_name() << "): " << e.what();
      }
      throw;
    }
  }

  void TearDown() override
  {
    if (!device_) { return; }
    device_->synchronize();
    for (auto* p : allocations_) { b().deallocate(p, b().legacy_default_stream()); }
    for (auto e : events_) { b().destroy_event(e); }
    device_.reset();
  }

  backend& b() { return device_->backend(); }
  const std::string& backend_name() { return GetParam().name; }
  sim_backend* sim() { return device_->sim(); }
  bool rocm() { return b().device_type() == kDLROCM; }
  std::string err(std::string_view cuda_name, std::string_view hip_name)
  {
    return std::string(rocm() ? hip_name : cuda_name);
  }

  stream_handle stream(bool non_blocking) { return device_->stream(b().current_device(), non_blocking); }

  event_handle event()
  {
    events_.push_back(b().create_event());
    return events_.back();
  }

  /// `n` floats of device memory on the current device, set to `value` before this returns.
  float* floats(std::size_t n, float value) { return device_->allocate(n, b().current_device(), value); }

  /// Enqueues on `s` a write of `value` to `n` floats at `dst`.
  void fill(stream_handle s, float* dst, std::size_t n, float value) { device_->delayed_fill(s, dst, n, value); }

  /// Holds `s`: its work enqueued from now on waits until the hold ends (test_device::hold).
  [[nodiscard]] handoff::testing::test_hold hold(stream_handle s) { return device_->hold(s); }
  /// True when `s`'s last work waits for a hold (test_device::held_back).
  bool held_back(stream_handle s) { return device_->held_back(s); }

  /// Enqueues a copy of `n` floats to the host on `s` and waits for it.
  std::vector<float> read(stream_handle s, const float* src, std::size_t n) { return device_->read(s, src, n); }
  /// Enqueues that copy without waiting: the values once `s` got past it (test_device::read_later).
  std::span<const float> read_later(stream_handle s, const float* src, std::size_t n)
  {
    return device_->read_later(s, src, n);
  }
  /// The gate of an ordering test: `consumer`'s read of `n` floats at `src`, checked to wait for the
  /// producer's hold `held`, once the hold has ended (test_device::gated_read).
  std::span<const float> read_after(handoff::testing::test_hold& held, stream_handle consumer, const float* src,
                                    std::size_t n)
  {
    const auto [waited, seen] = device_->gated_read(held, consumer, src, n);
    EXPECT_TRUE(waited) << "the consumer does not wait for the held producer";
    return seen;
  }

  std::optional<handoff::testing::test_device> device_;
  std::vector<event_handle> events_;
  std::vector<void*> allocations_;  // made by the tests themselves
};

#define REQUIRE_SIM()                                                        \
  do {                                                                       \
    if (sim() == nullptr) { GTEST_SKIP() << "needs the simulation extras"; } \
  } while (false)

// --- identity and stream numbering -------------------------------------------------------------

TEST_P(DeviceTest, DefaultStreamNumberingFollowsTheRuntime)
{
  EXPECT_GE(b().device_count(), 1);
  EXPECT_EQ(b().current_device(), 0);
  const auto created = stream(false);
  EXPECT_GT(raw(created), 2U);
  if (rocm()) {
    EXPECT_EQ(b().name(), "sim-rocm");
    EXPECT_EQ(raw(b().legacy_default_stream()), 0U);  // ROCm's null stream
    EXPECT_GT(raw(b().per_thread_default_stream()), 2U);
    EXPECT_EQ(b().stream_device(stream_handle{0}), 0);
    EXPECT_DEVICE_ERROR((void)b().stream_device(stream_handle{1}), "hipErrorInvalidHandle");
    EXPECT_DEVICE_ERROR((void)b().stream_device(stream_handle{2}), "hipErrorInvalidHandle");
    EXPECT_DEVICE_ERROR(b().synchronize_stream(stream_handle{1}), "hipErrorInvalidHandle");
  } else {
    EXPECT_EQ(b().device_type(), kDLCUDA);
    EXPECT_EQ(raw(b().legacy_default_stream()), 1U);      // cudaStreamLegacy
    EXPECT_EQ(raw(b().per_thread_default_stream()), 2U);  // cudaStreamPerThread
    EXPECT_EQ(b().stream_device(stream_handle{1}), 0);
    EXPECT_EQ(b().stream_device(stream_handle{2}), 0);
    EXPECT_NO_THROW(b().synchronize_stream(stream_handle{1}));
    EXPECT_NO_THROW(b().synchronize_stream(stream_handle{2}));
  }
  EXPECT_TRUE(b().stream_is_blocking(b().legacy_default_stream()));
  EXPECT_TRUE(b().stream_is_blocking(created));
  EXPECT_FALSE(b().stream_is_blocking(stream(true)));
  EXPECT_EQ(b().stream_capture_status(created), capture_status::none);
}

TEST_P(DeviceTest, SimNamesItsFlavour)
{
  REQUIRE_SIM();
  EXPECT_EQ(b().name(), backend_name());
  EXPECT_EQ(b().device_type(), rocm() ? kDLROCM : kDLCUDA);
  EXPECT_EQ(sim()->flavour(), rocm() ? sim_flavour::rocm : sim_flavour::cuda);
  EXPECT_DEVICE_ERROR((void)b().stream_device(stream_handle{0x1234}),
                      err("cudaErrorInvalidResourceHandle", "hipErrorInvalidHandle"));
  EXPECT_DEVICE_ERROR(b().set_current_device(b().device_count()),
                      err("cudaErrorInvalidDevice", "hipErrorInvalidDevice"));
  try {
    (void)b().stream_device(stream_handle{0x1234});
  } catch (const device_error& e) {
    EXPECT_EQ(e.backend(), backend_name());
    const std::string expected = rocm() ? "hipStreamGetDevice(0x1234) failed: hipErrorInvalidHandle: "
                                        : "cuStreamGetDevice(0x1234) failed: "
                                          "cudaErrorInvalidResourceHandle: ";
    EXPECT_EQ(std::string(e.what()).rfind(expected, 0), 0U) << e.what();
  }
}

// --- ordering across streams ---------------------------------------------------------------------

TEST_P(DeviceTest, EventWaitOrdersWorkAcrossStreams)
{
  const auto producer = stream(true);
  const auto consumer = stream(true);
  float* data = floats(count, 0.0f);
  auto held = hold(producer);
  fill(producer, data, count, 1.0f);
  const auto e = event();
  b().record_event(e, producer);
  b().stream_wait_event(consumer, e);
  EXPECT_TRUE(all_equal(read_after(held, consumer, data, count), 1.0f));
}

// Negative control: the same exchange without the wait reads the data before the fill, which
// shows the test above can fail.
TEST_P(DeviceTest, MissingWaitObservesStaleData)
{
  const auto producer = stream(true);
  const auto consumer = stream(true);
  float* data = floats(count, 0.0f);
  {
    const auto held = hold(producer);
    fill(producer, data, count, 1.0f);
    EXPECT_TRUE(all_equal(read(consumer, data, count), 0.0f));
    EXPECT_FALSE(held_back(consumer));
  }
  b().synchronize_stream(producer);
  EXPECT_TRUE(all_equal(read(consumer, data, count), 1.0f));
}

TEST_P(DeviceTest, ReRecordingReplacesTheCapturedWork)
{
  const auto producer = stream(true);
  const auto consumer = stream(true);
  const auto idle = stream(true);
  const auto e = event();
  EXPECT_TRUE(b().query_event(e));  // never recorded

  float* data = floats(count, 0.0f);
  auto held = hold(producer);
  fill(producer, data, count, 1.0f);
  b().record_event(e, producer);
  EXPECT_FALSE(b().query_event(e));
  b().stream_wait_event(consumer, e);  // captures the record on `producer`

  b().record_event(e, idle);  // now tracks `idle`, which has no work
  b().synchronize_event(e);
  EXPECT_TRUE(b().query_event(e));
  EXPECT_TRUE(all_equal(read(idle, data, count), 0.0f));  // the fill has not run yet

  // The earlier wait still orders `consumer` after the fill.
  EXPECT_TRUE(all_equal(read_after(held, consumer, data, count), 1.0f));
}

TEST_P(DeviceTest, SynchronizeEventBlocksUntilTheRecordedWorkIsDone)
{
  const auto s = stream(true);
  const auto e = event();
  float* data = floats(count, 0.0f);
  std::atomic<bool> synchronized{false};
  std::optional<std::thread> waiter;
  {
    const auto held = hold(s);
    fill(s, data, count, 3.0f);
    b().record_event(e, s);
    waiter.emplace([&] {
      b().synchronize_event(e);
      synchronized = true;
    });
    EXPECT_FALSE(synchronized.load()) << "the synchronization returned before the recorded work ran";
  }
  waiter->join();
  EXPECT_TRUE(synchronized.load());
  EXPECT_TRUE(b().query_event(e));
  // Read on a stream that waits for nothing: only the synchronization can have made the fill visible.
  EXPECT_TRUE(all_equal(read(stream(true), data, count), 3.0f));
}

TEST_P(DeviceTest, QueryStreamSaysWhetherItsWorkIsDone)
{
  const auto s = stream(true);
  const auto blocking = stream(false);
  float* data = floats(count, 0.0f);
  EXPECT_TRUE(b().query_stream(s)) << "a new stream is idle";
  {
    const auto held = hold(s);
    fill(s, data, count, 3.0f);
    EXPECT_FALSE(b().query_stream(s));
    EXPECT_TRUE(b().query_stream(blocking)) << "another stream's work is not this one's";
  }
  b().synchronize_stream(s);
  EXPECT_TRUE(b().query_stream(s));
  {
    const auto held = hold(b().legacy_default_stream());
    fill(b().legacy_default_stream(), data, count, 4.0f);
    EXPECT_FALSE(b().query_stream(b().legacy_default_stream()));
  }
  b().synchronize_stream(b().legacy_default_stream());
  EXPECT_TRUE(b().query_stream(b().legacy_default_stream()));
}

// --- the default streams -------------------------------------------------------------------------

TEST_P(DeviceTest, LegacyStreamWaitsForBlockingStreams)
{
  const auto blocking = stream(false);
  float* data = floats(count, 0.0f);
  auto held = hold(blocking);
  fill(blocking, data, count, 1.0f);
  EXPECT_TRUE(all_equal(read_after(held, b().legacy_default_stream(), data, count), 1.0f));
}

// CUDA leaves open whether synchronizing the legacy stream waits for the blocking streams' work
// enqueued after its last operation; the simulator takes the stricter reading, so that handoff, which
// waits for the legacy stream through an event recorded there, is right under either.
TEST_P(DeviceTest, SynchronizingTheLegacyStreamWaitsForItsOwnWorkOnly)
{
  REQUIRE_SIM();
  const auto blocking = stream(false);
  const auto legacy = b().legacy_default_stream();
  float* data = floats(count, 0.0f);
  const auto e = event();
  {
    const auto held = hold(blocking);
    fill(blocking, data, count, 1.0f);
    b().synchronize_stream(legacy);
    EXPECT_TRUE(all_equal(read(stream(true), data, count), 0.0f)) << "the blocking stream's work was waited for";
    b().record_event(e, legacy);  // an operation of the legacy stream: after the blocking stream's work
    EXPECT_DEVICE_ERROR(b().synchronize_event(e), sim_backend::hold_deadlock_error);
  }
  b().synchronize_event(e);
  EXPECT_TRUE(all_equal(read(stream(true), data, count), 1.0f));
}

TEST_P(DeviceTest, BlockingStreamsWaitForTheLegacyStream)
{
  const auto blocking = stream(false);
  float* data = floats(count, 0.0f);
  auto held = hold(b().legacy_default_stream());
  fill(b().legacy_default_stream(), data, count, 2.0f);
  EXPECT_TRUE(all_equal(read_after(held, blocking, data, count), 2.0f));
}

TEST_P(DeviceTest, NonBlockingStreamsSkipImplicitSynchronization)
{
  const auto non_blocking = stream(true);
  const auto legacy = b().legacy_default_stream();
  float* first = floats(count, 0.0f);
  float* second = floats(count, 0.0f);
  {
    const auto held = hold(non_blocking);
    fill(non_blocking, first, count, 1.0f);
    EXPECT_TRUE(all_equal(read(legacy, first, count), 0.0f));  // the legacy stream did not wait
  }
  b().synchronize_stream(non_blocking);
  EXPECT_TRUE(all_equal(read(legacy, first, count), 1.0f));

  {
    const auto held = hold(legacy);
    fill(legacy, second, count, 1.0f);
    EXPECT_TRUE(all_equal(read(non_blocking, second, count), 0.0f));  // nor this one
  }
  b().synchronize_stream(legacy);
  EXPECT_TRUE(all_equal(read(non_blocking, second, count), 1.0f));
}

TEST_P(DeviceTest, PerThreadDefaultStreamsArePerThreadAndBlocking)
{
  const auto mine = b().per_thread_default_stream();
  EXPECT_TRUE(b().stream_is_blocking(mine));
  EXPECT_EQ(b().per_thread_default_stream(), mine);
  float* data = floats(count, 0.0f);
  stream_handle theirs{};
  std::vector<float> seen;
  std::span<const float> on_legacy;
  {
    const auto held = hold(mine);
    fill(mine, data, count, 1.0f);
    std::thread other([&] {
      theirs = b().per_thread_default_stream();
      seen = read(theirs, data, count);
    });
    other.join();
    EXPECT_TRUE(all_equal(seen, 0.0f));  // another thread's queue: not ordered after the fill
    if (rocm()) {
      EXPECT_NE(theirs, mine);
    } else {
      EXPECT_EQ(theirs, mine);  // one value, resolved per thread
    }
    // The per-thread stream is blocking, so the legacy stream waits for it.
    on_legacy = read_later(b().legacy_default_stream(), data, count);
    EXPECT_TRUE(held_back(b().legacy_default_stream()));
  }
  b().synchronize_device();
  EXPECT_TRUE(all_equal(on_legacy, 1.0f));
}

// --- devices ----------------------------------------------------------------------------------

TEST_P(DeviceTest, RecordingAnEventOfAnotherDeviceFails)
{
  if (b().device_count() < 2) { GTEST_SKIP() << "needs a second device (the backend has one)"; }
  b().set_current_device(1);
  EXPECT_EQ(b().current_device(), 1);
  const auto e1 = event();
  const auto s1 = stream(true);
  float* data = floats(count, 0.0f);
  b().set_current_device(0);
  const auto s0 = stream(true);
  EXPECT_EQ(b().stream_device(s1), 1);
  EXPECT_EQ(b().stream_device(s0), 0);
  EXPECT_DEVICE_ERROR(b().record_event(e1, s0), err("cudaErrorInvalidResourceHandle", "hipErrorInvalidHandle"));

  // Waiting on another device's event is allowed and orders the work.
  auto held = hold(s1);
  fill(s1, data, count, 1.0f);
  b().record_event(e1, s1);
  b().stream_wait_event(s0, e1);
  EXPECT_TRUE(all_equal(read_after(held, s0, data, count), 1.0f));
}

TEST_P(DeviceTest, CurrentDeviceIsPerThread)
{
  if (b().device_count() < 2) { GTEST_SKIP() << "needs a second device (the backend has one)"; }
  b().set_current_device(1);
  int other = -1;
  std::thread t([&] { other = b().current_device(); });
  t.join();
  EXPECT_EQ(other, 0);
  EXPECT_EQ(b().current_device(), 1);
  b().set_current_device(0);
}

// --- memory -------------------------------------------------------------------------------------

TEST_P(DeviceTest, PointerAttributesComeFromTheAllocationTable)
{
  const int device = b().device_count() - 1;
  b().set_current_device(device);
  constexpr std::size_t bytes = 4096;
  auto* p = static_cast<std::byte*>(b().allocate(bytes, b().legacy_default_stream()));
  allocations_.push_back(p);
  b().synchronize_device();

  const auto a = b().attributes(p);
  EXPECT_EQ(a.kind, memory_kind::device);
  EXPECT_EQ(a.device, device);
  EXPECT_EQ(a.base, p);
  EXPECT_GE(a.size, bytes);
  EXPECT_EQ(a.device_pointer, p);

  const auto inner = b().attributes(p + 100);
  EXPECT_EQ(inner.kind, memory_kind::device);
  EXPECT_EQ(inner.base, p);
  EXPECT_EQ(inner.device_pointer, p + 100);

  int on_stack = 0;
  const auto host = b().attributes(&on_stack);
  EXPECT_EQ(host.kind, memory_kind::unregistered);
  EXPECT_EQ(host.device, -1);
  auto heap = std::make_unique<int[]>(16);
  EXPECT_EQ(b().attributes(heap.get()).kind, memory_kind::unregistered);

  if (auto* simulated = sim()) {
    EXPECT_EQ(a.size, bytes);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0U);
    EXPECT_NE(b().attributes(p + bytes).base, p);  // one past the end is not inside

    auto* pinned = static_cast<std::byte*>(simulated->allocate_pinned_host(64));
    const auto pa = b().attributes(pinned + 63);
    EXPECT_EQ(pa.kind, memory_kind::pinned_host);
    EXPECT_EQ(pa.device, device);
    EXPECT_EQ(pa.base, pinned);
    EXPECT_EQ(pa.size, 64U);

    auto* managed = static_cast<std::byte*>(simulated->allocate_managed(128));
    const auto ma = b().attributes(managed + 1);
    EXPECT_EQ(ma.kind, memory_kind::managed);
    EXPECT_EQ(ma.device, device);
    EXPECT_EQ(ma.base, managed);

    simulated->free_sync(pinned);
    simulated->free_sync(managed);
    EXPECT_EQ(b().attributes(managed).kind, memory_kind::unregistered);
    EXPECT_DEVICE_ERROR(simulated->free_sync(managed), err("cudaErrorInvalidValue", "hipErrorInvalidValue"));
  }
  b().set_current_device(0);
}

TEST_P(DeviceTest, DeallocateIsStreamOrdered)
{
  REQUIRE_SIM();
  const auto s = stream(true);
  const auto before = sim()->live_allocations();
  void* p = b().allocate(1024, s);
  EXPECT_EQ(sim()->live_allocations(), before + 1);
  {
    const auto held = hold(s);
    b().deallocate(p, s);
    sim()->synchronize_unheld();
    EXPECT_EQ(b().attributes(p).kind,
              memory_kind::device);  // still owned until the stream gets there
  }
  b().synchronize_stream(s);
  EXPECT_EQ(b().attributes(p).kind, memory_kind::unregistered);
  EXPECT_EQ(sim()->live_allocations(), before);
}

TEST_P(DeviceTest, CopiesAndHostFunctionsRunInStreamOrder)
{
  const auto s = stream(true);
  float* src = floats(count, 5.0f);
  float* dst = floats(count, 0.0f);
  b().copy_async(dst, src, count * sizeof(float), s);
  std::atomic<int> calls{0};
  b().launch_host_func(
    s, [](void* c) { static_cast<std::atomic<int>*>(c)->fetch_add(1); }, &calls);
  EXPECT_TRUE(all_equal(read(s, dst, count), 5.0f));
  EXPECT_EQ(calls.load(), 1);
}

// --- simulation extras: faults and capture
// ---------------------------------------------------------

TEST_P(DeviceTest, InjectedFaultsFailEachOperationOnce)
{
  REQUIRE_SIM();
  auto& s = *sim();
  const auto blocking = stream(false);
  const auto capturing = stream(true);
  const auto e = event();
  auto* p = static_cast<std::byte*>(b().allocate(1024, blocking));
  allocations_.push_back(p);
  void* to_free = s.allocate_managed(64);

  const std::vector<std::pair<std::string_view, std::function<void()>>> calls{
    {"device_count", [&] { (void)b().device_count(); }},
    {"current_device", [&] { (void)b().current_device(); }},
    {"set_current_device", [&] { b().set_current_device(0); }},
    {"push_current_device",
     [&] {
       b().push_current_device(0);
       b().pop_current_device();
     }},
    {"create_stream", [&] { b().destroy_stream(b().create_stream(true)); }},
    {"stream_device", [&] { (void)b().stream_device(blocking); }},
    {"stream_is_blocking", [&] { (void)b().stream_is_blocking(blocking); }},
    {"stream_capture_status", [&] { (void)b().stream_capture_status(blocking); }},
    {"stream_capture_id", [&] { (void)b().stream_capture_id(blocking); }},
    {"query_stream", [&] { (void)b().query_stream(blocking); }},
    {"synchronize_stream", [&] { b().synchronize_stream(blocking); }},
    {"synchronize_device", [&] { b().synchronize_device(); }},
    {"exchange_capture_mode", [&] { (void)b().exchange_capture_mode(capture_mode::global); }},
    {"create_event", [&] { b().destroy_event(b().create_event()); }},
    {"record_event", [&] { b().record_event(e, blocking); }},
    {"query_event", [&] { (void)b().query_event(e); }},
    {"synchronize_event", [&] { b().synchronize_event(e); }},
    {"stream_wait_event", [&] { b().stream_wait_event(blocking, e); }},
    {"attributes", [&] { (void)b().attributes(p); }},
    {"allocate", [&] { b().deallocate(b().allocate(64, blocking), blocking); }},
    {"copy_async", [&] { b().copy_async(p, p + 512, 64, blocking); }},
    {"launch_host_func",
     [&] {
       b().launch_host_func(
         blocking, [](void*) {}, nullptr);
     }},
    {"enqueue_fill", [&] { s.enqueue_fill(blocking, p, 16, std::byte{7}); }},
    {"enqueue_sleep", [&] { s.enqueue_sleep(blocking, 1ms); }},
    {"launch_kernel", [&] { s.launch_kernel(blocking, "k", {}); }},
    {"begin_capture",
     [&] {
       s.begin_capture(capturing);
       (void)s.end_capture(capturing);
     }},
    {"end_capture",
     [&] {
       if (b().stream_capture_status(capturing) == capture_status::none) { s.begin_capture(capturing); }
       (void)s.end_capture(capturing);
     }},
    {"launch_graph",
     [&] {
       s.begin_capture(capturing);
       s.launch_graph(s.end_capture(capturing), blocking);
     }},
    {"allocate_pinned_host", [&] { s.free_sync(s.allocate_pinned_host(64)); }},
    {"allocate_managed", [&] { s.free_sync(s.allocate_managed(64)); }},
    {"free_sync", [&] { s.free_sync(to_free); }},
    {"context_id", [&] { (void)b().context_id(0); }},
    {"release_with_capture",
     [&] {
       if (b().stream_capture_status(capturing) == capture_status::none) { s.begin_capture(capturing); }
       s.release_with_capture(
         capturing, [](void*) noexcept {}, nullptr);
       (void)s.end_capture(capturing);
     }},
    {"hold", [&] { s.hold(blocking).release(); }},
    {"uuid", [&] { (void)b().uuid(0); }},
    {"ipc_memory_handle", [&] { (void)b().ipc_memory_handle(p); }},
    {"create_ipc_event", [&] { b().destroy_event(b().create_ipc_event()); }},
    {"ipc_event_handle",
     [&] {
       const auto shared = b().create_ipc_event();
       try {
         (void)b().ipc_event_handle(shared);
       } catch (...) {
         b().destroy_event(shared);
         throw;
       }
       b().destroy_event(shared);
     }},
    {"register_host_memory",
     [&] {
       alignas(8) static std::uint64_t word = 0;
       b().unregister_host_memory(b().register_host_memory(&word, sizeof word));
     }},
    {"stream_write_value", [&] { b().stream_write_value(blocking, p, 1); }},
    {"stream_wait_value", [&] { b().stream_wait_value(blocking, p, 0); }},
    {"pending", [&] { (void)s.pending(blocking); }},
    {"held", [&] { (void)s.held(blocking); }},
    {"waits_for_hold", [&] { (void)s.waits_for_hold(blocking); }},
    {"synchronize_unheld", [&] { s.synchronize_unheld(); }},
  };

  const std::string name = err("cudaErrorLaunchFailure", "hipErrorLaunchFailure");
  for (const auto op : sim_backend::fault_operations()) {
    SCOPED_TRACE(std::string(op));
    auto it = std::find_if(calls.begin(), calls.end(), [&](const auto& c) { return c.first == op; });
    ASSERT_NE(it, calls.end()) << "no test call for injectable operation " << op;
    s.inject_fault(std::string(op), 1, name);
    try {
      it->second();
      ADD_FAILURE() << op << " did not fail";
    } catch (const device_error& error) {
      EXPECT_EQ(error.error_name(), name);
      EXPECT_EQ(error.backend(), backend_name());
      EXPECT_NE(std::string(error.what()).find(") failed: " + name + ": "), std::string::npos) << error.what();
    }
    EXPECT_NO_THROW(it->second()) << op << " should succeed once the fault is spent";
  }
}

TEST_P(DeviceTest, InjectedFaultsCountDownAndClear)
{
  REQUIRE_SIM();
  auto& s = *sim();
  const auto st = stream(true);
  const auto e = event();
  s.inject_fault("record_event", 2, "cudaErrorIllegalAddress");
  EXPECT_DEVICE_ERROR(b().record_event(e, st), "cudaErrorIllegalAddress");
  EXPECT_DEVICE_ERROR(b().record_event(e, st), "cudaErrorIllegalAddress");
  EXPECT_NO_THROW(b().record_event(e, st));

  s.inject_fault("attributes", 5, "cudaErrorInvalidValue");
  s.clear_faults();
  EXPECT_NO_THROW((void)b().attributes(nullptr));
  s.inject_fault("create_event", 3, "cudaErrorMemoryAllocation");
  s.inject_fault("create_event", 0, "cudaErrorMemoryAllocation");  // removes it
  b().destroy_event(b().create_event());

  EXPECT_THROW(s.inject_fault("no_such_call", 1, "x"), value_error);
  EXPECT_THROW(s.inject_fault("record_event", -1, "x"), value_error);
}

TEST_P(DeviceTest, AGlobalCaptureForbidsEveryThreadNotRelaxedToWaitOnAnything)
{
  REQUIRE_SIM();
  auto& s = *sim();
  const auto capturing = stream(true);
  const auto other = stream(true);
  float* data = floats(16, 0.0f);
  const std::string unsupported = err("cudaErrorStreamCaptureUnsupported", "hipErrorStreamCaptureUnsupported");
  const auto reached = b().create_event();
  b().record_event(reached, other);

  // What a watching thread does while another thread captures, as torch.cuda.graph does.
  const auto on_another_thread = [](auto&& call) { std::thread{std::forward<decltype(call)>(call)}.join(); };
  s.begin_capture(capturing);
  on_another_thread([&] {
    EXPECT_DEVICE_ERROR((void)b().query_event(reached), unsupported);
    EXPECT_DEVICE_ERROR((void)b().query_stream(other), unsupported);
  });
  EXPECT_EQ(b().stream_capture_status(capturing), capture_status::invalidated);
  EXPECT_DEVICE_ERROR((void)s.end_capture(capturing),
                      err("cudaErrorStreamCaptureInvalidated", "hipErrorStreamCaptureInvalidated"));

  // Relaxed, the same calls are allowed, and the capture survives them.
  s.begin_capture(capturing);
  s.enqueue_fill(capturing, data, 16, 2.0f);
  on_another_thread([&] {
    const relaxed_capture_mode relaxed{b()};
    EXPECT_TRUE(b().query_event(reached));
    b().synchronize_stream(other);
    EXPECT_EQ(b().exchange_capture_mode(capture_mode::relaxed), capture_mode::relaxed);
  });
  on_another_thread([&] {  // a thread's mode is its own
    EXPECT_EQ(b().exchange_capture_mode(capture_mode::thread_local_only), capture_mode::global);
    EXPECT_TRUE(b().query_event(reached));  // thread-local mode minds the thread's own captures only
  });
  EXPECT_DEVICE_ERROR(b().synchronize_event(reached), unsupported);  // the capturing thread itself
  EXPECT_EQ(b().stream_capture_status(capturing), capture_status::invalidated);
  EXPECT_DEVICE_ERROR((void)s.end_capture(capturing),
                      err("cudaErrorStreamCaptureInvalidated", "hipErrorStreamCaptureInvalidated"));

  s.begin_capture(capturing);
  s.enqueue_fill(capturing, data, 16, 3.0f);
  on_another_thread([&] {
    const relaxed_capture_mode relaxed{b()};
    EXPECT_TRUE(b().query_event(reached));
  });
  const auto graph = s.end_capture(capturing);
  EXPECT_EQ(graph.size(), 1U);
  EXPECT_TRUE(b().query_event(reached));  // nothing captures any more
  b().destroy_event(reached);
}

TEST_P(DeviceTest, CaptureForbidsTheLegacyStream)
{
  REQUIRE_SIM();
  auto& s = *sim();
  const auto legacy = b().legacy_default_stream();
  const auto blocking = stream(false);
  float* data = floats(16, 0.0f);
  const std::string implicit = err("cudaErrorStreamCaptureImplicit", "hipErrorStreamCaptureImplicit");

  s.begin_capture(blocking);
  EXPECT_EQ(b().stream_capture_status(blocking), capture_status::active);
  // CUDA answers cudaErrorStreamCaptureImplicit: the legacy stream is as good as captured.
  EXPECT_EQ(b().stream_capture_status(legacy), capture_status::active);
  EXPECT_EQ(b().stream_capture_status(blocking), capture_status::active);  // a query is harmless
  EXPECT_DEVICE_ERROR(s.enqueue_fill(legacy, data, 16, 1.0f), implicit);
  EXPECT_EQ(b().stream_capture_status(blocking), capture_status::invalidated);
  EXPECT_DEVICE_ERROR((void)s.end_capture(blocking),
                      err("cudaErrorStreamCaptureInvalidated", "hipErrorStreamCaptureInvalidated"));
  EXPECT_EQ(b().stream_capture_status(blocking), capture_status::none);
  EXPECT_TRUE(all_equal(read(legacy, data, 16), 0.0f));

  // A capturing non-blocking stream leaves the legacy stream alone.
  const auto non_blocking = stream(true);
  s.begin_capture(non_blocking);
  EXPECT_EQ(b().stream_capture_status(legacy), capture_status::none);
  EXPECT_NO_THROW(s.enqueue_fill(legacy, data, 16, 4.0f));
  {
    const relaxed_capture_mode relaxed{b()};  // the capture is in global mode: see the next test
    EXPECT_NO_THROW(b().synchronize_stream(legacy));
  }
  EXPECT_EQ(s.end_capture(non_blocking).size(), 0U);
  EXPECT_TRUE(all_equal(read(legacy, data, 16), 4.0f));

  EXPECT_DEVICE_ERROR(s.begin_capture(legacy),
                      err("cudaErrorStreamCaptureUnsupported", "hipErrorStreamCaptureUnsupported"));
}

TEST_P(DeviceTest, CaptureForbidsSynchronizationAndDefersWork)
{
  REQUIRE_SIM();
  auto& s = *sim();
  const auto capturing = stream(true);
  const std::string unsupported = err("cudaErrorStreamCaptureUnsupported", "hipErrorStreamCaptureUnsupported");
  const std::string invalidated = err("cudaErrorStreamCaptureInvalidated", "hipErrorStreamCaptureInvalidated");

  s.begin_capture(capturing);
  EXPECT_DEVICE_ERROR(b().synchronize_stream(capturing), unsupported);
  EXPECT_EQ(b().stream_capture_status(capturing), capture_status::invalidated);
  EXPECT_DEVICE_ERROR((void)s.end_capture(capturing), invalidated);

  s.begin_capture(capturing);
  EXPECT_DEVICE_ERROR(b().synchronize_device(), unsupported);
  EXPECT_DEVICE_ERROR((void)s.end_capture(capturing), invalidated);

  // Captured work is recorded, not run; an event recorded in the capture cannot be queried.
  std::atomic<int> calls{0};
  const auto e = event();
  s.begin_capture(capturing);
  EXPECT_DEVICE_ERROR(s.begin_capture(capturing), err("cudaErrorIllegalState", "hipErrorIllegalState"));
  b().launch_host_func(
    capturing, [](void* c) { static_cast<std::atomic<int>*>(c)->fetch_add(1); }, &calls);
  b().record_event(e, capturing);
  EXPECT_DEVICE_ERROR((void)b().query_event(e), err("cudaErrorCapturedEvent", "hipErrorCapturedEvent"));
  // A stream that waits on captured work joins the capture (fork), and leaves it at the end.
  const auto forked = stream(true);
  b().stream_wait_event(forked, e);
  EXPECT_EQ(b().stream_capture_status(forked), capture_status::active);
  EXPECT_DEVICE_ERROR((void)s.end_capture(forked),
                      err("cudaErrorStreamCaptureUnmatched", "hipErrorStreamCaptureUnmatched"));
  EXPECT_DEVICE_ERROR((void)s.end_capture(capturing), invalidated);  // unmatched end invalidates
  EXPECT_EQ(b().stream_capture_status(forked), capture_status::none);

  s.begin_capture(capturing);
  b().launch_host_func(
    capturing, [](void* c) { static_cast<std::atomic<int>*>(c)->fetch_add(1); }, &calls);
  b().record_event(e, capturing);
  EXPECT_EQ(s.end_capture(capturing).size(), 2U);
  b().synchronize_device();
  EXPECT_EQ(calls.load(), 0);
  b().record_event(e, capturing);  // recorded outside a capture again
  b().synchronize_event(e);
  EXPECT_TRUE(b().query_event(e));
  EXPECT_DEVICE_ERROR((void)s.end_capture(capturing), err("cudaErrorIllegalState", "hipErrorIllegalState"));
}

// --- lifetime and threads ----------------------------------------------------------------------

TEST_P(DeviceTest, DestroyingStreamsAndTheBackendDrainsPendingWork)
{
  REQUIRE_SIM();
  std::atomic<int> calls{0};
  const auto bump = [](void* c) { static_cast<std::atomic<int>*>(c)->fetch_add(1); };
  const auto s = b().create_stream(false);
  {
    const auto held = hold(s);
    b().launch_host_func(s, bump, &calls);
    b().destroy_stream(s);  // the work still runs
    EXPECT_EQ(calls.load(), 0);
  }
  b().synchronize_device();
  EXPECT_EQ(calls.load(), 1);

  auto fresh = handoff::testing::make_backend(GetParam());
  const auto t = fresh->create_stream(true);
  {
    const auto held = as_sim(*fresh)->hold(t);
    fresh->launch_host_func(t, bump, &calls);
    (void)fresh->allocate(256, t);  // freed by the destructor
  }                                 // still queued, most likely, when the backend goes
  fresh.reset();
  EXPECT_EQ(calls.load(), 2);
}

TEST_P(DeviceTest, ConcurrentProducersAndConsumersStayOrdered)
{
  constexpr int threads = 4;
  constexpr int rounds = 10;
  constexpr std::size_t n = 64;
  std::vector<float*> buffers;
  buffers.reserve(threads);
  for (int t = 0; t < threads; ++t) { buffers.push_back(floats(n, 0.0f)); }
  std::atomic<int> failures{0};
  std::vector<std::thread> workers;
  workers.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const auto producer = b().create_stream(true);
      const auto consumer = b().create_stream(t % 2 == 0);
      const auto e = b().create_event();
      for (int r = 1; r <= rounds; ++r) {
        if (auto* simulated = sim()) {
          simulated->enqueue_fill(producer, buffers[static_cast<std::size_t>(t)], n, static_cast<float>(r), 2ms);
        } else {
          std::vector<float> values(n, static_cast<float>(r));
          b().copy_async(buffers[static_cast<std::size_t>(t)], values.data(), n * sizeof(float), producer);
          b().synchronize_stream(producer);
        }
        b().record_event(e, producer);
        b().stream_wait_event(consumer, e);
        std::vector<float> out(n);
        b().copy_async(out.data(), buffers[static_cast<std::size_t>(t)], n * sizeof(float), consumer);
        b().synchronize_stream(consumer);
        if (!all_equal(out, static_cast<float>(r))) { failures.fetch_add(1); }
      }
      b().destroy_event(e);
      b().destroy_stream(consumer);
      b().destroy_stream(producer);
    });
  }
  for (auto& w : workers) { w.join(); }
  EXPECT_EQ(failures.load(), 0);
}

// --- context resets and graph-retained releases ---------------------------------------------------

TEST_P(DeviceTest, AContextResetGivesTheDeviceANewContextAndDestroysWhatWasMadeInTheOldOne)
{
  REQUIRE_SIM();
  const auto before = b().context_id(0);
  EXPECT_EQ(b().context_id(0), before) << "asking changes nothing";
  const auto old_event = b().create_event();
  sim()->reset_device(0);
  EXPECT_NE(b().context_id(0), before);
  EXPECT_DEVICE_ERROR(b().record_event(old_event, b().legacy_default_stream()),
                      err("cudaErrorInvalidResourceHandle", "hipErrorInvalidHandle"));
  EXPECT_EQ(sim()->violations().size(), 1U) << "a handle of the old context is a destroyed one";
  sim()->clear_violations();
  const auto fresh = event();
  b().record_event(fresh, b().legacy_default_stream());
  b().synchronize_event(fresh);
}

TEST_P(DeviceTest, AGraphRetainsWhatAReleaseWaitsForUntilItAndItsLaunchesAreGone)
{
  REQUIRE_SIM();
  const auto s = stream(false);
  float* data = floats(count, 0.0f);
  std::atomic<int> released{0};
  sim()->begin_capture(s);
  sim()->enqueue_fill(s, data, count, 1.0f);
  sim()->release_with_capture(
    s, [](void* counter) noexcept { ++*static_cast<std::atomic<int>*>(counter); }, &released);
  std::optional<sim_graph> graph{sim()->end_capture(s)};
  EXPECT_EQ(released.load(), 0);
  {
    const auto held = hold(s);
    sim()->launch_graph(*graph, s);
    graph.reset();
    sim()->synchronize_unheld();
    EXPECT_EQ(released.load(), 0) << "released while a launch of the graph still runs";
  }
  b().synchronize_stream(s);
  EXPECT_EQ(released.load(), 1);
  EXPECT_DEVICE_ERROR(sim()->release_with_capture(
                        s, [](void*) noexcept {}, nullptr),
                      err("cudaErrorIllegalState", "hipErrorIllegalState"));
  const auto blocking = stream(false);
  sim()->begin_capture(blocking);
  EXPECT_DEVICE_ERROR(sim()->release_with_capture(
                        b().legacy_default_stream(), [](void*) noexcept {}, nullptr),
                      err("cudaErrorStreamCaptureImplicit", "hipErrorStreamCaptureImplicit"));
  EXPECT_NO_THROW((void)sim()->end_capture(blocking)) << "asking the legacy stream broke the capture";
}

// One simulated device as on most GPU machines, and two for what crosses devices.
INSTANTIATE_TEST_SUITE_P(Device, DeviceTest,
                         ::testing::Values(backend_choice{"sim", 1}, backend_choice{"sim", 2},
                                           backend_choice{"sim-rocm", 1}, backend_choice{"sim-rocm", 2},
                                           backend_choice{"cuda"}),
                         handoff::testing::backend_choice_name);

}  // namespace
}  // namespace handoff::device
