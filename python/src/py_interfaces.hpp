// Importers for the non-DLPack protocols: __array_interface__, the buffer protocol, and the CUDA
// Array Interface.
#pragma once

#include "py_support.hpp"

namespace handoff::python {

/// Imports `object` through its `__array_interface__` (v3) dict.
/// @throws value_error naming a missing or ill-typed field, not_implemented_error for a mask.
[[nodiscard]] array import_array_interface(py::handle object, py::handle interface);

/// Imports `object` through the buffer protocol.
[[nodiscard]] array import_buffer(py::handle object);

/// A parsed, validated `__cuda_array_interface__` (v0 to v3), before its pointer is resolved.
struct cuda_array_interface {
  array_layout layout;                 ///< device left unset: the pointer's attributes decide it
  std::optional<std::int64_t> stream;  ///< v3 `stream`: the producer's stream, nullopt when absent
};

/// Parses and validates a `__cuda_array_interface__` dict.
/// @throws value_error naming the field, not_implemented_error for a mask.
[[nodiscard]] cuda_array_interface parse_cuda_array_interface(py::handle interface);

/// Imports `object` through its `__cuda_array_interface__`: parses it, resolves the pointer with
/// the active backend, makes the consumer stream (a DLPack value; nullopt for the default) wait on
/// the interface's `stream` with an event (never a host synchronize), and binds the view to it,
/// keeping `consumer_owner` (may be empty) alive with the binding.
/// @throws device_error when there is no backend.
[[nodiscard]] array import_cuda_array_interface(py::handle object, py::handle interface,
                                                std::optional<std::int64_t> consumer,
                                                std::shared_ptr<const void> consumer_owner);

}  // namespace handoff::python
