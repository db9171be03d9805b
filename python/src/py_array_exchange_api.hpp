// handoff.Array's DLPack C exchange API: the table C and C++ consumers call to exchange handoff
// arrays without calling Python.
#pragma once

#include <pybind11/pybind11.h>

#include <handoff/dlpack.h>

namespace handoff::python {

namespace py = pybind11;

/// The DLPack version whose exchange API the table implements.
inline constexpr DLPackVersion exchange_api_version{1, 2};

/// handoff.Array's table, for the life of the process.
[[nodiscard]] const DLPackExchangeAPI& array_exchange_api() noexcept;

/// A new "dlpack_exchange_api" capsule holding array_exchange_api(), for the type attribute
/// `__dlpack_c_exchange_api__`.
[[nodiscard]] py::capsule array_exchange_api_capsule();

}  // namespace handoff::python
