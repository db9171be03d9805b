// For library authors: handoff.view and the export behind handoff.Exporter.
#pragma once

#include <handoff/array.hpp>
#include <handoff/exchange.hpp>

#include <pybind11/pybind11.h>

namespace handoff::python {

namespace py = pybind11;

/// The view handoff.view makes of a checked `layout` (see make_array) through `on`, as a C++ array.
[[nodiscard]] array described_view(exchange& on, array_layout&& layout, py::handle owner, py::handle stream);
/// handoff.view of a checked `layout`: `owner` (None or any object) is held until the last view,
/// capsule and consumer stream using the memory are done; `stream` is the stream the data is ready
/// on (None: unknown; an int in DLPack's convention or a stream object).
[[nodiscard]] py::object make_array(exchange& on, array_layout layout, py::handle owner, py::handle stream);

/// handoff.Exporter.__dlpack__: `exported` (a handoff.Array) exported as Array.__dlpack__ does, the
/// capsule holding `instance` as well as the array's producer.
/// @throws type_error when `exported` is not a handoff.Array.
[[nodiscard]] py::capsule exporter_dlpack(exchange& on, py::handle instance, py::handle exported, py::handle stream,
                                          py::handle max_version, py::handle dl_device, py::handle copy);

/// Adds `view` and `_exporter_dlpack` to `m`, which make and export views through `on`.
void bind_view(py::module_& m, exchange& on);

}  // namespace handoff::python
