// Stream objects as handoff.as_stream reads them (a handoff.Stream, an int handle, or an object
// with __cuda_stream__(), .cuda_stream or .ptr), resolved here so that an import onto a stream
// object calls no Python code of handoff's and makes no handoff.Stream.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace handoff::python {

namespace py = pybind11;

/// The native handle of the stream that handoff.as_stream(stream) makes, without making it: a
/// handoff.Stream's own, an int as it is, or what __cuda_stream__(), .cuda_stream or .ptr says.
/// @throws type_error for a bool or what is no stream, value_error for a handle outside
///         [0, 2**63) or a negative device; what the object's own attributes raise propagates.
[[nodiscard]] std::uint64_t stream_handle(py::handle stream);

/// Binds `_resolve_stream`, `_check_stream` and `_set_stream_type`, which handoff._streams uses.
void bind_streams(py::module_& m);

}  // namespace handoff::python
