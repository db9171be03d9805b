// The consumer side: handoff.from_dlpack and handoff.asarray.
#pragma once

#include "py_support.hpp"

#include <handoff/array.hpp>
#include <handoff/context.hpp>

#include <optional>

namespace handoff::python {

/// Creates the context variable behind `handoff.stream(...)` blocks and the cached call
/// arguments, and adds `from_dlpack` and `asarray` to `m` as METH_FASTCALL functions.
void init_exchange(py::module_& m);

/// The stream of the enclosing `handoff.stream(...)` block (a handoff.Stream), or None.
[[nodiscard]] py::object enclosing_stream();

/// A `stream` argument resolved once: the argument, else the enclosing handoff.stream block. None,
/// an int in DLPack's convention (checked), or a stream object handoff.as_stream accepts, returned
/// itself (it may own its stream). @throws type_error for objects that are no stream, value_error
/// for bad ints or handles.
[[nodiscard]] py::object consumer_stream(py::handle stream);

/// The DLPack `stream` value naming `stream` (None, an int, or a stream object) for data on
/// `device`: None for devices without streams; CUDA's legacy default handle 0 is spelled 1.
[[nodiscard]] py::object producer_stream_argument(py::handle stream, DLDeviceType device);

/// Where a device view handed to a consumer stream is bound.
struct consumer_binding {
  context* ctx;
  int device;
  device::stream_handle stream;
};

/// Where a device view imported for `consumer` (a DLPack stream value; None for the default stream)
/// is bound: nullopt when nothing orders it (host data, stream=-1, memory no active backend orders).
/// @throws value_error for a stream value the device does not take; device_error when the device's
///         data needs ordering and no backend can give it.
[[nodiscard]] std::optional<consumer_binding> consumer_binding_of(const array& view, py::handle consumer);

/// A device view imported for `consumer` (see consumer_binding_of): its data is ready there, and its
/// producer outlives the work the consumer then enqueues there. `stream_object` (the stream object
/// `consumer` came from, or None) is kept alive with the binding.
void bind_to_consumer(const array& view, py::handle consumer, py::handle stream_object);

/// handoff.from_dlpack(x, /, *, device=None, copy=None, stream=None)
[[nodiscard]] py::object from_dlpack(py::handle x, py::handle device, py::handle copy, py::handle stream);

/// handoff.asarray(x, /, *, device=None, copy=None, stream=None)
[[nodiscard]] py::object asarray(py::handle x, py::handle device, py::handle copy, py::handle stream);

}  // namespace handoff::python
