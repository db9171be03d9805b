#include "py_streams.hpp"

#include "py_arguments.hpp"
#include "py_cpython.hpp"
#include "py_errors.hpp"
#include "py_owners.hpp"

#include <handoff/error.hpp>

#include <fmt/format.h>

#include <array>
#include <string>
#include <utility>

namespace handoff::python {
namespace {

// Interned attribute names, and handoff.Stream once the package registered it.
struct stream_names {
  PyObject* cuda_stream_protocol = nullptr;  // "__cuda_stream__"
  PyObject* cuda_stream = nullptr;           // PyTorch's
  PyObject* ptr = nullptr;                   // CuPy's
  PyObject* device = nullptr;
  PyObject* index = nullptr;
  PyObject* device_id = nullptr;
  PyObject* handle = nullptr;
  PyObject* stream = nullptr;           // a CUDA Array Interface producer's attribute
  PyObject* source = nullptr;           // handoff.Stream's stream object
  PyObject* open = nullptr;             // whether a block's entry is still open
  PyTypeObject* stream_type = nullptr;  // handoff.Stream
  // The blocks entered in this context, innermost last (handoff._streams' entries, each with
  // `stream` and `open`): context-local, so that blocks are per thread and per asyncio task.
  PyObject* blocks = nullptr;
};
stream_names names;

// A handoff.Stream handle: an int in [0, 2**63).
std::uint64_t checked_handle(py::handle handle)
{
  HANDOFF_EXPECTS(is_int(handle.ptr()), type_error,
                  fmt::format("Stream handle must be an int, not {}", type_name(handle)));
  const int64_reading value = read_int64(handle.ptr());
  HANDOFF_EXPECTS(
    value.fits() && value.value >= 0, value_error,
    fmt::format("Stream handle {} is outside the native range [0, 2**63)", py::str(handle).cast<std::string>()));
  return static_cast<std::uint64_t>(value.value);
}

// A handoff.Stream device: None or an int >= 0.
void check_device(py::handle device)
{
  bool valid = device.is_none();
  if (!valid && is_int(device.ptr())) { valid = read_int64(device.ptr()).saturated() >= 0; }
  HANDOFF_EXPECTS(
    valid, value_error,
    fmt::format("Stream device must be None or a non-negative int, got {}", py::repr(device).cast<std::string>()));
}

// The device a stream object names, as an int; None when it names none or one that is not
// int-like: its `.device`'s `.index` (PyTorch's torch.device) or `.device_id` (cuda.core's Device),
// or that `.device` itself; else the stream's own `.device_id` (CuPy's), where -1 names none.
py::object device_of(py::handle stream)
{
  py::object index;
  if (py::object device = optional_attribute(stream, names.device); device && !device.is_none()) {
    index = optional_attribute(device, names.index);
    if (!index) { index = optional_attribute(device, names.device_id); }
    if (!index) { index = std::move(device); }
  } else {
    index = optional_attribute(stream, names.device_id);
    if (!index || (is_int(index.ptr()) && read_int64(index.ptr()).saturated() == -1)) { return py::none(); }
  }
  if (index.is_none()) { return index; }
  PyObject* number = PyNumber_Long(index.ptr());  // int(index)
  if (number == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_ValueError)) {
      throw py::error_already_set();
    }
    PyErr_Clear();
    return py::none();
  }
  return py::reinterpret_steal<py::object>(number);
}

// A stream object's native handle and the device it names (None, or an int >= 0).
struct resolved_stream {
  std::uint64_t handle{0};
  py::object device;
};

// The stream a stream object names by `handle`, on the device it names. The device is read first,
// as as_stream always did (it made Stream(handle, device=...), its arguments evaluated first).
resolved_stream stream_named_by_handle(py::handle stream, py::handle handle)
{
  py::object device = device_of(stream);
  const std::uint64_t native = checked_handle(handle);
  check_device(device);
  return {native, std::move(device)};
}

// What handoff.as_stream makes a handoff.Stream of, from anything but a handoff.Stream.
resolved_stream resolve_stream_object(py::handle stream)
{
  PyObject* raw = stream.ptr();
  HANDOFF_EXPECTS(!PyBool_Check(raw), type_error, "a bool is not a stream");
  if (PyLong_Check(raw)) { return {checked_handle(stream), py::none()}; }
  py::object value = optional_attribute(stream, names.cuda_stream_protocol);
  if (value && !value.is_none()) {
    if (PyCallable_Check(value.ptr()) != 0) {
      // Called with no new object of ours alive in this frame: Python code may run, and a daemon thread
      // that finalization ends there (pthread_exit) unwinds through it, dropping what it holds
      // without the GIL. A method call makes no bound method to hold.
      value = py::object();
      value = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(raw, names.cuda_stream_protocol));
      if (!value) { throw py::error_already_set(); }
    }
    PyObject* pair = value.ptr();
    HANDOFF_EXPECTS(PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2 && is_int(PyTuple_GET_ITEM(pair, 0)) &&
                      is_int(PyTuple_GET_ITEM(pair, 1)),
                    type_error,
                    fmt::format("{}.__cuda_stream__() must return (version, handle), two ints", type_name(stream)));
    return stream_named_by_handle(stream, PyTuple_GET_ITEM(pair, 1));
  }
  for (PyObject* name : std::array{names.cuda_stream, names.ptr}) {
    if (const py::object handle = optional_attribute(stream, name); handle && is_int(handle.ptr())) {
      return stream_named_by_handle(stream, handle);
    }
  }
  throw type_error(
    fmt::format("{} is not a stream: expected an int, handoff.Stream, or an object with "
                "__cuda_stream__(), .cuda_stream or .ptr",
                type_name(stream)));
}

}  // namespace

