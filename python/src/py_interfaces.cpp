#include "py_interfaces.hpp"

#include "py_gil.hpp"

#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/runtime.hpp>
#include <handoff/stream.hpp>

#include <fmt/format.h>

#include <memory>

namespace handoff::python {
namespace {

// Reads one key of an interface dict, naming the interface in errors.
class interface_reader {
 public:
  interface_reader(py::handle interface, const char* protocol) : protocol_(protocol)
  {
    HANDOFF_EXPECTS(PyDict_Check(interface.ptr()), value_error, fmt::format("{} must be a dict", protocol));
    dict_ = py::reinterpret_borrow<py::dict>(interface);
  }

  [[nodiscard]] py::handle optional(const char* key) const
  {
    PyObject* value = PyDict_GetItemString(dict_.ptr(), key);  // borrowed; nullptr when absent
    return value;
  }

  [[nodiscard]] py::handle required(const char* key) const
  {
    py::handle value = optional(key);
    HANDOFF_EXPECTS(value, value_error, fmt::format("{} has no '{}' key", protocol_, key));
    return value;
  }

  [[nodiscard]] std::int64_t integer(py::handle value, const char* what) const
  {
    HANDOFF_EXPECTS(PyLong_Check(value.ptr()) && !PyBool_Check(value.ptr()), value_error,
                    fmt::format("{} '{}' must be an int, not {}", protocol_, what, type_name(value)));
    int overflow = 0;
    const long long out = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    HANDOFF_EXPECTS(overflow == 0, value_error, fmt::format("{} '{}' is out of range", protocol_, what));
    return out;
  }

