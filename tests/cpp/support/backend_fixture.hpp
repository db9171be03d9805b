// The fixture of the suites that run on every backend: each test on a fresh backend (the parameter:
// the simulator with one device or two, of either family, or CUDA), with helpers for `n` floats of
// device memory on it, and the exchange context over it.
#pragma once

#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/error.hpp>

#include "service/service_thread.hpp"
#include "support/test_device.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <optional>
#include <span>
#include <stdexcept>
#include <vector>

// Skips a test that needs a second device where the backend has one.
#define HANDOFF_REQUIRE_TWO_DEVICES()                                                              \
  do {                                                                                             \
    if (b().device_count() < 2) { GTEST_SKIP() << "needs a second device (the backend has one)"; } \
  } while (false)

// Skips, on a real device, a test of what only the simulator can do or show (`why`).
#define HANDOFF_REQUIRE_SIM(why)                                                    \
  do {                                                                              \
    if (device_->sim() == nullptr) { GTEST_SKIP() << "simulator only: " << (why); } \
  } while (false)

namespace handoff::testing {

using namespace std::chrono_literals;

class BackendTest : public ::testing::TestWithParam<backend_choice> {
 protected:
  static constexpr std::size_t n = 1024;
  // For tests of timing itself: an ordering or release test holds its race with hold() instead, so
  // that it is right on any machine's speed.
  static constexpr auto slow = 200ms;

  void SetUp() override
  {
    try {
      device_.emplace(GetParam());
    } catch (const device_error& e) {
      if (GetParam().name == "cuda") {
        GTEST_SKIP() << "no usable CUDA backend (" << e.error_name() << "): " << e.what();
      }
      throw;
    }
  }

  device::backend& b() { return device_->backend(); }
  /// The simulator's extras, for tests that begin with HANDOFF_REQUIRE_SIM.
  device::sim_backend& sim()
  {
    if (auto* simulated = device_->sim()) { return *simulated; }
    throw std::logic_error("a simulator-only test did not begin with HANDOFF_REQUIRE_SIM");
  }

  float* allocate_on(int device) { return device_->allocate(n, device); }
  device::stream_handle stream_on(int device, bool non_blocking = true)
  {
    return device_->stream(device, non_blocking);
  }
  /// Sets the n floats at `data` to `value` on `stream`, after `delay`.
  void fill(device::stream_handle stream, float* data, float value, std::chrono::nanoseconds delay = {})
  {
    device_->delayed_fill(stream, data, n, value, delay);
  }
  void delay(device::stream_handle stream, std::chrono::nanoseconds duration) { device_->delay(stream, duration); }
  /// Holds `stream`'s work enqueued from now on until the hold ends (test_device::hold).
  [[nodiscard]] test_hold hold(device::stream_handle stream) { return device_->hold(stream); }
  /// True when `stream`'s last work waits for a hold (test_device::held_back).
  bool held_back(device::stream_handle stream) { return device_->held_back(stream); }
  /// Copies the n floats at `data` to the host on `stream` and waits for that copy only.
  std::vector<float> read(const float* data, device::stream_handle stream) { return device_->read(stream, data, n); }
  /// Enqueues that copy without waiting: its values once `stream` got past it (test_device::read_later).
  std::span<const float> read_later(const float* data, device::stream_handle stream)
  {
    return device_->read_later(stream, data, n);
  }
  /// The gate of an ordering test: enqueues `consumer`'s read of the n floats at `data`, checks that
  /// it waits for the producer's hold `held`, ends the hold, and returns what it read.
  std::span<const float> read_after(test_hold& held, const float* data, device::stream_handle consumer)
  {
    const auto [waited, seen] = device_->gated_read(held, consumer, data, n);
    EXPECT_TRUE(waited) << "the consumer does not wait for the held producer";
    return seen;
  }

  std::optional<test_device> device_;
};

/// BackendTest with the exchange context (event pool, deferred releases) of its backend.
class BackendContextTest : public BackendTest {
 protected:
  void SetUp() override
  {
    BackendTest::SetUp();
    if (IsSkipped()) { return; }
    ctx_.emplace(b(), std::make_unique<detail::service_thread>());
  }

  context& ctx() { return *ctx_; }
  /// `stream` bound on the context for data of `device` (on which default streams resolve).
  bound_stream bound(device::stream_handle stream, int device = 0)
  {
    return bound_stream{.ctx = &ctx(), .device = device, .stream = stream, .stream_owner = nullptr};
  }

  /// A view of the n floats at `data` on `device` of the backend, whose producer frees nothing (the
  /// fixture owns the memory) and calls `on_release`, if given, when released.
  array device_view(float* data, int device, std::function<void()> on_release = {})
  {
    array_layout layout;
    layout.data = data;
    layout.device = {b().device_type(), device};
    layout.dtype = {kDLFloat, 32, 1};
    layout.shape = std::vector<std::int64_t>{static_cast<std::int64_t>(n)};
    layout.strides = std::vector<std::int64_t>{1};
    return array{std::move(layout), shared_producer{[release = std::move(on_release)]() noexcept {
                   if (release) { release(); }
                 }}};
  }

  /// Records that `view`'s data is ready on `stream` (of `device`), as its producer would.
  void mark_ready(const array& view, device::stream_handle stream, int device = 0)
  {
    view.owner().set_ready_on({.ctx = &ctx(), .device = device, .stream = stream, .stream_owner = nullptr});
  }

  /// A view of the n floats at `data` on device 0 whose write of `value` is enqueued on `producer`,
  /// ready there: what a producer hands over while its kernel runs, as long as the test holds
  /// `producer` (hold).
  array pending_view(float* data, device::stream_handle producer, float value)
  {
    array view = device_view(data, 0);
    fill(producer, data, value);
    mark_ready(view, producer);
    return view;
  }

  std::optional<context> ctx_;
};

}  // namespace handoff::testing
