// The consumer side: handoff.from_dlpack and handoff.asarray.
#pragma once

#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/stream_value.hpp>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>

namespace handoff::python {

namespace py = pybind11;

/// Creates the cached call arguments, and adds `from_dlpack` and `asarray` to `m` as METH_FASTCALL
/// functions that import through `on`, which must outlive the module.
void init_exchange(py::module_& m, exchange& on);

/// A consumer's `stream` argument, read once (stream_named_by): the argument, else the stream of the
/// enclosing handoff.stream block, else the default stream.
/// @throws type_error for objects that are no stream, value_error for bad ints or handles.
[[nodiscard]] named_stream consumer_stream(py::handle stream);

/// True for NumPy's arrays (not subclasses), which live on the host: their device need not be asked.
[[nodiscard]] bool is_numpy_array(PyObject* x) noexcept;

/// handoff.from_dlpack(x, /, *, device=None, copy=None, stream=None), imported through `on`.
[[nodiscard]] py::object from_dlpack(exchange& on, py::handle x, py::handle device, py::handle copy, py::handle stream);

/// What asarray raises for an object that speaks none of its protocols: a TypeError that says the
/// object does not fit (an overload may take it), unlike any other failure of the import.
class no_array_protocol : public type_error {
 public:
  using type_error::type_error;
};

/// handoff.asarray(x, /, *, device=None, copy=None, stream=None), imported through `on`.
[[nodiscard]] py::object asarray(exchange& on, py::handle x, py::handle device, py::handle copy, py::handle stream);

}  // namespace handoff::python
