// Binding of handoff.sim (the simulated accelerator).
#pragma once

#include <handoff/exchange.hpp>

#include <pybind11/pybind11.h>

namespace handoff::python {

/// Adds handoff._sim to `parent`, whose calls drive the simulated device of `on`'s context.
void bind_sim(pybind11::module_& parent, exchange& on);

}  // namespace handoff::python
