// handoff.Array: a plain CPython type holding a handoff::array, and the producer side of DLPack.
#pragma once

#include <handoff/array.hpp>
#include <handoff/exchange.hpp>

#include <pybind11/pybind11.h>

namespace handoff::python {

namespace py = pybind11;

/// Creates the `handoff.Array` type, whose arrays export through `on` (which must outlive the
/// module), and adds it to `m`.
void bind_array(py::module_& m, exchange& on);

/// `handoff.Array.__dlpack__` of `view`, exported through `on`: validates the stream for the array's device, makes the
/// copy asked for, then orders the consumer stream after the stream the exported data is ready on (the copy's, when one
/// was made) and exports a capsule (versioned when max_version >= (1, 0)).
[[nodiscard]] py::capsule export_dlpack(exchange& on, const array& view, py::handle stream, py::handle max_version,
                                        py::handle dl_device, py::handle copy);

/// CUDA Array Interface v3 of CUDA-resident `view`, its `stream` the one the data is ready on (None
/// when unknown), as `on` tells it. @throws py::attribute_error for data elsewhere, or a dtype the interface lacks.
[[nodiscard]] py::dict cuda_array_interface(const exchange& on, const array& view);

/// NumPy's array interface v3 of CPU `view`. @throws py::attribute_error for data elsewhere.
[[nodiscard]] py::dict array_interface(const array& view);

/// Wraps a view as a new `handoff.Array`, a view in the ownership graph of data made by `library`
/// (null: the library of the import in progress, if any). @throws py::error_already_set when out
/// of memory.
[[nodiscard]] py::object wrap(array&& view, const char* library = nullptr);

/// The view held by `object` when it is a `handoff.Array`, else nullptr. Borrowed: valid while
/// `object` is alive.
[[nodiscard]] array* as_array(py::handle object) noexcept;

/// The library `object`'s data was made by, when it is a `handoff.Array` that knows it, else null.
[[nodiscard]] const char* library_of_array(py::handle object) noexcept;

}  // namespace handoff::python
