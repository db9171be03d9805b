// Compiles <handoff/pybind11.hpp>, which extensions include, under this build's warnings and
// clang-tidy: every constraint instantiated once. Nothing here is called.
#include <handoff/pybind11.hpp>

#include <cstdint>

namespace handoff::py {

template class array<>;
template class array<float, shape<-1, 3>, device::cpu, c_contig, ro>;
template class array<std::int8_t, ndim<2>, device::cuda, f_contig>;
template class array<bool, device::rocm>;
template class array<std::uint16_t, shape<2, -1>>;
template class array<float16, ndim<1>, device::cpu>;
template class array<bfloat16, device::cpu, ro>;

// view() and explain_mismatches are templates that the explicit instantiations above leave out.
[[maybe_unused]] float16& first(const array<float16, ndim<1>, device::cpu>& values)
{
  return values.view()(0);
}
[[maybe_unused]] const bfloat16& first(const array<bfloat16, device::cpu, ro>& values)
{
  return values.view()(0, 0);
}
[[maybe_unused]] void explain(pybind11::module_& m)
{
  explain_mismatches(m, {"f"});
}

}  // namespace handoff::py
