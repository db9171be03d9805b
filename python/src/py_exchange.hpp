// The consumer side: handoff.from_dlpack and handoff.asarray.
#pragma once

#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/stream_value.hpp>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>

namespace handoff::python {

namespace py = pybind11;

/// The exchange every call of the module runs, the process's (module.cpp, the composition root).
/// @throws device_error as handoff::process_exchange does.
[[nodiscard]] exchange& module_exchange();

/// Creates the context variable behind `handoff.stream(...)` blocks and the cached call
/// arguments, and adds `from_dlpack` and `asarray` to `m` as METH_FASTCALL functions.
void init_exchange(py::module_& m);

/// The stream of the enclosing `handoff.stream(...)` block (a handoff.Stream), or None.
[[nodiscard]] py::object enclosing_stream();

/// The stream of the enclosing `handoff.stream(...)` block when it serves `device`'s data (device
/// memory, and a block stream of no device or of the data's), else None.
[[nodiscard]] py::object enclosing_stream_for(DLDevice device);

/// What keeps stream `handle` alive when the enclosing `handoff.stream(...)` block names it by a
/// stream object (CuPy's, PyTorch's, ...), or when a framework this thread calls (framework_call)
/// names it; empty otherwise (no block, a bare handle, another stream).
[[nodiscard]] std::shared_ptr<const void> enclosing_stream_owner(std::uint64_t handle);

/// The consumer stream of a framework handoff hands an array to (its from_dlpack): what keeps it
/// alive until the framework's array is released, for `handle` (nullopt: any stream it names).
struct framework_stream {
  std::optional<std::uint64_t> handle;
  std::shared_ptr<const void> owner;
};

/// For its scope, exports on this thread to the stream `stream` names are to a consumer whose
/// stream is alive when it releases them (enclosing_stream_owner): their producers are kept until
/// the work it then enqueued there is done. Scopes nest.
class framework_call {
 public:
  explicit framework_call(const framework_stream& stream) noexcept;
  ~framework_call();
  framework_call(const framework_call&) = delete;
  framework_call& operator=(const framework_call&) = delete;
  framework_call(framework_call&&) = delete;
  framework_call& operator=(framework_call&&) = delete;

 private:
  const framework_stream* outer_;
};

/// A consumer's `stream` argument, read once (stream_named_by): the argument, else the stream of the
/// enclosing handoff.stream block, else the default stream.
/// @throws type_error for objects that are no stream, value_error for bad ints or handles.
[[nodiscard]] named_stream consumer_stream(py::handle stream);

/// True for NumPy's arrays (not subclasses), which live on the host: their device need not be asked.
[[nodiscard]] bool is_numpy_array(PyObject* x) noexcept;

/// handoff.from_dlpack(x, /, *, device=None, copy=None, stream=None)
[[nodiscard]] py::object from_dlpack(py::handle x, py::handle device, py::handle copy, py::handle stream);

/// What asarray raises for an object that speaks none of its protocols: a TypeError that says the
/// object does not fit (an overload may take it), unlike any other failure of the import.
class no_array_protocol : public type_error {
 public:
  using type_error::type_error;
};

/// handoff.asarray(x, /, *, device=None, copy=None, stream=None)
[[nodiscard]] py::object asarray(py::handle x, py::handle device, py::handle copy, py::handle stream);

}  // namespace handoff::python
