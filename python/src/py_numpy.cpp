#include "py_numpy.hpp"

#include <handoff/dtype.hpp>
#include <handoff/error.hpp>

#include <fmt/format.h>

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

// NumPy's type numbers (NPY_TYPES) of the dtypes DLPack has, with their DLPack dtype: the one
// table both directions read. Where two NumPy types have one dtype (long and long long of 64
// bits), the first is the one made.
struct numpy_dtype {
  int type_num;
  DLDataType dtype;
};
constexpr DLDataType make_dtype(DLDataTypeCode code, std::size_t bits) noexcept
{
  return DLDataType{static_cast<std::uint8_t>(code), static_cast<std::uint8_t>(bits), 1};
}
constexpr std::array numpy_dtypes{
  numpy_dtype{0, make_dtype(kDLBool, 8)},                 // NPY_BOOL
  numpy_dtype{1, make_dtype(kDLInt, 8)},                  // NPY_BYTE
  numpy_dtype{2, make_dtype(kDLUInt, 8)},                 // NPY_UBYTE
  numpy_dtype{3, make_dtype(kDLInt, 16)},                 // NPY_SHORT
  numpy_dtype{4, make_dtype(kDLUInt, 16)},                // NPY_USHORT
  numpy_dtype{5, make_dtype(kDLInt, 32)},                 // NPY_INT
  numpy_dtype{6, make_dtype(kDLUInt, 32)},                // NPY_UINT
  numpy_dtype{7, make_dtype(kDLInt, 8 * sizeof(long))},   // NPY_LONG
  numpy_dtype{8, make_dtype(kDLUInt, 8 * sizeof(long))},  // NPY_ULONG
  numpy_dtype{9, make_dtype(kDLInt, 64)},                 // NPY_LONGLONG
  numpy_dtype{10, make_dtype(kDLUInt, 64)},               // NPY_ULONGLONG
  numpy_dtype{11, make_dtype(kDLFloat, 32)},              // NPY_FLOAT
  numpy_dtype{12, make_dtype(kDLFloat, 64)},              // NPY_DOUBLE
  numpy_dtype{14, make_dtype(kDLComplex, 64)},            // NPY_CFLOAT
  numpy_dtype{15, make_dtype(kDLComplex, 128)},           // NPY_CDOUBLE
  numpy_dtype{23, make_dtype(kDLFloat, 16)},              // NPY_HALF
};

// NumPy's type number for a DLPack dtype; nullopt for those NumPy has no type for.
std::optional<int> numpy_type(DLDataType dtype) noexcept
{
  for (const numpy_dtype& known : numpy_dtypes) {
    if (known.dtype == dtype) { return known.type_num; }
  }
  return std::nullopt;
}

// The DLPack dtype of a NumPy type number, by a lookup (an argument's import asks it); a dtype
// of no bits for the types DLPack lacks (long double, objects, strings, dates, structures).
constexpr std::size_t max_type_num = 23;
constexpr auto dtypes_by_type_num = [] {
  std::array<DLDataType, max_type_num + 1> table{};
  for (const numpy_dtype& known : numpy_dtypes) { table.at(static_cast<std::size_t>(known.type_num)) = known.dtype; }
  return table;
}();

std::optional<DLDataType> dlpack_type(int type_num) noexcept
{
  if (type_num < 0 || static_cast<std::size_t>(type_num) > max_type_num) { return std::nullopt; }
  const DLDataType dtype = dtypes_by_type_num[static_cast<std::size_t>(type_num)];
  return dtype.bits != 0 ? std::optional<DLDataType>(dtype) : std::nullopt;
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

}  // namespace

std::optional<array_layout> numpy_array_layout(PyObject* ndarray) noexcept
{
  const auto& fields = *reinterpret_cast<const numpy_array_fields*>(ndarray);
  // NumPy's __dlpack_device__ reports the device of a DLPack capsule at the root of the array's
  // bases (pinned or managed memory imported by numpy.from_dlpack): not host memory to assume.
  PyObject* root = fields.base;
  while (root != nullptr && PyObject_TypeCheck(root, Py_TYPE(ndarray)) != 0) {  // subclasses' bases too
    root = reinterpret_cast<const numpy_array_fields*>(root)->base;
  }
  if (root != nullptr && PyCapsule_CheckExact(root)) { return std::nullopt; }
  return numpy_fields_layout(ndarray);
}

std::optional<array_layout> numpy_fields_layout(PyObject* ndarray) noexcept
{
  const auto& fields = *reinterpret_cast<const numpy_array_fields*>(ndarray);
  const auto& descr = *reinterpret_cast<const numpy_descr_fields*>(fields.descr);
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

void require_numpy_can_hold(const array_layout& layout)
{
  HANDOFF_EXPECTS(numpy_type(layout.dtype).has_value(), buffer_error,
                  fmt::format("NumPy has no dtype for {} data; return it untagged (a handoff.Array) or as a framework "
                              "that has one",
                              dtype_name(layout.dtype)));
  HANDOFF_EXPECTS(
    layout.shape.size() <= numpy_max_dims, buffer_error,
    fmt::format("NumPy holds at most {} dimensions, and the array has {}", numpy_max_dims, layout.shape.size()));
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
