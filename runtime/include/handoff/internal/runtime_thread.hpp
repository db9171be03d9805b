// Internal: starting the runtime's own threads.
#pragma once

#include <functional>
#include <thread>

namespace handoff::detail {

/// Starts a thread of the runtime's own (the service thread, the simulator's workers and its IPC
/// watch) that takes none of the process's asynchronous signals: SIGINT, SIGTERM and the like go to
/// the program's threads, however early the runtime's started. A Python program handles them in its
/// main thread, which a signal delivered elsewhere does not wake; a thread waiting in sigwait for a
/// signal it blocks never sees one that another thread took. A fault of the thread's own (SIGSEGV,
/// SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS) still reaches the process's handlers, and a
/// profiler's SIGPROF the thread. What the runtime runs there for others (a producer's deleter, a
/// Python owner's finalizer) runs with the signals blocked, as does a thread or a process it starts.
/// @throws std::system_error as std::thread's constructor does; the caller's signal mask is kept.
[[nodiscard]] std::thread start_runtime_thread(std::function<void()> body);

}  // namespace handoff::detail
