// What an embedding runtime (the Python module) gives the exchange and the device context it composes,
// so that handoff runs what it hands over under the embedding's rules: producers' deleters, host
// waits, and batches of deferred releases.
#pragma once

namespace handoff {

/// Runs an imported tensor's deleter: `invoke(tensor)` calls it. Without one, it runs at once, where
/// the last view goes (any thread). The Python module's runs producers' deleters holding the GIL, and
/// keeps them unrun, deliberately, once other threads may no longer enter the interpreter (CuPy's and
/// PyTorch's deleters take the GIL, which aborts or hangs a thread at interpreter exit).
using deleter_runner = void (*)(void (*invoke)(void* tensor) noexcept, void* tensor) noexcept;

/// How the host waits where an exchange must block it (a copy to the host, a host view, a free that
/// waits for its device): `body(state)` runs on the calling thread and may throw, which must
/// propagate. The Python module's releases the GIL around it, so that other threads run meanwhile.
using blocking_section = void (*)(void (*body)(void* state), void* state);

/// How the executor runs a batch of deferred releases that their streams let go together: `body(state)`
/// runs them all, and must be called exactly once. The Python module's takes the GIL when the first
/// producer's deleter asks for it and keeps it to the batch's end, so that a busy interpreter hands
/// it over once per batch, not once per release (which let releases fall behind imports without bound).
using release_section = void (*)(void (*body)(void* state) noexcept, void* state) noexcept;

/// The hooks an exchange and a device context are made with (null: the work runs as it is). The
/// exchange runs its imports' deleters with `run_deleter`; the context waits in `block_host` and runs
/// its releases in `run_releases`. The process's runtime makes both with the process's embedding
/// (runtime.hpp: embed_process).
struct embedding {
  deleter_runner run_deleter{nullptr};
  blocking_section block_host{nullptr};
  release_section run_releases{nullptr};
};

/// Runs `body(state)` in `section`, or as it is where there is none. What `body` throws propagates.
inline void run_blocking(blocking_section section, void (*body)(void* state), void* state)
{
  if (section != nullptr) {
    section(body, state);
  } else {
    body(state);
  }
}

}  // namespace handoff
