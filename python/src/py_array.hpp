// handoff.Array: a plain CPython type holding a handoff::array, and the producer side of DLPack.
#pragma once

#include "py_support.hpp"

namespace handoff::python {

/// Creates the `handoff.Array` type and adds it to `m`.
void bind_array(py::module_& m);

/// Wraps a view as a new `handoff.Array`. @throws py::error_already_set when out of memory.
[[nodiscard]] py::object wrap(array&& view);

/// The view held by `object` when it is a `handoff.Array`, else nullptr. Borrowed: valid while
/// `object` is alive.
[[nodiscard]] array* as_array(py::handle object) noexcept;

}  // namespace handoff::python
