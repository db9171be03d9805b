// A C++ tensor type that exports itself through handoff, and functions that take any array.
#include <handoff/pybind11.hpp>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace py = pybind11;
namespace hp = handoff::pybind;

namespace {

// A host tensor of float32 values that owns its memory.
class tensor {
 public:
  tensor(std::int64_t rows, std::int64_t cols, float value)
      : shape_{rows, cols}, values_(static_cast<std::size_t>(rows * cols), value)
  {}

  [[nodiscard]] hp::array_desc describe() const
  {
    hp::array_desc desc;
    desc.data = const_cast<float*>(values_.data());
    desc.shape = shape_;
    desc.dtype = {kDLFloat, 32, 1};
    return desc;
  }

 private:
  std::vector<std::int64_t> shape_;
  std::vector<float> values_;
};

// Holds any array and exports it again, whatever its device: def_dlpack over memory it does not
// own (the held handoff.Array keeps the producer alive).
class held {
 public:
  explicit held(hp::array<> values) : values_(std::move(values)) {}

  [[nodiscard]] hp::array_desc describe() const
  {
    hp::array_desc desc;
    desc.data = values_.data();
    for (std::size_t i = 0; i < values_.ndim(); ++i) {
      desc.shape.push_back(values_.shape(i));
      desc.strides.push_back(values_.stride(i));
    }
    desc.dtype = values_.dtype();
    desc.device = {values_.device_type(), values_.device_id()};
    desc.stream = values_.stream();
    desc.readonly = values_.readonly();
    return desc;
  }

 private:
  hp::array<> values_;
};

// Sums a read-only row-major float32 array of the host.
double sum(const hp::array<float, hp::device::cpu, hp::c_contig, hp::ro>& values)
{
  double total = 0;
  for (std::int64_t i = 0; i < values.size(); ++i) { total += values.data()[i]; }
  return total;
}

// Scales a writable one-dimensional float32 host array in place, whatever its stride.
void scale(const hp::array<float, hp::ndim<1>, hp::device::cpu>& values, float factor)
{
  for (std::int64_t i = 0; i < values.shape(0); ++i) { values.data()[i * values.stride(0)] *= factor; }
}

// Any (n, 3) float32 array of any device, returned as the imported handoff.Array: ordered onto
// the consumer stream of the call.
hp::array<float, hp::shape<-1, 3>> rows_of_three(hp::array<float, hp::shape<-1, 3>> values)
{
  return values;
}

// The same, for a function that orders its own work on the data (stream=-1): no wait is inserted,
// and CUDA data is taken even where handoff cannot start CUDA.
hp::array<float, hp::shape<-1, 3>, hp::orders_itself> rows_of_three_unordered(
  hp::array<float, hp::shape<-1, 3>, hp::orders_itself> values)
{
  return values;
}

// Sums a two-dimensional float32 host array of any strides, element by element through view().
double sum_2d(const hp::array<float, hp::ndim<2>, hp::device::cpu, hp::ro>& values)
{
  const auto v = values.view();  // v(i, j): through the strides, no checks per access
  double total = 0;
  for (std::int64_t i = 0; i < v.shape(0); ++i) {
    for (std::int64_t j = 0; j < v.shape(1); ++j) { total += v(i, j); }
  }
  return total;
}

// Negates a one-dimensional float16 or bfloat16 host array in place (the sign bit is the same in
// both), and returns it: two overloads that only the dtype tells apart.
template <typename Half>
hp::array<Half, hp::ndim<1>, hp::device::cpu> negate(hp::array<Half, hp::ndim<1>, hp::device::cpu> values)
{
  const auto v = values.view();
  for (std::int64_t i = 0; i < v.shape(0); ++i) { v(i).bits ^= 0x8000U; }
  return values;
}

// Buffers that arrays made in C++ own, freed with their capsule (for the tests: every one freed).
std::int64_t buffers_freed = 0;

// 0, 1, ..., n-1 in new C++ memory, owned by a capsule that frees it: returned as a handoff.Array,
// or, with a framework tag, as that framework's array (zero-copy; the capsule kept alive by it).
template <typename... Tag>
hp::array<Tag..., float, hp::ndim<1>> arange(std::int64_t n)
{
  auto* values = new std::vector<float>(static_cast<std::size_t>(n));
  std::iota(values->begin(), values->end(), 0.0F);
  const py::capsule owner(values, [](void* buffer) {
    delete static_cast<std::vector<float>*>(buffer);
    ++buffers_freed;
  });
  return {values->data(), {n}, owner};
}

// n float32 values of device memory at `data_ptr` that a kernel wrote on `stream` (its native handle;
// None: the caller's handoff.stream block's stream; 0: unknown), returned holding `owner` (what frees
// the memory): what a library returns after launching on a stream of its own. Consumers are
// ordered after that stream; a framework's array keeps `owner` until the framework's stream is done.
template <typename... Tag>
hp::array<Tag..., float, hp::ndim<1>> device_result(std::uintptr_t data_ptr, std::int64_t n,
                                                    std::tuple<int, int> device, std::optional<std::intptr_t> stream,
                                                    py::object owner)
{
  const DLDevice on{static_cast<DLDeviceType>(std::get<0>(device)), std::get<1>(device)};
  return {reinterpret_cast<float*>(data_ptr), {n}, owner, {}, on, stream.value_or(hp::enclosing_stream)};
}

// A column-major 2 x 3 array of C++ memory (strides in elements), read-only to Python.
hp::array<hp::numpy, float, hp::ndim<2>, hp::ro> column_major()
{
  static const float values[] = {0, 3, 1, 4, 2, 5};  // [[0, 1, 2], [3, 4, 5]] column by column
  return {values, {2, 3}, py::none(), {1, 2}};
}

// Made with as many strides as there are dimensions, or not: a ValueError says which.
hp::array<float> with_strides(std::int64_t count)
{
  static float value = 0;
  return count == 1 ? hp::array<float>(&value, {1}, py::none(), {1})
                    : hp::array<float>(&value, {1}, py::none(), {1, 1});
}

// Any array of the host, returned as a numpy.ndarray of the same memory (made directly by NumPy's C
// API, its base holding the data).
hp::array<hp::numpy, hp::device::cpu, hp::ro> as_numpy(hp::array<hp::numpy, hp::device::cpu, hp::ro> values)
{
  return values;
}

// Any array of the host, returned as a torch.Tensor of the same memory. PyTorch has no read-only
// tensors: read-only data is refused (BufferError) rather than returned writable.
hp::array<hp::pytorch, hp::device::cpu, hp::ro> as_torch(hp::array<hp::pytorch, hp::device::cpu, hp::ro> values)
{
  return values;
}

// What the accessors say about any array, writable or read-only.
py::dict describe(const hp::array<hp::ro>& values)
{
  py::list shape;
  for (std::size_t i = 0; i < values.ndim(); ++i) { shape.append(values.shape(i)); }
  const DLDataType dtype = values.dtype();
  py::dict out;
  out["shape"] = py::tuple(shape);
  out["size"] = values.size();
  out["itemsize"] = values.itemsize();
  out["nbytes"] = values.nbytes();
  out["dtype"] = py::make_tuple(dtype.code, dtype.bits, dtype.lanes);
  out["readonly"] = values.readonly();
  out["device"] = py::make_tuple(static_cast<int>(values.device_type()), values.device_id());
  return out;
}

}  // namespace

