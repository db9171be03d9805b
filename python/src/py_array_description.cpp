// What handoff's hooks read of another library's array (py_array_description.hpp): NumPy's arrays
// from the fields its C API documents, others from their `shape`, `dtype` and `nbytes`, and the data
// pointer as each library says it.
#include "py_array_description.hpp"

#include "py_cpython.hpp"
#include "py_exchange.hpp"
#include "py_numpy.hpp"

#include <handoff/dtype.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <functional>
#include <numeric>
#include <utility>

namespace handoff::python {
namespace {

// The name of a dtype object ("torch.float32" reads "float32"), remembered per object: str() of a
// NumPy dtype costs microseconds.
std::optional<std::string> dtype_name_of(PyObject* dtype)
{
  // NOLINTNEXTLINE(cppcoreguidelines-owning-memory): never destroyed (object_cache)
  static auto* known =
    new object_cache<PyObject*, std::string>{1024, [](PyObject* const& key) noexcept { return key; }};
  if (const std::string* found = known->find(dtype)) { return *found; }
  const auto text = py::reinterpret_steal<py::object>(PyObject_Str(dtype));
  Py_ssize_t size = 0;
  const char* utf8 = text ? PyUnicode_AsUTF8AndSize(text.ptr(), &size) : nullptr;
  if (utf8 == nullptr) {
    PyErr_Clear();
    return std::nullopt;
  }
  const std::string_view full{utf8, static_cast<std::size_t>(size)};
  return known->remember(dtype, std::string{full.substr(full.rfind('.') + 1)});
}

// How each library says where an array's data starts, without side effects.
enum class pointer_read : std::uint8_t {
  none,
  data_ptr,               // PyTorch: tensor.data_ptr()
  unsafe_buffer_pointer,  // JAX
  array_interface,        // NumPy's __array_interface__["data"][0]
  data_ptr_attribute,     // CuPy: array.data.ptr
};

std::optional<std::uintptr_t> read_pointer(PyObject* value, pointer_read how)
{
  static PyObject* const data_ptr = interned("data_ptr");
  static PyObject* const unsafe_buffer_pointer = interned("unsafe_buffer_pointer");
  static PyObject* const array_interface = interned("__array_interface__");
  static PyObject* const data = interned("data");
  static PyObject* const ptr = interned("ptr");
  py::object read;
  switch (how) {
    case pointer_read::data_ptr:
      read = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(value, data_ptr));
      break;
    case pointer_read::unsafe_buffer_pointer:
      read = py::reinterpret_steal<py::object>(PyObject_CallMethodNoArgs(value, unsafe_buffer_pointer));
      break;
    case pointer_read::array_interface:
      if (auto interface = py::reinterpret_steal<py::object>(PyObject_GetAttr(value, array_interface))) {
        PyObject* entry = PyDict_Check(interface.ptr()) != 0 ? PyDict_GetItemWithError(interface.ptr(), data) : nullptr;
        if (entry != nullptr && PyTuple_Check(entry) != 0 && PyTuple_GET_SIZE(entry) > 0) {
          read = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(entry, 0));
        }
      }
      break;
    case pointer_read::data_ptr_attribute:
      if (auto memory = py::reinterpret_steal<py::object>(PyObject_GetAttr(value, data))) {
        read = py::reinterpret_steal<py::object>(PyObject_GetAttr(memory.ptr(), ptr));
      }
      break;
    case pointer_read::none:
      break;
  }
  const unsigned long long pointer = read && PyLong_Check(read.ptr()) != 0 ? PyLong_AsUnsignedLongLong(read.ptr()) : 0;
  if (!read || PyLong_Check(read.ptr()) == 0 || PyErr_Occurred() != nullptr) {
    PyErr_Clear();  // not this library's way, or an array that cannot say it now (a deleted JAX array)
    return std::nullopt;
  }
  return static_cast<std::uintptr_t>(pointer);
}

// Each array type's way to its data pointer, remembered (with a reference to the type: no other type
// is made at its address meanwhile) until the hooks go or the bound is reached.
object_cache<PyTypeObject*, pointer_read>& pointer_reads()
{
  // NOLINTNEXTLINE(cppcoreguidelines-owning-memory): never destroyed (object_cache)
  static auto* known = new object_cache<PyTypeObject*, pointer_read>{
    1024, [](PyTypeObject* const& type) noexcept { return reinterpret_cast<PyObject*>(type); }};
  return *known;
}

// Where `value`'s data starts, read the way that works for its type, found once per type: trying
// each way costs an exception per library that is not the array's.
std::optional<std::uintptr_t> data_pointer(PyObject* value)
{
  auto& known = pointer_reads();
  PyTypeObject* type = Py_TYPE(value);
  if (const pointer_read* how = known.find(type)) { return read_pointer(value, *how); }
  for (const pointer_read how : {pointer_read::data_ptr, pointer_read::unsafe_buffer_pointer,
                                 pointer_read::array_interface, pointer_read::data_ptr_attribute}) {
    if (const auto pointer = read_pointer(value, how)) {
      known.remember(type, how);
      return pointer;
    }
  }
  known.remember(type, pointer_read::none);
  return std::nullopt;
}

