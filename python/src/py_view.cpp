// For library authors: handoff.view, which wraps memory a library describes itself, and the export
// behind handoff.Exporter. Arguments are converted here; the checks and the stream they are ready on
// are the runtime's (make_view).
#include "py_view.hpp"

#include "py_arguments.hpp"
#include "py_array.hpp"
#include "py_cpython.hpp"
#include "py_errors.hpp"
#include "py_owners.hpp"
#include "py_streams.hpp"

#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/interface.hpp>

#include <fmt/format.h>

#include <climits>

namespace handoff::python {
namespace {

std::int64_t int64_of(py::handle value, const char* field)
{
  HANDOFF_EXPECTS(is_int(value.ptr()), type_error, fmt::format("{} must hold ints, not {}", field, type_name(value)));
  const int64_reading read = read_int64(value.ptr());
  HANDOFF_EXPECTS(read.fits(), value_error,
                  fmt::format("{} holds {}, which does not fit in 64 bits", field, py::str(value).cast<std::string>()));
  return read.value;
}

// An int (one axis) or a sequence of ints.
extents int_sequence(py::handle value, const char* field)
{
  extents out;
  if (is_int(value.ptr())) {
    out.push_back(int64_of(value, field));
    return out;
  }
  HANDOFF_EXPECTS(PySequence_Check(value.ptr()) && !PyUnicode_Check(value.ptr()), type_error,
                  fmt::format("{} must be an int or a sequence of ints, not {}", field, type_name(value)));
  for (const py::handle item : py::reinterpret_borrow<py::sequence>(value)) { out.push_back(int64_of(item, field)); }
  return out;
}

void* data_pointer(py::handle value)
{
  HANDOFF_EXPECTS(is_int(value.ptr()), type_error, fmt::format("data_ptr must be an int, not {}", type_name(value)));
  const unsigned long long address = PyLong_AsUnsignedLongLong(value.ptr());
  if (address == static_cast<unsigned long long>(-1) && PyErr_Occurred() != nullptr) {
    PyErr_Clear();
    throw value_error(fmt::format("data_ptr {} is not an address", py::str(value).cast<std::string>()));
  }
  return reinterpret_cast<void*>(static_cast<std::uintptr_t>(address));
}

// A dtype name ('float32') or an object naming one in its `name` (a NumPy dtype, in native byte
// order: DLPack has no other, and a swapped '>f4' is named 'float32' too).
DLDataType dtype_argument(py::handle value)
{
  py::object name = py::reinterpret_borrow<py::object>(value);
  if (!PyUnicode_Check(value.ptr()) && py::hasattr(value, "name")) {
    if (py::hasattr(value, "isnative")) {
      HANDOFF_EXPECTS(PyObject_IsTrue(value.attr("isnative").ptr()) == 1, buffer_error,
                      fmt::format("{} is not in native byte order, and DLPack has no other (convert it first, "
                                  "e.g. with numpy's astype(dtype.newbyteorder('=')))",
                                  py::repr(value).cast<std::string>()));
    }
    name = value.attr("name");
  }
  HANDOFF_EXPECTS(PyUnicode_Check(name.ptr()), type_error,
                  fmt::format("dtype must be a name such as 'float32' or a NumPy dtype, not {}", type_name(value)));
  const auto text = name.cast<std::string>();
  const auto dtype = dtype_from_name(text);
  HANDOFF_EXPECTS(dtype.has_value(), value_error,
                  fmt::format("dtype '{}' is not a dtype handoff knows (NumPy-style names: 'float32', 'int8', "
                              "'bool', 'bfloat16', 'complex64', ...)",
                              text));
  return *dtype;
}

py::object view(exchange& on, py::handle data_ptr, py::handle shape, py::handle dtype, py::handle device,
                py::handle strides, py::handle owner, py::handle stream, bool readonly)
{
  array_layout layout;
  layout.data = data_pointer(data_ptr);
  layout.shape = int_sequence(shape, "shape");
  layout.dtype = dtype_argument(dtype);
  HANDOFF_EXPECTS(!device.is_none(), type_error, "device is required: a (device_type, device_id) tuple or 'cpu'");
  layout.device = *device_argument(device, "device");
  layout.readonly = readonly;
  if (strides.is_none()) {
    layout.strides = contiguous_strides(layout.shape);
  } else {
    const extents bytes = int_sequence(strides, "strides");
    layout.strides = element_strides(layout.shape, bytes, itemsize(layout.dtype), "strides");
  }
  return make_array(on, std::move(layout), owner, stream);
}

}  // namespace

array described_view(exchange& on, array_layout&& layout, py::handle owner, py::handle stream)
{
  // None: the stream is unknown, which is not DLPack's None (the default stream).
  const named_stream ready = stream.is_none() ? named_stream{} : stream_named_by(stream);
  shared_producer keep = owner.is_none() ? shared_producer{[] {}} : python_owner(owner);
  return on.view(std::move(layout), std::move(keep), ready);
}

py::object make_array(exchange& on, array_layout layout, py::handle owner, py::handle stream)
{
  return wrap(described_view(on, std::move(layout), owner, stream));
}

py::capsule exporter_dlpack(exchange& on, py::handle instance, py::handle exported, py::handle stream,
                            py::handle max_version, py::handle dl_device, py::handle copy)
{
  const array* view = as_array(exported);
  HANDOFF_EXPECTS(view != nullptr, type_error,
                  fmt::format("{}.__handoff_array__() must return a handoff.Array, not {}", type_name(instance),
                              type_name(exported)));
  array holding{view->layout(), shared_producer{[inner = view->owner(), outer = python_owner(instance)]() noexcept {}}};
  if (const auto ready = view->owner().ready_on()) { holding.owner().set_ready_on(*ready); }
  return export_dlpack(on, holding, stream, max_version, dl_device, copy);
}

void bind_view(py::module_& m, exchange& on)
{
  m.def(
    "view",
    [&on](py::handle data_ptr, py::handle shape, py::handle dtype, py::handle device, py::handle strides,
          py::handle owner, py::handle stream,
          bool readonly) { return view(on, data_ptr, shape, dtype, device, strides, owner, stream, readonly); },
    py::arg("data_ptr"), py::arg("shape"), py::arg("dtype"), py::kw_only(), py::arg("device"),
    py::arg("strides") = py::none(), py::arg("owner") = py::none(), py::arg("stream") = py::none(),
    py::arg("readonly") = false,
    "Wraps memory that `owner` keeps alive as a handoff.Array, without copying.\n\n"
    "`device` is (device_type, device_id) with DLPack's codes, or 'cpu'; `strides` are in bytes (None: C\n"
    "order); `stream` is the stream the data is ready on (an int in DLPack's convention or any stream\n"
    "object; None: unknown, so exports order after the device's default stream). `owner` is held until the\n"
    "last view, capsule and consumer stream using the memory are done.");
  m.def(
    "_exporter_dlpack",
    [&on](py::handle instance, py::handle exported, py::handle stream, py::handle max_version, py::handle dl_device,
          py::handle copy) { return exporter_dlpack(on, instance, exported, stream, max_version, dl_device, copy); },
    py::arg("instance"), py::arg("exported"), py::arg("stream"), py::arg("max_version"), py::arg("dl_device"),
    py::arg("copy"), "handoff.Exporter.__dlpack__: exports `exported` holding `instance` too.");
}

}  // namespace handoff::python
