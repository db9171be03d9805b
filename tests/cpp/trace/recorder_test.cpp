// Exchange tracing on every backend: the action and hazards of each exchange, sessions and
// listeners, with a negative control for each hazard.
#include <handoff/exchange.hpp>
#include <handoff/internal/ordering.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/ownership.hpp>
#include <handoff/trace.hpp>

#include "support/backend_fixture.hpp"

#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace handoff;
using handoff::testing::BackendContextTest;

class TraceTest : public BackendContextTest {
 protected:
  void SetUp() override
  {
    BackendContextTest::SetUp();
    if (IsSkipped()) { return; }
    session_ = trace::begin_session();
  }
  void TearDown() override
  {
    if (session_ != 0) { (void)trace::end_session(session_); }
  }

  std::vector<trace::event> finish()
  {
    auto events = trace::end_session(std::exchange(session_, 0));
    return events;
  }

  // Exports `view` through the exchange (which traces its operations itself) for a consumer whose
  // DLPack `stream` argument is `consumer`, and deletes the tensor.
  void traced_export(const array& view, std::optional<std::int64_t> consumer)
  {
    export_request request;
    if (consumer) { request.stream = named_stream::dlpack(*consumer); }
    request.max_version = DLPackVersion{DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};
    DLManagedTensorVersioned* tensor = exchange{ctx()}.export_dlpack(view, request).versioned;
    tensor->deleter(tensor);
  }

  // The DLPack stream value of stream `s`.
  std::int64_t on(device::stream_handle s) { return stream_value_of(b().device_type(), static_cast<std::uint64_t>(s)); }

  std::uint64_t session_{0};
};

TEST_P(TraceTest, AnOrderedExportRecordsItsWaitAndBothStreams)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const auto consumer = stream_on(0);
  const array view = device_view(data, 0);
  mark_ready(view, producer);
  traced_export(view, on(consumer));
  const auto events = finish();
  ASSERT_EQ(events.size(), 1U);
  const trace::event& e = events[0];
  EXPECT_EQ(e.kind, trace::event_kind::export_data);
  EXPECT_EQ(e.action, trace::action::wait);
  EXPECT_EQ(e.hazard, nullptr);
  ASSERT_TRUE(e.producer_stream && e.consumer_stream);
  EXPECT_EQ(e.producer_stream->handle, static_cast<std::uint64_t>(producer));
  EXPECT_EQ(e.consumer_stream->handle, static_cast<std::uint64_t>(consumer));
  EXPECT_EQ(e.buffer, view.owner().id());
  EXPECT_EQ(e.nbytes, static_cast<std::int64_t>(n * sizeof(float)));
  EXPECT_EQ(e.shape, (std::vector<std::int64_t>{static_cast<std::int64_t>(n)}));
}

TEST_P(TraceTest, TheSameStreamIsElided)
{
  float* data = allocate_on(0);
  const auto stream = stream_on(0);
  const array view = device_view(data, 0);
  mark_ready(view, stream);
  traced_export(view, on(stream));
  const auto events = finish();
  ASSERT_EQ(events.size(), 1U);
  EXPECT_EQ(events[0].action, trace::action::elided);
}

TEST_P(TraceTest, AnUnorderedHandOverWhileTheProducerWorksIsAHazard)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  std::optional<array> view;  // alive past finish(): its release is no event of this test
  {
    const auto held = hold(producer);
    view.emplace(pending_view(data, producer, 1.0F));
    traced_export(*view, -1);
  }
  const auto events = finish();
  ASSERT_EQ(events.size(), 1U);
  EXPECT_EQ(events[0].action, trace::action::unordered);
  ASSERT_NE(events[0].hazard, nullptr);
  EXPECT_STREQ(events[0].hazard, "unordered");
  EXPECT_NE(events[0].detail.find("pending"), std::string::npos) << events[0].detail;
  b().synchronize_device();
}

TEST_P(TraceTest, NegativeControlAnUnorderedHandOverOfFinishedWorkIsNoHazard)
{
  float* data = allocate_on(0);
  const auto producer = stream_on(0);
  const array view = device_view(data, 0);
  fill(producer, data, 1.0F);
  b().synchronize_stream(producer);
  mark_ready(view, producer);
  traced_export(view, -1);
  const auto events = finish();
  ASSERT_EQ(events.size(), 1U);
  EXPECT_EQ(events[0].action, trace::action::unordered);
  EXPECT_EQ(events[0].hazard, nullptr);
}

