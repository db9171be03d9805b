// The per-process runtime (the composition root): which device backend serves this process, the
// exchange over it, and what it reports.
#pragma once

#include <handoff/context.hpp>
#include <handoff/embedding.hpp>
#include <handoff/exchange.hpp>

#include <string>
#include <vector>

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

/// The process's exchange, over the backend HANDOFF_BACKEND chooses (auto, cuda, sim, sim-rocm,
/// none), which the first operation that needs a device starts: `none`, and `auto` with no usable
/// CUDA device, give it no device context (with `auto`, CUDA data that needs ordering is then
/// refused). Its operations throw device_error when a backend named explicitly could not start
/// (every call, with the original reason), or the process is a child forked after its parent
/// started a backend. Thread-safe.
[[nodiscard]] exchange& process_exchange() noexcept;

/// Makes the process's exchange and device context with `hooks` (the Python module gives its own as it
/// loads). Thread-safe. @return false, and nothing changes, once either was made: call it before the
/// process's first exchange.
bool embed_process(const embedding& hooks) noexcept;

/// The process exchange's device context if a backend has started (never starts one); nullptr
/// otherwise.
[[nodiscard]] context* started_context() noexcept;

/// Serves every exchange live on a Unix socket, one JSON object per line, from the runtime's service
/// thread (see `handoff-trace attach`): in `$XDG_RUNTIME_DIR/handoff` (else `<tmp>/handoff-<uid>`),
/// mode 0700, the socket `trace-<pid>.sock` mode 0600, clients of another uid refused. Starts once;
/// returns the socket's path. Thread-safe. @throws std::system_error when the socket cannot be made.
[[nodiscard]] std::string serve_trace();
/// Stops serving (closes the clients, removes the socket). Thread-safe; nothing when not serving.
void stop_serving_trace() noexcept;
/// Where process `pid` serves its trace, if it does, most likely first: the path serve_trace() would
/// return in it (found by its uid and environment, also for another user's process), and the one
/// under $TMPDIR (or /tmp) that a process started without $XDG_RUNTIME_DIR uses, when that differs.
/// For the clients (`handoff-trace attach`).
[[nodiscard]] std::vector<std::string> trace_socket_paths(int pid);

}  // namespace handoff
