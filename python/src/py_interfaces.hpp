// Importers for the non-DLPack protocols: __array_interface__, the buffer protocol, and the CUDA
// Array Interface.
#pragma once

#include <handoff/array.hpp>
#include <handoff/stream_value.hpp>

#include <pybind11/pybind11.h>

#include <handoff/interface.hpp>

namespace handoff::python {

namespace py = pybind11;

/// Imports `object` through its `__array_interface__` (v3) dict.
/// @throws value_error naming a missing or ill-typed field (a `data` that is neither a pointer pair
///         nor a buffer, nor absent from an object with a buffer), not_implemented_error for a mask.
[[nodiscard]] array import_array_interface(py::handle object, py::handle interface);

/// Imports `object` through the buffer protocol.
[[nodiscard]] array import_buffer(py::handle object);

/// Reads a `__cuda_array_interface__` dict and validates it (handoff::validate_cuda_array_interface).
/// @throws value_error naming the field, not_implemented_error for a mask.
[[nodiscard]] cuda_interface parse_cuda_array_interface(py::handle interface);

/// Imports `object` through its `__cuda_array_interface__`: parses it, resolves the pointer with
/// the active backend, makes the consumer stream wait on the interface's `stream` with an event
/// (never a host synchronize), and binds the view to it, keeping `consumer.owner` alive with the
/// binding. When the view is released, the
/// interface's stream waits for the consumer's work in turn where it is certainly alive then
/// (handoff::bind_interface_import), a stream handle only when `object` holds it as its `stream`
/// attribute (as Numba's arrays do), which is then kept until the release has run.
/// @throws device_error when there is no backend.
[[nodiscard]] array import_cuda_array_interface(py::handle object, py::handle interface, const named_stream& consumer);

}  // namespace handoff::python