TEST_P(TraceTest, AConsumerStreamOfAnotherDeviceIsACrossDeviceHazard)
{
  HANDOFF_REQUIRE_TWO_DEVICES();
  float* data = allocate_on(0);
  const auto other_device = stream_on(1);
  const array view = device_view(data, 0);
  {
    trace::exchange_scope scope{trace::event_kind::import_data, "cuda-array-interface"};
    scope.set_view(view);
    bind_import(view, bound(other_device));
  }
  {  // negative control: a stream of the data's device
    trace::exchange_scope scope{trace::event_kind::import_data, "cuda-array-interface"};
    scope.set_view(view);
    bind_import(view, bound(stream_on(0)));
  }
  const auto events = finish();
  ASSERT_EQ(events.size(), 2U);
  ASSERT_NE(events[0].hazard, nullptr);
  EXPECT_STREQ(events[0].hazard, "cross-device");
  EXPECT_EQ(events[1].hazard, nullptr);
}

TEST_P(TraceTest, ADeferredReleaseIsTracedAsAWaitOnTheConsumerStream)
{
  float* data = allocate_on(0);
  const auto consumer = stream_on(0);
  std::optional<array> view{device_view(data, 0)};
  const std::uint64_t buffer = view->owner().id();
  bind_import(*view, bound(consumer));
  view.reset();
  ctx().drain();
  const auto events = finish();
  const auto release = std::find_if(events.begin(), events.end(),
                                    [](const trace::event& e) { return e.kind == trace::event_kind::release; });
  ASSERT_NE(release, events.end());
  EXPECT_EQ(release->buffer, buffer);
  EXPECT_EQ(release->action, trace::action::wait);
  ASSERT_TRUE(release->consumer_stream.has_value());
  EXPECT_EQ(release->consumer_stream->handle, static_cast<std::uint64_t>(consumer));
}

TEST_P(TraceTest, AnExchangeThatThrowsIsRefused)
{
  float* data = allocate_on(0);
  const array view = device_view(data, 0);
  try {
    trace::exchange_scope scope{trace::event_kind::export_data, "dlpack"};
    scope.set_view(view);
    throw std::runtime_error("refused");
  } catch (const std::runtime_error&) {  // expected
  }
  const auto events = finish();
  ASSERT_EQ(events.size(), 1U);
  EXPECT_EQ(events[0].action, trace::action::refused);
}

INSTANTIATE_TEST_SUITE_P(Backends, TraceTest, handoff::testing::sim_and_cuda(), handoff::testing::backend_choice_name);

// --- Sessions and listeners: no backend involved --------------------------------------------

class TraceSessionTest : public ::testing::Test {
 protected:
  static void host_exchange(std::int64_t items)
  {
    std::vector<float> data(static_cast<std::size_t>(items));
    array_layout layout;
    layout.data = data.data();
    layout.shape = std::vector<std::int64_t>{items};
    layout.strides = std::vector<std::int64_t>{1};
    const array view{std::move(layout), shared_producer{[] {}}};
    trace::exchange_scope scope{trace::event_kind::import_data, "buffer"};
    scope.set_view(view);
  }
};

TEST_F(TraceSessionTest, NothingIsRecordedWithoutASessionOrListener)
{
  if (trace::enabled()) { GTEST_SKIP() << "HANDOFF_LOG_LEVEL=debug records every exchange"; }
  trace::exchange_scope scope{trace::event_kind::import_data, "buffer"};
  EXPECT_FALSE(scope.active());
}

TEST_F(TraceSessionTest, EachSessionSeesTheEventsSinceItBegan)
{
  const auto outer = trace::begin_session();
  host_exchange(1);
  const auto inner = trace::begin_session();
  host_exchange(2);
  EXPECT_EQ(trace::session_events(inner).size(), 2U) << "the import and the release of its producer";
  const auto inner_events = trace::end_session(inner);
  host_exchange(3);
  const auto outer_events = trace::end_session(outer);
  EXPECT_EQ(inner_events.size(), 2U);
  ASSERT_EQ(outer_events.size(), 6U);
  EXPECT_EQ(outer_events[4].shape, (std::vector<std::int64_t>{3}));
  EXPECT_THROW((void)trace::end_session(inner), value_error);
}

