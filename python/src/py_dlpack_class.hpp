// For library authors' C++ classes (the table's def_dlpack, <handoff/pybind11.hpp>'s
// handoff::pybind::def_dlpack): the producer side of DLPack, for memory a callback describes.
#pragma once

#include <handoff/python_c_api.h>
#include <handoff/array.hpp>
#include <handoff/exchange.hpp>

#include <pybind11/pybind11.h>

#include <optional>

namespace handoff::python {

namespace py = pybind11;

/// Gives `type` __dlpack__, __dlpack_device__, __cuda_array_interface__, __array_interface__ and
/// handoff.Array's DLPack C exchange API (both attributes), each asking `describe(self, context,
/// ...)` for the memory an instance holds, with handoff.Array's semantics, exporting through `on`
/// (which must outlive the class); `context_owner` (may be None) is held as long as the methods are.
/// @throws what setting the type's attributes raises.
void def_dlpack(exchange& on, py::handle type, handoff_describe_fn describe, void* context, py::handle context_owner);

/// The view of what `object` holds when it is an instance of a def_dlpack class, holding it, as its
/// __dlpack__ exports it; nullopt for any other object.
/// @throws what describing the instance throws.
[[nodiscard]] std::optional<array> described_instance(PyObject* object);

}  // namespace handoff::python
