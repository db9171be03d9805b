// NumPy's arrays read and made through NumPy's own C API (its documented array fields, and the table
// `_ARRAY_API` it publishes, read at run time): handoff neither links nor needs NumPy.
#pragma once

#include <handoff/array.hpp>

#include <pybind11/pybind11.h>

#include <cstddef>
#include <optional>

namespace handoff::python {

namespace py = pybind11;

/// The layout of `ndarray`, an instance of numpy.ndarray itself (is_numpy_array), read from the
/// fields NumPy's C API documents: what its __dlpack__ would describe, without the capsule. nullopt
/// for what DLPack refuses or describes otherwise (a swapped byte order, a dtype it lacks, strides
/// that are no multiple of the item): numpy's own __dlpack__ then says what it makes of it.
[[nodiscard]] std::optional<array_layout> numpy_array_layout(PyObject* ndarray) noexcept;

/// As numpy_array_layout, wherever the memory is: an array over a DLPack capsule (what
/// numpy.from_dlpack returns) is read too. Its device is not the layout's to say (it is left kDLCPU).
[[nodiscard]] std::optional<array_layout> numpy_fields_layout(PyObject* ndarray) noexcept;

/// The most dimensions a NumPy array has (NumPy 2's NPY_MAXDIMS).
inline constexpr std::size_t numpy_max_dims = 64;

/// @throws buffer_error naming the dtype or the rank when NumPy cannot hold an array of `layout`: a
///         dtype NumPy has no type for (bfloat16, float8, ...), or more than numpy_max_dims dimensions.
void require_numpy_can_hold(const array_layout& layout);

/// A numpy.ndarray of `layout`'s memory, zero-copy, writable unless it is read-only, `base`
/// kept alive as its base; None when NumPy cannot hold it so (data off the host, a dtype NumPy
/// has no type for, more dimensions than it takes): numpy.from_dlpack then says what it makes of it.
/// @throws py::error_already_set when NumPy cannot be imported or fails.
[[nodiscard]] py::object numpy_array_of(const array_layout& layout, py::object base);

}  // namespace handoff::python
