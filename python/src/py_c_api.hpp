// The C functions the module offers to extensions (<handoff/python_c_api.h>).
#pragma once

#include <handoff/exchange.hpp>

#include <pybind11/pybind11.h>

namespace handoff::python {

namespace py = pybind11;

/// Adds the `_C_API` capsule to `m`, whose functions run `on` (which must outlive the process's
/// extensions: the process's exchange).
void bind_c_api(py::module_& m, exchange& on);

}  // namespace handoff::python
