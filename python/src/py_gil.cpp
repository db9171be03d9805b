#include "py_gil.hpp"

#include "py_cpython.hpp"

#include <atomic>
#include <chrono>
#include <thread>

namespace handoff::python {
namespace {

// A thread counts itself in `entering` before it looks at `closing`, and the closer sets `closing`
// before it looks at `entering` (both sequentially consistent): either the thread sees the gate
// closed, or the closer sees the thread and lets it through first.
std::atomic<bool> closing{false};
std::atomic<int> entering{0};
std::atomic<unsigned long> finalizing_thread{0};

bool is_finalizing_thread() noexcept
{
  return PyThread_get_thread_ident() == finalizing_thread.load(std::memory_order_relaxed);
}

// Runs `take` (which takes the GIL) unless the gate is closed; true when it ran.
template <typename Take>
bool through_gate(Take take) noexcept
{
  if (is_finalizing_thread()) {
    take();
    return true;
  }
  entering.fetch_add(1);
  const bool open = !closing.load();
  if (open) { take(); }
  entering.fetch_sub(1);
  return open;
}

}  // namespace

void set_finalizing_thread(unsigned long ident) noexcept
{
  finalizing_thread.store(ident, std::memory_order_relaxed);
}

void reset_after_fork_in_child() noexcept
{
  entering.store(0);
  finalizing_thread.store(PyThread_get_thread_ident(), std::memory_order_relaxed);
}

void close_python_gate() noexcept
{
  closing.store(true);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds{1};
  while (entering.load() > 0 && std::chrono::steady_clock::now() < deadline) {
    Py_BEGIN_ALLOW_THREADS std::this_thread::sleep_for(std::chrono::milliseconds{1});
    Py_END_ALLOW_THREADS
  }
}

bool interpreter_finalizing() noexcept
{
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

bool python_is_closing() noexcept
{
  return closing.load() || interpreter_finalizing();
}

bool holds_gil() noexcept
{
  // What PyGILState_Check asks, without its shortcut that answers yes for every thread once a
  // sub-interpreter exists: does the thread state holding the GIL belong to this thread? Asked by
  // thread id, not of PyGILState_GetThisThreadState, whose thread-specific lookup costs as much as
  // the rest of a deleter's run (every imported array's release asks).
#if PY_VERSION_HEX >= 0x030D0000
  const PyThreadState* holder = PyThreadState_GetUnchecked();
#else
  const PyThreadState* holder = _PyThreadState_UncheckedGet();
#endif
  return holder != nullptr && holder->thread_id == PyThread_get_thread_ident();
}

bool ensure_gil(PyGILState_STATE& state) noexcept
{
  if (holds_gil()) {  // already held: nothing to wait for
    state = PyGILState_Ensure();
    return true;
  }
  return through_gate([&state] { state = PyGILState_Ensure(); });
}

void take_gil_back(PyThreadState* state) noexcept
{
  if (!through_gate([state] { PyEval_RestoreThread(state); })) {
    for (;;) { std::this_thread::sleep_for(std::chrono::hours{1}); }  // until the process exits
  }
}

namespace {
thread_local gil_batch* open_batch = nullptr;
}  // namespace

thread_local bool python_part_running = false;

gil_batch::gil_batch() noexcept
{
  open_batch = this;
}

gil_batch::~gil_batch()
{
  open_batch = nullptr;
  if (held_) { PyGILState_Release(state_); }
}

gil_batch* gil_batch::current() noexcept
{
  return open_batch;
}

void gil_batch::hand_back() noexcept
{
  if (held_) { PyGILState_Release(state_); }
  held_ = false;
  asked_ = false;
}

bool gil_batch::take() noexcept
{
  if (!asked_) {
    asked_ = true;
    held_ = ensure_gil(state_);
  }
  return held_;
}

void run_releases_in_gil_batch(void (*body)(void*) noexcept, void* state) noexcept
{
  if (holds_gil()) {
    body(state);
    return;
  }
  const gil_batch batch;
  body(state);
}

call_argument::~call_argument()
{
  if (object_ != nullptr && holds_gil()) { Py_DECREF(object_); }  // else a thread that finalization ends
}

void run_deleter_with_gil(void (*invoke)(void*) noexcept, void* tensor) noexcept
{
  with_gil([invoke, tensor] { invoke(tensor); });
}

void run_without_gil(void (*body)(void*), void* state)
{
  gil_batch* batch = gil_batch::current();
  // Not held (a thread of the runtime's, outside Python); or held by a batch's Python part that is
  // running (a finalizer dropping an array), which must get it back as it was: the runtime's thread
  // may not wait for it once Python's exit has begun.
  if (!holds_gil() || (batch != nullptr && python_part_running)) {
    body(state);
    return;
  }
  if (batch != nullptr) {
    batch->hand_back();  // between the batch's Python parts: the next takes it again
    body(state);
    return;
  }
  without_gil([body, state] { body(state); });
}

}  // namespace handoff::python
