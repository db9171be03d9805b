// What a trace session keeps: each event whole, its variable-size parts in mapped memory that is
// given back as the session drops them, and nothing of it in the program's heap.
#include "trace/kept_events.hpp"

#include <handoff/activity.hpp>
#include <handoff/trace.hpp>

#include <gtest/gtest.h>

#include <malloc.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

using namespace handoff;
using trace::detail::kept_event;
using trace::detail::map_pages;
using trace::detail::payload_arena;
using trace::detail::unmap_pages;

// An event with every variable-size field filled, each longer than a short string holds in place.
// Its line is one of eight interned names: the names live as long as the process, on its heap, so
// a name made for each event would grow the heap that ASessionsEventsLeave... measures.
trace::event full_event(int n)
{
  trace::event e;
  e.kind = trace::event_kind::launch;
  e.time_ns = 1000 + n;
  e.shape = {2, 3, n};
  e.where = activity::intern("/a/user/file/somewhere/deep.py:" + std::to_string(n % 8));
  e.detail = "a detail long enough to be held on the heap";
  e.fix = "a fix long enough to be held on the heap, too";
  e.buffers = {trace::buffer_ref{.address = 64, .nbytes = 8, .mode = activity::access::read, .buffer = 7},
               trace::buffer_ref{.address = 128, .nbytes = 16, .mode = activity::access::write, .buffer = 0}};
  e.other.emplace();
  e.other->seq = 3;
  e.other->where = "/the/other/side/of/the/race.py:12";
  e.hazard = "race";
  return e;
}

void expect_same(const trace::event& a, const trace::event& b)
{
  EXPECT_EQ(a.kind, b.kind);
  EXPECT_EQ(a.time_ns, b.time_ns);
  EXPECT_EQ(a.shape, b.shape);
  EXPECT_EQ(a.where, b.where);  // the same interned name
  EXPECT_EQ(a.detail, b.detail);
  EXPECT_EQ(a.fix, b.fix);
  ASSERT_EQ(a.buffers.size(), b.buffers.size());
  for (std::size_t i = 0; i < a.buffers.size(); ++i) {
    EXPECT_EQ(a.buffers[i].address, b.buffers[i].address);
    EXPECT_EQ(a.buffers[i].nbytes, b.buffers[i].nbytes);
    EXPECT_EQ(a.buffers[i].mode, b.buffers[i].mode);
    EXPECT_EQ(a.buffers[i].buffer, b.buffers[i].buffer);
  }
  ASSERT_EQ(a.other.has_value(), b.other.has_value());
  if (a.other) {
    EXPECT_EQ(a.other->seq, b.other->seq);
    EXPECT_EQ(a.other->where, b.other->where);
  }
  EXPECT_STREQ(a.hazard, b.hazard);
}

TEST(KeptEventTest, ExpandsToTheEventAsRecorded)
{
  payload_arena arena;
  const trace::event recorded = full_event(5);
  const kept_event kept{recorded, arena};
  expect_same(kept.expanded(), recorded);
  EXPECT_STREQ(kept.hazard(), "race");
}

TEST(KeptEventTest, EveryFieldOfAnExchangeAndOfAnActivityComesBackAsRecorded)
{
  // Every field set to something other than its default, compared as the trace writes them all.
  trace::event exchange;
  exchange.kind = trace::event_kind::export_data;
  exchange.protocol = "dlpack";
  exchange.time_ns = 11;
  exchange.thread = 12;
  exchange.device = {kDLCUDA, 1};
  exchange.shape = {4, 5};
  exchange.dtype = {kDLInt, 8, 1};
  exchange.nbytes = 20;
  exchange.producer = "torch";
  exchange.consumer = "numpy";
  exchange.producer_stream = trace::stream_id{.device = {kDLCUDA, 1}, .handle = 0x51};
  exchange.consumer_stream = trace::stream_id{.device = {kDLCUDA, 1}, .handle = 0x52};
  exchange.action = trace::action::wait;
  exchange.hazard = "unordered";
  exchange.detail = "what was wrong";
  exchange.where = "app.py:3";
  exchange.buffer = 7;
  exchange.view = 8;
  exchange.interposed = "observed";
  exchange.stream_argument = 2;
  trace::event activity = full_event(9);
  activity.op = "kernel";
  activity.thread = 13;
  activity.device = {kDLCUDA, 1};
  activity.stream = trace::stream_id{.device = {kDLCUDA, 1}, .handle = 0x53};
  activity.kernel = "scale";
  activity.nbytes = 24;
  activity.blocked_ns = 14;
  activity.library = "cupy";
  activity.seq = 15;
  activity.other->kind = trace::event_kind::copy;
  activity.other->kernel = "fill";
  activity.other->stream = trace::stream_id{.device = {kDLCUDA, 1}, .handle = 0x54};
  activity.other->library = "torch";
  activity.other->time_ns = 16;
  payload_arena arena;
  for (const trace::event& e : {exchange, activity}) {
    const kept_event kept{e, arena};
    EXPECT_EQ(trace::to_json(kept.expanded()), trace::to_json(e));
  }
}

