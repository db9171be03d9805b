// Device calls that block the host run without the GIL, and come back safely at interpreter exit.
#pragma once

#include <Python.h>

#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

namespace handoff::python {

/// Names the thread that will finalize the interpreter (`threading.main_thread().ident`).
void set_finalizing_thread(unsigned long ident) noexcept;

/// Takes the GIL back after PyEval_SaveThread. While the interpreter finalizes, CPython (before
/// 3.14) ends any other thread that asks for the GIL with pthread_exit, whose unwinding aborts at
/// the first noexcept frame and runs C++ destructors that touch Python without the GIL. Such a
/// thread (a daemon thread still inside a device call) is parked until the process exits instead,
/// which is what CPython 3.14 does itself.
void take_gil_back(PyThreadState* state) noexcept;

/// Runs `work` (device calls that may block the host; it must not touch Python) with the GIL
/// released, then returns its result or rethrows its exception with the GIL held again. The GIL is
/// taken back outside any destructor (see take_gil_back).
template <typename Work>
std::invoke_result_t<Work&> without_gil(Work&& work)
{
  using result = std::invoke_result_t<Work&>;
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

}  // namespace handoff::python
