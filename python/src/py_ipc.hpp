// Binding of handoff.ipc (the hand-off across processes of one node).
#pragma once

#include <pybind11/pybind11.h>

namespace handoff::python {

void bind_ipc(pybind11::module_& parent);

}  // namespace handoff::python
