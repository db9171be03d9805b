#include "service/service_thread.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace {

using handoff::detail::service_thread;

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
