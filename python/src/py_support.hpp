// Shared pieces of the bindings: the Array type, Python-owned producers, capsules, argument parsing.
#pragma once

#include <handoff/array.hpp>
#include <handoff/stream_value.hpp>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>

namespace handoff::python {

namespace py = pybind11;

/// The C++ state of a `handoff.Array`.
struct py_array {
  array view;
};

/// Wraps a view as a new `handoff.Array`.
[[nodiscard]] py::object wrap(array view);

/// Keeps `object` alive until the producer is released; the release takes the GIL and may run on
/// any thread. During interpreter finalization the reference is left alone.
[[nodiscard]] producer_ref python_owner(py::handle object);

/// Consumes a "dltensor_versioned" or "dltensor" capsule: renames it "used_..." and imports it.
/// @throws value_error if it was consumed already, type_error if it is not a DLPack capsule.
[[nodiscard]] array consume_capsule(py::handle capsule);

/// Wraps an exported tensor in a capsule whose destructor runs the deleter unless consumed.
[[nodiscard]] py::capsule make_capsule(DLManagedTensorVersioned* tensor);
[[nodiscard]] py::capsule make_capsule(DLManagedTensor* tensor);

/// A Python `stream` argument as an integer (None -> nullopt).
/// @throws type_error for bool and non-integers, value_error for integers outside int64.
[[nodiscard]] std::optional<std::int64_t> stream_argument(py::handle stream);

/// A `device`/`dl_device` argument: None, a (device_type, device_id) tuple, or "cpu".
/// @throws type_error / value_error naming `field`.
[[nodiscard]] std::optional<DLDevice> device_argument(py::handle device, const char* field);

/// A `copy` argument: None, True or False. @throws type_error.
[[nodiscard]] std::optional<bool> copy_argument(py::handle copy);

/// True when the interpreter is shutting down and Python objects must not be touched.
[[nodiscard]] bool interpreter_finalizing() noexcept;

}  // namespace handoff::python
