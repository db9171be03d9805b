// The ownership graph and exchange tracing, seen from Python: library names, `where`, and the
// private functions behind handoff.trace, handoff.ownership_graph and handoff.serve_trace.
#pragma once

#include <handoff/array.hpp>
#include <handoff/exchange.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/trace.hpp>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string_view>

namespace handoff::python {

namespace py = pybind11;

/// Adds the private tracing functions to `m` (a launch trace watches `on`'s device) and installs the
/// annotator that fills `where`.
void bind_trace(py::module_& m, exchange& on);
/// Adds the private functions behind the hooks on other libraries' exchanges (handoff/_interpose.py),
/// which `on` orders.
void bind_interpose(py::module_& m, exchange& on);

/// What keeps native stream `handle` alive, when it is the current stream (on the device that works on
/// data of `data`) of an imported library that holds its streams in objects (CuPy's; PyTorch's own):
/// that stream object. Empty when no library says so. Holds the GIL.
[[nodiscard]] std::shared_ptr<const void> framework_stream_owner(std::uint64_t handle, DLDevice data);

/// `name` kept for the life of the process, as events and graph nodes point at library names. Holds the GIL.
[[nodiscard]] const char* intern_library(std::string_view name);

/// While an import runs, names the producer of each view wrap() makes after the imported object's
/// library (its type's top-level package; a handoff.Array passes its own producer's on), for the
/// ownership graph and the trace. A few instructions: the last type seen is remembered. Holds the GIL.
class producer_naming {
 public:
  explicit producer_naming(PyObject* producer) noexcept : outer_(current_library)
  {
    PyTypeObject* type = Py_TYPE(producer);
    current_library = type == last_type ? last_library : library_of(producer);
  }
  producer_naming(const producer_naming&) = delete;
  producer_naming& operator=(const producer_naming&) = delete;
  producer_naming(producer_naming&&) = delete;
  producer_naming& operator=(producer_naming&&) = delete;
  ~producer_naming() { current_library = outer_; }

  /// The library of the import in progress, or null.
  [[nodiscard]] static const char* current() noexcept { return current_library; }

 private:
  static const char* library_of(PyObject* producer) noexcept;  // and remembers a plain type's

  const char* outer_;
  static inline const char* current_library = nullptr;
  static inline PyTypeObject* last_type = nullptr;
  static inline const char* last_library = nullptr;
};

/// Sets the protocol of the exchange traced on this thread, if any.
inline void trace_protocol(std::string_view protocol) noexcept
{
  if (trace::exchange_scope* scope = trace::traced()) { scope->set_protocol(protocol); }
}

}  // namespace handoff::python
