// Binding of handoff.sim (the simulated accelerator).
#pragma once

#include <pybind11/pybind11.h>

namespace handoff::python {

void bind_sim(pybind11::module_& parent);

}  // namespace handoff::python
