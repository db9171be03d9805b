// Binding of handoff.Array.
#pragma once

#include "py_support.hpp"

namespace handoff::python {

/// Array.__dlpack__: validates the stream for the array's device, then exports a capsule.
[[nodiscard]] py::capsule export_dlpack(const py_array& self, py::handle stream, py::handle max_version,
                                        py::handle dl_device, py::handle copy);

void bind_array(py::module_& m);

}  // namespace handoff::python
