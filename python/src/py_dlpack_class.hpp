// For library authors' C++ classes (the table's def_dlpack, <handoff/pybind11.hpp>'s
// handoff::pybind::def_dlpack): the producer side of DLPack, for memory a callback describes.
#pragma once

#include <handoff/python_c_api.h>

#include <pybind11/pybind11.h>

namespace handoff::python {

namespace py = pybind11;

/// Gives `type` __dlpack__, __dlpack_device__, __cuda_array_interface__ and __array_interface__,
/// each asking `describe(self, context, ...)` for the memory an instance holds, with handoff.Array's
/// semantics; `context_owner` (may be None) is held as long as the methods are.
/// @throws what setting the type's attributes raises.
void def_dlpack(py::handle type, handoff_describe_fn describe, void* context, py::handle context_owner);

}  // namespace handoff::python
