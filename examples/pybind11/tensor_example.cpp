// A C++ tensor type that exports itself through handoff, and functions that take any array.
#include <handoff/pybind11.hpp>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace py = pybind11;
namespace hp = handoff::py;

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

}  // namespace

PYBIND11_MODULE(tensor_example, m)
{
  m.doc() = "An extension exchanging arrays through handoff's pybind11 helper.";
  py::class_<tensor> cls(m, "Tensor");
  cls.def(py::init<std::int64_t, std::int64_t, float>(), py::arg("rows"), py::arg("cols"), py::arg("value") = 0.0F);
  hp::def_dlpack(cls, [](const tensor& t) { return t.describe(); });
  m.def("sum", &sum, py::arg("values"));
  m.def("scale", &scale, py::arg("values"), py::arg("factor"));
  m.def("rows_of_three", &rows_of_three, py::arg("values"));
}
