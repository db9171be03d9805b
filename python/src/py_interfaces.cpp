#include "py_interfaces.hpp"

#include "py_cpython.hpp"
#include "py_errors.hpp"
#include "py_gil.hpp"
#include "py_owners.hpp"
#include "py_streams.hpp"

#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>

#include <fmt/format.h>

#include <memory>

namespace handoff::python {
namespace {

// Reads the keys of an interface dict into an interface_dict, checking the type of each value and
// naming the interface and the key in errors; the core checks the values.
class interface_reader {
 public:
  interface_reader(py::handle interface, const char* protocol) : protocol_(protocol)
  {
    HANDOFF_EXPECTS(PyDict_Check(interface.ptr()), value_error, fmt::format("{} must be a dict", protocol));
    dict_ = py::reinterpret_borrow<py::dict>(interface);
  }

  /// The value of `key`; a null handle when absent.
  [[nodiscard]] py::handle optional(const char* key) const
  {
    PyObject* value = PyDict_GetItemString(dict_.ptr(), key);  // borrowed; nullptr when absent
    return value;
  }

  /// The value of `key`; a null handle when absent or None.
  [[nodiscard]] py::handle given(const char* key) const
  {
    const py::handle value = optional(key);
    return value && !value.is_none() ? value : py::handle{};
  }

  [[nodiscard]] std::int64_t integer(py::handle value, const char* what) const
  {
    HANDOFF_EXPECTS(is_int(value.ptr()), value_error,
                    fmt::format("{} '{}' must be an int, not {}", protocol_, what, type_name(value)));
    const int64_reading read = read_int64(value.ptr());
    HANDOFF_EXPECTS(read.fits(), value_error, fmt::format("{} '{}' is out of range", protocol_, what));
    return read.value;
  }

  [[nodiscard]] extents integers(py::handle value, const char* key) const
  {
    HANDOFF_EXPECTS(PyTuple_Check(value.ptr()), value_error,
                    fmt::format("{} '{}' must be a tuple of ints, not {}", protocol_, key, type_name(value)));
    extents out;
    out.reserve(static_cast<std::size_t>(PyTuple_GET_SIZE(value.ptr())));
    for (const auto item : py::reinterpret_borrow<py::tuple>(value)) { out.push_back(integer(item, key)); }
    return out;
  }

  [[nodiscard]] std::string text(py::handle value, const char* key) const
  {
    HANDOFF_EXPECTS(PyUnicode_Check(value.ptr()), value_error,
                    fmt::format("{} '{}' must be a str, not {}", protocol_, key, type_name(value)));
    return value.cast<std::string>();
  }

  /// The keys both protocols share: version, shape, typestr, strides and mask.
  [[nodiscard]] interface_dict common() const
  {
    interface_dict dict;
    if (const py::handle version = optional("version")) { dict.version = integer(version, "version"); }
    if (const py::handle shape = optional("shape")) { dict.shape = integers(shape, "shape"); }
    if (const py::handle typestr = optional("typestr")) { dict.typestr = text(typestr, "typestr"); }
    if (const py::handle strides = given("strides")) { dict.strides = integers(strides, "strides"); }
    dict.masked = static_cast<bool>(given("mask"));
    return dict;
  }

  /// A `data` key that is a (pointer, readonly) tuple.
  [[nodiscard]] interface_pointer pointer(py::handle data) const
  {
    const bool pair = PyTuple_Check(data.ptr()) && PyTuple_GET_SIZE(data.ptr()) == 2;
    HANDOFF_EXPECTS(pair, value_error,
                    fmt::format("{} 'data' must be a (pointer, readonly) tuple, not {}", protocol_, type_name(data)));
    const auto tuple = py::reinterpret_borrow<py::tuple>(data);
    const std::int64_t address = integer(tuple[0], "data[0]");
    HANDOFF_EXPECTS(PyBool_Check(tuple[1].ptr()), value_error,
                    fmt::format("{} 'data'[1] (readonly) must be a bool", protocol_));
    return {address, tuple[1].ptr() == Py_True};
  }