TEST_F(TraceSessionTest, ABoundedSessionKeepsTheNewestEventsAndOlderHazardsAndCountsTheRest)
{
  const auto bounded = trace::begin_session(/*limit=*/4);
  const auto unbounded = trace::begin_session();  // the negative control: the same events, all kept
  host_exchange(1);                               // an import and a release
  {
    trace::exchange_scope scope{trace::event_kind::import_data, "dlpack"};
    scope.event().hazard = "unordered";  // an old hazard, kept past the window
  }
  for (std::int64_t items = 2; items <= 5; ++items) { host_exchange(items); }
  EXPECT_EQ(trace::session_dropped(bounded), 6U) << "eleven events: the newest four and the hazard kept";
  const auto all = trace::end_session(unbounded);
  const auto kept = trace::end_session(bounded);
  EXPECT_EQ(all.size(), 11U);
  ASSERT_EQ(kept.size(), 5U) << "the newest four and the hazard";
  EXPECT_STREQ(kept[0].hazard, "unordered");
  EXPECT_EQ(kept[1].shape, (std::vector<std::int64_t>{4}));
  EXPECT_EQ(kept[4].shape, (std::vector<std::int64_t>{5}));
  EXPECT_THROW((void)trace::session_dropped(bounded), value_error);
}

TEST_F(TraceSessionTest, ViewsStillAliveAtTheEndAreHeldNotHazards)
{
  const auto session = trace::begin_session();
  trace::event made;
  made.kind = trace::event_kind::import_data;
  made.view = 7;
  made.buffer = 3;
  made.where = "train.py:4";
  trace::event other = made;
  other.view = 8;
  const std::vector<trace::event> events{made, other};
  const std::vector<std::uint64_t> live{7, 9};  // 9: made before the trace began
  const auto held = trace::held_events(events, live, 42);
  (void)trace::end_session(session);
  ASSERT_EQ(held.size(), 1U);
  EXPECT_EQ(held[0].kind, trace::event_kind::held);
  EXPECT_EQ(held[0].hazard, nullptr);
  EXPECT_EQ(held[0].time_ns, 42);
  EXPECT_STREQ(held[0].where, "train.py:4");
  EXPECT_NE(held[0].detail.find("view:7 of buffer:3"), std::string::npos) << held[0].detail;
}

TEST_F(TraceSessionTest, AReleaseCarriesTheLayoutItsBufferWasExchangedWith)
{
  const auto session = trace::begin_session();
  host_exchange(5);
  const auto events = trace::end_session(session);
  ASSERT_EQ(events.size(), 2U);
  EXPECT_EQ(events[1].kind, trace::event_kind::release);
  EXPECT_EQ(events[1].buffer, events[0].buffer);
  EXPECT_EQ(events[1].shape, (std::vector<std::int64_t>{5}));
  EXPECT_EQ(events[1].action, trace::action::none);
}

TEST_F(TraceSessionTest, AReleaseOfABufferExchangedBeforeTheTraceSaysItsLayoutIsUnknown)
{
  std::vector<float> data(5);
  array_layout layout;
  layout.data = data.data();
  layout.shape = std::vector<std::int64_t>{5};
  layout.strides = std::vector<std::int64_t>{1};
  auto view = std::make_unique<array>(std::move(layout), shared_producer{[] {}});
  {
    trace::exchange_scope scope{trace::event_kind::import_data, "buffer"};  // before the trace: unseen
    scope.set_view(*view);
  }
  const auto session = trace::begin_session();
  view.reset();
  host_exchange(0);  // the negative control: an empty array the trace saw, released
  const auto events = trace::end_session(session);
  ASSERT_EQ(events.size(), 3U);
  EXPECT_EQ(events[0].kind, trace::event_kind::release);
  EXPECT_FALSE(trace::describes_data(events[0]));
  const std::string unseen = trace::to_json(events[0]);
  for (const char* field : {R"("device":null)", R"("shape":null)", R"("dtype":null)", R"("nbytes":null)"}) {
    EXPECT_NE(unseen.find(field), std::string::npos) << field << " in " << unseen;
  }
  ASSERT_EQ(events[2].kind, trace::event_kind::release);
  EXPECT_TRUE(trace::describes_data(events[2]));
  const std::string seen = trace::to_json(events[2]);
  EXPECT_NE(seen.find(R"("device":[1,0],"shape":[0],"dtype":"float32","nbytes":0)"), std::string::npos) << seen;
}

