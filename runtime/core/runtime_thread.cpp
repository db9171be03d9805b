#include <handoff/internal/runtime_thread.hpp>

#include <pthread.h>

#include <csignal>
#include <utility>

namespace handoff::detail {

namespace {

// Blocks the asynchronous signals in the calling thread while it lives, so that a thread started
// meanwhile inherits the mask (one set in the new thread's body would leave a window open).
class asynchronous_signals_blocked {
 public:
  asynchronous_signals_blocked() noexcept
  {
    sigset_t blocked;
    sigfillset(&blocked);
    // A fault of the thread's own still reaches the process's handlers (blocked, it ends the process
    // without them; SIGSYS is a seccomp filter's trap), and a profiler's SIGPROF samples the
    // runtime's threads as it does the others.
    for (const int kept : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS, SIGPROF}) {
      sigdelset(&blocked, kept);
    }
    restore_ = pthread_sigmask(SIG_BLOCK, &blocked, &previous_) == 0;
  }
  asynchronous_signals_blocked(const asynchronous_signals_blocked&) = delete;
  asynchronous_signals_blocked& operator=(const asynchronous_signals_blocked&) = delete;
  asynchronous_signals_blocked(asynchronous_signals_blocked&&) = delete;
  asynchronous_signals_blocked& operator=(asynchronous_signals_blocked&&) = delete;
  ~asynchronous_signals_blocked()
  {
    if (restore_) { pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }
  }

 private:
  sigset_t previous_{};
  bool restore_{false};
};

}  // namespace

std::thread start_runtime_thread(std::function<void()> body)
{
  const asynchronous_signals_blocked inherited;
  return std::thread(std::move(body));
}

}  // namespace handoff::detail
