#include "support/test_device.hpp"

#include "device/backend_factory.hpp"

#include <handoff/device_guard.hpp>
#include <handoff/error.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <thread>

namespace handoff::testing {
namespace {

// A non-blocking stream for one setup step: it never synchronizes with the streams a test orders.
class scratch_stream {
 public:
  explicit scratch_stream(device::backend& backend) : backend_(backend), stream_(backend.create_stream(true)) {}
  ~scratch_stream() { backend_.destroy_stream(stream_); }
  scratch_stream(const scratch_stream&) = delete;
  scratch_stream& operator=(const scratch_stream&) = delete;
  scratch_stream(scratch_stream&&) = delete;
  scratch_stream& operator=(scratch_stream&&) = delete;
  [[nodiscard]] device::stream_handle get() const noexcept { return stream_; }

 private:
  device::backend& backend_;
  device::stream_handle stream_;
};

}  // namespace

std::unique_ptr<device::backend> make_backend(const backend_choice& choice)
{
  if (choice.sim_devices == 0) { return device::make_backend(choice.name); }
  return std::make_unique<device::sim_backend>(
    choice.sim_devices, choice.name == "sim-rocm" ? device::sim_flavour::rocm : device::sim_flavour::cuda);
}

std::ostream& operator<<(std::ostream& out, const backend_choice& choice)
{
  out << choice.name;
  if (choice.sim_devices > 0) { out << " with " << choice.sim_devices << " device(s)"; }
  return out;
}

std::string backend_choice_name(const ::testing::TestParamInfo<backend_choice>& info)
{
  std::string name = info.param.name;
  std::replace(name.begin(), name.end(), '-', '_');
  if (info.param.sim_devices == 1) { name += "_1_device"; }
  if (info.param.sim_devices > 1) { name += fmt::format("_{}_devices", info.param.sim_devices); }
  return name;
}

test_device::test_device(const backend_choice& choice) : backend_(make_backend(choice)) {}

void test_hold::release() noexcept
{
  sim_.release();
  if (auto* gate = std::exchange(gate_, nullptr)) { gate->set_value(); }
}

void test_device::synchronize() noexcept
{
  device::backend& b = *backend_;
  for (int d = 0; d < b.device_count(); ++d) {
    try {
      const device_guard on{b, d};
      b.synchronize_device();
    } catch (const std::exception&) {}
  }
}

test_device::~test_device()
{
  synchronize();  // holds end with their scopes, before this
  device::backend& b = *backend_;
  for (const auto& [ptr, d] : allocations_) {
    try {
      const device_guard on{b, d};
      b.deallocate(ptr, b.legacy_default_stream());
    } catch (const std::exception&) {}  // the device cannot be made current: the backend frees it at exit
  }
  for (void* host : pinned_) {
    try {
      b.free_sync(host);
    } catch (const std::exception&) {}  // the backend frees it at exit
  }
  for (const auto s : streams_) { b.destroy_stream(s); }
  if (auto* simulated = sim()) {
    const auto violations = simulated->violations();
    EXPECT_TRUE(violations.empty()) << "uses CUDA leaves undefined: " << fmt::format("{}", fmt::join(violations, "; "));
  }
  backend_.reset();  // drains what a device could not finish above while the host functions' arguments live
}

device::stream_handle test_device::stream(int device, bool non_blocking)
{
  const device_guard on{*backend_, device};
  const auto s = backend_->create_stream(non_blocking);
  const std::lock_guard lock{mutex_};
  streams_.push_back(s);
  return s;
}

float* test_device::allocate(std::size_t count, int device, float value)
{
  device::backend& b = *backend_;
  const device_guard on{b, device};
  const scratch_stream setup{b};
  void* ptr = b.allocate(count * sizeof(float), setup.get());
  {
    const std::lock_guard lock{mutex_};
    allocations_.emplace_back(ptr, device);
  }
  const std::vector<float> values(count, value);
  b.copy_async(ptr, values.data(), count * sizeof(float), setup.get());
  b.synchronize_stream(setup.get());
  return static_cast<float*>(ptr);
}

test_hold test_device::hold(device::stream_handle stream)
{
  const device_guard on{*backend_, backend_->stream_device(stream)};  // a host function goes on its device
  if (auto* simulated = sim()) { return test_hold{simulated->hold(stream)}; }
  std::promise<void>* gate = nullptr;
  {
    const std::lock_guard lock{mutex_};
    gate = &gates_.emplace_back();
  }
  // Waits only: a host function may not call the backend (CUDA forbids it).
  backend_->launch_host_func(
    stream, [](void* g) { static_cast<std::promise<void>*>(g)->get_future().wait(); }, gate);
  return test_hold{gate};
}

bool test_device::held_back(device::stream_handle stream)
{
  if (auto* simulated = sim()) { return simulated->waits_for_hold(stream); }
  return !backend_->query_stream(stream);
}

void test_device::delay(device::stream_handle stream, std::chrono::nanoseconds duration)
{
  std::chrono::nanoseconds* kept = nullptr;
  {
    const std::lock_guard lock{mutex_};
    kept = &delays_.emplace_back(duration);
  }
  // Sleeps only: a host function may not call the backend (CUDA forbids it).
  backend_->launch_host_func(
    stream, [](void* d) { std::this_thread::sleep_for(*static_cast<const std::chrono::nanoseconds*>(d)); }, kept);
}

void test_device::delayed_fill(device::stream_handle stream, float* dst, std::size_t count, float value,
                               std::chrono::nanoseconds delay)
{
  // The value is staged in device memory now, so what waits on the stream is a device-to-device
  // copy: a copy from pageable host memory may make the caller wait for the stream, delay included.
  const float* staging = allocate(count, backend_->stream_device(stream), value);
  if (delay > std::chrono::nanoseconds::zero()) { this->delay(stream, delay); }
  backend_->copy_async(dst, staging, count * sizeof(float), stream);
}

std::span<const float> test_device::read_later(device::stream_handle stream, const float* src, std::size_t count)
{
  const device_guard on{*backend_, backend_->stream_device(stream)};  // no context on another device
  auto* host = static_cast<float*>(backend_->allocate_pinned_host(count * sizeof(float)));
  {
    const std::lock_guard lock{mutex_};
    pinned_.push_back(host);
  }
  std::fill_n(host, count, std::numeric_limits<float>::quiet_NaN());
  backend_->copy_async(host, src, count * sizeof(float), stream);
  return {host, count};
}

test_device::gated_values test_device::gated_read(test_hold& held, device::stream_handle consumer, const float* src,
                                                  std::size_t count)
{
  const std::span<const float> seen = read_later(consumer, src, count);
  const bool waited = held_back(consumer);
  held.release();
  backend_->synchronize_stream(consumer);
  return {.waited = waited, .seen = seen};
}

std::vector<float> test_device::read(device::stream_handle stream, const float* src, std::size_t count)
{
  std::vector<float> host(count, std::numeric_limits<float>::quiet_NaN());
  backend_->copy_async(host.data(), src, count * sizeof(float), stream);
  backend_->synchronize_stream(stream);
  return host;
}

}  // namespace handoff::testing
