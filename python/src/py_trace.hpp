// The ownership graph and exchange tracing, seen from Python: library names, `where`, and the
// private functions behind handoff.trace, handoff.ownership_graph and handoff.serve_trace.
#pragma once

#include <handoff/array.hpp>
#include <handoff/trace.hpp>

#include <pybind11/pybind11.h>

#include <string_view>

namespace handoff::python {

namespace py = pybind11;

/// Adds the private tracing functions to `m` and installs the annotator that fills `where`.
void bind_trace(py::module_& m);

/// Names `view`'s producer after `producer`'s library (its type's top-level package; a handoff.Array
/// passes its own producer's on). Cheap: the last type seen is remembered. Holds the GIL.
void name_producer(const array& view, py::handle producer) noexcept;

/// The exchange traced on this thread, or null: a handful of instructions when tracing is off.
[[nodiscard]] inline trace::exchange_scope* traced() noexcept
{
  return trace::enabled() ? trace::exchange_scope::current() : nullptr;
}

/// Sets the protocol of the exchange traced on this thread, if any.
inline void trace_protocol(std::string_view protocol) noexcept
{
  if (trace::exchange_scope* scope = traced()) { scope->set_protocol(protocol); }
}

}  // namespace handoff::python
