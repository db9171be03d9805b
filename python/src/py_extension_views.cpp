#include "py_extension_views.hpp"

#include "py_array.hpp"
#include "py_exchange.hpp"
#include "py_numpy.hpp"
#include "py_owners.hpp"
#include "py_streams.hpp"
#include "py_trace.hpp"
#include "py_view.hpp"

#include <handoff/error.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/stream_value.hpp>
#include <handoff/trace.hpp>

#include <fmt/format.h>

#include <array>
#include <memory>

namespace handoff::python {
namespace {

handoff_array_info info_of(const array_layout& layout, std::intptr_t stream)
{
  return handoff_array_info{
    .data = layout.data,
    .ndim = static_cast<std::int32_t>(layout.shape.size()),
    .shape = layout.shape.data(),
    .strides = layout.strides.data(),
    .dtype = layout.dtype,
    .device = layout.device,
    .stream = stream,
    .readonly = layout.readonly ? 1 : 0,
  };
}

// The view of a NumPy array, read from its fields and holding a reference to it, as its own
// __dlpack__ capsule would; null where the general import must decide (a subclass, which may
// override __dlpack__; a trace, which records the import as asarray's; what DLPack would refuse).
std::unique_ptr<handoff_view> numpy_view(exchange& on, PyObject* object)
{
  if (!is_numpy_array(object) || trace::enabled()) { return nullptr; }
  std::optional<array_layout> layout = numpy_array_layout(object);
  if (!layout) { return nullptr; }
  auto made = std::make_unique_for_overwrite<handoff_view>();  // no zeroing of what is written below
  made->host.emplace(std::move(*layout));
  made->owner = py::reinterpret_borrow<py::object>(object);
  made->library = "numpy";
  made->info = info_of(*made->host, 0);
  on.count_host_import();
  return made;
}

// The runtime's view held by `view`, registered in the ownership graph.
const array& hold(handoff_view& view, array&& made)
{
  view.held.emplace(std::move(made));
  view.node.emplace(*view.held, "handoff::pybind::array", view.library);
  return *view.held;
}

// The view's handoff.Array, made once.
const py::object& python_object(exchange& on, handoff_view& view)
{
  if (!view.python) { view.python = wrap(array{runtime_view(on, view)}, view.library); }
  return view.python;
}

// Where extension_view_to_python finds each framework's from_dlpack (imported once, kept).
py::handle from_dlpack_of(int framework)
{
  static constexpr std::array<const char*, 5> modules{nullptr, "numpy", "torch", "jax.dlpack", "cupy"};
  static std::array<PyObject*, 5> functions{};
  PyObject*& function = functions.at(static_cast<std::size_t>(framework));
  if (function == nullptr) {
    py::object found = py::module_::import(modules.at(static_cast<std::size_t>(framework))).attr("from_dlpack");
    function = found.release().ptr();
  }
  return function;
}

// The stream `framework`'s from_dlpack orders device data for (its current stream, which it passes
// to __dlpack__), as alive until the framework's array is released: PyTorch's streams come from
// pools it never destroys (c10's stream pool note), JAX's is XLA's stream for external ready events,
// which lives with its client; CuPy's current stream object is held. So the C++ owner of a result is
// kept until the work the framework has then queued there is done.
framework_stream consumer_stream_of(int framework, DLDevice device)
{
  if (framework == HANDOFF_FRAMEWORK_CUPY) {
    const py::object stream = py::module_::import("cupy.cuda").attr("get_current_stream")(device.device_id);
    return {.handle = stream.attr("ptr").cast<std::uint64_t>(), .owner = stream_keep_alive(stream)};
  }
  static const int lives_for_the_process = 0;
  return {.handle = std::nullopt,
          .owner = std::shared_ptr<const void>{std::shared_ptr<const void>{}, &lives_for_the_process}};
}

}  // namespace

array_layout layout_of(const handoff_array_desc& desc)
{
  HANDOFF_EXPECTS(desc.ndim >= 0 && (desc.ndim == 0 || desc.shape != nullptr), value_error,
                  fmt::format("view: the shape is missing or ndim ({}) is negative", desc.ndim));
  const auto rank = static_cast<std::size_t>(desc.ndim);
  array_layout layout;
  layout.data = desc.data;
  layout.device = desc.device;
  layout.dtype = desc.dtype;
  layout.readonly = desc.readonly != 0;
  layout.shape = std::span<const std::int64_t>{desc.shape, rank};
  if (desc.strides != nullptr) {
    layout.strides = std::span<const std::int64_t>{desc.strides, rank};
  } else {
    layout.strides = contiguous_strides(layout.shape);
  }
  return layout;
}

py::object ready_stream_of(const handoff_array_desc& desc)
{
  if (desc.stream == HANDOFF_STREAM_ENCLOSING) { return enclosing_stream_for(desc.device); }
  return desc.stream == 0 ? py::object(py::none()) : py::object(py::int_(desc.stream));
}

handoff_array_info array_info(const array& view)
{
  const auto ready = view.owner().ready_on();
  return info_of(view.layout(),
                 ready ? stream_value_of(view.device().device_type, static_cast<std::uint64_t>(ready->stream)) : 0);
}

handoff_view* import_extension_view(exchange& on, py::handle object, py::handle stream)
{
  std::unique_ptr<handoff_view> made = numpy_view(on, object.ptr());
  if (!made) {
    // Traced as handoff.asarray's own imports are, the consumer being the extension.
    const producer_naming naming{object.ptr()};
    trace::exchange_scope scope{trace::event_kind::import_data, "dlpack"};
    if (scope.active()) { scope.event().consumer = "handoff::pybind"; }
    made = std::make_unique<handoff_view>();
    made->python = asarray(on, object, py::none(), py::none(), stream);
    made->info = array_info(*as_array(made->python));
  }
  return made.release();
}

handoff_view* describe_extension_view(exchange& on, array_layout layout, py::handle owner, py::handle stream)
{
  auto made = std::make_unique<handoff_view>();
  if (layout.device.device_type == kDLCPU && stream.is_none() && !trace::enabled()) {
    validate_description(layout);  // what handoff.view checks of host memory
    validate_layout(layout);
    made->host.emplace(std::move(layout));
    made->owner = py::reinterpret_borrow<py::object>(owner);
    made->info = info_of(*made->host, 0);
  } else {
    made->info = array_info(hold(*made, described_view(on, std::move(layout), owner, stream)));
  }
  return made.release();
}

void retain_extension_view(handoff_view* view) noexcept
{
  if (view != nullptr) { ++view->references; }
}

void release_extension_view(handoff_view* view) noexcept
{
  if (view != nullptr && --view->references == 0) { delete view; }
}

const array& runtime_view(exchange& on, handoff_view& view)
{
  if (view.python) { return *as_array(view.python); }
  if (view.held) { return *view.held; }
  return hold(view, described_view(on, array_layout{*view.host}, view.owner, py::none()));
}

py::object extension_view_to_python(exchange& on, handoff_view& view, int framework)
{
  HANDOFF_EXPECTS(framework >= HANDOFF_FRAMEWORK_HANDOFF && framework <= HANDOFF_FRAMEWORK_CUPY, value_error,
                  fmt::format("view_to_python: {} is no handoff_framework", framework));
  if (framework == HANDOFF_FRAMEWORK_HANDOFF) { return python_object(on, view); }
  // What NumPy cannot hold is refused naming why, not with numpy.from_dlpack's bare RuntimeError.
  if (framework == HANDOFF_FRAMEWORK_NUMPY) {
    require_numpy_can_hold(view.host ? *view.host : runtime_view(on, view).layout());
  }
  // NumPy's array of host data is made directly, the same array numpy.from_dlpack would make
  // without the export; its base keeps the data: the owner of writable host memory, else the view
  // (NumPy lets an array be made writable again when its base is). A trace records the export.
  if (framework == HANDOFF_FRAMEWORK_NUMPY && !trace::enabled()) {
    py::object base;
    if (view.host && !view.host->readonly && !view.owner.is_none()) {
      base = view.owner;
    } else {
      base = py::capsule(&view, "handoff.view", [](PyObject* capsule) {
        release_extension_view(static_cast<handoff_view*>(PyCapsule_GetPointer(capsule, "handoff.view")));
      });
      retain_extension_view(&view);  // the capsule's, once it exists
    }
    const array_layout& layout = view.host ? *view.host : runtime_view(on, view).layout();
    if (py::object made = numpy_array_of(layout, std::move(base)); !made.is_none()) { return made; }
  }
  const py::object& exported = python_object(on, view);
  // PyTorch's and CuPy's arrays cannot be read-only, and their from_dlpack ignores DLPack's flag:
  // the C++ side's read-only data (a const buffer) would come back writable.
  HANDOFF_EXPECTS(
    !as_array(exported)->readonly() || (framework != HANDOFF_FRAMEWORK_TORCH && framework != HANDOFF_FRAMEWORK_CUPY),
    buffer_error,
    fmt::format("read-only data cannot be returned as a {} array, which would be writable: return it as a "
                "handoff.Array or a NumPy array, or copy it",
                framework == HANDOFF_FRAMEWORK_TORCH ? "PyTorch" : "CuPy"));
  const DLDevice device = as_array(exported)->device();
  if (framework == HANDOFF_FRAMEWORK_NUMPY || !has_streams(device.device_type)) {
    return from_dlpack_of(framework)(exported);
  }
  const framework_stream consumer = consumer_stream_of(framework, device);
  const framework_call call{consumer};
  return from_dlpack_of(framework)(exported);
}

}  // namespace handoff::python
