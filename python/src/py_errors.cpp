#include "py_errors.hpp"

#include <handoff/error.hpp>

#include <cstring>
#include <new>
#include <utility>

namespace handoff::python {

std::string_view type_name(py::handle object) noexcept
{
  PyTypeObject* type = Py_TYPE(object.ptr());
  if (PyType_HasFeature(type, Py_TPFLAGS_HEAPTYPE)) {  // a class: its __name__ is its own object
    if (const char* name = PyUnicode_AsUTF8(reinterpret_cast<PyHeapTypeObject*>(type)->ht_name)) { return name; }
    PyErr_Clear();
  }
  const char* dot = std::strrchr(type->tp_name, '.');  // a static type: "module.name"
  return dot != nullptr ? dot + 1 : type->tp_name;
}

namespace {

PyObject* device_error_type = nullptr;

void raise_device_error(const device_error& e)
{
  py::object instance = py::reinterpret_borrow<py::object>(device_error_type)(e.what());
  instance.attr("backend") = e.backend();
  instance.attr("error_name") = e.error_name();
  PyErr_SetObject(device_error_type, instance.ptr());
}

}  // namespace

void set_device_error_type(PyObject* type) noexcept
{
  device_error_type = type;
}

void translate_exception(std::exception_ptr thrown)
{
  try {
    if (thrown) { std::rethrow_exception(std::move(thrown)); }
  } catch (const device_error& e) {
    raise_device_error(e);
  } catch (const value_error& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const buffer_error& e) {
    PyErr_SetString(PyExc_BufferError, e.what());
  } catch (const type_error& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const not_implemented_error& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what());
  }
}

void raise_current_exception() noexcept
{
  try {
    try {
      throw;
    } catch (py::error_already_set& e) {
      e.restore();
    } catch (const py::builtin_exception& e) {
      e.set_error();
    } catch (const error&) {
      translate_exception(std::current_exception());
    } catch (const std::bad_alloc&) {
      PyErr_NoMemory();
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  } catch (py::error_already_set& e) {  // raised while building the Python exception
    e.restore();
  } catch (...) {
    PyErr_SetString(PyExc_SystemError, "an unknown C++ exception escaped from handoff");
  }
}

}  // namespace handoff::python
