// The C functions the module offers to extensions (<handoff/python_c_api.h>).
#pragma once

#include <pybind11/pybind11.h>

namespace handoff::python {

namespace py = pybind11;

/// Adds the `_C_API` capsule to `m`.
void bind_c_api(py::module_& m);

}  // namespace handoff::python
