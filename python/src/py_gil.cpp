#include "py_gil.hpp"

#include "py_support.hpp"

#include <atomic>
#include <chrono>
#include <thread>

namespace handoff::python {
namespace {

std::atomic<unsigned long> finalizing_thread{0};

}  // namespace

void set_finalizing_thread(unsigned long ident) noexcept
{
  finalizing_thread.store(ident, std::memory_order_relaxed);
}

void take_gil_back(PyThreadState* state) noexcept
{
  // The finalizing thread itself may still run device calls (from finalizers): it must come back.
  const bool finalizer = PyThread_get_thread_ident() == finalizing_thread.load(std::memory_order_relaxed);
  while (!finalizer && interpreter_finalizing()) { std::this_thread::sleep_for(std::chrono::hours{1}); }
  PyEval_RestoreThread(state);
}

}  // namespace handoff::python
