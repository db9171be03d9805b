// A backend for the suites that run on every backend, and the test-only operations they need on it:
// device memory set before use, holds that keep a stream's work waiting, writes, and reads through a
// stream.
// All of it goes through the device interface (no kernels), so it runs on the simulator and on a GPU.
#pragma once

#include <handoff/device.hpp>
#include <handoff/internal/sim.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <ostream>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace handoff::testing {

/// The backend a parameterized suite runs on: a simulated one ("sim", "sim-rocm") with
/// `sim_devices` devices, or "cuda" with the machine's devices (`sim_devices` 0).
struct backend_choice {
  std::string name;
  int sim_devices = 0;
};

std::ostream& operator<<(std::ostream& out, const backend_choice& choice);

/// "sim_1_device", "sim_2_devices", "sim_rocm_1_device", "cuda": test names that say the backend.
[[nodiscard]] std::string backend_choice_name(const ::testing::TestParamInfo<backend_choice>& info);

/// A new backend of that choice.
/// @throws handoff::device_error when it cannot start: "cuda" on a machine without a usable device,
///         or in a build without the CUDA backend.
[[nodiscard]] std::unique_ptr<device::backend> make_backend(const backend_choice& choice);

/// "sim" with one device (as on most GPU machines) and with two, and "cuda" (skipped where no CUDA
/// device is usable).
inline auto sim_and_cuda()
{
  return ::testing::Values(backend_choice{"sim", 1}, backend_choice{"sim", 2}, backend_choice{"cuda"});
}

/// sim_and_cuda() and "sim-rocm" with one device: the suites whose rules differ by device family.
inline auto every_family()
{
  return ::testing::Values(backend_choice{"sim", 1}, backend_choice{"sim", 2}, backend_choice{"sim-rocm", 1},
                           backend_choice{"cuda"});
}

/// A hold on a stream of a test's backend (test_device::hold): the work enqueued on the stream after
/// it waits until release() or the hold's destruction. Move-only; ends on the thread that made it.
class test_hold {
 public:
  test_hold(test_hold&& other) noexcept : sim_(std::move(other.sim_)), gate_(std::exchange(other.gate_, nullptr)) {}
  test_hold& operator=(test_hold&&) = delete;
  test_hold(const test_hold&) = delete;
  test_hold& operator=(const test_hold&) = delete;
  ~test_hold() { release(); }

  /// Lets the held work run. Idempotent.
  void release() noexcept;

 private:
  friend class test_device;
  explicit test_hold(device::sim_hold sim) noexcept : sim_(std::move(sim)) {}
  explicit test_hold(std::promise<void>* gate) noexcept : gate_(gate) {}

  device::sim_hold sim_;               // on the simulator
  std::promise<void>* gate_{nullptr};  // on a GPU: what the stream's host function waits for
};

/// A backend and what a test made on it. Thread-safe.
class test_device {
 public:
  /// @throws handoff::device_error as make_backend does.
  explicit test_device(const backend_choice& choice);
  /// Waits for the work on every device (synchronize), frees the memory and streams made here,
  /// and fails the running test if the simulator saw a use that CUDA leaves undefined.
  ~test_device();
  test_device(const test_device&) = delete;
  test_device& operator=(const test_device&) = delete;
  test_device(test_device&&) = delete;
  test_device& operator=(test_device&&) = delete;

  /// Waits for the work on every device; a device that cannot (a capture or a fault left behind)
  /// is left to the backend's destructor, which drains it.
  void synchronize() noexcept;

  [[nodiscard]] device::backend& backend() noexcept { return *backend_; }
  /// The simulator's extras; nullptr on a real device.
  [[nodiscard]] device::sim_backend* sim() noexcept { return device::as_sim(*backend_); }

  /// A stream on `device`, destroyed with this.
  [[nodiscard]] device::stream_handle stream(int device, bool non_blocking = true);
  /// `count` floats of device memory on `device`, set to `value` before this returns; freed with this.
  [[nodiscard]] float* allocate(std::size_t count, int device, float value = 0.0F);
  /// Holds `stream` until the returned hold ends: its work enqueued from now on waits, so that a test
  /// holds a race exactly as long as its assertions need. The simulator's hold (sim_backend::hold); on
  /// a GPU, a host function that waits for the release, and so holds the device's host-function
  /// thread meanwhile (a second hold's host function starts only once the first hold has ended).
  /// Inside a hold, never wait on this thread for the held work: the simulator refuses
  /// (handoffErrorHoldDeadlock), a GPU waits for ever.
  [[nodiscard]] test_hold hold(device::stream_handle stream);
  /// True when the last work enqueued on `stream` waits for a hold: on the simulator, an answer of
  /// its dependencies (sim_backend::waits_for_hold); on a GPU, that it is not done yet.
  [[nodiscard]] bool held_back(device::stream_handle stream);
  /// Enqueues on `stream` a host function that sleeps for `duration`: the stream's later work
  /// starts after it. It holds the backend's host-function thread meanwhile, as CUDA's does.
  void delay(device::stream_handle stream, std::chrono::nanoseconds duration);
  /// Enqueues on `stream`: wait `delay` (none: no host function), then set `count` floats at `dst`
  /// to `value`. Returns at once.
  void delayed_fill(device::stream_handle stream, float* dst, std::size_t count, float value,
                    std::chrono::nanoseconds delay = {});
  /// Copies `count` floats at `src` to the host on `stream` and waits for that stream only: device
  /// memory is never read on the host, where a GPU's is not addressable.
  [[nodiscard]] std::vector<float> read(device::stream_handle stream, const float* src, std::size_t count);
  /// Enqueues a copy of `count` floats at `src` to the host on `stream`, without waiting: the values
  /// are there once the stream has got past the copy (synchronize it after the hold that keeps it
  /// waiting). Pinned host memory, which a GPU's asynchronous copy does not wait for; it lives as
  /// long as this.
  [[nodiscard]] std::span<const float> read_later(device::stream_handle stream, const float* src, std::size_t count);

  /// What `gated_read` saw: whether the read waited for the hold, and what it read once the hold ended.
  struct gated_values {
    bool waited;
    std::span<const float> seen;
  };
  /// The gate of an ordering test: enqueues `consumer`'s read of `count` floats at `src` (read_later)
  /// while `held` holds the producer, asks whether it waits (held_back), ends the hold and waits for
  /// the read.
  [[nodiscard]] gated_values gated_read(test_hold& held, device::stream_handle consumer, const float* src,
                                        std::size_t count);

 private:
  std::unique_ptr<device::backend> backend_;
  std::mutex mutex_;
  std::vector<std::pair<void*, int>> allocations_;  // with their devices
  std::vector<device::stream_handle> streams_;
  std::deque<std::chrono::nanoseconds> delays_;  // the host functions' arguments: addresses that stay
  std::deque<std::promise<void>> gates_;         // the holds' host functions' arguments, on a GPU
  std::vector<void*> pinned_;                    // read_later's destinations
};

}  // namespace handoff::testing
