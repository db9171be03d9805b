// What an embedding runtime (the Python module) installs so that handoff runs what it hands over
// under the embedding's rules: producers' deleters, host waits, and batches of deferred releases.
#pragma once

namespace handoff {

/// Runs an imported tensor's deleter: `invoke(tensor)` calls it. The default runs it at once, where
/// the last view goes (any thread). An embedding runtime installs its own to run producers'
/// deleters under its rules: the Python module runs them holding the GIL, and keeps them unrun,
/// deliberately, once other threads may no longer enter the interpreter (CuPy's and PyTorch's
/// deleters take the GIL, which aborts or hangs a thread at interpreter exit).
using deleter_runner = void (*)(void (*invoke)(void* tensor) noexcept, void* tensor) noexcept;
/// Installs `runner` for every later release of an imported tensor (nullptr: the default).
void set_deleter_runner(deleter_runner runner) noexcept;

/// How the host waits where an exchange must block it (a copy to the host, a host view): `body(state)`
/// runs on the calling thread and may throw, which must propagate. The Python module releases the
/// GIL around it, so that other threads run while this one waits.
using blocking_section = void (*)(void (*body)(void* state), void* state);
/// Installs `section` for every later blocking transfer (nullptr: the body runs as it is).
void set_blocking_section(blocking_section section) noexcept;

/// How the executor runs a batch of deferred releases that their streams let go together: `body(state)`
/// runs them all. An embedding runtime installs one to take, at most once per batch, what releases
/// need: the Python module's takes the GIL when the first producer's deleter asks for it and keeps
/// it to the batch's end, so that a busy interpreter hands it over once per batch, not once per
/// release (which let releases fall behind imports without bound). Must call `body` exactly once.
using release_section = void (*)(void (*body)(void* state) noexcept, void* state) noexcept;
/// Installs `section` for every later batch of releases (nullptr: the body runs as it is).
void set_release_section(release_section section) noexcept;

}  // namespace handoff
