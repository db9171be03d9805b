// handoff for pybind11 extensions, header-only: a drop-in `__dlpack__` for a bound class
// (def_dlpack) and an argument type that takes any array handoff.asarray takes (array<...>).
//
// It calls the `handoff` Python module through the versioned table of <handoff/python_c_api.h>, so
// an extension needs pybind11 and these headers, links nothing of handoff's, and works with every
// handoff whose table has the same major version. Include dir: handoff.get_include(); CMake:
// find_package(handoff) in handoff.get_cmake_dir(), target handoff::pybind11.
#pragma once

#include <handoff/python_c_api.h>

#include <pybind11/gil_safe_call_once.h>
#include <pybind11/pybind11.h>

#include <complex>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace handoff::py {

/// Memory a bound class describes for def_dlpack.
struct array_desc {
  void* data = nullptr;
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;  ///< in elements, as in DLPack; empty: row-major
  DLDataType dtype{kDLFloat, 32, 1};
  DLDevice device{kDLCPU, 0};
  std::intptr_t stream = 0;  ///< the native handle of the stream the data is ready on; 0: unknown
  bool readonly = false;
};

namespace detail {

/// The `handoff` module's table, loaded once (importing handoff if needed).
/// @throws pybind11::error_already_set when handoff cannot be imported or its table is another major version.
inline const handoff_py_api& api()
{
  PYBIND11_CONSTINIT static pybind11::gil_safe_call_once_and_store<const handoff_py_api*> storage;
  return *storage
            .call_once_and_store_result([] {
              const pybind11::object capsule = pybind11::module_::import("handoff._handoff").attr("_C_API");
              const auto* table =
                static_cast<const handoff_py_api*>(PyCapsule_GetPointer(capsule.ptr(), HANDOFF_PY_API_CAPSULE));
              if (table == nullptr) { throw pybind11::error_already_set(); }
              if (table->major != HANDOFF_PY_API_MAJOR) {
                throw pybind11::import_error("handoff's C API is version " + std::to_string(table->major) +
                                             ", this extension was built for version " +
                                             std::to_string(HANDOFF_PY_API_MAJOR) + "; rebuild it");
              }
              return table;
            })
            .get_stored();
}

/// A new reference from a table call, or the Python error it set.
inline pybind11::object checked(PyObject* made)
{
  if (made == nullptr) { throw pybind11::error_already_set(); }
  return pybind11::reinterpret_steal<pybind11::object>(made);
}

/// handoff.view of what `describe` says about `self`, holding `self`.
template <typename T, typename Describe>
pybind11::object view_of(pybind11::handle self, const Describe& describe)
{
  const array_desc d = describe(pybind11::cast<const T&>(self));
  if (!d.strides.empty() && d.strides.size() != d.shape.size()) {
    throw pybind11::value_error("array_desc: strides has " + std::to_string(d.strides.size()) +
                                " entries but shape has " + std::to_string(d.shape.size()) + " dimensions");
  }
  const handoff_array_desc c{d.data,         static_cast<std::int32_t>(d.shape.size()),
                             d.shape.data(), d.strides.empty() ? nullptr : d.strides.data(),
                             d.dtype,        d.device,
                             d.stream,       d.readonly ? 1 : 0};
  return checked(api().view(&c, self.ptr()));
}

}  // namespace detail

/// Adds `__dlpack__`, `__dlpack_device__` and `__cuda_array_interface__` (CUDA memory only;
/// otherwise AttributeError, so `hasattr` is False) to `cls`, a `pybind11::class_<T, ...>`, with
/// handoff.Array's semantics; `describe` is any callable `array_desc(const T&)`. Exported data
/// keeps the Python object alive.
template <typename Class, typename Describe>
void def_dlpack(Class& cls, Describe describe)
{
  namespace pyb = pybind11;
  using T = typename Class::type;
  cls.def(
    "__dlpack__",
    [describe](pyb::handle self, pyb::handle stream, pyb::handle max_version, pyb::handle dl_device, pyb::handle copy) {
      const pyb::object exported = detail::view_of<T>(self, describe);
      return detail::checked(detail::api().export_dlpack(self.ptr(), exported.ptr(), stream.ptr(), max_version.ptr(),
                                                         dl_device.ptr(), copy.ptr()));
    },
    pyb::kw_only(), pyb::arg("stream") = pyb::none(), pyb::arg("max_version") = pyb::none(),
    pyb::arg("dl_device") = pyb::none(), pyb::arg("copy") = pyb::none(),
    "Exports the data as a DLPack capsule, ordered for the consumer's stream (handoff.Array.__dlpack__).");
  cls.def(
    "__dlpack_device__",
    [describe](const T& value) {
      const DLDevice device = describe(value).device;
      return pyb::make_tuple(static_cast<int>(device.device_type), device.device_id);
    },
    "The (device_type, device_id) of the data, with DLPack's codes.");
  cls.def_property_readonly(
    "__cuda_array_interface__",
    [describe](pyb::handle self) -> pyb::object {
      // A named object, not an accessor of a temporary: the accessor would outlive the view.
      const pyb::object exported = detail::view_of<T>(self, describe);
      return exported.attr("__cuda_array_interface__");
    },
    "CUDA Array Interface v3 of CUDA memory, with the stream the data is ready on.");
}

