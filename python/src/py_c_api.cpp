// The table of <handoff/python_c_api.h>: each function converts its C arguments and calls what the
// Python API calls, so that an extension's arrays behave exactly as handoff.view's and
// handoff.Exporter's.
#include "py_c_api.hpp"

#include "py_array.hpp"
#include "py_dlpack_class.hpp"
#include "py_errors.hpp"
#include "py_exchange.hpp"
#include "py_extension_views.hpp"
#include "py_view.hpp"

#include <handoff/python_c_api.h>
#include <handoff/error.hpp>
#include <handoff/stream_value.hpp>

#include <fmt/format.h>

#include <span>

namespace handoff::python {
namespace {

// The exchange bind_c_api was given: the table's functions have no closure to hold it.
exchange* bound_exchange = nullptr;

py::handle none_if_null(PyObject* object) noexcept
{
  return object != nullptr ? py::handle(object) : py::handle(Py_None);
}

PyObject* view(const handoff_array_desc* desc, PyObject* owner) noexcept
{
  return python_entry([&] {
    HANDOFF_EXPECTS(desc != nullptr, value_error, "view: the description is NULL");
    return make_array(*bound_exchange, layout_of(*desc), none_if_null(owner), ready_stream_of(*desc));
  });
}

// Not noexcept: the consumer stream's owner lookup runs Python code (see python_code_entry).
PyObject* export_dlpack(PyObject* instance, PyObject* exported, PyObject* stream, PyObject* max_version,
                        PyObject* dl_device, PyObject* copy)
{
  return python_code_entry([&] {
    return py::object(exporter_dlpack(*bound_exchange, none_if_null(instance), none_if_null(exported),
                                      none_if_null(stream), none_if_null(max_version), none_if_null(dl_device),
                                      none_if_null(copy)));
  });
}

PyObject* asarray(PyObject* object, PyObject* stream) noexcept
{
  return python_entry([&] {
    HANDOFF_EXPECTS(object != nullptr, value_error, "asarray: the object is NULL");
    return python::asarray(*bound_exchange, object, py::none(), py::none(), none_if_null(stream));
  });
}

// Runs an import for a caller that may try something else: 0 when it made one; 1, nothing raised,
// when the object speaks no array protocol (it does not fit); -1 with any other failure's error.
template <typename Import>
int import_if_it_fits(Import&& import) noexcept
{
  try {
    import();
    return 0;
  } catch (const no_array_protocol&) {
    return 1;
  } catch (...) {
    raise_current_exception();
    return -1;
  }
}

int import_array(PyObject* object, PyObject* stream, PyObject** out) noexcept
{
  if (out == nullptr || object == nullptr) {
    PyErr_SetString(PyExc_ValueError, "import_array: the object or the output is NULL");
    return -1;
  }
  *out = nullptr;
  return import_if_it_fits([&] {
    *out = python::asarray(*bound_exchange, object, py::none(), py::none(), none_if_null(stream)).release().ptr();
  });
}

int describe(PyObject* object, handoff_array_info* out) noexcept
{
  const array* view = object != nullptr ? as_array(object) : nullptr;
  if (view == nullptr || out == nullptr) {
    PyErr_Format(PyExc_TypeError, "describe: expected a handoff.Array and an output, got %s",
                 object != nullptr ? Py_TYPE(object)->tp_name : "NULL");
    return -1;
  }
  *out = array_info(*view);
  return 0;
}

int import_view(PyObject* object, PyObject* stream, handoff_view** out, handoff_array_info* info) noexcept
{
  if (object == nullptr || out == nullptr || info == nullptr) {
    PyErr_SetString(PyExc_ValueError, "import_view: the object or an output is NULL");
    return -1;
  }
  *out = nullptr;
  return import_if_it_fits([&] {
    *out = import_extension_view(*bound_exchange, object, none_if_null(stream));
    *info = (*out)->info;
  });
}

handoff_view* make_view(const handoff_array_desc* desc, PyObject* owner, handoff_array_info* info) noexcept
{
  try {
    HANDOFF_EXPECTS(desc != nullptr && info != nullptr, value_error, "make_view: the description or output is NULL");
    handoff_view* made =
      describe_extension_view(*bound_exchange, layout_of(*desc), none_if_null(owner), ready_stream_of(*desc));
    *info = made->info;
    return made;
  } catch (...) {
    raise_current_exception();
    return nullptr;
  }
}

void retain_view(handoff_view* view) noexcept
{
  retain_extension_view(view);
}

void release_view(handoff_view* view) noexcept
{
  release_extension_view(view);
}

PyObject* view_to_python(handoff_view* view, int framework) noexcept
{
  return python_entry([&] {
    HANDOFF_EXPECTS(view != nullptr, value_error, "view_to_python: the view is NULL");
    return extension_view_to_python(*bound_exchange, *view, framework);
  });
}

int def_dlpack(PyObject* type, handoff_describe_fn describe, void* context, PyObject* context_owner) noexcept
{
  try {
    HANDOFF_EXPECTS(type != nullptr, value_error, "def_dlpack: the type is NULL");
    python::def_dlpack(*bound_exchange, type, describe, context, none_if_null(context_owner));
    return 0;
  } catch (...) {
    raise_current_exception();
    return -1;
  }
}

const handoff_py_api table{
  .major = HANDOFF_PY_API_MAJOR,
  .minor = HANDOFF_PY_API_MINOR,
  .view = view,
  .export_dlpack = export_dlpack,
  .asarray = asarray,
  .describe = describe,
  .import_array = import_array,
  .import_view = import_view,
  .make_view = make_view,
  .retain_view = retain_view,
  .release_view = release_view,
  .view_to_python = view_to_python,
  .def_dlpack = def_dlpack,
};

}  // namespace

void bind_c_api(py::module_& m, exchange& on)
{
  bound_exchange = &on;
  m.attr("_C_API") = py::capsule(const_cast<handoff_py_api*>(&table), HANDOFF_PY_API_CAPSULE);
}

}  // namespace handoff::python
