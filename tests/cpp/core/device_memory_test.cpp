// Device memory handoff owns or reads: the DLPack device of each memory kind, copies in stream
// order, and allocations freed in the order of their stream.
#include <handoff/array.hpp>
#include <handoff/error.hpp>
#include <handoff/internal/device_memory.hpp>
#include <handoff/internal/ordering.hpp>

#include "support/backend_fixture.hpp"

#include <array>
#include <latch>
#include <optional>
#include <span>
#include <thread>

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

using namespace handoff;
using DeviceMemoryTest = handoff::testing::BackendContextTest;

TEST_P(DeviceMemoryTest, DeviceCopiesFollowThePendingWrite)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  std::optional<array> view;
  std::optional<array> copy;
  std::span<const float> seen;
  {
    const auto held = hold(producer);
    view.emplace(pending_view(data, producer, 8.0F));
    if (device_->sim() != nullptr) {  // the host copy waits for the held write: for ever, a GPU would
      EXPECT_THROW((void)copy_device_array(ctx(), *view, /*to_host=*/true), device_error);
    }
    copy.emplace(copy_device_array(ctx(), *view, /*to_host=*/false));
    EXPECT_NE(copy->data(), view->data());
    EXPECT_EQ(copy->owner().ready_on()->stream, producer);
    seen = read_later(static_cast<const float*>(copy->data()), producer);
  }
  b().synchronize_stream(producer);
  EXPECT_EQ(seen.front(), 8.0F);

  const array host = copy_device_array(ctx(), *view, /*to_host=*/true);
  EXPECT_EQ(host.device().device_type, kDLCPU);
  EXPECT_EQ(static_cast<const float*>(host.data())[n - 1], 8.0F);
}

TEST_P(DeviceMemoryTest, AnArrayAllocatedOnAThreadsDefaultStreamIsFreedAfterItsWorkFromAnyThread)
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
    {
      const auto held = hold(b().per_thread_default_stream());  // its write waits until the check is done
      fill(b().per_thread_default_stream(), static_cast<float*>(allocated->data()), 1.0F);
      filled.count_down();
      checked.wait();
    }
    b().synchronize_stream(b().per_thread_default_stream());
  });
  filled.wait();
  const void* data = allocated->data();
  std::thread([&] { allocated.reset(); }).join();
  sim().synchronize_unheld();  // a free that does not wait for the held write has run by now
  EXPECT_EQ(b().attributes(data).kind, device::memory_kind::device) << "freed while its stream still wrote it";
  checked.count_down();
  allocating.join();
  ctx().drain();
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceMemoryTest, handoff::testing::sim_and_cuda(),
                         handoff::testing::backend_choice_name);

}  // namespace
