// The table of <handoff/python_c_api.h>: each function converts its C arguments and calls what the
// Python API calls, so that an extension's arrays behave exactly as handoff.view's and
// handoff.Exporter's.
#include "py_c_api.hpp"

#include "py_array.hpp"
#include "py_errors.hpp"
#include "py_exchange.hpp"
#include "py_view.hpp"

#include <handoff/python_c_api.h>
#include <handoff/error.hpp>
#include <handoff/stream_value.hpp>

#include <fmt/format.h>

#include <span>

namespace handoff::python {
namespace {

py::handle none_if_null(PyObject* object) noexcept
{
  return object != nullptr ? py::handle(object) : py::handle(Py_None);
}

PyObject* view(const handoff_array_desc* desc, PyObject* owner) noexcept
{
  return python_entry([&] {
    HANDOFF_EXPECTS(desc != nullptr, value_error, "view: the description is NULL");
    HANDOFF_EXPECTS(desc->ndim >= 0 && (desc->ndim == 0 || desc->shape != nullptr), value_error,
                    fmt::format("view: the shape is missing or ndim ({}) is negative", desc->ndim));
    const auto rank = static_cast<std::size_t>(desc->ndim);
    array_layout layout;
    layout.data = desc->data;
    layout.device = desc->device;
    layout.dtype = desc->dtype;
    layout.readonly = desc->readonly != 0;
    layout.shape = std::span<const std::int64_t>{desc->shape, rank};
    if (desc->strides != nullptr) {
      layout.strides = std::span<const std::int64_t>{desc->strides, rank};
    } else {
      layout.strides = contiguous_strides(layout.shape);
    }
    const py::object stream = desc->stream == 0 ? py::object(py::none()) : py::object(py::int_(desc->stream));
    return make_array(std::move(layout), none_if_null(owner), stream);
  });
}

PyObject* export_dlpack(PyObject* instance, PyObject* exported, PyObject* stream, PyObject* max_version,
                        PyObject* dl_device, PyObject* copy) noexcept
{
  return python_entry([&] {
    return py::object(exporter_dlpack(none_if_null(instance), none_if_null(exported), none_if_null(stream),
                                      none_if_null(max_version), none_if_null(dl_device), none_if_null(copy)));
  });
}

PyObject* asarray(PyObject* object, PyObject* stream) noexcept
{
  return python_entry([&] {
    HANDOFF_EXPECTS(object != nullptr, value_error, "asarray: the object is NULL");
    return python::asarray(object, py::none(), py::none(), none_if_null(stream));
  });
}

int import_array(PyObject* object, PyObject* stream, PyObject** out) noexcept
{
  if (out == nullptr || object == nullptr) {
    PyErr_SetString(PyExc_ValueError, "import_array: the object or the output is NULL");
    return -1;
  }
  *out = nullptr;
  try {
    *out = python::asarray(object, py::none(), py::none(), none_if_null(stream)).release().ptr();
    return 0;
  } catch (const no_array_protocol&) {
    return 1;  // it does not fit: nothing raised
  } catch (...) {
    raise_current_exception();
    return -1;
  }
}

int describe(PyObject* object, handoff_array_info* out) noexcept
{
  const array* view = object != nullptr ? as_array(object) : nullptr;
  if (view == nullptr || out == nullptr) {
    PyErr_Format(PyExc_TypeError, "describe: expected a handoff.Array and an output, got %s",
                 object != nullptr ? Py_TYPE(object)->tp_name : "NULL");
    return -1;
  }
  const auto ready = view->owner().ready_on();
  const std::intptr_t stream =
    ready ? stream_value_of(view->device().device_type, static_cast<std::uint64_t>(ready->stream)) : 0;
  *out = handoff_array_info{
    .data = view->data(),
    .ndim = view->ndim(),
    .shape = view->shape().data(),
    .strides = view->strides().data(),
    .dtype = view->dtype(),
    .device = view->device(),
    .stream = stream,
    .readonly = view->readonly() ? 1 : 0,
  };
  return 0;
}

const handoff_py_api table{
  .major = HANDOFF_PY_API_MAJOR,
  .minor = HANDOFF_PY_API_MINOR,
  .view = view,
  .export_dlpack = export_dlpack,
  .asarray = asarray,
  .describe = describe,
  .import_array = import_array,
};

}  // namespace

void bind_c_api(py::module_& m)
{
  m.attr("_C_API") = py::capsule(const_cast<handoff_py_api*>(&table), HANDOFF_PY_API_CAPSULE);
}

}  // namespace handoff::python
