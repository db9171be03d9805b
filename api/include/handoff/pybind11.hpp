// handoff for pybind11 extensions, header-only: a drop-in `__dlpack__` for a bound class
// (def_dlpack) and an argument type that takes any array handoff.asarray takes (array<...>).
//
// It calls the `handoff` Python module through the versioned table of <handoff/python_c_api.h>, so
// an extension needs pybind11 and these headers, links nothing of handoff's, and works with every
// handoff whose table has the same major version. At run time it needs the `handoff` Python package:
// the first use imports handoff._handoff for its C API capsule (_C_API), and raises ImportError where
// handoff is not installed. Include dir: handoff.get_include(); CMake: find_package(handoff) in
// handoff.get_cmake_dir(), target handoff::pybind11. C++17 is enough (the example is built so), with
// pybind11 2.13.6 or later.
#pragma once

#include <handoff/python_c_api.h>

#include <pybind11/gil_safe_call_once.h>
#include <pybind11/pybind11.h>

#if PYBIND11_VERSION_HEX < 0x020D0600
#error "<handoff/pybind11.hpp> needs pybind11 2.13.6 or later (pybind11::detail::try_translate_exceptions)"
#endif

#include <algorithm>
#include <complex>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#if __cplusplus >= 202002L
#include <span>
#endif
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace handoff::pybind {

/// The `stream` of an array made from C++ memory that is ready on the stream of the enclosing
/// handoff.stream block (the caller's): for device memory, where that stream is on the data's
/// device; else unknown. An array's default.
inline constexpr std::intptr_t enclosing_stream = HANDOFF_STREAM_ENCLOSING;

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
              if (table->minor < HANDOFF_PY_API_MINOR) {
                throw pybind11::import_error(
                  "handoff's C API is version " + std::to_string(table->major) + "." + std::to_string(table->minor) +
                  ", older than the " + std::to_string(HANDOFF_PY_API_MAJOR) + "." +
                  std::to_string(HANDOFF_PY_API_MINOR) + " this extension was built for; upgrade handoff");
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

/// One reference to a view the table made (handoff_view), which needs the GIL as a
/// pybind11::object does.
class counted_view {
 public:
  counted_view() noexcept = default;
  /// Takes over the reference `adopted` holds.
  explicit counted_view(handoff_view* adopted) noexcept : view_(adopted) {}
  counted_view(const counted_view& other) noexcept : view_(other.view_)
  {
    if (view_ != nullptr) { api().retain_view(view_); }
  }
  counted_view(counted_view&& other) noexcept : view_(std::exchange(other.view_, nullptr)) {}
  counted_view& operator=(const counted_view& other) noexcept
  {
    counted_view copy(other);
    std::swap(view_, copy.view_);
    return *this;
  }
  counted_view& operator=(counted_view&& other) noexcept
  {
    counted_view moved(std::move(other));
    std::swap(view_, moved.view_);
    return *this;
  }
  ~counted_view()
  {
    if (view_ != nullptr) { api().release_view(view_); }
  }

  [[nodiscard]] handoff_view* get() const noexcept { return view_; }
  [[nodiscard]] explicit operator bool() const noexcept { return view_ != nullptr; }

 private:
  handoff_view* view_ = nullptr;
};

/// A view of `desc`'s memory holding `owner` (may be null), its description into `info`.
inline counted_view make_view(const handoff_array_desc& desc, pybind11::handle owner, handoff_array_info& info)
{
  handoff_view* made = api().make_view(&desc, owner.ptr(), &info);
  if (made == nullptr) { throw pybind11::error_already_set(); }
  return counted_view(made);
}

/// def_dlpack's description of `T`'s instances: what `Describe` says, kept per thread until the
/// table has read it (before this thread's next call).
template <typename T, typename Describe>
int describe_instance(PyObject* self, void* context, handoff_array_desc* out) noexcept
{
  thread_local array_desc described;
  try {
    // pybind11::cast's caster, its type's record looked up once rather than per call.
    static const pybind11::detail::type_info* const type = pybind11::detail::get_type_info(typeid(T), true);
    pybind11::detail::type_caster_generic instance(type);
    if (!instance.load(self, /*convert=*/false)) {
      throw pybind11::type_error(std::string("__dlpack__ of ") + type->type->tp_name + " called on a " +
                                 Py_TYPE(self)->tp_name);
    }
    described = (*static_cast<const Describe*>(context))(*static_cast<const T*>(instance.value));
    if (!described.strides.empty() && described.strides.size() != described.shape.size()) {
      throw pybind11::value_error("array_desc: strides has " + std::to_string(described.strides.size()) +
                                  " entries but shape has " + std::to_string(described.shape.size()) + " dimensions");
    }
    *out = handoff_array_desc{described.data,         static_cast<std::int32_t>(described.shape.size()),
                              described.shape.data(), described.strides.empty() ? nullptr : described.strides.data(),
                              described.dtype,        described.device,
                              described.stream,       described.readonly ? 1 : 0};
    return 0;
  } catch (...) {
    pybind11::detail::try_translate_exceptions();  // sets the Python error pybind11 would
    return -1;
  }
}

/// The view as a handoff.Array (a new reference).
inline pybind11::object python_array(const counted_view& view)
{
  return checked(api().view_to_python(view.get(), HANDOFF_FRAMEWORK_HANDOFF));
}

/// DLPack's stream=-1 (borrowed: made once, kept for the process).
inline PyObject* unordered_stream()
{
  PYBIND11_CONSTINIT static pybind11::gil_safe_call_once_and_store<pybind11::object> storage;
  return storage.call_once_and_store_result([] { return pybind11::int_(-1); }).get_stored().ptr();
}

}  // namespace detail

/// Adds `__dlpack__`, `__dlpack_device__`, `__cuda_array_interface__` (CUDA memory only) and
/// `__array_interface__` (CPU memory only; so `np.asarray(obj)` is zero-copy) to `cls`, a
/// `pybind11::class_<T, ...>`, with handoff.Array's semantics; where an interface does not apply
/// it raises AttributeError, so `hasattr` is False. `describe` is any callable
/// `array_desc(const T&)`. Exported data keeps the Python object alive: a DLPack capsule holds it,
/// and NumPy holds the object whose `__array_interface__` it read.
template <typename Class, typename Describe>
void def_dlpack(Class& cls, Describe describe)
{
  using T = typename Class::type;
  auto held = std::make_unique<Describe>(std::move(describe));
  const pybind11::capsule owner(held.get(), [](void* context) { delete static_cast<Describe*>(context); });
  void* context = held.release();  // the capsule owns it
  if (detail::api().def_dlpack(cls.ptr(), &detail::describe_instance<T, Describe>, context, owner.ptr()) != 0) {
    throw pybind11::error_already_set();
  }
}

// ---------------------------------------------------------------------------------------------
// array<Constraints...>: an argument type, like nanobind's nb::ndarray.

namespace device {
struct cpu {};
struct cuda {};
struct rocm {};
}  // namespace device

/// Framework tags: what a returned array reaches Python as, zero-copy, through the framework's own
/// from_dlpack (which orders a device array for the framework's current stream). No tag, or
/// array_api: a handoff.Array. Arguments of any framework are taken whatever the tag.
struct numpy {};      ///< numpy.ndarray (numpy.from_dlpack)
struct pytorch {};    ///< torch.Tensor (torch.from_dlpack)
struct jax {};        ///< jax.Array (jax.dlpack.from_dlpack)
struct cupy {};       ///< cupy.ndarray (cupy.from_dlpack)
struct array_api {};  ///< handoff.Array, the array API's exchange type

/// The function orders its own work on the argument's data (DLPack's `stream=-1`, as
/// handoff.from_dlpack(x, stream=-1)): no wait is inserted for it, and CUDA data is taken even where
/// handoff cannot start CUDA. The function must then make its stream wait for the producer's.
struct orders_itself {};

struct c_contig {};  ///< row-major without gaps
struct f_contig {};  ///< column-major without gaps
struct ro {};        ///< read-only data accepted (and data() is const); otherwise refused

/// Extents: -1 accepts any.
template <std::int64_t... Extents>
struct shape {};

template <int N>
struct ndim {};

/// IEEE 754 half precision (DLPack's kDLFloat, 16 bits), as a scalar constraint and the element of
/// view(): the raw bits, which handoff never converts.
struct float16 {
  std::uint16_t bits;
};

/// bfloat16 (DLPack's kDLBfloat, 16 bits), as a scalar constraint and the element of view(): the raw
/// bits, which handoff never converts.
struct bfloat16 {
  std::uint16_t bits;
};

/// Typed access to an array's elements, from array<...>::view(): `v(i, j, ...)` is the element at
/// those indices through the strides, unchecked, as nanobind's ndarray_view. `Ndim` is the array's
/// ndim<N> or shape<...> constraint (-1: none), which the number of indices must match. Valid while
/// the array it came from lives.
template <typename Scalar, int Ndim>
class array_view {
 public:
  array_view(Scalar* data, std::int32_t ndim, const std::int64_t* shape, const std::int64_t* strides) noexcept
      : data_(data), ndim_(ndim), shape_(shape), strides_(strides)
  {}

  template <typename... Index>
  [[nodiscard]] Scalar& operator()(Index... index) const noexcept
  {
    static_assert(Ndim < 0 || sizeof...(Index) == static_cast<std::size_t>(Ndim),
                  "handoff::pybind::array_view: as many indices as the array's ndim<N> or shape<...>");
    static_assert((std::is_integral_v<Index> && ...), "handoff::pybind::array_view: indices are integers");
    return at(std::index_sequence_for<Index...>{}, index...);
  }

  [[nodiscard]] std::size_t ndim() const noexcept
  {
    if constexpr (Ndim >= 0) {
      return static_cast<std::size_t>(Ndim);
    } else {
      return static_cast<std::size_t>(ndim_);
    }
  }
  [[nodiscard]] std::int64_t shape(std::size_t i) const noexcept { return shape_[i]; }
  /// In elements.
  [[nodiscard]] std::int64_t stride(std::size_t i) const noexcept { return strides_[i]; }
  [[nodiscard]] Scalar* data() const noexcept { return data_; }

 private:
  template <std::size_t... K, typename... Index>
  Scalar& at(std::index_sequence<K...> /*dimensions*/, Index... index) const noexcept
  {
    return data_[(std::int64_t{0} + ... + (static_cast<std::int64_t>(index) * strides_[K]))];
  }

  Scalar* data_;
  std::int32_t ndim_;
  const std::int64_t* shape_;
  const std::int64_t* strides_;
};

namespace detail {

namespace pyd = pybind11::detail;

template <typename T>
inline constexpr bool is_scalar_v =
  std::is_arithmetic_v<T> || std::is_same_v<T, std::complex<float>> || std::is_same_v<T, std::complex<double>> ||
  std::is_same_v<T, float16> || std::is_same_v<T, bfloat16>;

template <typename T>
constexpr DLDataType dtype_of()
{
  const auto bits = static_cast<std::uint8_t>(8 * sizeof(T));
  if constexpr (std::is_same_v<T, bool>) {
    return {kDLBool, 8, 1};
  } else if constexpr (std::is_same_v<T, float16>) {
    return {kDLFloat, 16, 1};
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    return {kDLBfloat, 16, 1};
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
  } else if constexpr (std::is_same_v<T, float16>) {
    return pyd::const_name("float16");
  } else if constexpr (std::is_same_v<T, bfloat16>) {
    return pyd::const_name("bfloat16");
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

// What the mismatch messages say an array has.
inline std::string dtype_text(DLDataType dtype)
{
  std::string name;
  switch (dtype.code) {
    case kDLBool:
      name = "bool";
      break;
    case kDLInt:
      name = "int";
      break;
    case kDLUInt:
      name = "uint";
      break;
    case kDLFloat:
      name = "float";
      break;
    case kDLBfloat:
      name = "bfloat";
      break;
    case kDLComplex:
      name = "complex";
      break;
    default:
      name = "type code " + std::to_string(dtype.code) + " of ";
      break;
  }
  if (dtype.code != kDLBool || dtype.bits != 8) { name += std::to_string(dtype.bits); }
  if (dtype.lanes != 1) { name += "x" + std::to_string(dtype.lanes); }
  return name;
}

inline std::string device_text(DLDevice device)
{
  std::string name;
  switch (device.device_type) {
    case kDLCPU:
      return "cpu";
    case kDLCUDA:
      name = "cuda";
      break;
    case kDLCUDAHost:
      name = "cuda_host";
      break;
    case kDLCUDAManaged:
      name = "cuda_managed";
      break;
    case kDLROCM:
      name = "rocm";
      break;
    case kDLROCMHost:
      name = "rocm_host";
      break;
    default:
      name = "device type " + std::to_string(static_cast<int>(device.device_type));
      break;
  }
  return name + ":" + std::to_string(device.device_id);
}

inline std::string extents_text(const std::int64_t* extents, std::int32_t ndim)
{
  std::string text = "(";
  for (std::int32_t i = 0; i < ndim; ++i) { text += (i == 0 ? "" : ", ") + std::to_string(extents[i]); }
  return text + (ndim == 1 ? ",)" : ")");
}

// What a constraint accepts, why an array does not meet it, and how the signature names it.
template <typename C>
struct constraint {
  static_assert(is_scalar_v<C>, "not a handoff::pybind::array constraint");
  static bool accepts(const handoff_array_info& info)
  {
    constexpr DLDataType want = dtype_of<C>();
    return info.dtype.code == want.code && info.dtype.bits == want.bits && info.dtype.lanes == want.lanes;
  }
  static std::string mismatch(const handoff_array_info& info) { return "dtype is " + dtype_text(info.dtype); }
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
  static std::string mismatch(const handoff_array_info& info)
  {
    return "shape is " + extents_text(info.shape, info.ndim);
  }
  static constexpr auto name =
    pyd::const_name("shape=(") + pyd::concat(extent_name<Extents>()...) + pyd::const_name(")");
};
template <int N>
struct constraint<ndim<N>> {
  static bool accepts(const handoff_array_info& info) { return info.ndim == N; }
  static std::string mismatch(const handoff_array_info& info) { return "ndim is " + std::to_string(info.ndim); }
  static constexpr auto name = pyd::const_name("ndim=") + pyd::const_name<static_cast<std::size_t>(N)>();
};
struct device_constraint {
  static std::string mismatch(const handoff_array_info& info) { return "device is " + device_text(info.device); }
};
template <>
struct constraint<device::cpu> : device_constraint {
  static bool accepts(const handoff_array_info& info) { return info.device.device_type == kDLCPU; }
  static constexpr auto name = pyd::const_name("device='cpu'");
};
template <>
struct constraint<device::cuda> : device_constraint {
  static bool accepts(const handoff_array_info& info)
  {
    return info.device.device_type == kDLCUDA || info.device.device_type == kDLCUDAManaged;
  }
  static constexpr auto name = pyd::const_name("device='cuda'");
};
template <>
struct constraint<device::rocm> : device_constraint {
  static bool accepts(const handoff_array_info& info) { return info.device.device_type == kDLROCM; }
  static constexpr auto name = pyd::const_name("device='rocm'");
};
template <>
struct constraint<c_contig> {
  static bool accepts(const handoff_array_info& info) { return is_contiguous(info, /*row_major=*/true); }
  static std::string mismatch(const handoff_array_info& info)
  {
    return "order is not C (strides " + extents_text(info.strides, info.ndim) + " in elements)";
  }
  static constexpr auto name = pyd::const_name("order='C'");
};
template <>
struct constraint<f_contig> {
  static bool accepts(const handoff_array_info& info) { return is_contiguous(info, /*row_major=*/false); }
  static std::string mismatch(const handoff_array_info& info)
  {
    return "order is not F (strides " + extents_text(info.strides, info.ndim) + " in elements)";
  }
  static constexpr auto name = pyd::const_name("order='F'");
};
// A constraint that no argument breaks (`ro`, which widens, and the framework tags, which say what a
// returned array becomes); the signature names it.
struct accepts_anything {
  static bool accepts(const handoff_array_info& /*info*/) { return true; }
  static std::string mismatch(const handoff_array_info& /*info*/) { return {}; }
};
template <>
struct constraint<numpy> : accepts_anything {
  static constexpr auto name = pyd::const_name("returned as numpy");
};
template <>
struct constraint<pytorch> : accepts_anything {
  static constexpr auto name = pyd::const_name("returned as torch");
};
template <>
struct constraint<jax> : accepts_anything {
  static constexpr auto name = pyd::const_name("returned as jax");
};
template <>
struct constraint<cupy> : accepts_anything {
  static constexpr auto name = pyd::const_name("returned as cupy");
};
template <>
struct constraint<array_api> : accepts_anything {
  static constexpr auto name = pyd::const_name("returned as handoff.Array");
};

// The framework a tag returns arrays as (a handoff_framework); -1 for the other constraints.
template <typename C>
struct framework_tag : std::integral_constant<int, -1> {};
template <>
struct framework_tag<numpy> : std::integral_constant<int, HANDOFF_FRAMEWORK_NUMPY> {};
template <>
struct framework_tag<pytorch> : std::integral_constant<int, HANDOFF_FRAMEWORK_TORCH> {};
template <>
struct framework_tag<jax> : std::integral_constant<int, HANDOFF_FRAMEWORK_JAX> {};
template <>
struct framework_tag<cupy> : std::integral_constant<int, HANDOFF_FRAMEWORK_CUPY> {};
template <>
struct framework_tag<array_api> : std::integral_constant<int, HANDOFF_FRAMEWORK_HANDOFF> {};

template <>
struct constraint<orders_itself> : accepts_anything {
  static constexpr auto name = pyd::const_name("stream=-1");
};
template <>
struct constraint<ro> : accepts_anything {
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

// The number of dimensions a constraint fixes (-1: none).
template <typename C>
struct ndim_of : std::integral_constant<int, -1> {};
template <int N>
struct ndim_of<ndim<N>> : std::integral_constant<int, N> {};
template <std::int64_t... Extents>
struct ndim_of<shape<Extents...>> : std::integral_constant<int, static_cast<int>(sizeof...(Extents))> {};

// Why arguments did not fit, collected only while explain_mismatches' wrapper runs a call (else
// null, and recording costs one branch).
inline std::vector<std::string>*& mismatch_sink() noexcept
{
  thread_local std::vector<std::string>* sink = nullptr;
  return sink;
}

/// Records `signature: why()` for the call being explained, once.
template <typename Why>
void record_mismatch(const char* signature, const Why& why)
{
  std::vector<std::string>* sink = mismatch_sink();
  if (sink == nullptr) { return; }
  std::string line = std::string(signature) + ": " + why();
  if (std::find(sink->begin(), sink->end(), line) == sink->end()) { sink->push_back(std::move(line)); }
}

/// Collects the mismatches of one call; a nested explained call collects its own.
class mismatch_scope {
 public:
  mismatch_scope() noexcept : outer_(std::exchange(mismatch_sink(), &reasons_)) {}
  ~mismatch_scope() { mismatch_sink() = outer_; }
  mismatch_scope(const mismatch_scope&) = delete;
  mismatch_scope& operator=(const mismatch_scope&) = delete;
  mismatch_scope(mismatch_scope&&) = delete;
  mismatch_scope& operator=(mismatch_scope&&) = delete;

  [[nodiscard]] const std::vector<std::string>& reasons() const noexcept { return reasons_; }

 private:
  std::vector<std::string> reasons_;
  std::vector<std::string>* outer_;
};

/// Calls `function`; when pybind11 finds no overload for the arguments, its TypeError gains a line
/// per array argument that did not fit, saying why.
inline pybind11::object call_explained(const pybind11::object& function, const pybind11::args& args,
                                       const pybind11::kwargs& kwargs)
{
  const mismatch_scope scope;
  try {
    return function(*args, **kwargs);
  } catch (const pybind11::error_already_set& error) {
    if (scope.reasons().empty() || !error.matches(PyExc_TypeError)) { throw; }
    std::string message = pybind11::str(error.value());
    if (message.find("(): incompatible function arguments") == std::string::npos) { throw; }
    message += "\nWhy the array arguments did not fit:";
    for (const std::string& reason : scope.reasons()) { message += "\n    " + reason; }
    throw pybind11::type_error(message);
  }
}

}  // namespace detail

/// An array argument (or return value) of any protocol handoff.asarray takes, imported zero-copy and
/// ordered onto the consumer stream (the enclosing handoff.stream block, else the device's default).
/// An object that does not meet the constraints makes pybind11 try the next overload; the final
/// TypeError lists the accepted signature (and, with explain_mismatches, why each array did not fit).
/// Returned to Python it is a handoff.Array.
template <typename... Constraints>
class array {
 public:
  using scalar = typename detail::first_scalar<Constraints...>::type;
  static constexpr bool read_only = (std::is_same_v<Constraints, ro> || ...);
  /// Imported with DLPack's stream=-1 (orders_itself): no wait inserted.
  static constexpr bool self_ordered = (std::is_same_v<Constraints, orders_itself> || ...);
  using element = std::conditional_t<std::is_void_v<scalar>, void, scalar>;
  using pointer = std::conditional_t<read_only, const element*, element*>;
  /// The number of dimensions an ndim<N> or shape<...> constraint fixes (-1: none).
  static constexpr int static_ndim = std::max({-1, detail::ndim_of<Constraints>::value...});

  /// The framework a returned array reaches Python as (a handoff_framework).
  static constexpr int framework =
    std::max({int{HANDOFF_FRAMEWORK_HANDOFF}, detail::framework_tag<Constraints>::value...});
  static_assert((0 + ... + (detail::framework_tag<Constraints>::value >= 0 ? 1 : 0)) <= 1,
                "handoff::pybind::array: at most one framework tag");

  array() = default;
  /// An array of the view `view` holds, described by `info`.
  array(detail::counted_view view, const handoff_array_info& info) : view_(std::move(view)), info_(info) {}

  /// An array of C++ memory, as nb::ndarray(data, shape, owner): `owner` (a capsule, `self`, any
  /// object) is kept alive as long as the array or anything exported from it. `strides` in elements
  /// (empty: row-major); `device` the memory's (default: the host; device memory is checked against
  /// the device it claims). `stream` is the native handle of the stream device data is ready on (a
  /// kernel that wrote it there): exports order the consumer after it. By default, the enclosing
  /// handoff.stream block's stream (the caller's) where it is on the data's device; 0 or no block:
  /// unknown, so exports order after the device's legacy default stream, which does not cover a
  /// non-blocking stream's work. The dtype is the scalar constraint's; `ro` makes it read-only.
  /// @throws pybind11::value_error for extents or strides that do not fit, or memory that breaks a
  ///         constraint (the reason named); what handoff.view raises.
  template <typename S = scalar, std::enable_if_t<!std::is_void_v<S>, int> = 0>
  array(pointer data, std::initializer_list<std::int64_t> shape, pybind11::handle owner,
        std::initializer_list<std::int64_t> strides = {}, DLDevice device = {kDLCPU, 0},
        std::intptr_t stream = enclosing_stream)
      : array(data, shape.size(), shape.begin(), owner, strides.size(), strides.begin(), device, stream)
  {}
  /// The same with the extents as pointer and count (`strides` may be null: row-major).
  template <typename S = scalar, std::enable_if_t<!std::is_void_v<S>, int> = 0>
  array(pointer data, std::size_t ndim, const std::int64_t* shape, pybind11::handle owner,
        const std::int64_t* strides = nullptr, DLDevice device = {kDLCPU, 0}, std::intptr_t stream = enclosing_stream)
      : array(data, ndim, shape, owner, strides != nullptr ? ndim : 0, strides, device, stream)
  {}
#if __cplusplus >= 202002L
  /// The same with the extents as spans (C++20).
  template <typename S = scalar, std::enable_if_t<!std::is_void_v<S>, int> = 0>
  array(pointer data, std::span<const std::int64_t> shape, pybind11::handle owner,
        std::span<const std::int64_t> strides = {}, DLDevice device = {kDLCPU, 0},
        std::intptr_t stream = enclosing_stream)
      : array(data, shape.size(), shape.data(), owner, strides.size(), strides.data(), device, stream)
  {}
#endif

  /// True when the imported array meets every constraint.
  [[nodiscard]] static bool accepts(const handoff_array_info& info)
  {
    return (read_only || info.readonly == 0) && (detail::constraint<Constraints>::accepts(info) && ...);
  }

  /// Why an imported array does not meet the constraints: each failed one, "; "-separated.
  [[nodiscard]] static std::string mismatch(const handoff_array_info& info)
  {
    std::string why;
    const auto add = [&why](const std::string& reason) { why += (why.empty() ? "" : "; ") + reason; };
    ((detail::constraint<Constraints>::accepts(info) ? void() : add(detail::constraint<Constraints>::mismatch(info))),
     ...);
    if (!read_only && info.readonly != 0) { add("read-only (the parameter is not ro)"); }
    return why;
  }

  [[nodiscard]] pointer data() const noexcept
  {
    return static_cast<pointer>(info_.data);
  }
  [[nodiscard]] std::size_t ndim() const noexcept
  {
    return static_cast<std::size_t>(info_.ndim);
  }
  [[nodiscard]] std::int64_t shape(std::size_t i) const noexcept
  {
    return info_.shape[i];
  }
  /// In elements.
  [[nodiscard]] std::int64_t stride(std::size_t i) const noexcept
  {
    return info_.strides[i];
  }
  [[nodiscard]] std::int64_t size() const noexcept
  {
    std::int64_t n = 1;
    for (std::size_t i = 0; i < ndim(); ++i) { n *= shape(i); }
    return n;
  }
  /// Bytes per element.
  [[nodiscard]] std::int64_t itemsize() const noexcept
  {
    return (static_cast<std::int64_t>(info_.dtype.bits) * info_.dtype.lanes + 7) / 8;
  }
  /// size() x itemsize().
  [[nodiscard]] std::int64_t nbytes() const noexcept
  {
    return size() * itemsize();
  }
  [[nodiscard]] DLDataType dtype() const noexcept
  {
    return info_.dtype;
  }
  [[nodiscard]] bool readonly() const noexcept
  {
    return info_.readonly != 0;
  }
  [[nodiscard]] DLDeviceType device_type() const noexcept
  {
    return info_.device.device_type;
  }
  [[nodiscard]] std::int32_t device_id() const noexcept
  {
    return info_.device.device_id;
  }
  /// The native handle of the stream the data is ready on for this call's consumer (0: none).
  [[nodiscard]] std::intptr_t stream() const noexcept
  {
    return info_.stream;
  }
  /// The data as a handoff.Array (None for a default-constructed array).
  [[nodiscard]] pybind11::object object() const
  {
    return view_ ? detail::python_array(view_) : pybind11::none();
  }
  /// The data as the tagged framework's array (a handoff.Array without a tag), as returning the
  /// array to Python makes it; None for a default-constructed array.
  [[nodiscard]] pybind11::object to_python() const
  {
    return view_ ? detail::checked(detail::api().view_to_python(view_.get(), framework)) : pybind11::none();
  }

  /// Typed element access (const with `ro`); needs a scalar type among the constraints. Host data
  /// only, as data() is: a device pointer is not to be dereferenced here.
  template <typename S = scalar>
  [[nodiscard]] auto view() const noexcept
  {
    static_assert(!std::is_void_v<S>, "handoff::pybind::array::view() needs a scalar type among the constraints");
    using viewed = std::conditional_t<read_only, const S, S>;
    return array_view<viewed, static_ndim>(static_cast<viewed*>(info_.data), info_.ndim, info_.shape, info_.strides);
  }

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
  template <typename S = scalar>
  array(pointer data, std::size_t ndim, const std::int64_t* shape, pybind11::handle owner, std::size_t stride_count,
        const std::int64_t* strides, DLDevice device, std::intptr_t stream)
  {
    static_assert(!std::is_void_v<S>, "handoff::pybind::array of C++ memory needs a scalar type among the constraints");
    if (stride_count != 0 && stride_count != ndim) {
      throw pybind11::value_error("handoff::pybind::array: " + std::to_string(stride_count) + " strides for " +
                                  std::to_string(ndim) + " dimensions");
    }
    if (static_ndim >= 0 && ndim != static_cast<std::size_t>(static_ndim)) {
      throw pybind11::value_error("handoff::pybind::array: " + std::to_string(ndim) +
                                  " dimensions where the type has " + std::to_string(static_ndim));
    }
    const handoff_array_desc desc{
      const_cast<void*>(static_cast<const void*>(data)),  // a read-only view never writes through it
      static_cast<std::int32_t>(ndim),
      shape,
      stride_count != 0 ? strides : nullptr,
      detail::dtype_of<S>(),
      device,
      stream,
      read_only ? 1 : 0};
    view_ = detail::make_view(desc, owner, info_);
    if (!accepts(info_)) { throw pybind11::value_error("handoff::pybind::array: " + mismatch(info_)); }
  }

  detail::counted_view view_;
  handoff_array_info info_{};
};

/// Makes the TypeError of a failed call to each function `names` of `scope` (a module or a
/// pybind11::class_, after its def calls, overloads included) say why each array argument did not
/// fit, after pybind11's list of signatures: e.g. `handoff.Array[float32, ndim=1]: dtype is
/// float64; ndim is 2`. It replaces each function with one that calls the original (keeping its
/// docstring), which costs a call through Python per call.
template <typename Scope>
void explain_mismatches(Scope& scope, std::initializer_list<const char*> names)
{
  namespace pyb = pybind11;
  for (const char* name : names) {
    const pyb::object raw = scope.attr("__dict__")[name];
    const bool is_method = PyInstanceMethod_Check(raw.ptr()) != 0;
    const bool is_static = PyObject_TypeCheck(raw.ptr(), &PyStaticMethod_Type) != 0;
    pyb::object function = raw;
    if (is_method) {
      function = pyb::reinterpret_borrow<pyb::object>(PyInstanceMethod_Function(raw.ptr()));
    } else if (is_static) {
      function = raw.attr("__func__");
    }
    const pyb::object doc = pyb::getattr(function, "__doc__", pyb::none());
    const std::string doc_text = doc.is_none() ? std::string() : doc.cast<std::string>();
    pyb::object wrapper;
    {
      pyb::options options;
      options.disable_function_signatures();  // the docstring is the original's, signatures included
      wrapper = pyb::cpp_function(
        [function](const pyb::args& args, const pyb::kwargs& kwargs) {
          return detail::call_explained(function, args, kwargs);
        },
        pyb::name(name), pyb::scope(scope), pyb::doc(doc_text.c_str()));
    }
    if (is_method) {
      wrapper = detail::checked(PyInstanceMethod_New(wrapper.ptr()));
    } else if (is_static) {
      wrapper = detail::checked(PyStaticMethod_New(wrapper.ptr()));
    }
    pyb::setattr(scope, name, wrapper);
  }
}

}  // namespace handoff::pybind

namespace pybind11::detail {

template <typename... Constraints>
struct type_caster<handoff::pybind::array<Constraints...>> {
  using value_type = handoff::pybind::array<Constraints...>;
  PYBIND11_TYPE_CASTER(value_type, value_type::signature);

  // Only "this object does not fit" lets pybind11 try the next overload: any other failure of the
  // import (handoff.DeviceError, KeyboardInterrupt, MemoryError, a producer's own) propagates.
  // Under explain_mismatches, a misfit records why.
  bool load(handle source, bool /*convert*/)
  {
    namespace hpd = handoff::pybind::detail;
    // None: the enclosing handoff.stream block's stream, else the device's default stream.
    PyObject* stream = value_type::self_ordered ? hpd::unordered_stream() : Py_None;
    handoff_view* made = nullptr;
    handoff_array_info info{};
    const int status = hpd::api().import_view(source.ptr(), stream, &made, &info);
    if (status == 1) { return no_protocol(source); }
    if (status != 0) { throw error_already_set(); }
    hpd::counted_view imported(made);
    if (!value_type::accepts(info)) {
      hpd::record_mismatch(value_type::signature.text, [&info] { return value_type::mismatch(info); });
      return false;
    }
    value = value_type(std::move(imported), info);
    return true;
  }

  // A handoff.Array, or the tagged framework's array (numpy.ndarray, torch.Tensor, ...).
  static handle cast(const value_type& source, return_value_policy /*policy*/, handle /*parent*/)
  {
    return source.to_python().release();
  }

 private:
  static bool no_protocol(handle source)
  {
    handoff::pybind::detail::record_mismatch(value_type::signature.text, [source] {
      return std::string(Py_TYPE(source.ptr())->tp_name) + " speaks no array protocol";
    });
    return false;
  }
};

}  // namespace pybind11::detail
