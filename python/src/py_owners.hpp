// Python objects the runtime keeps: producers, stream objects and buffers held until the device is
// done with them, and let go of under the GIL from any thread.
#pragma once

#include <handoff/array.hpp>
#include <handoff/context.hpp>

#include <pybind11/pybind11.h>

#include <memory>

namespace handoff::python {

namespace py = pybind11;

/// Keeps `object` alive until the producer is released; the release takes the GIL and may run on
/// any thread. During interpreter finalization the reference is left alone.
[[nodiscard]] shared_producer python_owner(py::handle object);

/// Calls `visit(object)` for each Python object that `owner` alone keeps alive: its Python owner and
/// the stream objects of its bindings, when nothing else holds them. For tp_traverse (GIL held).
/// Returns the first non-zero result of `visit`, as tp_traverse does.
int visit_kept_python_objects(const shared_producer& owner, visitproc visit, void* arg);

/// True when `owner` keeps Python objects alive (its owner, stream objects) that the garbage collector
/// sees into: an array holding it may be part of a reference cycle, so the collector must track it.
[[nodiscard]] bool keeps_python_objects(const shared_producer& owner);

/// A reference to a stream object (anything but None or an int) for a bound_stream to keep it
/// alive; the last copy lets go of it under the GIL, from any thread. Empty for None and ints.
[[nodiscard]] std::shared_ptr<const void> stream_keep_alive(py::handle stream_object);

/// Keeps `object` alive until the work enqueued on `stream` (of `device`) so far is done: for
/// host memory a device copy may still write when a wait for it failed.
void keep_alive_until_done(context& ctx, int device, device::stream_handle stream, py::handle object) noexcept;

}  // namespace handoff::python
