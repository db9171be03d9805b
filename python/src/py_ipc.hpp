// Binding of handoff.ipc (the hand-off across processes of one node).
#pragma once

#include <handoff/exchange.hpp>

#include <pybind11/pybind11.h>

namespace handoff::python {

/// Adds handoff._ipc to `parent`, sharing and opening arrays through `on`.
void bind_ipc(pybind11::module_& parent, exchange& on);

}  // namespace handoff::python
