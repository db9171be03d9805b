// The consumer side: handoff.from_dlpack and handoff.asarray.
#pragma once

#include "py_support.hpp"

namespace handoff::python {

/// Creates the context variable behind `handoff.stream(...)` blocks and the cached call
/// arguments, and adds `from_dlpack` and `asarray` to `m` as METH_FASTCALL functions.
void init_exchange(py::module_& m);

/// handoff.from_dlpack(x, /, *, device=None, copy=None, stream=None)
[[nodiscard]] py::object from_dlpack(py::handle x, py::handle device, py::handle copy, py::handle stream);

/// handoff.asarray(x, /, *, device=None, copy=None, stream=None)
[[nodiscard]] py::object asarray(py::handle x, py::handle device, py::handle copy, py::handle stream);

}  // namespace handoff::python