  [[nodiscard]] std::vector<std::int64_t> integers(py::handle value, const char* key) const
  {
    HANDOFF_EXPECTS(PyTuple_Check(value.ptr()), value_error,
                    fmt::format("{} '{}' must be a tuple of ints, not {}", protocol_, key, type_name(value)));
    std::vector<std::int64_t> out;
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

  [[nodiscard]] const char* protocol() const noexcept { return protocol_; }

  static std::string type_name(py::handle value)
  {
    return py::str(py::type::handle_of(value).attr("__name__")).cast<std::string>();
  }

 private:
  py::dict dict_;
  const char* protocol_;
};

// Shape, typestr and strides (bytes in the interface, elements in handoff).
array_layout common_layout(const interface_reader& reader)
{
  array_layout layout;
  layout.shape = reader.integers(reader.required("shape"), "shape");
  layout.dtype = dtype_from_typestr(reader.text(reader.required("typestr"), "typestr"),
                                    fmt::format("{} 'typestr'", reader.protocol()));
  const py::handle mask = reader.optional("mask");
  if (mask && !mask.is_none()) {
    throw not_implemented_error(fmt::format("{} with a mask is not supported", reader.protocol()));
  }
  const py::handle strides = reader.optional("strides");
  if (!strides || strides.is_none()) {
    for (std::size_t i = 0; i < layout.shape.size(); ++i) {
      HANDOFF_EXPECTS(layout.shape[i] >= 0, value_error,
                      fmt::format("{} 'shape'[{}] is negative ({})", reader.protocol(), i, layout.shape[i]));
    }
    layout.strides = contiguous_strides(layout.shape);
    return layout;
  }
  const auto bytes = reader.integers(strides, "strides");
  HANDOFF_EXPECTS(bytes.size() == layout.shape.size(), value_error,
                  fmt::format("{} 'strides' has {} entries but 'shape' has {}", reader.protocol(), bytes.size(),
                              layout.shape.size()));
  const auto item = static_cast<std::int64_t>(itemsize(layout.dtype));
  layout.strides.reserve(bytes.size());
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    HANDOFF_EXPECTS(bytes[i] % item == 0, buffer_error,
                    fmt::format("{} 'strides'[{}] = {} is not a multiple of the item size {}; DLPack strides count "
                                "elements",
                                reader.protocol(), i, bytes[i], item));
    layout.strides.push_back(bytes[i] / item);
  }
  return layout;
}

// The (pointer, readonly) pair of a `data` key.
std::pair<void*, bool> data_pair(const interface_reader& reader, py::handle data)
{
  const bool pair = PyTuple_Check(data.ptr()) && PyTuple_GET_SIZE(data.ptr()) == 2;
  HANDOFF_EXPECTS(pair, value_error,
                  fmt::format("{} 'data' must be a (pointer, readonly) tuple, not {}", reader.protocol(),
                              interface_reader::type_name(data)));
  const auto tuple = py::reinterpret_borrow<py::tuple>(data);
  const std::int64_t address = reader.integer(tuple[0], "data[0]");
  HANDOFF_EXPECTS(address >= 0, value_error,
                  fmt::format("{} 'data'[0] is a negative pointer ({})", reader.protocol(), address));
  HANDOFF_EXPECTS(PyBool_Check(tuple[1].ptr()), value_error,
                  fmt::format("{} 'data'[1] (readonly) must be a bool", reader.protocol()));
  return {reinterpret_cast<void*>(static_cast<std::uintptr_t>(address)), tuple[1].ptr() == Py_True};
}

array bind_layout(array_layout layout, producer_ref owner, const char* protocol)
{
  try {
    return array{std::move(layout), std::move(owner)};
  } catch (const value_error& e) {
    throw value_error(fmt::format("{}: {}", protocol, e.what()));
  }
}

// Holds a Py_buffer until the producer is released (under the GIL, from any thread).
producer_ref buffer_owner(std::unique_ptr<Py_buffer> buffer)
{
  Py_buffer* raw = buffer.release();
  return producer_ref{[raw]() noexcept {
    PyGILState_STATE state{};
    if (interpreter_finalizing() || !ensure_gil(state)) { return; }  // exiting: the process keeps it
    PyBuffer_Release(raw);
    PyGILState_Release(state);
    delete raw;
  }};
}

// Refuses an __array_interface__ whose elements reach outside the buffer its data lies in, which
// NumPy does not check: reading them would be out of bounds.
void check_within(const array& view, std::int64_t offset, std::int64_t length)
{
  if (view.size() == 0) { return; }
  const auto item = static_cast<std::int64_t>(view.itemsize());
  std::int64_t low = offset;
  std::int64_t high = offset + item;  // offset <= length, both far from overflowing
  bool representable = true;
  for (std::size_t i = 0; i < view.shape().size(); ++i) {
    std::int64_t reach = 0;
    representable = representable && !__builtin_mul_overflow(view.shape()[i] - 1, view.strides()[i], &reach) &&
                    !__builtin_mul_overflow(reach, item, &reach);
    std::int64_t& end = reach < 0 ? low : high;
    representable = representable && !__builtin_add_overflow(end, reach, &end);
  }
  HANDOFF_EXPECTS(representable && low >= 0 && high <= length, value_error,
                  fmt::format("__array_interface__ 'shape' and 'strides' from 'offset' {} reach outside the {}-byte "
                              "buffer of 'data'",
                              offset, length));
}

}  // namespace

array import_buffer(py::handle object)
{
  auto buffer = std::make_unique<Py_buffer>();
  if (PyObject_GetBuffer(object.ptr(), buffer.get(), PyBUF_RECORDS_RO) != 0) { throw py::error_already_set(); }
  const Py_buffer& b = *buffer;
  producer_ref owner = buffer_owner(std::move(buffer));  // from here on, every exit releases the buffer
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
    return bind_layout(std::move(layout), std::move(owner), "buffer");
  }
  const auto item = static_cast<std::int64_t>(b.itemsize);
  for (int i = 0; i < b.ndim; ++i) {
    HANDOFF_EXPECTS(b.strides[i] % item == 0, buffer_error,
                    fmt::format("buffer stride {} is not a multiple of the item size {}", b.strides[i], item));
    layout.strides.push_back(b.strides[i] / item);
  }
  return bind_layout(std::move(layout), std::move(owner), "buffer");
}

