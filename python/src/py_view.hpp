// For library authors: handoff.view and the export behind handoff.Exporter.
#pragma once

#include "py_support.hpp"

namespace handoff::python {

/// Adds `view` and `_exporter_dlpack` to `m`.
void bind_view(py::module_& m);

}  // namespace handoff::python