// ---------------------------------------------------------------------------------------------
// array<Constraints...>: an argument type, like nanobind's nb::ndarray.

namespace device {
struct cpu {};
struct cuda {};
struct rocm {};
}  // namespace device

struct c_contig {};  ///< row-major without gaps
struct f_contig {};  ///< column-major without gaps
struct ro {};        ///< read-only data accepted (and data() is const); otherwise refused

/// Extents: -1 accepts any.
template <std::int64_t... Extents>
struct shape {};

template <int N>
struct ndim {};

namespace detail {

namespace pyd = pybind11::detail;

template <typename T>
inline constexpr bool is_scalar_v =
  std::is_arithmetic_v<T> || std::is_same_v<T, std::complex<float>> || std::is_same_v<T, std::complex<double>>;

template <typename T>
constexpr DLDataType dtype_of()
{
  const auto bits = static_cast<std::uint8_t>(8 * sizeof(T));
  if constexpr (std::is_same_v<T, bool>) {
    return {kDLBool, 8, 1};
  } else if constexpr (std::is_floating_point_v<T>) {
    return {kDLFloat, bits, 1};
  } else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    return {kDLInt, bits, 1};
  } else if constexpr (std::is_integral_v<T>) {
    return {kDLUInt, bits, 1};
  } else {
    return {kDLComplex, bits, 1};
  }
}

template <typename T>
constexpr auto scalar_name()
{
  if constexpr (std::is_same_v<T, bool>) {
    return pyd::const_name("bool");
  } else if constexpr (std::is_floating_point_v<T>) {
    return pyd::const_name("float") + pyd::const_name<8 * sizeof(T)>();
  } else if constexpr (std::is_integral_v<T> && std::is_signed_v<T>) {
    return pyd::const_name("int") + pyd::const_name<8 * sizeof(T)>();
  } else if constexpr (std::is_integral_v<T>) {
    return pyd::const_name("uint") + pyd::const_name<8 * sizeof(T)>();
  } else {
    return pyd::const_name("complex") + pyd::const_name<8 * sizeof(T)>();
  }
}

template <std::int64_t Extent>
constexpr auto extent_name()
{
  if constexpr (Extent < 0) {
    return pyd::const_name("*");
  } else {
    return pyd::const_name<static_cast<std::size_t>(Extent)>();
  }
}

inline bool is_contiguous(const handoff_array_info& info, bool row_major)
{
  std::int64_t expected = 1;
  for (std::int32_t k = 0; k < info.ndim; ++k) {
    const std::int32_t i = row_major ? info.ndim - 1 - k : k;
    if (info.shape[i] == 0) { return true; }
    if (info.shape[i] != 1 && info.strides[i] != expected) { return false; }
    expected *= info.shape[i];
  }
  return true;
}

// What a constraint accepts, and how the signature names it.
template <typename C>
struct constraint {
  static_assert(is_scalar_v<C>, "not a handoff::py::array constraint");
  static bool accepts(const handoff_array_info& info)
  {
    constexpr DLDataType want = dtype_of<C>();
    return info.dtype.code == want.code && info.dtype.bits == want.bits && info.dtype.lanes == want.lanes;
  }
  static constexpr auto name = scalar_name<C>();
};
template <std::int64_t... Extents>
struct constraint<shape<Extents...>> {
  static bool accepts(const handoff_array_info& info)
  {
    if (info.ndim != static_cast<std::int32_t>(sizeof...(Extents))) { return false; }
    constexpr std::int64_t wanted[] = {Extents...};
    for (std::size_t i = 0; i < sizeof...(Extents); ++i) {
      if (wanted[i] >= 0 && info.shape[i] != wanted[i]) { return false; }
    }
    return true;
  }
  static constexpr auto name =
    pyd::const_name("shape=(") + pyd::concat(extent_name<Extents>()...) + pyd::const_name(")");
};
template <int N>
struct constraint<ndim<N>> {
  static bool accepts(const handoff_array_info& info) { return info.ndim == N; }
  static constexpr auto name = pyd::const_name("ndim=") + pyd::const_name<static_cast<std::size_t>(N)>();
};
template <>
struct constraint<device::cpu> {
  static bool accepts(const handoff_array_info& info) { return info.device.device_type == kDLCPU; }
  static constexpr auto name = pyd::const_name("device='cpu'");
};
template <>
struct constraint<device::cuda> {
  static bool accepts(const handoff_array_info& info)
  {
    return info.device.device_type == kDLCUDA || info.device.device_type == kDLCUDAManaged;
  }
  static constexpr auto name = pyd::const_name("device='cuda'");
};
template <>
struct constraint<device::rocm> {
  static bool accepts(const handoff_array_info& info) { return info.device.device_type == kDLROCM; }
  static constexpr auto name = pyd::const_name("device='rocm'");
};
template <>
struct constraint<c_contig> {
  static bool accepts(const handoff_array_info& info) { return is_contiguous(info, /*row_major=*/true); }
  static constexpr auto name = pyd::const_name("order='C'");
};
template <>
struct constraint<f_contig> {
  static bool accepts(const handoff_array_info& info) { return is_contiguous(info, /*row_major=*/false); }
  static constexpr auto name = pyd::const_name("order='F'");
};
template <>
struct constraint<ro> {
  static bool accepts(const handoff_array_info& /*info*/) { return true; }
  static constexpr auto name = pyd::const_name("readonly");
};