TEST(KeptEventTest, AnEventWithNothingVariableTakesNoRoom)
{
  payload_arena arena;
  trace::event bare;
  bare.time_ns = 42;
  kept_event kept{bare, arena};
  EXPECT_EQ(arena.mapped_chunks(), 0U);
  EXPECT_EQ(kept.expanded().time_ns, 42);
  kept.release(arena);  // gives nothing back, harmlessly
}

TEST(PayloadArenaTest, AChunkNoKeptEventUsesIsUnmappedAndTheNewestIsReused)
{
  payload_arena arena;
  std::vector<kept_event> kept;
  kept.reserve(10'000);
  for (int n = 0; n < 10'000; ++n) { kept.emplace_back(full_event(n), arena); }
  const std::size_t mapped = arena.mapped_chunks();
  EXPECT_GT(mapped, 1U) << "10,000 events of about 200 bytes fill more than one 256 KiB chunk";
  for (kept_event& k : kept) { k.release(arena); }
  EXPECT_EQ(arena.mapped_chunks(), 1U) << "only the newest chunk stays, emptied";
  kept.clear();
  for (int n = 0; n < 100; ++n) { kept.emplace_back(full_event(n), arena); }
  EXPECT_EQ(arena.mapped_chunks(), 1U) << "filled again from its start";
  expect_same(kept.back().expanded(), full_event(99));
}

TEST(PayloadArenaTest, AnEventLargerThanAChunkHasOneOfItsOwn)
{
  payload_arena arena;
  trace::event large = full_event(1);
  large.detail.assign(std::size_t{1} << 20U, 'x');
  const kept_event small{full_event(2), arena};
  const kept_event kept{large, arena};
  EXPECT_EQ(arena.mapped_chunks(), 2U);
  EXPECT_EQ(kept.expanded().detail, large.detail);
  expect_same(small.expanded(), full_event(2));
}

TEST(MappedPagesTest, SizesGivenBackOnceDoNotKeepAMappingGivenBackNowFromBeingReused)
{
  // A reused mapping keeps what was written to it; a new one is zeroed (the negative control: with
  // no room made for it, the mapping below is unmapped and mapped anew).
  constexpr std::size_t page = 4096;
  for (std::size_t pages = 3; pages < 3 + 16; ++pages) {  // more odd sizes than are kept
    unmap_pages(map_pages(pages * page), pages * page);
  }
  constexpr std::size_t bytes = 41 * page;  // a size nothing else here asks for
  auto* block = static_cast<unsigned char*>(map_pages(bytes));
  block[0] = 0xAB;
  unmap_pages(block, bytes);
  auto* again = static_cast<unsigned char*>(map_pages(bytes));
  EXPECT_EQ(again, block);
  EXPECT_EQ(again[0], 0xAB) << "mapped anew: the mapping given back was not kept";
  unmap_pages(again, bytes);
}

// The property the arena is for: a session that keeps thousands of events leaves the program's heap
// as it found it (what glibc's allocator has handed out and not had back), and its events read back
// whole; the negative control keeps the same events in the heap.
TEST(KeptEventsTest, ASessionsEventsLeaveTheProgramsHeapAsItFoundIt)
{
#ifdef HANDOFF_TEST_SANITIZED
  GTEST_SKIP() << "a sanitizer's allocator is not glibc's: mallinfo2 does not count it";
#endif
  constexpr int count = 5000;
  const auto exchange_event = [](int n) {
    trace::event e = full_event(n);
    e.kind = trace::event_kind::import_data;  // a session without device activity keeps exchanges
    return e;
  };
  const std::uint64_t session = trace::begin_session();
  for (int n = 0; n < 16; ++n) { trace::record(exchange_event(n)); }  // the recorder's own first allocations
  const std::size_t before = mallinfo2().uordblks;
  for (int n = 16; n < count; ++n) { trace::record(exchange_event(n)); }
  const std::size_t after = mallinfo2().uordblks;
  const std::vector<trace::event> events = trace::end_session(session);

  std::vector<trace::event> in_the_heap;  // the negative control
  in_the_heap.reserve(count);
  const std::size_t control_before = mallinfo2().uordblks;
  for (int n = 16; n < count; ++n) { in_the_heap.push_back(exchange_event(n)); }
  const std::size_t control_after = mallinfo2().uordblks;

  EXPECT_LT(after - before, std::size_t{4096}) << "the session kept " << count << " events outside the heap";
  EXPECT_GT(control_after - control_before, std::size_t{count} * 100) << "the same events in the heap grow it";
  ASSERT_EQ(events.size(), static_cast<std::size_t>(count));
  expect_same(events[1234], exchange_event(1234));
}

}  // namespace
