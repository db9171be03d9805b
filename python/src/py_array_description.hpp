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

/// `value` as the trace describes it; nullopt for what is not array-like. Sets no Python error.
[[nodiscard]] std::optional<array_description> describe(py::handle value);

/// What the trace says when a consumer made a copy of the data it was handed (`handed`) rather than
/// a view of it (`made`); empty when it made a view.
[[nodiscard]] std::string copy_note(std::string_view consumer, const array_description& handed,
                                    const array_description& made);

}  // namespace handoff::python