PYBIND11_MODULE(tensor_example, m)
{
  m.doc() = "An extension exchanging arrays through handoff's pybind11 helper.";
  py::class_<tensor> cls(m, "Tensor");
  cls.def(py::init<std::int64_t, std::int64_t, float>(), py::arg("rows"), py::arg("cols"), py::arg("value") = 0.0F);
  // __dlpack__, __dlpack_device__, and __array_interface__ as the memory is on the host:
  // np.asarray(tensor) is a zero-copy view that keeps the tensor alive.
  hp::def_dlpack(cls, [](const tensor& t) { return t.describe(); });
  py::class_<held> held_cls(m, "Held");
  held_cls.def(py::init<hp::array<>>(), py::arg("values"));
  hp::def_dlpack(held_cls, [](const held& h) { return h.describe(); });  // __array_interface__ only on the host
  m.def("sum", &sum, py::arg("values"));
  m.def("scale", &scale, py::arg("values"), py::arg("factor"));
  m.def("rows_of_three", &rows_of_three, py::arg("values"));
  m.def("rows_of_three_unordered", &rows_of_three_unordered, py::arg("values"));
  m.def("sum_2d", &sum_2d, py::arg("values"));
  m.def("negate", &negate<hp::float16>, py::arg("values"));
  m.def("negate", &negate<hp::bfloat16>, py::arg("values"));
  m.def("describe", &describe, py::arg("values"));
  m.def("arange", &arange<>, py::arg("n"));
  m.def("arange_numpy", &arange<hp::numpy>, py::arg("n"));
  m.def("arange_torch", &arange<hp::pytorch>, py::arg("n"));
  m.def("arange_jax", &arange<hp::jax>, py::arg("n"));
  m.def("device_result", &device_result<>, py::arg("data_ptr"), py::arg("n"), py::arg("device"),
        py::arg("stream") = py::none(), py::arg("owner") = py::none());
  m.def("device_result_torch", &device_result<hp::pytorch>, py::arg("data_ptr"), py::arg("n"), py::arg("device"),
        py::arg("stream") = py::none(), py::arg("owner") = py::none());
  m.def("device_result_cupy", &device_result<hp::cupy>, py::arg("data_ptr"), py::arg("n"), py::arg("device"),
        py::arg("stream") = py::none(), py::arg("owner") = py::none());
  m.def("column_major", &column_major);
  m.def("as_numpy", &as_numpy, py::arg("values"));
  m.def("as_torch", &as_torch, py::arg("values"));
  m.def("with_strides", &with_strides, py::arg("count"));
  m.def("buffers_freed", [] { return buffers_freed; });
  // A failed call's TypeError then also says why each array argument did not fit.
  hp::explain_mismatches(m, {"sum", "scale", "rows_of_three", "sum_2d", "negate"});
}
