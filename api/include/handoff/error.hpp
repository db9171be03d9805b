// Exceptions thrown by handoff; each maps to exactly one Python exception in the bindings.
#pragma once

#include <stdexcept>
#include <string>

namespace handoff {

/// Base of every handoff exception.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A value that is malformed or invalid for its context: a stream value, an interface field, a
/// consumed capsule (Python `ValueError`). The message names the offending field or value.
class value_error : public error {
 public:
  using error::error;
};

/// Data that cannot be exchanged as asked: unsupported dtype, byte order, read-only to a legacy
/// consumer, a copy refused, an unreachable device (Python `BufferError`).
class buffer_error : public error {
 public:
  using error::error;
};

/// An argument of the wrong type, or an object with no exchange protocol (Python `TypeError`).
class type_error : public error {
 public:
  using error::error;
};

/// A valid request that handoff does not implement, such as masked arrays (`NotImplementedError`).
class not_implemented_error : public error {
 public:
  using error::error;
};

/// A device runtime call failed (Python `handoff.DeviceError`, a `RuntimeError`).
class device_error : public error {
 public:
  /// @param backend     backend name ("cuda", "sim", ...)
  /// @param error_name  the backend's symbolic error name, e.g. "cudaErrorInsufficientDriver"
  /// @param message     full human-readable message (call, location, error text)
  device_error(std::string backend, std::string error_name, const std::string& message)
      : error(message), backend_(std::move(backend)), error_name_(std::move(error_name))
  {}

  [[nodiscard]] const std::string& backend() const noexcept { return backend_; }
  [[nodiscard]] const std::string& error_name() const noexcept { return error_name_; }

 private:
  std::string backend_;
  std::string error_name_;
};

/// The error names of the device_errors handoff raises itself (a backend's carry its own, such as
/// "cudaErrorInsufficientDriver"): what the Python DeviceError's `error_name` says.
namespace error_names {
inline constexpr const char* no_backend = "handoffErrorNoBackend";            ///< no device backend is active
inline constexpr const char* invalid_backend = "handoffErrorInvalidBackend";  ///< HANDOFF_BACKEND names none
inline constexpr const char* wrong_backend = "handoffErrorWrongBackend";      ///< data of the other device family
inline constexpr const char* forked_child = "handoffErrorForkedChild";        ///< the parent's backend, after fork
inline constexpr const char* not_simulated = "handoffErrorNotSimulated";      ///< handoff.sim without the simulator
}  // namespace error_names

}  // namespace handoff

/// Throws `exception_type(message)` when `condition` is false. `message` is evaluated only then.
#define HANDOFF_EXPECTS(condition, exception_type, message)           \
  do {                                                                \
    if (!(condition)) [[unlikely]] { throw exception_type(message); } \
  } while (false)
