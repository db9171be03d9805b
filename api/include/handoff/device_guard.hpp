// device_guard: makes a device current for a scope and restores the previous one.
#pragma once

#include <handoff/device.hpp>

namespace handoff {

/// Makes `device` current on the calling thread for the guard's scope (a no-op when it already is),
/// then restores the previous device; the restore never throws.
class device_guard {
 public:
  /// @throws device_error when the device cannot be made current.
  device_guard(device::backend& backend, int device) : backend_(backend), previous_(backend.current_device())
  {
    if (previous_ != device) { backend_.set_current_device(device); }
    switched_ = previous_ != device;
  }
  device_guard(const device_guard&) = delete;
  device_guard& operator=(const device_guard&) = delete;
  device_guard(device_guard&&) = delete;
  device_guard& operator=(device_guard&&) = delete;
  ~device_guard()
  {
    if (!switched_) { return; }
    try {
      backend_.set_current_device(previous_);
    } catch (...) {  // a runtime shutting down: nothing left to restore
    }
  }

 private:
  device::backend& backend_;
  int previous_;
  bool switched_{false};
};

}  // namespace handoff
