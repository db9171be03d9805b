// Non-owning streams and the one way handoff orders two of them.
#pragma once

#include <handoff/device.hpp>

namespace handoff {
class event_pool;
}

namespace handoff {

/// A non-owning view of a stream of a backend. Cheap to copy. A default stream (legacy or
/// per-thread) is resolved on the device that is current when it is used.
class stream_view {
 public:
  constexpr stream_view(device::backend& backend, device::stream_handle handle) noexcept
      : backend_(&backend), handle_(handle)
  {}

  [[nodiscard]] constexpr device::stream_handle handle() const noexcept { return handle_; }
  [[nodiscard]] constexpr device::backend& backend() const noexcept { return *backend_; }
  [[nodiscard]] friend constexpr bool operator==(stream_view a, stream_view b) noexcept
  {
    return a.backend_ == b.backend_ && a.handle_ == b.handle_;
  }

  /// Orders the work enqueued so far on `producer` before the work enqueued on this stream from now
  /// on, for data owned by `device` (on which default streams resolve): records a pooled event on
  /// `producer`, on the producer stream's own device (work on the data may come from a peer
  /// device's stream), and makes this stream wait on it; the current device is restored. Never
  /// blocks the host.
  /// Does nothing (counted in `waits_elided`) only when the streams are the same. The legacy
  /// default stream's implicit synchronization is not relied on: it orders only work actually
  /// enqueued on it, so a consumer stream that is then handed on without work of its own would
  /// order nothing.
  /// @throws buffer_error when a stream is capturing into a graph and the ordering is impossible.
  /// @throws device_error when a device call fails; the current device is restored.
  void wait(stream_view producer, int device, event_pool& events) const;

 private:
  // Tells the exchange being traced on this thread, if any, about the wait.
  void note_wait(int device, stream_view producer, bool inserted) const noexcept;

  device::backend* backend_;
  device::stream_handle handle_;
};

}  // namespace handoff