// An integer as Python reads one (an int, or what has __index__: NumPy's integers in a shape) that
// fits in int64; nullopt for anything else. Sets no Python error.
std::optional<std::int64_t> as_int64(PyObject* value)
{
  if (value == nullptr) { return std::nullopt; }
  py::object index;
  if (PyLong_Check(value) == 0) {
    if (PyIndex_Check(value) == 0) { return std::nullopt; }
    index = py::reinterpret_steal<py::object>(PyNumber_Index(value));
    if (!index) {
      PyErr_Clear();
      return std::nullopt;
    }
    value = index.ptr();
  }
  const int64_reading read = read_int64(value);
  if (read.overflow != 0) { return std::nullopt; }
  return read.value;
}

// `value` described from its `shape`, `dtype` and `nbytes`; nullopt for what is not array-like.
std::optional<array_description> describe_by_attributes(PyObject* value)
{
  static PyObject* const shape_name = interned("shape");
  static PyObject* const dtype_name = interned("dtype");
  static PyObject* const nbytes_name = interned("nbytes");
  array_description out;
  const auto shape = py::reinterpret_steal<py::object>(PyObject_GetAttr(value, shape_name));
  const auto sizes = shape ? py::reinterpret_steal<py::object>(PySequence_Fast(shape.ptr(), "shape")) : py::object{};
  const auto dtype = py::reinterpret_steal<py::object>(PyObject_GetAttr(value, dtype_name));
  const auto nbytes = py::reinterpret_steal<py::object>(PyObject_GetAttr(value, nbytes_name));
  const auto size = nbytes ? as_int64(nbytes.ptr()) : std::nullopt;
  auto name = dtype ? dtype_name_of(dtype.ptr()) : std::nullopt;
  if (!sizes || !size || !name) {
    PyErr_Clear();
    return std::nullopt;
  }
  const Py_ssize_t rank = PySequence_Fast_GET_SIZE(sizes.ptr());
  out.shape.reserve(static_cast<std::size_t>(rank));
  for (Py_ssize_t i = 0; i < rank; ++i) {
    const auto extent = as_int64(PySequence_Fast_GET_ITEM(sizes.ptr(), i));
    if (!extent) { return std::nullopt; }
    out.shape.push_back(*extent);
  }
  out.dtype = std::move(*name);
  out.nbytes = *size;
  out.data = data_pointer(value);
  return out;
}

// `value` as the trace describes it; nullopt for what is not array-like. A NumPy array is read from
// the fields NumPy's C API documents (its __array_interface__ builds a dictionary per call).
std::optional<array_description> describe(py::handle value)
{
  if (is_numpy_array(value.ptr())) {
    if (const std::optional<array_layout> layout = numpy_fields_layout(value.ptr())) {
      array_description out;
      out.shape.assign(layout->shape.begin(), layout->shape.end());
      out.dtype = dtype_name(layout->dtype);
      out.nbytes =
        std::accumulate(out.shape.begin(), out.shape.end(), std::int64_t{layout->dtype.bits / 8}, std::multiplies<>{});
      out.data = reinterpret_cast<std::uintptr_t>(layout->data);
      return out;
    }
  }
  return describe_by_attributes(value.ptr());
}

// What the trace says when the consumer made a copy of the data it was handed rather than a view of
// it (JAX makes int32 of int64 data while x64 is off); empty when it made a view.
std::string copy_note(std::string_view consumer, const array_description& handed, const array_description& made)
{
  if (made.shape != handed.shape || made.dtype != handed.dtype) {
    return fmt::format("{} made a copy: {}[{}] of the {}[{}] it was handed", consumer, made.dtype,
                       fmt::join(made.shape, ", "), handed.dtype, fmt::join(handed.shape, ", "));
  }
  // An empty array's data pointer is whatever its library chose (NumPy's is an allocation, PyTorch's null).
  if (handed.nbytes > 0 && handed.data && made.data && handed.data != made.data) {
    return fmt::format("{} made a copy of the {}[{}] it was handed", consumer, handed.dtype,
                       fmt::join(handed.shape, ", "));
  }
  return {};
}

}  // namespace

void forget_array_types() noexcept
{
  pointer_reads().forget();
}

exchange_description describe_exchange(py::handle argument, py::handle result, std::string_view consumer)
{
  // A view's two sides are the same data: where one side is cheap to read in full and the other is
  // not (a PyTorch tensor's shape, dtype and size are three Python attributes), equal data pointers
  // are enough. An empty array's pointer tells nothing (see copy_note).
  const bool argument_cheap = is_numpy_array(argument.ptr());
  const bool one_side_cheap = argument_cheap != is_numpy_array(result.ptr());
  std::optional<array_description> handed;
  std::optional<array_description> made;
  if (one_side_cheap) {
    std::optional<array_description>& cheap = argument_cheap ? handed : made;
    cheap = describe(argument_cheap ? argument : result);
    if (cheap && cheap->nbytes > 0 && cheap->data &&
        data_pointer((argument_cheap ? result : argument).ptr()) == cheap->data) {
      return {std::move(cheap), {}};
    }
  }
  // A copy, or a pair the pointers cannot tell: both sides in full (the cheap one is read already).
  if (!one_side_cheap || !argument_cheap) { handed = describe(argument); }
  if (!one_side_cheap || argument_cheap) { made = describe(result); }
  exchange_description out{std::move(handed), {}};
  if (!out.data) {
    out.data = std::move(made);
  } else if (made) {
    out.copy = copy_note(consumer, *out.data, *made);
  }
  return out;
}

}  // namespace handoff::python