py::object enclosing_stream()
{
  PyObject* raw = nullptr;
  if (PyContextVar_Get(names.blocks, nullptr, &raw) != 0) { throw py::error_already_set(); }
  const auto blocks = py::reinterpret_steal<py::object>(raw);
  if (!PyTuple_Check(raw)) { return py::none(); }
  // The innermost block still open: one left elsewhere (a generator finished in another context)
  // no longer counts here either.
  for (Py_ssize_t i = PyTuple_GET_SIZE(raw); i-- > 0;) {
    py::handle entry = PyTuple_GET_ITEM(raw, i);
    const int open = PyObject_IsTrue(entry.attr(names.open).ptr());
    if (open < 0) { throw py::error_already_set(); }
    if (open != 0) { return entry.attr(names.stream); }
  }
  return py::none();
}

py::object enclosing_stream_for(DLDevice device)
{
  if (!has_streams(device.device_type)) { return py::none(); }
  py::object block = enclosing_stream();
  if (block.is_none()) { return block; }
  const py::object on = block.attr("device");
  return on.is_none() || on.cast<long long>() == device.device_id ? block : py::object(py::none());
}

namespace {
// The framework whose from_dlpack this thread is calling (framework_call), if any.
thread_local const framework_stream* calling_framework = nullptr;
}  // namespace

framework_call::framework_call(const framework_stream& stream) noexcept
    : outer_(std::exchange(calling_framework, &stream))
{}

framework_call::~framework_call()
{
  calling_framework = outer_;
}

std::shared_ptr<const void> enclosing_stream_owner(std::uint64_t handle)
{
  if (const framework_stream* framework = calling_framework) {
    if (!framework->handle || *framework->handle == handle) { return framework->owner; }
  }
  const py::object block = enclosing_stream();
  if (block.is_none()) { return {}; }
  py::object source = block.attr(names.source);  // the stream object handoff.as_stream was given, or None
  if (source.is_none() || stream_handle(block) != handle) { return {}; }
  return stream_keep_alive(source);
}

std::uint64_t stream_handle(py::handle stream)
{
  if (names.stream_type != nullptr && PyObject_TypeCheck(stream.ptr(), names.stream_type)) {
    return checked_handle(stream.attr(names.handle));
  }
  return resolve_stream_object(stream).handle;
}

std::shared_ptr<const void> stream_held_by(py::handle producer, std::uint64_t handle)
{
  const call_argument held{optional_attribute(producer, names.stream)};
  PyObject* raw = held.get().ptr();
  if (raw == Py_None || PyLong_Check(raw) != 0) { return {}; }  // a bare handle holds no stream
  const bool wrapper = names.stream_type != nullptr && PyObject_TypeCheck(raw, names.stream_type) != 0;
  if (wrapper && optional_attribute(held.get(), names.source).is_none()) { return {}; }  // made from an int
  try {
    if (stream_handle(held.get()) != handle) { return {}; }  // another stream
  } catch (const type_error&) {
    return {};  // not a stream object
  } catch (const value_error&) {
    return {};
  }
  return stream_keep_alive(held.get());
}

named_stream stream_named_by(py::handle stream)
{
  if (stream.is_none()) { return {}; }
  if (is_int(stream.ptr())) { return named_stream::dlpack(*stream_argument(stream)); }
  return named_stream::native(stream_handle(stream), stream_keep_alive(stream));  // TypeError for what is no stream
}

py::object stream_argument_for(const named_stream& stream, DLDeviceType device)
{
  // A stream of device data is checked before the producer is asked: it may not check it (a producer
  // of pinned memory is not given the consumer's stream at all), or refuse it in its own words
  // (PyTorch asserts). Host data takes any consumer stream, and gives its producer none.
  if (is_pinned_host(device) || (!stream.is_default() && has_streams(device))) { (void)request_for(stream, device); }
  const auto value = dlpack_stream_value(stream, device);
  return value ? py::object(py::int_(*value)) : py::object(py::none());
}

void bind_streams(py::module_& m)
{
  names.cuda_stream_protocol = interned("__cuda_stream__");
  names.cuda_stream = interned("cuda_stream");
  names.ptr = interned("ptr");
  names.device = interned("device");
  names.index = interned("index");
  names.device_id = interned("device_id");
  names.handle = interned("handle");
  names.stream = interned("stream");
  names.source = interned("_source");
  names.open = interned("open");
  names.blocks = PyContextVar_New("handoff.stream", py::tuple().ptr());
  if (names.blocks == nullptr) { throw py::error_already_set(); }
  m.attr("_stream_var") = py::reinterpret_borrow<py::object>(names.blocks);
  m.def(
    "_set_stream_type",
    [](py::type stream_type) {
      names.stream_type = reinterpret_cast<PyTypeObject*>(stream_type.release().ptr());  // kept for the process
    },
    py::arg("stream_type"), "Registers handoff.Stream, whose handle stream objects are read without a lookup.");
  m.def(
    "_resolve_stream",
    [](py::handle stream) {
      resolved_stream resolved = resolve_stream_object(stream);
      return py::make_tuple(resolved.handle, std::move(resolved.device));
    },
    py::arg("stream"), "(handle, device) of a stream object, as handoff.as_stream resolves it.");
  m.def(
    "_check_stream",
    [](py::handle handle, py::handle device) {
      (void)checked_handle(handle);
      check_device(device);
    },
    py::arg("handle"), py::arg("device"), "Checks the handle and device of a handoff.Stream.");
}

}  // namespace handoff::python
