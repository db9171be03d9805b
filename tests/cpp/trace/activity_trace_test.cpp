// Device activity in a launch trace, on the simulator: each operation becomes an event with its
// stream, the race detector flags what CUDA leaves unordered (and only that), host waits carry the
// time they blocked, and nothing is recorded outside a launch trace.
#include "device/sim/sim_backend.hpp"

#include <handoff/activity.hpp>
#include <handoff/trace.hpp>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

namespace handoff {
namespace {

using namespace std::chrono_literals;
using device::sim_backend;
using device::sim_flavour;
using device::stream_handle;

class ActivityTraceTest : public ::testing::Test {
 protected:
  void SetUp() override { data_ = static_cast<float*>(sim_.allocate(n * sizeof(float), sim_.legacy_default_stream())); }
  void TearDown() override
  {
    if (session_ != 0) { (void)trace::end_session(session_); }
    sim_.synchronize_device();
    sim_.free_sync(data_);
  }

  void begin() { session_ = trace::begin_session(0, /*activity=*/true); }
  std::vector<trace::event> finish() { return trace::end_session(std::exchange(session_, 0)); }

  void launch(stream_handle s, activity::access mode, const char* name = "kernel")
  {
    const activity::buffer_use use{
      .address = reinterpret_cast<std::uintptr_t>(data_), .bytes = n * sizeof(float), .mode = mode};
    sim_.launch_kernel(s, activity::intern(name), {&use, 1});
  }

  static std::vector<const trace::event*> hazards(const std::vector<trace::event>& events)
  {
    std::vector<const trace::event*> out;
    for (const auto& e : events) {
      if (e.hazard != nullptr) { out.push_back(&e); }
    }
    return out;
  }

  static constexpr std::size_t n = 256;
  sim_backend sim_{1, sim_flavour::cuda};
  float* data_{nullptr};
  std::uint64_t session_{0};
};

TEST(ActivityInternTest, ANameIsOnePointerWhereverItsTextComesFromAndOnEveryThread)
{
  std::string text = "intern-test-kernel";
  const char* first = activity::intern(text);
  EXPECT_STREQ(first, "intern-test-kernel");
  const std::string copy = text;
  EXPECT_EQ(activity::intern(copy), first) << "the same text in another buffer";
  const char* longer = activity::intern("intern-test-kernel-2");  // the last name is its prefix
  EXPECT_STREQ(longer, "intern-test-kernel-2");
  EXPECT_STREQ(activity::intern("intern-test"), "intern-test") << "a prefix of the last name";
  text[0] = 'X';  // the buffer a name came from changes: the name does not
  EXPECT_STREQ(activity::intern(text), "Xntern-test-kernel");
  EXPECT_STREQ(first, "intern-test-kernel");
  EXPECT_STREQ(activity::intern(""), "");
  EXPECT_STREQ(activity::intern(""), "");
  const char* on_another_thread = nullptr;
  std::thread{[&] { on_another_thread = activity::intern("intern-test-kernel"); }}.join();
  EXPECT_EQ(on_another_thread, first);
}

TEST(ActivityInternTest, ANameFoundAmongTheThreadsRecentOnesIsItselfWhereverItIsAmongThem)
{
  // The thread's recent names, most recent first: each name asked again is found second or third,
  // and moved to the front (negative control: three different pointers).
  const std::array<const char*, 3> first{activity::intern("intern-recent-a"), activity::intern("intern-recent-b"),
                                         activity::intern("intern-recent-c")};
  EXPECT_NE(first[0], first[1]);
  EXPECT_NE(first[1], first[2]);
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(activity::intern(std::string{"intern-recent-a"}), first[0]) << "round " << round;
    EXPECT_EQ(activity::intern(std::string{"intern-recent-c"}), first[2]) << "round " << round;
    EXPECT_EQ(activity::intern(std::string{"intern-recent-b"}), first[1]) << "round " << round;
  }
}

TEST(ActivityInternTest, NamesAskedInTurnStayOnePointerEachBeyondTheThreadsRecentOnes)
{
  std::vector<const char*> first;
  first.reserve(20);
  for (int i = 0; i < 20; ++i) { first.push_back(activity::intern(fmt::format("intern-turn-{}", i))); }
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 20; ++i) {
      EXPECT_EQ(activity::intern(fmt::format("intern-turn-{}", i)), first[static_cast<std::size_t>(i)]) << i;
    }
  }
}

