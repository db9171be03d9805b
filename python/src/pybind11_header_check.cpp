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

}  // namespace handoff::py