 private:
  py::dict dict_;
  const char* protocol_;
};

array bind_layout(array_layout layout, shared_producer owner, const char* protocol)
{
  try {
    return array{std::move(layout), std::move(owner)};
  } catch (const value_error& e) {
    throw value_error(fmt::format("{}: {}", protocol, e.what()));
  }
}

// Holds a Py_buffer until the producer is released (under the GIL, from any thread).
shared_producer buffer_owner(std::unique_ptr<Py_buffer> buffer)
{
  Py_buffer* raw = buffer.release();
  return shared_producer{[raw]() noexcept {
    with_gil([raw] {
      PyBuffer_Release(raw);
      delete raw;
    });
  }};
}

// What keeps the producer's stream, named by the interface's `stream`, alive until the view's
// release (stream_held_by). Empty when nothing proves the stream alive then.
std::shared_ptr<const void> held_stream(py::handle object, std::optional<std::int64_t> stream)
{
  const stream_request producer = classify_stream(kDLCUDA, stream);
  if (producer.order != stream_order::handle) { return {}; }
  return stream_held_by(object, producer.handle);
}

}  // namespace

array import_buffer(py::handle object)
{
  auto buffer = std::make_unique<Py_buffer>();
  if (PyObject_GetBuffer(object.ptr(), buffer.get(), PyBUF_RECORDS_RO) != 0) { throw py::error_already_set(); }
  const Py_buffer& b = *buffer;
  shared_producer owner = buffer_owner(std::move(buffer));  // from here on, every exit releases the buffer
  array_layout layout;
  layout.dtype = dtype_from_buffer_format(b.format != nullptr ? b.format : "B", static_cast<std::size_t>(b.itemsize));
  layout.data = b.buf;
  layout.readonly = b.readonly != 0;
  // Exporters may leave shape or strides NULL (ctypes does for strides; 0-d buffers may for both):
  // PEP 3118 reads that as C-contiguous, and a NULL shape of one dimension as len / itemsize.
  if (b.ndim > 0 && b.shape != nullptr) {
    layout.shape.assign(b.shape, b.shape + b.ndim);
  } else if (b.ndim > 0) {
    layout.shape.assign(1, static_cast<std::int64_t>(b.len / b.itemsize));
  }
  if (b.ndim == 0 || b.strides == nullptr || b.shape == nullptr) {
    layout.strides = contiguous_strides(layout.shape);
  } else {
    extents bytes;
    bytes.assign(b.strides, b.strides + b.ndim);
    layout.strides = element_strides(layout.shape, bytes, static_cast<std::size_t>(b.itemsize), "buffer 'strides'");
  }
  return bind_layout(std::move(layout), std::move(owner), "buffer");
}

array import_array_interface(py::handle object, py::handle interface)
{
  const interface_reader reader{interface, "__array_interface__"};
  interface_dict dict = reader.common();
  const py::handle data = reader.given("data");
  if (data && PyTuple_Check(data.ptr())) {
    dict.data = reader.pointer(data);
    return array{validate_array_interface(dict), python_owner(object)};
  }
  // The data is the buffer of `data`, or of the object itself, from `offset` on.
  if (const py::handle offset = reader.optional("offset")) { dict.offset = reader.integer(offset, "offset"); }
  const py::handle exporter = data ? data : object;
  HANDOFF_EXPECTS(PyObject_CheckBuffer(exporter.ptr()) != 0, value_error,
                  data ? fmt::format("__array_interface__ 'data' must be a (pointer, readonly) tuple or an object "
                                     "with the buffer protocol, not {}",
                                     type_name(data))
                       : fmt::format("__array_interface__ 'data' is absent or None, and the {} object has no buffer",
                                     type_name(object)));
  const array whole = import_buffer(exporter);
  HANDOFF_EXPECTS(whole.is_c_contiguous(), value_error,
                  "__array_interface__ 'data' is a buffer, but not a contiguous one");
  return array{validate_array_interface(dict, {whole.data(), whole.nbytes(), whole.readonly()}), whole.owner()};
}

cuda_interface parse_cuda_array_interface(py::handle interface)
{
  const interface_reader reader{interface, "__cuda_array_interface__"};
  interface_dict dict = reader.common();
  if (const py::handle data = reader.optional("data")) { dict.data = reader.pointer(data); }
  if (const py::handle stream = reader.given("stream")) { dict.stream = reader.integer(stream, "stream"); }
  return validate_cuda_array_interface(dict);
}

array import_cuda_array_interface(exchange& on, py::handle object, py::handle interface, const import_request& request)
{
  cuda_interface parsed = parse_cuda_array_interface(interface);
  std::shared_ptr<const void> stream_owner = held_stream(object, parsed.stream);
  return on.import_interface(std::move(parsed), python_owner(object), request, std::move(stream_owner));
}

}  // namespace handoff::python
