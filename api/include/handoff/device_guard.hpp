// device_guard: makes a device current for a scope and restores the previous one.
#pragma once

#include <handoff/device.hpp>

#include <optional>

namespace handoff {

/// Makes `device` current on the calling thread for the guard's scope (a no-op when it already is),
/// then restores exactly what was current before: the previous context, or none. Restoring never
/// selects a device, so it never creates a context on a device the thread had not used.
class device_guard {
 public:
  /// @throws device_error when the device cannot be made current.
  device_guard(device::backend& backend, int device) : backend_(backend)
  {
    if (backend_.device_is_current(device)) { return; }
    backend_.push_current_device(device);
    pushed_ = true;
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  device_guard(device_guard&&) = delete;
  device_guard& operator=(device_guard&&) = delete;
  ~device_guard()
  {
    if (pushed_) { backend_.pop_current_device(); }
  }

 private:
  device::backend& backend_;
  bool pushed_{false};
};

/// Puts the calling thread in relaxed capture mode for the guard's scope, then restores its mode.
/// For a thread that watches streams (the service thread polling releases): in global mode its
/// queries would fail, and invalidate the capture, while any thread captures in global mode
/// (torch.cuda.graph's default). Where the mode cannot be set, the scope changes nothing.
class relaxed_capture_mode {
 public:
  explicit relaxed_capture_mode(device::backend& backend) noexcept : backend_(backend)
  {
    try {
      previous_ = backend_.exchange_capture_mode(device::capture_mode::relaxed);
    } catch (...) {}  // the queries then fail as they would have, and say why
  }
  relaxed_capture_mode(const relaxed_capture_mode&) = delete;
  relaxed_capture_mode& operator=(const relaxed_capture_mode&) = delete;
  relaxed_capture_mode(relaxed_capture_mode&&) = delete;
  relaxed_capture_mode& operator=(relaxed_capture_mode&&) = delete;
  ~relaxed_capture_mode()
  {
    if (!previous_ || *previous_ == device::capture_mode::relaxed) { return; }
    try {
      (void)backend_.exchange_capture_mode(*previous_);
    } catch (...) {}
  }

 private:
  device::backend& backend_;
  std::optional<device::capture_mode> previous_;
};

}  // namespace handoff