array import_array_interface(py::handle object, py::handle interface)
{
  const interface_reader reader{interface, "__array_interface__"};
  if (const py::handle version = reader.optional("version")) {
    const auto v = reader.integer(version, "version");
    HANDOFF_EXPECTS(v == 3, value_error, fmt::format("__array_interface__ 'version' {} is not known (expected 3)", v));
  }
  array_layout layout = common_layout(reader);
  const py::handle data = reader.optional("data");
  if (!data || data.is_none() || !PyTuple_Check(data.ptr())) {
    // The data is the buffer of `data`, or of the object itself, from `offset` on.
    const py::handle exporter = (!data || data.is_none()) ? object : data;
    std::int64_t offset = 0;
    if (const py::handle o = reader.optional("offset")) { offset = reader.integer(o, "offset"); }
    array whole = import_buffer(exporter);
    HANDOFF_EXPECTS(whole.is_c_contiguous(), value_error,
                    "__array_interface__ 'data' is a buffer, but not a contiguous one");
    HANDOFF_EXPECTS(
      offset >= 0 && offset <= whole.nbytes(), value_error,
      fmt::format("__array_interface__ 'offset' {} is outside the {}-byte buffer", offset, whole.nbytes()));
    layout.data = static_cast<std::byte*>(whole.data()) + offset;
    layout.readonly = whole.readonly();
    array out = bind_layout(std::move(layout), whole.owner(), "__array_interface__");
    check_within(out, offset, whole.nbytes());
    return out;
  }
  std::tie(layout.data, layout.readonly) = data_pair(reader, data);
  return bind_layout(std::move(layout), python_owner(object), "__array_interface__");
}

cuda_array_interface parse_cuda_array_interface(py::handle interface)
{
  const interface_reader reader{interface, "__cuda_array_interface__"};
  const auto version = reader.integer(reader.required("version"), "version");
  HANDOFF_EXPECTS(version >= 0 && version <= 3, value_error,
                  fmt::format("__cuda_array_interface__ 'version' {} is not known (handoff reads 0 to 3)", version));
  cuda_array_interface out;
  out.layout = common_layout(reader);
  std::tie(out.layout.data, out.layout.readonly) = data_pair(reader, reader.required("data"));
  if (const py::handle stream = reader.optional("stream"); stream && !stream.is_none()) {
    const auto value = reader.integer(stream, "stream");
    HANDOFF_EXPECTS(value != 0, value_error,
                    "__cuda_array_interface__ 'stream' 0 is disallowed (ambiguous); use 1 for the legacy default "
                    "stream or 2 for per-thread");
    out.stream = value;
  }
  // Validate the layout now (shape, overflow, null pointer) so errors name the field before any
  // device is touched.
  (void)bind_layout(out.layout, producer_ref{}, "__cuda_array_interface__");
  return out;
}

array import_cuda_array_interface(py::handle object, py::handle interface, std::optional<std::int64_t> consumer,
                                  std::shared_ptr<const void> consumer_owner)
{
  cuda_array_interface parsed = parse_cuda_array_interface(interface);
  context& ctx = require_context("importing __cuda_array_interface__ data");
  device::backend& backend = ctx.backend();
  const device::pointer_attributes where = backend.attributes(parsed.layout.data);
  const bool rocm = backend.device_type() == kDLROCM;
  switch (where.kind) {
    case device::memory_kind::device:
      parsed.layout.device = {backend.device_type(), where.device};
      break;
    case device::memory_kind::managed:
      HANDOFF_EXPECTS(!rocm, buffer_error, "managed memory on ROCm has no DLPack device type");
      parsed.layout.device = {kDLCUDAManaged, 0};
      break;
    case device::memory_kind::pinned_host:
      parsed.layout.device = {rocm ? kDLROCMHost : kDLCUDAHost, 0};
      break;
    case device::memory_kind::unregistered:
      throw buffer_error("__cuda_array_interface__ 'data' points to memory the device does not know");
  }
  if (where.device_pointer != nullptr) { parsed.layout.data = where.device_pointer; }
  const DLDeviceType type = parsed.layout.device.device_type;
  array view = bind_layout(std::move(parsed.layout), python_owner(object), "__cuda_array_interface__");

  const auto consumer_stream = resolve_stream(backend, classify_stream(type, consumer));
  if (!consumer_stream) { return view; }  // the consumer orders its work itself
  const int device = owning_device(ctx, view);
  if (parsed.stream) {  // v3: the producer's work on `stream` must finish before the consumer's
    if (const auto producer = resolve_stream(backend, classify_stream(type, parsed.stream))) {
      stream_view{backend, *consumer_stream}.wait(stream_view{backend, *producer}, device, ctx.events());
    }
  }
  bind_import(ctx, view, device, *consumer_stream, std::move(consumer_owner));
  return view;
}

}  // namespace handoff::python
