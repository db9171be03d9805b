// The consumer's calls into a producer's DLPack C exchange API (`__dlpack_c_exchange_api__`).
#pragma once

#include <pybind11/pybind11.h>

#include <handoff/dlpack.h>

#include <cstdint>
#include <optional>

namespace handoff::python {

namespace py = pybind11;

/// Interns the attribute names; called once at module initialization.
void init_exchange_api();

/// The table `type` publishes as `__dlpack_c_exchange_api__` when handoff can import through it:
/// a "dlpack_exchange_api" capsule of major version 1 with `managed_tensor_from_py_object_no_sync`.
/// nullptr otherwise. Tables are cached by capsule (strong references keep them valid), so a call
/// costs a type attribute lookup.
[[nodiscard]] const DLPackExchangeAPI* exchange_api_of(PyTypeObject* type);

/// True when `x.is_conj()` says its memory holds the conjugates of its values (PyTorch's lazy
/// conjugation): the table exports that memory as it is, where `__dlpack__` refuses it.
/// @throws py::error_already_set when `is_conj` raises.
[[nodiscard]] bool is_lazy_conjugate(PyObject* x);

/// True when `x.requires_grad` (PyTorch's autograd) is true: the table exports such a tensor, where
/// `__dlpack__` refuses it (a consumer could write into an autograd leaf unseen).
/// @throws py::error_already_set when reading the attribute raises.
[[nodiscard]] bool requires_grad(PyObject* x);

/// The tensor `api` makes of `x`, without synchronization; its deleter belongs to the caller.
/// nullptr when the producer's call failed: its Python error is cleared and logged.
[[nodiscard]] DLManagedTensorVersioned* managed_tensor_of(const DLPackExchangeAPI& api, PyObject* x) noexcept;

/// The DLPack stream value of the stream `api`'s producer enqueues its work on for `device`
/// (nullopt: the device's default stream). False when the table has no `current_work_stream` or
/// the call failed (Python error cleared and logged).
[[nodiscard]] bool current_work_stream(const DLPackExchangeAPI& api, DLDevice device,
                                       std::optional<std::int64_t>& value) noexcept;

}  // namespace handoff::python