TEST_F(ActivityTraceTest, NothingIsRecordedOutsideALaunchTrace)
{
  EXPECT_FALSE(activity::recording());
  const auto exchanges_only = trace::begin_session();
  EXPECT_FALSE(activity::recording());
  launch(sim_.create_stream(true), activity::access::write);
  EXPECT_TRUE(trace::end_session(exchanges_only).empty());
}

TEST_F(ActivityTraceTest, EachOperationIsAnEventOnItsStream)
{
  begin();
  EXPECT_TRUE(activity::recording());
  const auto s = sim_.create_stream(/*non_blocking=*/true);
  sim_.enqueue_fill(s, data_, n, 1.0F);
  launch(s, activity::access::read_write, "scale");
  const auto e = sim_.create_event();
  sim_.record_event(e, s);
  sim_.stream_wait_event(sim_.legacy_default_stream(), e);
  sim_.synchronize_stream(s);
  sim_.destroy_event(e);
  sim_.destroy_stream(s);
  const auto events = finish();
  EXPECT_FALSE(activity::recording());
  const std::vector<std::string_view> expected{"stream create", "copy set",    "launch kernel", "stream record",
                                               "stream wait",   "sync stream", "stream destroy"};
  ASSERT_EQ(events.size(), expected.size());
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(fmt::format("{} {}", trace::name(events[i].kind), events[i].op), expected[i]);
  }
  const auto& kernel = events[2];
  EXPECT_STREQ(kernel.kernel, "scale");
  ASSERT_TRUE(kernel.stream);
  EXPECT_EQ(kernel.stream->handle, static_cast<std::uint64_t>(s));
  ASSERT_EQ(kernel.buffers.size(), 1U);
  EXPECT_EQ(kernel.buffers[0].address, reinterpret_cast<std::uintptr_t>(data_));
  EXPECT_EQ(kernel.buffers[0].mode, activity::access::read_write);
  EXPECT_EQ(events[4].stream->handle, 1U);  // the legacy default stream, as the backend names it
  EXPECT_LT(events[0].seq, events[1].seq);
  EXPECT_TRUE(hazards(events).empty());
}

TEST_F(ActivityTraceTest, ALaunchOnTheLegacyStreamAfterANonBlockingWriteIsARace)
{
  begin();
  const auto producer = sim_.create_stream(/*non_blocking=*/true);
  sim_.enqueue_fill(producer, data_, n, 1.0F);
  launch(sim_.legacy_default_stream(), activity::access::read, "consume");
  const auto events = finish();
  const auto found = hazards(events);
  ASSERT_EQ(found.size(), 1U);
  EXPECT_STREQ(found[0]->hazard, "race");
  EXPECT_STREQ(found[0]->kernel, "consume");
  ASSERT_TRUE(found[0]->other);
  EXPECT_EQ(found[0]->other->kind, trace::event_kind::copy);
  EXPECT_EQ(found[0]->other->stream->handle, static_cast<std::uint64_t>(producer));
  EXPECT_EQ(found[0]->other->seq, events[1].seq);
  EXPECT_FALSE(found[0]->fix.empty());
  sim_.destroy_stream(producer);
}

TEST_F(ActivityTraceTest, TheSameLaunchOnABlockingStreamIsOrderedByTheLegacyStreamsRule)
{
  begin();
  const auto producer = sim_.create_stream(/*non_blocking=*/false);
  sim_.enqueue_fill(producer, data_, n, 1.0F);
  launch(sim_.legacy_default_stream(), activity::access::read, "consume");
  EXPECT_TRUE(hazards(finish()).empty());
  sim_.destroy_stream(producer);
}

