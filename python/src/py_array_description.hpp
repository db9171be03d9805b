// What handoff's hooks read of another library's array, without side effects: its shape, its dtype's
// name, its size and where its data starts, for the trace's description of an exchange.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace handoff::python {

namespace py = pybind11;

// An array as the trace describes it: its shape, its dtype's name (NumPy's, PyTorch's, CuPy's and
// JAX's float32 all read "float32"), its size, and where its data starts, where its library says so.
struct array_description {
  std::vector<std::int64_t> shape;
  std::string dtype;
  std::int64_t nbytes{0};
  std::optional<std::uintptr_t> data;
};

/// What the trace says of an exchange: the data the consumer was handed, and, when the consumer made
/// a copy of it rather than a view, a note saying so.
struct exchange_description {
  std::optional<array_description> data;  ///< nullopt when neither side is array-like
  std::string copy;                       ///< empty for a view
};

/// The consumer's import of `argument` as `result`, as the trace describes it (the argument as it
/// says it is, else the result). Reads as little as tells a view: a NumPy array (read from its C
/// fields) in full and the other side's data pointer only, unless the two pointers differ or cannot
/// be compared. Sets no Python error.
[[nodiscard]] exchange_description describe_exchange(py::handle argument, py::handle result, std::string_view consumer);

/// Lets go of the array types describe_exchange remembers (each type's way to its data pointer), and
/// so of what they keep alive: the hooks that describe exchanges are gone.
void forget_array_types() noexcept;

}  // namespace handoff::python
