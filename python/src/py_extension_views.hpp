// The views a C++ extension holds through the table of <handoff/python_c_api.h> (what
// <handoff/pybind11.hpp>'s array holds), made without a Python object.
#pragma once

#include <handoff/python_c_api.h>
#include <handoff/array.hpp>
#include <handoff/exchange.hpp>
#include <handoff/ownership.hpp>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <optional>

/// A view an extension holds. Host data that nothing orders is held without the runtime's
/// bookkeeping, which it needs none of: a NumPy array's data, or memory the extension described,
/// kept by `owner` (the NumPy array; the extension's owner). The runtime's view (an array, a node of the ownership
/// graph) is made when an export or a Python object needs one, or at once for everything else. Counted under the GIL,
/// as every call of the table is made.
struct handoff_view {
  std::int64_t references{1};
  handoff_array_info info{};
  // Host data held without the runtime: `host` describes it (strides in elements), `owner` keeps it.
  pybind11::object owner;
  std::optional<handoff::array_layout> host;
  const char* library{nullptr};  // of the data, for the ownership graph
  // The runtime's view: the general import's handoff.Array, or an array made for the view.
  pybind11::object python;
  std::optional<handoff::array> held;
  std::optional<handoff::tracked_view> node;
};

namespace handoff::python {

namespace py = pybind11;

/// The layout an extension's description gives (NULL strides: row-major).
/// @throws value_error for a description without one.
[[nodiscard]] array_layout layout_of(const handoff_array_desc& desc);

/// The stream `desc` says its data is ready on, as handoff.view takes it: None when unknown (0), the
/// enclosing handoff.stream block's stream for HANDOFF_STREAM_ENCLOSING (enclosing_stream_for), else
/// the native handle as an int.
[[nodiscard]] py::object ready_stream_of(const handoff_array_desc& desc);

/// What an extension is told of `view`: its layout, and the stream its data is ready on.
[[nodiscard]] handoff_array_info array_info(const array& view);

/// The view of `object` that handoff.asarray(object, stream=stream) imports (NumPy's arrays, while
/// nothing is traced, read from their fields: the layout their __dlpack__ would describe).
/// @throws what asarray throws (no_array_protocol when nothing fits).
[[nodiscard]] handoff_view* import_extension_view(exchange& on, py::handle object, py::handle stream);

/// The view handoff.view makes of `layout`, held by `owner` (None: nothing), ready on `stream`
/// (None: unknown). @throws what handoff.view throws.
[[nodiscard]] handoff_view* describe_extension_view(exchange& on, array_layout layout, py::handle owner,
                                                    py::handle stream);

/// Takes one more reference to `view`. Under the GIL.
void retain_extension_view(handoff_view* view) noexcept;

/// Lets go of one reference to `view`, deleting it with the last. Under the GIL.
void release_extension_view(handoff_view* view) noexcept;

/// The runtime's view of `view`'s data, made on first use. @throws what an import of the data throws.
[[nodiscard]] const array& runtime_view(exchange& on, handoff_view& view);

/// `view` as a handoff_framework's array (a handoff.Array for HANDOFF_FRAMEWORK_HANDOFF).
/// @throws value_error for an unknown framework; what the framework's from_dlpack raises.
[[nodiscard]] py::object extension_view_to_python(exchange& on, handoff_view& view, int framework);

}  // namespace handoff::python