TEST_F(ActivityTraceTest, AQueryIsNoEventAndOrdersLaterWorkOnceItSawTheWorkDone)
{
  begin();
  const auto producer = sim_.create_stream(/*non_blocking=*/true);
  const auto consumer = sim_.create_stream(/*non_blocking=*/true);
  const auto written = sim_.create_event();
  {
    const auto held = sim_.hold(producer);
    sim_.enqueue_fill(producer, data_, n, 1.0F);
    sim_.record_event(written, producer);
    EXPECT_FALSE(sim_.query_event(written));  // held: the query saw nothing done, and orders nothing
    launch(consumer, activity::access::read, "early");
  }
  while (!sim_.query_event(written)) { std::this_thread::yield(); }
  launch(consumer, activity::access::read, "late");
  const auto events = finish();
  const auto found = hazards(events);
  ASSERT_EQ(found.size(), 1U);
  EXPECT_STREQ(found[0]->kernel, "early");
  for (const auto& e : events) {
    EXPECT_FALSE(e.kind == trace::event_kind::sync && e.op == std::string_view{"event"}) << "a query became an event";
  }
  sim_.synchronize_device();
  sim_.destroy_event(written);
  sim_.destroy_stream(producer);
  sim_.destroy_stream(consumer);
}

TEST_F(ActivityTraceTest, AHostWaitCarriesTheTimeItBlocked)
{
  begin();
  const auto s = sim_.create_stream(true);
  sim_.enqueue_sleep(s, 30ms);
  sim_.synchronize_stream(s);
  const auto events = finish();
  const auto sync =
    std::find_if(events.begin(), events.end(), [](const trace::event& e) { return e.kind == trace::event_kind::sync; });
  ASSERT_NE(sync, events.end());
  EXPECT_GE(sync->blocked_ns, std::chrono::nanoseconds{25ms}.count());
  sim_.destroy_stream(s);
}

TEST_F(ActivityTraceTest, AStreamOrderedFreeIsRecordedAndAUseOnAnotherStreamIsAReuse)
{
  begin();
  const auto a = sim_.create_stream(true);
  const auto b = sim_.create_stream(true);
  auto* scratch = static_cast<float*>(sim_.allocate(64, a));
  const activity::buffer_use use{
    .address = reinterpret_cast<std::uintptr_t>(scratch), .bytes = 64, .mode = activity::access::write};
  sim_.deallocate(scratch, a);
  sim_.launch_kernel(b, activity::intern("late"), {&use, 1});  // touches nothing: a kernel of the trace only
  const auto events = finish();
  const auto found = hazards(events);
  ASSERT_EQ(found.size(), 1U);
  EXPECT_STREQ(found[0]->hazard, "reuse");
  EXPECT_EQ(found[0]->other->kind, trace::event_kind::memory);
  sim_.synchronize_device();
  sim_.destroy_stream(a);
  sim_.destroy_stream(b);
}

// report() fills one event per thread again and again: an event keeps nothing of the one before it.
TEST_F(ActivityTraceTest, AnEventHoldsNothingOfTheEventsRecordedBeforeItOnTheThread)
{
  trace::set_annotator([](trace::event& e) noexcept {
    if (e.kernel != nullptr && std::string_view{e.kernel} == "racy") { e.where = "racy.py:7"; }  // its line only
  });
  begin();
  const auto producer = sim_.create_stream(/*non_blocking=*/true);
  sim_.enqueue_fill(producer, data_, n, 1.0F);
  launch(sim_.legacy_default_stream(), activity::access::read, "racy");  // a race, with its line
  sim_.synchronize_device();
  sim_.record_event(sim_.create_event(), sim_.legacy_default_stream());  // no buffer, no line, no hazard
  const auto events = finish();
  trace::set_annotator(nullptr);
  ASSERT_EQ(events.size(), 5U);  // create, set, launch, sync, record
  const trace::event& racy = events[2];
  ASSERT_STREQ(racy.hazard, "race");
  EXPECT_STREQ(racy.where, "racy.py:7");
  const trace::event& after = events[4];
  EXPECT_EQ(after.kind, trace::event_kind::stream);
  EXPECT_EQ(after.hazard, nullptr);
  EXPECT_TRUE(after.detail.empty());
  EXPECT_TRUE(after.fix.empty());
  EXPECT_FALSE(after.other);
  EXPECT_EQ(after.where, nullptr);
  EXPECT_TRUE(after.buffers.empty());
  EXPECT_EQ(after.kernel, nullptr);
  EXPECT_EQ(after.nbytes, 0);
  sim_.destroy_stream(producer);
}

