// DLPack capsules: the names the protocol gives them, and a deleter that runs exactly once.
#pragma once

#include <handoff/array.hpp>
#include <handoff/exchange.hpp>

#include <pybind11/pybind11.h>

namespace handoff::python {

namespace py = pybind11;

/// Consumes a "dltensor_versioned" or "dltensor" capsule: renames it "used_..." and takes its tensor
/// through `on` (exchange::take_tensor: its deleter runs with the exchange's deleter runner).
/// @throws value_error if it was consumed already, type_error if it is not a DLPack capsule.
[[nodiscard]] array consume_capsule(const exchange& on, py::handle capsule);

/// Wraps an exported tensor in a capsule whose destructor runs the deleter unless consumed.
[[nodiscard]] py::capsule make_capsule(DLManagedTensorVersioned* tensor);
[[nodiscard]] py::capsule make_capsule(DLManagedTensor* tensor);

}  // namespace handoff::python
