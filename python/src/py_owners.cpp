#include "py_owners.hpp"

#include "py_gil.hpp"

namespace handoff::python {
namespace {

void release_reference(PyObject* object) noexcept
{
  with_gil([object] { Py_DECREF(object); });
}

}  // namespace

std::shared_ptr<const void> stream_keep_alive(py::handle stream_object)
{
  if (stream_object.is_none() || PyLong_Check(stream_object.ptr()) != 0) { return {}; }
  PyObject* raw = stream_object.inc_ref().ptr();
  return std::shared_ptr<const void>{raw, [](PyObject* object) noexcept { release_reference(object); }};
}

void keep_alive_until_done(context& ctx, int device, device::stream_handle stream, py::handle object) noexcept
{
  PyObject* raw = object.inc_ref().ptr();
  ctx.release_after(device, stream, [raw]() noexcept { release_reference(raw); });
}

producer_ref python_owner(py::handle object)
{
  PyObject* raw = object.inc_ref().ptr();
  return producer_ref{[raw]() noexcept { release_reference(raw); }};
}

}  // namespace handoff::python