// The annotator may run a release, whose device activity is reported while the first report is
// being filled: each gets an event of its own.
TEST_F(ActivityTraceTest, AReportMadeWhileTheThreadFillsAnotherKeepsBothWhole)
{
  static sim_backend* sim = nullptr;
  static float* other = nullptr;
  static int depth = 0;
  sim = &sim_;
  other = static_cast<float*>(sim_.allocate(n * sizeof(float), sim_.legacy_default_stream()));
  depth = 0;
  trace::set_annotator([](trace::event& e) noexcept {
    e.where = activity::intern(fmt::format("depth{}.py:1", depth));
    if (depth++ == 0) {  // inside the outer launch's report: the inner one is recorded first
      const activity::buffer_use use{
        .address = reinterpret_cast<std::uintptr_t>(other), .bytes = 4 * sizeof(float), .mode = activity::access::read};
      sim->launch_kernel(sim->legacy_default_stream(), activity::intern("inner"), {&use, 1});
    }
  });
  begin();
  launch(sim_.legacy_default_stream(), activity::access::write, "outer");
  const auto events = finish();
  trace::set_annotator(nullptr);
  ASSERT_EQ(events.size(), 2U);
  const trace::event& inner = events[0];
  const trace::event& outer = events[1];
  EXPECT_STREQ(inner.kernel, "inner");
  EXPECT_STREQ(inner.where, "depth1.py:1");
  ASSERT_EQ(inner.buffers.size(), 1U);
  EXPECT_EQ(inner.buffers[0].address, reinterpret_cast<std::uintptr_t>(other));
  EXPECT_STREQ(outer.kernel, "outer");
  EXPECT_STREQ(outer.where, "depth0.py:1");
  ASSERT_EQ(outer.buffers.size(), 1U);
  EXPECT_EQ(outer.buffers[0].address, reinterpret_cast<std::uintptr_t>(data_));
  EXPECT_EQ(outer.buffers[0].mode, activity::access::write);
  sim_.synchronize_device();
  sim_.free_sync(other);
}

// A thread gives its reused event back when it exits; a thread-exit destructor that runs after that
// (made before the thread's first report, so destroyed after) still reports, into an event of its own.
TEST_F(ActivityTraceTest, AReportWhileTheThreadExitsAfterItsEventWasGivenBack)
{
  struct launches_at_exit {
    sim_backend* sim{nullptr};
    float* data{nullptr};
    launches_at_exit() = default;
    launches_at_exit(const launches_at_exit&) = delete;
    launches_at_exit& operator=(const launches_at_exit&) = delete;
    launches_at_exit(launches_at_exit&&) = delete;
    launches_at_exit& operator=(launches_at_exit&&) = delete;
    ~launches_at_exit()
    {
      const activity::buffer_use use{
        .address = reinterpret_cast<std::uintptr_t>(data), .bytes = sizeof(float), .mode = activity::access::read};
      sim->launch_kernel(sim->legacy_default_stream(), activity::intern("at-exit"), {&use, 1});
    }
  };
  begin();
  std::thread{[this] {
    thread_local launches_at_exit last;  // made first: destroyed after the thread's reused event
    last.sim = &sim_;
    last.data = data_;
    launch(sim_.legacy_default_stream(), activity::access::write, "before-exit");
  }}.join();
  const auto events = finish();
  ASSERT_EQ(events.size(), 2U);
  EXPECT_STREQ(events[0].kernel, "before-exit");
  EXPECT_STREQ(events[1].kernel, "at-exit");
  ASSERT_EQ(events[1].buffers.size(), 1U);
  EXPECT_EQ(events[1].buffers[0].mode, activity::access::read);
  EXPECT_EQ(events[1].thread, events[0].thread);
}

TEST_F(ActivityTraceTest, ActivityEventsWriteTheirOwnFields)
{
  begin();
  launch(sim_.legacy_default_stream(), activity::access::write, "k\"q");
  const auto events = finish();
  ASSERT_EQ(events.size(), 1U);
  const std::string json = trace::to_json(events[0]);
  EXPECT_NE(json.find(R"("kind":"launch")"), std::string::npos) << json;
  EXPECT_NE(json.find(R"("kernel":"k\"q")"), std::string::npos) << json;
  EXPECT_NE(json.find(R"("access":"write")"), std::string::npos) << json;
  EXPECT_NE(json.find(R"("stream":1)"), std::string::npos) << json;
  EXPECT_EQ(json.find(R"("producer")"), std::string::npos) << json;  // an exchange's fields are not an activity's
}

}  // namespace
}  // namespace handoff
