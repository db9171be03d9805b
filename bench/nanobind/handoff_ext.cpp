// The benchmark's extension written with handoff's pybind11 helper; nanobind_ext.cpp is the same
// with nanobind. Keep the two doing the same work, call for call.
#include <handoff/pybind11.hpp>

#include <pybind11/pybind11.h>

#include <array>
#include <cstdint>

namespace py = pybind11;
namespace hp = handoff::pybind;

namespace {

using vector = hp::array<float, hp::ndim<1>, hp::c_contig, hp::device::cpu>;

double sum(const vector& values)
{
  const float* data = values.data();
  double total = 0;
  for (std::int64_t i = 0; i < values.shape(0); ++i) { total += data[i]; }
  return total;
}

double sum3(const vector& a, const vector& b, const vector& c)
{
  return sum(a) + sum(b) + sum(c);
}

void scale(const vector& values, float factor)
{
  float* data = values.data();
  for (std::int64_t i = 0; i < values.shape(0); ++i) { data[i] *= factor; }
}

// A new array of C++ memory, owned by a capsule that frees it.
hp::array<hp::numpy, float, hp::ndim<1>> arange(std::int64_t n)
{
  auto* data = new float[static_cast<std::size_t>(n)];
  for (std::int64_t i = 0; i < n; ++i) { data[i] = static_cast<float>(i); }
  const py::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  return {data, {n}, owner};
}

struct buffer {
  std::array<float, 16> values{};
};

}  // namespace

PYBIND11_MODULE(bench_handoff, m)
{
  m.def("sum3", &sum3);
  m.def("scale", &scale);
  m.def("arange", &arange);
  py::class_<buffer> cls(m, "Buffer");
  cls.def(py::init<>());
  hp::def_dlpack(cls, [](const buffer& b) {
    hp::array_desc desc;
    desc.data = const_cast<float*>(b.values.data());  // NOLINT(cppcoreguidelines-pro-type-const-cast)
    desc.shape = {static_cast<std::int64_t>(b.values.size())};
    return desc;
  });
}
