// The benchmark's extension written with nanobind's nb::ndarray; handoff_ext.cpp is the same with
// handoff's pybind11 helper. Keep the two doing the same work, call for call.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <array>
#include <cstdint>

namespace nb = nanobind;

namespace {

using vector = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

double sum(const vector& values)
{
  const float* data = values.data();
  double total = 0;
  for (std::size_t i = 0; i < values.shape(0); ++i) { total += data[i]; }
  return total;
}

double sum3(const vector& a, const vector& b, const vector& c)
{
  return sum(a) + sum(b) + sum(c);
}

void scale(const vector& values, float factor)
{
  float* data = values.data();
  for (std::size_t i = 0; i < values.shape(0); ++i) { data[i] *= factor; }
}

// A new array of C++ memory, owned by a capsule that frees it.
nb::ndarray<nb::numpy, float, nb::ndim<1>> arange(std::int64_t n)
{
  auto* data = new float[static_cast<std::size_t>(n)];
  for (std::int64_t i = 0; i < n; ++i) { data[i] = static_cast<float>(i); }
  const nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<float*>(p); });
  return {data, {static_cast<std::size_t>(n)}, owner};
}

struct buffer {
  std::array<float, 16> values{};
};

}  // namespace

NB_MODULE(bench_nanobind, m)
{
  m.def("sum3", &sum3);
  m.def("scale", &scale);
  m.def("arange", &arange);
  // nanobind has no def_dlpack: the usual hand-written pair, its __dlpack__ an unversioned capsule
  // that keeps the instance alive (stream, max_version and the others are accepted and ignored).
  nb::class_<buffer>(m, "Buffer")
    .def(nb::init<>())
    .def("__dlpack__",
         [](nb::handle self, const nb::kwargs& /*kwargs*/) {
           buffer& b = nb::cast<buffer&>(self);
           return nb::ndarray<float, nb::shape<16>>(b.values.data(), {b.values.size()}, self);
         })
    .def("__dlpack_device__", [](nb::handle /*self*/) { return nb::make_tuple(1, 0); });
}
