#include "service/service_thread.hpp"

#include <handoff/internal/runtime_thread.hpp>

#include <gtest/gtest.h>

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>
#include <ctime>
#include <thread>
#include <vector>

namespace {

using handoff::detail::service_thread;
using handoff::detail::start_runtime_thread;

sigset_t blocked_on_this_thread()
{
  sigset_t mask;
  pthread_sigmask(SIG_BLOCK, nullptr, &mask);
  return mask;
}

TEST(ServiceThreadTest, RunsPostedWorkInOrderOffTheCallersThread)
{
  std::vector<int> order;
  std::thread::id ran_on;
  service_thread service;
  for (int i = 0; i < 100; ++i) {
    service.post([&order, &ran_on, i] {
      order.push_back(i);
      ran_on = std::this_thread::get_id();
    });
  }
  service.drain();
  ASSERT_EQ(order.size(), 100U);
  for (int i = 0; i < 100; ++i) { EXPECT_EQ(order[static_cast<std::size_t>(i)], i); }
  EXPECT_NE(ran_on, std::this_thread::get_id());
}

TEST(ServiceThreadTest, DestructorRunsWhatIsPending)
{
  std::atomic<int> ran{0};
  {
    service_thread service;
    for (int i = 0; i < 50; ++i) {
      service.post([&ran] {
        std::this_thread::sleep_for(std::chrono::microseconds{100});
        ++ran;
      });
    }
  }
  EXPECT_EQ(ran.load(), 50);
}

TEST(RuntimeThreadTest, TakesNoAsynchronousSignalButItsOwnFaultsAndLeavesTheCallersMaskAsItWas)
{
  sigset_t before;
  sigemptyset(&before);
  sigaddset(&before, SIGUSR2);  // the caller's own, to be kept
  sigset_t inherited;
  ASSERT_EQ(pthread_sigmask(SIG_SETMASK, &before, &inherited), 0);
  sigset_t in_plain_thread{};
  std::thread([&] { in_plain_thread = blocked_on_this_thread(); }).join();
  EXPECT_FALSE(sigismember(&in_plain_thread, SIGTERM)) << "the control: a thread inherits its creator's mask";

  sigset_t in_runtime_thread{};
  start_runtime_thread([&] { in_runtime_thread = blocked_on_this_thread(); }).join();
  for (const int asynchronous : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGCHLD, SIGPIPE, SIGALRM}) {
    EXPECT_TRUE(sigismember(&in_runtime_thread, asynchronous)) << strsignal(asynchronous);
  }
  for (const int kept : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS, SIGPROF}) {
    EXPECT_FALSE(sigismember(&in_runtime_thread, kept)) << strsignal(kept);
  }
  const sigset_t after = blocked_on_this_thread();
  for (int s = 1; s < NSIG; ++s) { EXPECT_EQ(sigismember(&after, s), sigismember(&before, s)) << strsignal(s); }
  pthread_sigmask(SIG_SETMASK, &inherited, nullptr);
}

TEST(ServiceThreadTest, ASignalTheProgramWaitsForReachesItAfterTheServiceStarted)
{
  // A program that blocks a signal to wait for it (sigwait) after the runtime's threads started:
  // one of them would have taken it, and SIGUSR1's default action ended the process.
  service_thread service;
  service.drain();
  sigset_t awaited;
  sigemptyset(&awaited);
  sigaddset(&awaited, SIGUSR1);
  sigset_t previous;
  ASSERT_EQ(pthread_sigmask(SIG_BLOCK, &awaited, &previous), 0);
  ASSERT_EQ(kill(getpid(), SIGUSR1), 0);
  const timespec patience{.tv_sec = 30, .tv_nsec = 0};
  EXPECT_EQ(sigtimedwait(&awaited, nullptr, &patience), SIGUSR1);
  pthread_sigmask(SIG_SETMASK, &previous, nullptr);
}

TEST(ServiceThreadTest, AThrowingTaskDoesNotStopTheService)
{
  std::atomic<bool> after{false};
  service_thread service;
  service.post([] { throw std::runtime_error("boom"); });
  service.post([&after] { after = true; });
  service.drain();
  EXPECT_TRUE(after.load());
}

}  // namespace
