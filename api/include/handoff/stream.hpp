// The resolved stream, and the one way handoff orders two streams.
#pragma once

#include <handoff/device.hpp>

#include <cstdint>
#include <functional>
#include <memory>

namespace handoff {

class context;

/// A stream of one device of one context: what a caller's `named_stream` becomes once the data's
/// device is known (exchange::import, exchange::export_dlpack, the DLPack C exchange API, the
/// pybind11 helper and the ordering mode all resolve it once). It says where device data is ready,
/// or which consumer stream must be done with the data before its producer is released. Cheap to
/// copy; a default stream (legacy or per-thread) resolves on `device`.
///
/// ```cpp
/// const bound_stream consumer{.ctx = &ctx, .device = 0, .stream = consumer_handle, .stream_owner = nullptr};
/// consumer.wait_for(producer_handle);               // no host wait: an event, pooled
/// consumer.release_after([]() noexcept { /* ... */ });  // once the work enqueued there by now is done
/// ```
struct bound_stream {
  context* ctx{nullptr};
  int device{0};
  device::stream_handle stream{};
  /// What keeps `stream` alive (a Python stream object, say: CuPy, cuda.core and Numba destroy
  /// their stream with it) for as long as the stream is in use, its deferred releases included.
  /// Empty when the caller owns the stream.
  std::shared_ptr<const void> stream_owner;

  /// Orders the work enqueued so far on `producer` (a stream of the same context) before the work
  /// enqueued on this stream from now on: records a pooled event on `producer`, on the producer
  /// stream's own device (work on the data may come from a peer device's stream), and makes this
  /// stream wait on it; the current device is restored. Never blocks the host.
  /// Does nothing (counted in `waits_elided`) only when the streams are the same, as CCCL's
  /// `stream_ref::wait`. The legacy default stream's implicit synchronization is not relied on: it
  /// orders only work actually enqueued on it, so a consumer stream that is then handed on without
  /// work of its own would order nothing.
  /// @throws buffer_error when a stream is capturing into a graph and the ordering is impossible.
  /// @throws device_error when a device call fails; the current device is restored.
  void wait_for(device::stream_handle producer) const;
  /// wait_for(producer.stream).
  /// @throws value_error when `producer` is a stream of another context.
  void wait_for(const bound_stream& producer) const;

  /// Runs `release` once the work enqueued on this stream by now is done (context::release_after),
  /// `stream_owner` kept alive until then.
  void release_after(std::function<void()> release) const noexcept;

  /// The DLPack stream value that names this stream to a producer (stream_value_of).
  [[nodiscard]] std::int64_t dlpack_value() const noexcept;
};

}  // namespace handoff
