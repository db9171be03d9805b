// The GIL around device calls that block the host, and Python's exit: no thread other than the one
// that finalizes the interpreter takes the GIL once exit has begun.
#pragma once

#include <Python.h>

#include <handoff/activity.hpp>
#include <handoff/embedding.hpp>

#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

namespace handoff::python {

/// Names the thread that will finalize the interpreter (`threading.main_thread().ident`).
void set_finalizing_thread(unsigned long ident) noexcept;

/// In a forked child (os.register_at_fork): its one thread is the one that will finalize, and no
/// thread of the parent's is on its way through the gate.
void reset_after_fork_in_child() noexcept;

/// Closes the gate before the interpreter finalizes (from an atexit handler, with the GIL held):
/// threads already on their way to the GIL get it (the GIL is released meanwhile, for at most a
/// second); any thread that asks later is refused. Finalization would otherwise end a thread that
/// waits for the GIL with pthread_exit, whose unwinding aborts at the first noexcept frame and
/// runs C++ destructors that touch Python without the GIL.
void close_python_gate() noexcept;

/// True when the interpreter is shutting down and Python objects must not be touched.
[[nodiscard]] bool interpreter_finalizing() noexcept;

/// True once Python's exit has begun: the gate is closed (close_python_gate) or the interpreter
/// finalizes. Nothing may then call back into Python code of the caller's (a DLPack SetError).
[[nodiscard]] bool python_is_closing() noexcept;

/// True when the calling thread holds the GIL.
[[nodiscard]] bool holds_gil() noexcept;

/// Takes the GIL on a thread that does not hold it (PyGILState_Ensure) and returns true, or
/// returns false without it once the gate is closed: the caller must then not touch Python.
[[nodiscard]] bool ensure_gil(PyGILState_STATE& state) noexcept;

/// The GIL for a scope on a thread that may or may not hold it (PyGILState_Ensure), released when
/// the scope ends. Declare it before the scope's Python objects, so that they go while it is held.
class gil_scope {
 public:
  gil_scope() noexcept : held_(ensure_gil(state_)) {}
  ~gil_scope()
  {
    if (held_) { PyGILState_Release(state_); }
  }
  gil_scope(const gil_scope&) = delete;
  gil_scope& operator=(const gil_scope&) = delete;
  gil_scope(gil_scope&&) = delete;
  gil_scope& operator=(gil_scope&&) = delete;

  /// False once the gate is closed: the scope must then not touch Python.
  [[nodiscard]] bool held() const noexcept { return held_; }

 private:
  PyGILState_STATE state_{};
  bool held_;
};

/// The GIL for a batch of work on a thread that does not hold it (the releases a stream let go
/// together): the first with_gil inside the batch takes it, and it is kept across the batch's
/// Python parts, so that a busy interpreter hands it over once per batch, not once per release; a
/// part that blocks the host (run_without_gil: a free that waits for its device) hands it back
/// first, and the next Python part takes it again. Batches do not nest.
class gil_batch {
 public:
  gil_batch() noexcept;
  ~gil_batch();
  gil_batch(const gil_batch&) = delete;
  gil_batch& operator=(const gil_batch&) = delete;
  gil_batch(gil_batch&&) = delete;
  gil_batch& operator=(gil_batch&&) = delete;

  /// The batch open on the calling thread, or nullptr.
  [[nodiscard]] static gil_batch* current() noexcept;
  /// Takes the GIL unless the batch did already; false once the gate is closed.
  [[nodiscard]] bool take() noexcept;
  /// Lets go of the GIL, if the batch holds it, until the next take().
  void hand_back() noexcept;

 private:
  PyGILState_STATE state_{};
  bool asked_{false};
  bool held_{false};
};

/// True on a thread while a with_gil body runs: Python code may be on its stack.
extern thread_local bool python_part_running;

/// Runs `body` (it touches Python objects, and must not throw) holding the GIL, from any thread: at
/// once where the thread holds it (as a consumer dropping what it imported usually does), else once
/// taken (for the batch's Python parts, inside a gil_batch). Not at all while the interpreter
/// finalizes or once the gate is closed: the process then keeps what `body` would have released.
template <typename Body>
void with_gil(Body&& body) noexcept
{
  if (interpreter_finalizing()) { return; }
  const auto run = [&body] {
    const bool outer = std::exchange(python_part_running, true);
    body();
    python_part_running = outer;
  };
  if (holds_gil()) {
    run();
    return;
  }
  if (gil_batch* batch = gil_batch::current()) {
    if (batch->take()) { run(); }
    return;
  }
  PyGILState_STATE state{};
  if (!ensure_gil(state)) { return; }
  run();
  PyGILState_Release(state);
}

/// While alive, and a launch trace records, the calling thread's Python line stands for the device
/// work it does without the GIL: the backend's reports are annotated with it. Made holding the GIL.
class parked_location {
 public:
  parked_location() noexcept : parked_(activity::recording() && park()) {}
  ~parked_location()
  {
    if (parked_) { unpark(); }
  }
  parked_location(const parked_location&) = delete;
  parked_location& operator=(const parked_location&) = delete;
  parked_location(parked_location&&) = delete;
  parked_location& operator=(parked_location&&) = delete;

 private:
  static bool park() noexcept;  // in py_trace.cpp, with the annotator
  static void unpark() noexcept;

  bool parked_;
};

/// Takes the GIL back after PyEval_SaveThread. Once the gate is closed, a thread other than the
/// finalizing one is parked here until the process exits (what CPython 3.14 does itself).
void take_gil_back(PyThreadState* state) noexcept;

/// Runs `work` (device calls that may block the host; it must not touch Python) with the GIL
/// released, then returns its result or rethrows its exception with the GIL held again.
template <typename Work>
std::invoke_result_t<Work&> without_gil(Work&& work)
{
  using result = std::invoke_result_t<Work&>;
  const parked_location parked;
  std::exception_ptr failure;
  PyThreadState* state = PyEval_SaveThread();
  if constexpr (std::is_void_v<result>) {
    try {
      work();
    } catch (...) {
      failure = std::current_exception();
    }
    take_gil_back(state);
    if (failure) { std::rethrow_exception(failure); }
  } else {
    std::optional<result> out;
    try {
      out.emplace(work());
    } catch (...) {
      failure = std::current_exception();
    }
    take_gil_back(state);
    if (failure) { std::rethrow_exception(failure); }
    return std::move(*out);
  }
}

/// The deleter runner handoff uses in Python (embedding::run_deleter): a producer's deleter runs holding
/// the GIL, since producers' deleters may take it; once the interpreter is finalizing, or other
/// threads may no longer enter it, the deleter is not run and the process keeps the memory.
void run_deleter_with_gil(void (*invoke)(void*) noexcept, void* tensor) noexcept;

/// The release section handoff uses in Python (embedding::run_releases): a batch of releases runs in a
/// gil_batch, so that producers' deleters take the GIL once for the batch.
void run_releases_in_gil_batch(void (*body)(void*) noexcept, void* state) noexcept;

/// The blocking section handoff uses in Python (embedding::block_host): the host waits with the GIL
/// released, so that other threads run meanwhile (and a host function queued on the device that
/// needs the GIL can run): a Python thread releases it around the wait, a batch of releases hands
/// it back, a thread that does not hold it just waits.
void run_without_gil(void (*body)(void*), void* state);

/// The embedding handoff runs under in Python: the process's exchange and context are made with it.
inline constexpr embedding python_embedding{
  .run_deleter = &run_deleter_with_gil, .block_host = &run_without_gil, .run_releases = &run_releases_in_gil_batch};

}  // namespace handoff::python