template <typename... C>
struct first_scalar {
  using type = void;
};
template <typename C, typename... Rest>
struct first_scalar<C, Rest...> {
  using type = std::conditional_t<is_scalar_v<C>, C, typename first_scalar<Rest...>::type>;
};

}  // namespace detail

/// An array argument (or return value) of any protocol handoff.asarray takes, imported zero-copy and
/// ordered onto the consumer stream (the enclosing handoff.stream block, else the device's default).
/// An object that does not meet the constraints makes pybind11 try the next overload; the final
/// TypeError lists the accepted signature. Returned to Python it is a handoff.Array.
template <typename... Constraints>
class array {
 public:
  using scalar = typename detail::first_scalar<Constraints...>::type;
  static constexpr bool read_only = (std::is_same_v<Constraints, ro> || ...);
  using element = std::conditional_t<std::is_void_v<scalar>, void, scalar>;
  using pointer = std::conditional_t<read_only, const element*, element*>;

  array() = default;
  array(pybind11::object handoff_array, const handoff_array_info& info) : object_(std::move(handoff_array)), info_(info)
  {}

  /// True when the imported array meets every constraint.
  [[nodiscard]] static bool accepts(const handoff_array_info& info)
  {
    return (read_only || info.readonly == 0) && (detail::constraint<Constraints>::accepts(info) && ...);
  }

  [[nodiscard]] pointer data() const noexcept { return static_cast<pointer>(info_.data); }
  [[nodiscard]] std::size_t ndim() const noexcept { return static_cast<std::size_t>(info_.ndim); }
  [[nodiscard]] std::int64_t shape(std::size_t i) const noexcept { return info_.shape[i]; }
  /// In elements.
  [[nodiscard]] std::int64_t stride(std::size_t i) const noexcept { return info_.strides[i]; }
  [[nodiscard]] std::int64_t size() const noexcept
  {
    std::int64_t n = 1;
    for (std::size_t i = 0; i < ndim(); ++i) { n *= shape(i); }
    return n;
  }
  [[nodiscard]] DLDeviceType device_type() const noexcept { return info_.device.device_type; }
  [[nodiscard]] std::int32_t device_id() const noexcept { return info_.device.device_id; }
  /// The native handle of the stream the data is ready on for this call's consumer (0: none).
  [[nodiscard]] std::intptr_t stream() const noexcept { return info_.stream; }
  /// The handoff.Array holding the data.
  [[nodiscard]] const pybind11::object& object() const noexcept { return object_; }

  static constexpr auto signature = [] {
    namespace pyd = pybind11::detail;
    if constexpr (sizeof...(Constraints) == 0) {
      return pyd::const_name("handoff.Array");
    } else {
      return pyd::const_name("handoff.Array[") + pyd::concat(detail::constraint<Constraints>::name...) +
             pyd::const_name("]");
    }
  }();

 private:
  pybind11::object object_;
  handoff_array_info info_{};
};

}  // namespace handoff::py

namespace pybind11::detail {

template <typename... Constraints>
struct type_caster<handoff::py::array<Constraints...>> {
  using value_type = handoff::py::array<Constraints...>;
  PYBIND11_TYPE_CASTER(value_type, value_type::signature);

  // Only "this object does not fit" lets pybind11 try the next overload: any other failure of the
  // import (handoff.DeviceError, KeyboardInterrupt, MemoryError, a producer's own) propagates.
  bool load(handle source, bool /*convert*/)
  {
    const handoff_py_api& api = handoff::py::detail::api();
    PyObject* made = nullptr;
    if (api.minor >= 1) {
      const int status = api.import_array(source.ptr(), Py_None, &made);
      if (status == 1) { return false; }  // speaks no array protocol
      if (status != 0) { throw error_already_set(); }
    } else {  // a handoff older than the table's import_array: its asarray's TypeError is "no protocol"
      made = api.asarray(source.ptr(), Py_None);
      if (made == nullptr) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) { throw error_already_set(); }
        PyErr_Clear();
        return false;
      }
    }
    object imported = reinterpret_steal<object>(made);
    handoff_array_info info{};
    if (api.describe(imported.ptr(), &info) != 0) {
      PyErr_Clear();
      return false;
    }
    if (!value_type::accepts(info)) { return false; }
    value = value_type(std::move(imported), info);
    return true;
  }

  static handle cast(const value_type& source, return_value_policy /*policy*/, handle /*parent*/)
  {
    return source.object().inc_ref();
  }
};

}  // namespace pybind11::detail