TEST_F(TraceSessionTest, EachReleaseCarriesItsOwnImportsShapeWhileOtherViewsComeAndGo)
{
  // The layout remembered for one buffer is reused for the next buffer's import once released;
  // here views overlap, and one has more dimensions than an event or a layout holds in place.
  std::vector<float> data(64);
  const auto import_of = [&](const std::vector<std::int64_t>& shape) {
    array_layout layout;
    layout.data = data.data();
    layout.shape = shape;
    layout.strides = contiguous_strides(layout.shape);
    auto view = std::make_unique<array>(std::move(layout), shared_producer{[] {}});
    trace::exchange_scope scope{trace::event_kind::import_data, "buffer"};
    scope.set_view(*view);
    return view;
  };
  const std::vector<std::int64_t> two{2, 3};
  const std::vector<std::int64_t> eight{1, 2, 1, 2, 1, 2, 1, 2};
  const std::vector<std::int64_t> one{7};
  const auto session = trace::begin_session();
  auto first = import_of(two);
  auto second = import_of(eight);
  first.reset();
  auto third = import_of(one);  // remembered where the first one's layout was
  third.reset();
  second.reset();
  const auto events = trace::end_session(session);
  ASSERT_EQ(events.size(), 6U);
  const std::vector<std::pair<std::size_t, std::size_t>> import_and_release{{0, 2}, {1, 5}, {3, 4}};
  for (const auto& [imported, released] : import_and_release) {
    EXPECT_EQ(events[released].kind, trace::event_kind::release);
    EXPECT_EQ(events[released].buffer, events[imported].buffer);
    EXPECT_EQ(events[released].shape, events[imported].shape) << "release " << released;
  }
  EXPECT_EQ(events[0].shape, two);
  EXPECT_EQ(events[1].shape, eight);
  EXPECT_EQ(events[3].shape, one);
}

TEST_F(TraceSessionTest, AReleaseWhileAnExceptionUnwindsIsNoRefusalButTheFailedImportIs)
{
  std::vector<float> data(4);
  const auto session = trace::begin_session();
  const auto failing_import = [&] {
    array_layout layout;
    layout.data = data.data();
    layout.shape = {4};
    layout.strides = {1};
    const array view{std::move(layout), shared_producer{[] {}}};
    trace::exchange_scope scope{trace::event_kind::import_data, "buffer"};
    scope.set_view(view);
    throw std::runtime_error("the import fails");  // the scope ends, then the view is released, unwinding
  };
  EXPECT_THROW(failing_import(), std::runtime_error);
  const auto events = trace::end_session(session);
  ASSERT_EQ(events.size(), 2U);
  EXPECT_EQ(events[0].kind, trace::event_kind::import_data);
  EXPECT_EQ(events[0].action, trace::action::refused);
  EXPECT_EQ(events[1].kind, trace::event_kind::release);
  EXPECT_EQ(events[1].action, trace::action::none);
}

TEST_F(TraceSessionTest, AListenerSeesEveryEventAsJson)
{
  std::vector<std::string> lines;
  const auto listener = trace::add_listener([&](const trace::event& e) { lines.push_back(trace::to_json(e)); });
  host_exchange(4);
  trace::remove_listener(listener);
  host_exchange(4);
  ASSERT_EQ(lines.size(), 2U);
  EXPECT_NE(lines[0].find(R"("kind":"import")"), std::string::npos) << lines[0];
  EXPECT_NE(lines[0].find(R"("shape":[4])"), std::string::npos) << lines[0];
  EXPECT_NE(lines[1].find(R"("kind":"release")"), std::string::npos) << lines[1];
}

TEST_F(TraceSessionTest, JsonEscapesWhatTheEmbeddingWrote)
{
  trace::event e;
  e.where = "dir \"a\"\\b\n.py:3";
  e.detail = std::string{"\x01"};
  const std::string json = trace::to_json(e);
  EXPECT_NE(json.find(R"("where":"dir \"a\"\\b\n.py:3")"), std::string::npos) << json;
  EXPECT_NE(json.find(R"("detail":"\u0001")"), std::string::npos) << json;
  EXPECT_NE(json.find(R"("hazard":null)"), std::string::npos) << json;
}

// Each event names its thread, asked of the kernel once per thread; a forked child's thread is
// asked again (its id is the child's process id), not taken for the parent's.
TEST(TraceThreadTest, EventsNameTheirThreadAndAForkedChildsItsOwn)
{
  const auto scoped_thread = [] {
    const std::uint64_t session = trace::begin_session();
    {
      const trace::exchange_scope scope{trace::event_kind::import_data, "dlpack"};
    }
    const std::vector<trace::event> events = trace::end_session(session);
    return events.size() == 1 ? events.front().thread : 0;
  };
  const auto own = static_cast<std::uint64_t>(::syscall(SYS_gettid));
  ASSERT_EQ(scoped_thread(), own);
  ASSERT_EQ(scoped_thread(), own) << "asked once, the same after";
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    _exit(scoped_thread() == static_cast<std::uint64_t>(getpid()) ? 0 : 1);  // the child's one thread
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the forked child's events name its own thread";
}

}  // namespace
