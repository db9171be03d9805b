// device_guard: makes a device current for a scope and restores the previous one.
#pragma once

#include <handoff/device.hpp>

namespace handoff {

/// Makes `device` current on the calling thread for the guard's scope (a no-op when it already is),
/// then restores exactly what was current before: the previous context, or none. Restoring never
/// selects a device, so it never creates a context on a device the thread had not used.
class device_guard {
 public:
  /// @throws device_error when the device cannot be made current.
  device_guard(device::backend& backend, int device) : backend_(backend)
  {
    if (backend_.current_device() == device) { return; }
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

}  // namespace handoff
