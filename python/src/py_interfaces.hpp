// Importers for the non-DLPack protocols: __array_interface__, the buffer protocol, and the CUDA
// Array Interface.
#pragma once

#include <handoff/array.hpp>
#include <handoff/exchange.hpp>
#include <handoff/interface.hpp>

#include <pybind11/pybind11.h>

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

/// Imports `object` through its `__cuda_array_interface__` with `on` (exchange::import_interface):
/// the interface's stream is held until the view's release when `object` holds it as its `stream`
/// attribute (as Numba's arrays do), so that the release may make it wait for the consumer's work.
/// @throws value_error naming a bad field; what the exchange throws.
[[nodiscard]] array import_cuda_array_interface(exchange& on, py::handle object, py::handle interface,
                                                const import_request& request);

}  // namespace handoff::python
