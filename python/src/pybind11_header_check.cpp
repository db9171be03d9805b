// Compiles <handoff/pybind11.hpp>, which extensions include, under this build's warnings and
// clang-tidy: every constraint instantiated once. Nothing here is called.
#include <handoff/pybind11.hpp>

#include <cstdint>

namespace handoff::pybind {

template class array<>;
template class array<float, shape<-1, 3>, device::cpu, c_contig, ro>;
template class array<std::int8_t, ndim<2>, device::cuda, f_contig>;
template class array<bool, device::rocm>;
template class array<std::uint16_t, shape<2, -1>>;
template class array<float16, ndim<1>, device::cpu>;
template class array<bfloat16, device::cpu, ro>;
template class array<numpy, double, ndim<2>>;
template class array<pytorch, float>;
template class array<jax, std::int32_t>;
template class array<cupy, float, device::cuda>;
template class array<array_api, float>;

// view() and explain_mismatches are templates that the explicit instantiations above leave out.
[[maybe_unused]] float16& first(const array<float16, ndim<1>, device::cpu>& values)
{
  return values.view()(0);
}
[[maybe_unused]] const bfloat16& first(const array<bfloat16, device::cpu, ro>& values)
{
  return values.view()(0, 0);
}
// Arrays of C++ memory, each way of giving the extents, and their conversion to Python.
[[maybe_unused]] pybind11::handle made(double* data, const std::int64_t* shape, pybind11::handle owner)
{
  const array<numpy, double, ndim<2>> listed{data, {2, 3}, owner, {3, 1}};
  const array<numpy, double, ndim<2>> counted{data, 2, shape, owner};
  (void)counted;
  const array<float, ro> read_only{static_cast<const float*>(nullptr), {0}, owner};
  (void)read_only;
  return pybind11::detail::make_caster<array<numpy, double, ndim<2>>>::cast(listed, {}, {});
}
[[maybe_unused]] void explain(pybind11::module_& m)
{
  explain_mismatches(m, {"f"});
}

}  // namespace handoff::pybind

// What an extension may well write: pybind11's usual alias and `using namespace handoff` together;
// `py` still names pybind11 alone (the helper's namespace is handoff::pybind).
namespace alias_check {
namespace py = pybind11;
using namespace handoff;  // NOLINT(google-build-using-namespace): the point of the check
[[maybe_unused]] py::object nothing()
{
  return py::none();
}
[[maybe_unused]] std::int64_t size_of(const pybind::array<float, pybind::ndim<1>>& values, const py::handle owner)
{
  return values.size() + (owner.is_none() ? 0 : 1);
}
}  // namespace alias_check
