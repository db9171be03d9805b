#include "py_numpy.hpp"

#include <array>
#include <bit>
#include <climits>
#include <cstdint>
#include <optional>

namespace handoff::python {
namespace {

// The entries of NumPy's C API table that are used here; their indices are fixed by NumPy's ABI
// (the same in NumPy 1.x and 2.x).
struct numpy_api {
  PyTypeObject* ndarray;
  PyObject* (*descr_from_type)(int typenum);
  PyObject* (*new_from_descr)(PyTypeObject* subtype, PyObject* descr, int nd, const Py_intptr_t* dims,
                              const Py_intptr_t* strides, void* data, int flags, PyObject* obj);
  int (*set_base_object)(PyObject* array, PyObject* base);
};

const numpy_api& numpy()
{
  static std::optional<numpy_api> loaded;  // under the GIL
  if (!loaded) {
    py::module_ multiarray;
    try {
      multiarray = py::module_::import("numpy._core._multiarray_umath");
    } catch (const py::error_already_set& e) {
      if (!e.matches(PyExc_ImportError)) { throw; }
      multiarray = py::module_::import("numpy.core.multiarray");  // NumPy 1.x
    }
    const py::object capsule = multiarray.attr("_ARRAY_API");
    auto** table = static_cast<void**>(PyCapsule_GetPointer(capsule.ptr(), nullptr));
    if (table == nullptr) { throw py::error_already_set(); }
    loaded = numpy_api{
      .ndarray = static_cast<PyTypeObject*>(table[2]),
      .descr_from_type = reinterpret_cast<PyObject* (*)(int)>(table[45]),
      .new_from_descr = reinterpret_cast<PyObject* (*)(PyTypeObject*, PyObject*, int, const Py_intptr_t*,
                                                       const Py_intptr_t*, void*, int, PyObject*)>(table[94]),
      .set_base_object = reinterpret_cast<int (*)(PyObject*, PyObject*)>(table[282]),
    };
  }
  return *loaded;
}

// NumPy's type numbers (NPY_TYPES) of the dtypes DLPack has; each unsigned type follows its signed one.
enum npy_type : int {
  npy_bool = 0,
  npy_byte = 1,
  npy_short = 3,
  npy_int = 5,
  npy_long = 7,
  npy_longlong = 9,
  npy_float = 11,
  npy_double = 12,
  npy_cfloat = 14,
  npy_cdouble = 15,
  npy_half = 23,
};
constexpr int npy_int64 = sizeof(long) == 8 ? npy_long : npy_longlong;

// NumPy's type number for a DLPack dtype; nullopt for those NumPy has no type for.
std::optional<int> numpy_type(DLDataType dtype)
{
  if (dtype.lanes != 1) { return std::nullopt; }
  const auto signed_type = [](std::uint8_t bits) -> std::optional<int> {
    switch (bits) {
      case 8:
        return npy_byte;
      case 16:
        return npy_short;
      case 32:
        return npy_int;
      case 64:
        return npy_int64;
      default:
        return std::nullopt;
    }
  };
  switch (dtype.code) {
    case kDLBool:
      return dtype.bits == 8 ? std::optional<int>(npy_bool) : std::nullopt;
    case kDLInt:
      return signed_type(dtype.bits);
    case kDLUInt:
      if (auto type = signed_type(dtype.bits)) { return *type + 1; }
      return std::nullopt;
    case kDLFloat:
      return dtype.bits == 16   ? std::optional<int>(npy_half)
             : dtype.bits == 32 ? std::optional<int>(npy_float)
             : dtype.bits == 64 ? std::optional<int>(npy_double)
                                : std::nullopt;
    case kDLComplex:
      return dtype.bits == 64    ? std::optional<int>(npy_cfloat)
             : dtype.bits == 128 ? std::optional<int>(npy_cdouble)
                                 : std::nullopt;
    default:
      return std::nullopt;
  }
}

// The public fields of NumPy's array and dtype objects, as its C API declares them
// (PyArrayObject_fields, PyArray_Descr's leading fields): the same in NumPy 1.x and 2.x.
struct numpy_array_fields {
  PyObject ob_base;
  char* data;
  int nd;
  Py_intptr_t* dimensions;
  Py_intptr_t* strides;
  PyObject* base;
  PyObject* descr;
  int flags;
};
struct numpy_descr_fields {
  PyObject ob_base;
  PyTypeObject* typeobj;
  char kind;
  char type;
  char byteorder;
  char former_flags;
  int type_num;
};

constexpr int writeable_flag = 0x400;  // NPY_ARRAY_WRITEABLE

// The DLPack dtype of a NumPy type number, for the types DLPack has (not long double, objects,
// strings, dates, structures).
std::optional<DLDataType> dlpack_type(int type_num)
{
  const auto make = [](DLDataTypeCode code, int bits) {
    return DLDataType{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1};
  };
  constexpr int long_bits = 8 * sizeof(long);
  switch (type_num) {
    case npy_bool:
      return make(kDLBool, 8);
    case npy_byte:
      return make(kDLInt, 8);
    case npy_byte + 1:
      return make(kDLUInt, 8);
    case npy_short:
      return make(kDLInt, 16);
    case npy_short + 1:
      return make(kDLUInt, 16);
    case npy_int:
      return make(kDLInt, 32);
    case npy_int + 1:
      return make(kDLUInt, 32);
    case npy_long:
      return make(kDLInt, long_bits);
    case npy_long + 1:
      return make(kDLUInt, long_bits);
    case npy_longlong:
      return make(kDLInt, 64);
    case npy_longlong + 1:
      return make(kDLUInt, 64);
    case npy_float:
      return make(kDLFloat, 32);
    case npy_double:
      return make(kDLFloat, 64);
    case npy_cfloat:
      return make(kDLComplex, 64);
    case npy_cdouble:
      return make(kDLComplex, 128);
    case npy_half:
      return make(kDLFloat, 16);
    default:
      return std::nullopt;
  }
}

}  // namespace

std::optional<array_layout> numpy_array_layout(PyObject* ndarray) noexcept
{
  const auto& fields = *reinterpret_cast<const numpy_array_fields*>(ndarray);
  const auto& descr = *reinterpret_cast<const numpy_descr_fields*>(fields.descr);
  // NumPy's __dlpack_device__ reports the device of a DLPack capsule at the root of the array's
  // bases (pinned or managed memory imported by numpy.from_dlpack): not host memory to assume.
  PyObject* root = fields.base;
  while (root != nullptr && Py_TYPE(root) == Py_TYPE(ndarray)) {
    root = reinterpret_cast<const numpy_array_fields*>(root)->base;
  }
  if (root != nullptr && PyCapsule_CheckExact(root)) { return std::nullopt; }
  constexpr char swapped = std::endian::native == std::endian::little ? '>' : '<';
  const std::optional<DLDataType> dtype = dlpack_type(descr.type_num);
  if (!dtype || descr.byteorder == swapped) { return std::nullopt; }
  const std::int64_t itemsize = dtype->bits / 8;
  array_layout layout;
  layout.data = fields.data;
  layout.dtype = *dtype;
  layout.readonly = (fields.flags & writeable_flag) == 0;
  layout.shape.assign(fields.dimensions, fields.dimensions + fields.nd);
  layout.strides.resize(static_cast<std::size_t>(fields.nd));
  for (std::size_t i = 0; i < layout.strides.size(); ++i) {
    if (fields.strides[i] % itemsize != 0) { return std::nullopt; }
    layout.strides[i] = fields.strides[i] / itemsize;
  }
  return layout;
}

py::object numpy_array_of(const array_layout& layout, py::object base)
{
  constexpr int max_dims = 32;  // NumPy 1.x's NPY_MAXDIMS (2.x takes 64)
  const std::optional<int> type = numpy_type(layout.dtype);
  const auto ndim = static_cast<int>(layout.shape.size());
  if (layout.device.device_type != kDLCPU || !type || ndim > max_dims) { return py::none(); }
  const numpy_api& np = numpy();
  std::array<Py_intptr_t, max_dims> dims{};
  std::array<Py_intptr_t, max_dims> strides{};
  const std::int64_t itemsize = (layout.dtype.bits + 7) / 8;
  for (std::size_t i = 0; i < layout.shape.size(); ++i) {
    dims[i] = static_cast<Py_intptr_t>(layout.shape[i]);
    strides[i] = static_cast<Py_intptr_t>(layout.strides[i] * itemsize);
  }
  PyObject* descr = np.descr_from_type(*type);  // a new reference, which new_from_descr steals
  if (descr == nullptr) { throw py::error_already_set(); }
  // NumPy allocates where the data is NULL (an empty array may have none): it gets an address.
  static std::byte no_data;
  void* data = layout.data != nullptr ? layout.data : &no_data;
  auto made = py::reinterpret_steal<py::object>(np.new_from_descr(np.ndarray, descr, ndim, dims.data(), strides.data(),
                                                                  data, layout.readonly ? 0 : writeable_flag, nullptr));
  if (!made) { throw py::error_already_set(); }
  if (np.set_base_object(made.ptr(), base.release().ptr()) != 0) { throw py::error_already_set(); }  // steals base
  return made;
}

}  // namespace handoff::python
