// handoff.Array's DLPack C exchange API: the table C and C++ consumers call to exchange handoff
// arrays without calling Python.
#pragma once

#include <pybind11/pybind11.h>

#include <handoff/dlpack.h>
#include <handoff/exchange.hpp>

namespace handoff::python {

namespace py = pybind11;

/// The DLPack version whose exchange API the table implements.
inline constexpr DLPackVersion exchange_api_version{1, 2};

/// Makes the tables below run `on`, which must outlive the process's extensions; called once,
/// before either table is published.
void bind_exchange_api(exchange& on) noexcept;

/// handoff.Array's table, for the life of the process.
[[nodiscard]] const DLPackExchangeAPI& array_exchange_api() noexcept;

/// The table of def_dlpack classes: handoff.Array's, but for dltensor_from_py_object_no_sync, which
/// is NULL (DLPack lets a producer leave a slot it does not support NULL): an instance describes its
/// memory on each call, and holds no shape or strides for a DLTensor to borrow. Its
/// managed_tensor_to_py_object_no_sync makes a handoff.Array, as handoff.Array's does.
[[nodiscard]] const DLPackExchangeAPI& class_exchange_api() noexcept;

/// True for the tables above: handoff's own, whose producers' __dlpack__ orders onto the consumer
/// stream directly.
[[nodiscard]] bool is_handoff_exchange_api(const DLPackExchangeAPI* api) noexcept;

/// A new "dlpack_exchange_api" capsule holding `api` (one of the tables above), for the type
/// attribute `__dlpack_c_exchange_api__`.
[[nodiscard]] py::capsule exchange_api_capsule(const DLPackExchangeAPI& api);

}  // namespace handoff::python
