// The per-process runtime: which device backend serves this process, and what it reports.
#pragma once

#include <handoff/context.hpp>
#include <handoff/device.hpp>

#include <string>

namespace handoff {

/// What `handoff.runtime_info()` reports.
struct runtime_description {
  std::string backend;  ///< "cuda", "sim", "sim-rocm" or "none"
  int device_count{0};
  std::string version;         ///< handoff's version
  std::string dlpack_version;  ///< highest DLPack version produced, "1.1"
  bool cuda_compiled{false};   ///< whether the CUDA backend was built
  std::string cuda_runtime;    ///< the CUDA runtime linked in, "13.0"; empty when not built
  int cuda_driver_minimum{0};  ///< the first NVIDIA driver branch that runs it, 580; 0 when not built
  std::string backend_error;   ///< why the requested backend could not start; empty when it did
};

/// handoff's version, "major.minor.patch".
[[nodiscard]] const char* version() noexcept;

/// Describes the runtime without throwing; starts the backend if it was not started yet.
[[nodiscard]] runtime_description describe_runtime() noexcept;

/// The backend chosen by HANDOFF_BACKEND (auto, cuda, sim, sim-rocm, none), started on first use.
/// Returns nullptr for `none` (and for `auto` with no usable device). Thread-safe.
/// @throws device_error when a backend named explicitly could not start (every call, with the
///         original reason).
[[nodiscard]] device::backend* active_backend();

/// Like active_backend(), but a missing backend is an error naming what needed one.
/// @throws device_error when there is no backend.
[[nodiscard]] device::backend& require_backend(const char* what);

/// Refuses data of `type` that needs ordering when nothing can order it: CUDA data (device, host
/// or managed memory) while HANDOFF_BACKEND=auto found no usable CUDA device, for which an
/// unordered exchange would race with the producer's work. HANDOFF_BACKEND=none asks for unordered
/// exchanges and is let through, as is every type the active backend orders.
/// @throws device_error (backend "cuda", the error that stopped its start) saying why.
void require_ordering(DLDeviceType type);

/// The exchange context (event pool, deferred releases) of the active backend; nullptr for none.
/// @throws device_error as active_backend() does.
[[nodiscard]] context* active_context();

/// The context if a backend has started (never starts one); nullptr otherwise.
[[nodiscard]] context* started_context() noexcept;

/// Like active_context(), but a missing backend is an error naming what needed one.
[[nodiscard]] context& require_context(const char* what);

/// Serves every exchange live on a Unix socket, one JSON object per line, from the runtime's service
/// thread (see `handoff-trace attach`): in `$XDG_RUNTIME_DIR/handoff` (else `<tmp>/handoff-<uid>`),
/// mode 0700, the socket `trace-<pid>.sock` mode 0600, clients of another uid refused. Starts once;
/// returns the socket's path. Thread-safe. @throws std::system_error when the socket cannot be made.
[[nodiscard]] std::string serve_trace();
/// Stops serving (closes the clients, removes the socket). Thread-safe; nothing when not serving.
void stop_serving_trace() noexcept;

}  // namespace handoff
