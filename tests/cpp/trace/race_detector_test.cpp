// The race detector's rules, each with its negative control: what orders two streams' accesses in
// CUDA (stream order, events, the legacy default stream, per-thread default streams, host
// synchronizations, stream-ordered allocations and frees) and what does not.
#include <handoff/internal/race_detector.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

using handoff::activity::access;
using handoff::activity::buffer_use;
using handoff::activity::kind;
using handoff::activity::record;
using handoff::activity::stream_class;
using handoff::activity::sync_scope;
using handoff::trace::access_site;
using handoff::trace::found_hazard;
using handoff::trace::race_detector;

struct stream_ref {
  std::uint64_t handle;
  stream_class klass;
  int device{0};
};

constexpr stream_ref legacy{1, stream_class::legacy};
constexpr stream_ref per_thread{2, stream_class::per_thread};
constexpr stream_ref producer{0x5100, stream_class::non_blocking};
constexpr stream_ref consumer{0x5200, stream_class::non_blocking};
constexpr stream_ref blocking_a{0x5300, stream_class::blocking};
constexpr stream_ref blocking_b{0x5400, stream_class::blocking};

constexpr std::uintptr_t data = 0x7000'0000;
constexpr std::uintptr_t other_data = 0x7100'0000;
constexpr std::size_t bytes = 4096;

class RaceDetectorTest : public ::testing::Test {
 protected:
  // Issues `r` from host thread `thread`, as kernel or operation `name`, at user line `where` (by
  // default a line of its own).
  std::optional<found_hazard> issue(record r, std::vector<buffer_use> uses = {}, const char* name = "k",
                                    std::uint64_t thread = 1, const std::string& where = {})
  {
    r.buffers = uses;
    access_site site;
    site.seq = ++seq_;
    site.kind = r.kind;
    site.kernel = name;
    site.stream = {.device = r.device.device_id, .handle = r.stream, .thread = 0};
    site.stream_class = r.stream_class;
    site.where = handoff::activity::intern(where.empty() ? "app.py:" + std::to_string(seq_) : where);
    return detector_.observe(r, thread, site);
  }

  static record on(kind k, stream_ref s)
  {
    record r;
    r.kind = k;
    r.stream = s.handle;
    r.stream_class = s.klass;
    r.device = {kDLCUDA, s.device};
    return r;
  }

  std::optional<found_hazard> launch(stream_ref s, access mode, std::uintptr_t at = data, std::uint64_t thread = 1)
  {
    return issue(on(kind::launch, s), {{.address = at, .bytes = bytes, .mode = mode}}, "k", thread);
  }
  std::optional<found_hazard> write(stream_ref s, std::uintptr_t at = data) { return launch(s, access::write, at); }
  std::optional<found_hazard> read(stream_ref s, std::uintptr_t at = data) { return launch(s, access::read, at); }

  void record_event(std::uint64_t event, stream_ref s)
  {
    record r = on(kind::event_record, s);
    r.event = event;
    (void)issue(r);
  }
  void wait_event(stream_ref s, std::uint64_t event)
  {
    record r = on(kind::stream_wait, s);
    r.event = event;
    (void)issue(r);
  }
  void host_waits_for(stream_ref s)
  {
    record r = on(kind::host_sync, s);
    r.scope = sync_scope::stream;
    (void)issue(r);
  }
  std::optional<found_hazard> free_on(stream_ref s, std::uintptr_t at = data)
  {
    record r = on(kind::free, s);
    r.stream_ordered = true;
    return issue(r, {{.address = at, .bytes = bytes, .mode = access::write}});
  }

  race_detector detector_;
  std::uint64_t seq_{0};
};

TEST_F(RaceDetectorTest, EachKeptAccessNamesItsOwnSiteWhileSitesNoLongerNamedAreReused)
{
  // Sites 1 and 2 write two ranges; 3 and 4 write the first again, so that 1, then 3, is named by
  // nothing and its place is taken by the next. Range two still names 2; range one names 4.
  EXPECT_FALSE(write(producer, data));
  EXPECT_FALSE(write(producer, other_data));
  EXPECT_FALSE(write(producer, data));
  EXPECT_FALSE(write(producer, data));
  const auto on_two = read(consumer, other_data);
  ASSERT_TRUE(on_two);
  EXPECT_EQ(on_two->other.seq, 2U);
  EXPECT_NE(on_two->detail.find("app.py:2"), std::string::npos) << on_two->detail;
  const auto on_one = read(consumer, data);
  ASSERT_TRUE(on_one);
  EXPECT_EQ(on_one->other.seq, 4U);
  EXPECT_NE(on_one->detail.find("app.py:4"), std::string::npos) << on_one->detail;
  // A read keeps its side besides the write's: the write after both reads names each stream's.
  const auto over = write(producer, other_data);
  ASSERT_TRUE(over);
  EXPECT_EQ(over->other.seq, 5U) << "the consumer's read of range two";
}

TEST_F(RaceDetectorTest, AccessesOnOneStreamAreOrdered)
{
  EXPECT_FALSE(write(producer));
  EXPECT_FALSE(read(producer));
  EXPECT_FALSE(write(producer));
}

TEST_F(RaceDetectorTest, AReadOnAnotherStreamWithNothingBetweenIsARaceNamingBothSides)
{
  EXPECT_FALSE(write(producer));
  const auto race = read(consumer);
  ASSERT_TRUE(race);
  EXPECT_STREQ(race->name, "race");
  EXPECT_EQ(race->other.seq, 1U);
  EXPECT_NE(race->detail.find("non-blocking stream 0x5200"), std::string::npos) << race->detail;
  EXPECT_NE(race->detail.find("non-blocking stream 0x5100"), std::string::npos) << race->detail;
  EXPECT_NE(race->detail.find("app.py:1"), std::string::npos) << race->detail;
  EXPECT_NE(race->detail.find("app.py:2"), std::string::npos) << race->detail;
  EXPECT_NE(race->fix.find("wait"), std::string::npos) << race->fix;
}

TEST_F(RaceDetectorTest, AnEventRecordedAfterTheWriteAndWaitedForOrdersTheRead)
{
  EXPECT_FALSE(write(producer));
  record_event(0xe1, producer);
  wait_event(consumer, 0xe1);
  EXPECT_FALSE(read(consumer));
}

TEST_F(RaceDetectorTest, AnEventRecordedBeforeTheWriteDoesNotOrderIt)
{
  record_event(0xe1, producer);
  EXPECT_FALSE(write(producer));
  wait_event(consumer, 0xe1);
  EXPECT_TRUE(read(consumer));
}

TEST_F(RaceDetectorTest, WaitingForAnEventNeverRecordedOrdersNothing)
{
  EXPECT_FALSE(write(producer));
  wait_event(consumer, 0xe9);
  EXPECT_TRUE(read(consumer));
}

TEST_F(RaceDetectorTest, OrderingIsTransitiveThroughAThirdStream)
{
  EXPECT_FALSE(write(producer));
  record_event(0xe1, producer);
  wait_event(blocking_a, 0xe1);
  record_event(0xe2, blocking_a);
  wait_event(consumer, 0xe2);
  EXPECT_FALSE(read(consumer));
}

TEST_F(RaceDetectorTest, ReadsDoNotRaceWithReadsButAWriteRacesWithEachUnorderedRead)
{
  EXPECT_FALSE(read(producer));
  EXPECT_FALSE(read(consumer));
  const auto race = write(blocking_a);
  ASSERT_TRUE(race);
  EXPECT_NE(race->detail.find("while the earlier read"), std::string::npos) << race->detail;
}

TEST_F(RaceDetectorTest, OverlappingRangesMeetAndDisjointOnesDoNot)
{
  EXPECT_FALSE(write(producer));
  EXPECT_FALSE(read(consumer, other_data));
  EXPECT_TRUE(issue(on(kind::launch, consumer), {{.address = data + 100, .bytes = 8, .mode = access::read}}));
}

// A range found alone on its memory is found again without a search; these hold that shortcut to
// what a search would find when ranges are added and forgotten between two lookups.
TEST_F(RaceDetectorTest, ARangeAddedInsideOneFoundAloneIsMetByTheNextUseOfTheWhole)
{
  EXPECT_FALSE(write(producer));
  EXPECT_FALSE(read(producer));  // the range found alone on its memory
  host_waits_for(producer);
  // Ordered after the producer's write, the consumer writes a part of the memory: a range of its own.
  EXPECT_FALSE(issue(on(kind::launch, consumer), {{.address = data + 256, .bytes = 64, .mode = access::write}}));
  const auto race = read(producer);
  ASSERT_TRUE(race) << "the consumer's write of a part is unordered with the producer's read of the whole";
  EXPECT_EQ(race->other.seq, 4U);
  // Negative control: ordered after the consumer, the read of the whole meets nothing.
  host_waits_for(consumer);
  EXPECT_FALSE(read(producer));
  EXPECT_FALSE(read(producer));
}

TEST_F(RaceDetectorTest, ARangeAddedBesideOneFoundAloneDoesNotMeetIt)
{
  EXPECT_FALSE(write(producer));
  EXPECT_FALSE(read(producer));
  EXPECT_FALSE(write(consumer, data + bytes));  // adjacent: [data + bytes, ...) does not overlap
  EXPECT_FALSE(read(producer));
  EXPECT_FALSE(read(consumer, data + bytes));
}

TEST_F(RaceDetectorTest, ARangeFoundAloneAndThenFreedIsNotFoundAgain)
{
  EXPECT_FALSE(write(producer));
  EXPECT_FALSE(read(producer));
  EXPECT_FALSE(free_on(producer));  // forgotten, and recorded again as freed on the producer
  const auto reuse = read(consumer);
  ASSERT_TRUE(reuse);
  EXPECT_STREQ(reuse->name, "reuse");
  // A synchronizing free forgets it altogether: the next use meets nothing.
  (void)issue(on(kind::free, legacy), {{.address = data, .bytes = bytes, .mode = access::write}});
  EXPECT_EQ(detector_.tracked_ranges(), 0U);
  EXPECT_FALSE(write(consumer));
  EXPECT_EQ(detector_.tracked_ranges(), 1U) << "recorded anew";
  EXPECT_FALSE(read(consumer));
  EXPECT_TRUE(read(producer)) << "the consumer's write since the free is unordered with the producer";
}

TEST_F(RaceDetectorTest, ManyBuffersUsedInTurnEachMeetTheirOwnLastWriter)
{
  // More buffers than the lookups remember: each use still meets its own range's writer.
  constexpr std::size_t buffers = 40;
  for (std::size_t i = 0; i < buffers; ++i) { EXPECT_FALSE(write(producer, data + i * bytes)); }
  for (std::size_t i = 0; i < buffers; ++i) { EXPECT_FALSE(read(producer, data + i * bytes)); }
  for (std::size_t i = 0; i < buffers; ++i) {
    const auto race = read(consumer, data + i * bytes);
    ASSERT_TRUE(race) << "buffer " << i;
    EXPECT_EQ(race->other.seq, i + 1) << "buffer " << i;
  }
}

TEST_F(RaceDetectorTest, TheLegacyStreamWaitsForBlockingStreamsAndTheyForIt)
{
  EXPECT_FALSE(write(blocking_a));
  EXPECT_FALSE(read(legacy));  // the legacy stream waited for blocking_a
  EXPECT_FALSE(write(legacy, other_data));
  EXPECT_FALSE(read(blocking_b, other_data));  // blocking_b waits for the legacy stream
}

TEST_F(RaceDetectorTest, TheLegacyStreamDoesNotWaitForANonBlockingStreamAndSaysSo)
{
  EXPECT_FALSE(write(producer));
  const auto race = read(legacy);
  ASSERT_TRUE(race);
  EXPECT_NE(race->detail.find("legacy default stream"), std::string::npos) << race->detail;
  EXPECT_NE(race->fix.find("does not wait for non-blocking streams"), std::string::npos) << race->fix;
}

TEST_F(RaceDetectorTest, ABlockingStreamsWorkAfterTheLegacyStreamsIsOrderedThroughIt)
{
  EXPECT_FALSE(write(blocking_a));
  (void)issue(on(kind::set, legacy), {{.address = other_data, .bytes = 4, .mode = access::write}});
  EXPECT_FALSE(read(blocking_b));  // blocking_a -> legacy -> blocking_b
}

TEST_F(RaceDetectorTest, EachThreadHasItsOwnPerThreadDefaultStream)
{
  EXPECT_FALSE(launch(per_thread, access::write, data, /*thread=*/11));
  EXPECT_FALSE(launch(per_thread, access::read, data, /*thread=*/11));
  EXPECT_TRUE(launch(per_thread, access::read, data, /*thread=*/12));
}

TEST_F(RaceDetectorTest, APerThreadDefaultStreamIsBlocking)
{
  EXPECT_FALSE(launch(per_thread, access::write, data, /*thread=*/11));
  EXPECT_FALSE(read(legacy));
}

TEST_F(RaceDetectorTest, AHostSynchronizationOrdersLaterWork)
{
  EXPECT_FALSE(write(producer));
  host_waits_for(producer);
  EXPECT_FALSE(read(consumer));
}

TEST_F(RaceDetectorTest, AHostSynchronizationOfAnotherStreamOrdersNothing)
{
  EXPECT_FALSE(write(producer));
  host_waits_for(blocking_a);
  EXPECT_TRUE(read(consumer));
}

TEST_F(RaceDetectorTest, ADeviceSynchronizationOrdersEveryStreamOfThatDeviceOnly)
{
  constexpr stream_ref elsewhere{0x5500, stream_class::non_blocking, 1};
  EXPECT_FALSE(write(producer));
  EXPECT_FALSE(write(elsewhere, other_data));
  record sync = on(kind::host_sync, producer);
  sync.scope = sync_scope::device;
  (void)issue(sync);
  EXPECT_FALSE(read(consumer));
  EXPECT_TRUE(read(consumer, other_data));
}

TEST_F(RaceDetectorTest, AnEventSynchronizationAndAQueryThatSawWorkDoneOrderLaterWork)
{
  EXPECT_FALSE(write(producer));
  record_event(0xe1, producer);
  record sync = on(kind::host_sync, producer);
  sync.scope = sync_scope::event;
  sync.event = 0xe1;
  (void)issue(sync);
  EXPECT_FALSE(read(consumer));

  EXPECT_FALSE(write(producer, other_data));
  record query = on(kind::host_query, producer);
  query.scope = sync_scope::stream;
  (void)issue(query);
  EXPECT_FALSE(read(consumer, other_data));
}

TEST_F(RaceDetectorTest, MemoryFreedOnOneStreamAndUsedOnAnotherIsAReuse)
{
  EXPECT_FALSE(write(producer));
  EXPECT_FALSE(free_on(producer));
  const auto reuse = write(consumer);
  ASSERT_TRUE(reuse);
  EXPECT_STREQ(reuse->name, "reuse");
  EXPECT_EQ(reuse->other.kind, kind::free);
  EXPECT_NE(reuse->fix.find("after the free"), std::string::npos) << reuse->fix;
}

TEST_F(RaceDetectorTest, AUseOrderedAfterTheFreeIsNoReuse)
{
  EXPECT_FALSE(write(producer));
  EXPECT_FALSE(free_on(producer));
  record_event(0xe1, producer);
  wait_event(consumer, 0xe1);
  EXPECT_FALSE(write(consumer));
}

TEST_F(RaceDetectorTest, AFreeWhileAnotherStreamStillReadsIsAReuse)
{
  EXPECT_FALSE(write(producer));
  record_event(0xe1, producer);
  wait_event(consumer, 0xe1);
  EXPECT_FALSE(issue(on(kind::copy, consumer), {{.address = data, .bytes = bytes, .mode = access::read}}, "copy"));
  const auto reuse = free_on(producer);
  ASSERT_TRUE(reuse);
  EXPECT_STREQ(reuse->name, "reuse");
  EXPECT_NE(reuse->fix.find("record_stream"), std::string::npos) << reuse->fix;
}

TEST_F(RaceDetectorTest, AFreeAfterTheReadersStreamIsWaitedForIsNoReuse)
{
  EXPECT_FALSE(write(producer));
  record_event(0xe1, producer);
  wait_event(consumer, 0xe1);
  EXPECT_FALSE(issue(on(kind::copy, consumer), {{.address = data, .bytes = bytes, .mode = access::read}}, "copy"));
  record_event(0xe2, consumer);
  wait_event(producer, 0xe2);
  EXPECT_FALSE(free_on(producer));
}

TEST_F(RaceDetectorTest, ASynchronizingFreeOrdersEveryEarlierUseOfItsDevice)
{
  EXPECT_FALSE(write(producer));
  record free_sync = on(kind::free, legacy);
  free_sync.stream_ordered = false;
  (void)issue(free_sync, {{.address = other_data, .bytes = bytes, .mode = access::write}});
  EXPECT_FALSE(read(consumer));
}

TEST_F(RaceDetectorTest, AStreamOrderedFreeOrdersNothingBeyondItsStream)
{
  EXPECT_FALSE(write(producer));
  EXPECT_FALSE(free_on(blocking_a, other_data));
  EXPECT_TRUE(read(consumer));
}

TEST_F(RaceDetectorTest, AStreamOrderedAllocatorOrdersTheReuseItHandsOut)
{
  EXPECT_FALSE(write(producer));
  EXPECT_FALSE(free_on(producer));
  record allocate = on(kind::allocate, consumer);
  allocate.stream_ordered = true;
  (void)issue(allocate, {{.address = data, .bytes = bytes, .mode = access::write}});
  EXPECT_FALSE(write(consumer));
}

TEST_F(RaceDetectorTest, AStreamHandleTakenAgainAfterADestroyIsAnotherStream)
{
  constexpr stream_ref reused{0x5600, stream_class::non_blocking};
  (void)issue(on(kind::stream_create, reused));
  EXPECT_FALSE(write(reused));
  (void)issue(on(kind::stream_destroy, reused));
  (void)issue(on(kind::stream_create, reused));
  EXPECT_TRUE(read(reused));
}

TEST_F(RaceDetectorTest, StreamsOfTheSameHandleOnTwoDevicesAreTwoStreams)
{
  constexpr stream_ref on_one{0x5100, stream_class::non_blocking, 1};
  EXPECT_FALSE(write(producer));
  EXPECT_TRUE(read(on_one));
}

TEST_F(RaceDetectorTest, TheLabelerNamesTheMemory)
{
  race_detector named{
    [](std::uintptr_t address, std::size_t) { return address == data ? std::string{"buffer:7"} : std::string{}; }};
  const access_site site;
  record w = on(kind::launch, producer);
  const buffer_use use{.address = data, .bytes = bytes, .mode = access::write};
  w.buffers = {&use, 1};
  EXPECT_FALSE(named.observe(w, 1, site));
  record r = on(kind::launch, consumer);
  r.buffers = {&use, 1};
  const auto race = named.observe(r, 1, site);
  ASSERT_TRUE(race);
  EXPECT_NE(race->detail.find("buffer:7"), std::string::npos) << race->detail;
}

TEST_F(RaceDetectorTest, ARaceFoundAgainBetweenTheSameLinesIsWordedAlikeAndNamesTheNewSide)
{
  // A race in a loop: found again each iteration, between the same two lines.
  const auto at = [this](stream_ref s, access mode, const char* where) {
    return issue(on(kind::launch, s), {{.address = data, .bytes = bytes, .mode = mode}}, "k", 1, where);
  };
  EXPECT_FALSE(at(producer, access::write, "loop.py:10"));
  const auto first = at(consumer, access::read, "loop.py:11");
  ASSERT_TRUE(first);
  host_waits_for(consumer);
  host_waits_for(producer);
  EXPECT_FALSE(at(producer, access::write, "loop.py:10"));
  const std::uint64_t second_write = seq_;
  const auto again = at(consumer, access::read, "loop.py:11");
  ASSERT_TRUE(again);
  EXPECT_EQ(again->detail, first->detail);
  EXPECT_EQ(again->fix, first->fix);
  EXPECT_EQ(again->other.seq, second_write) << "the earlier side is this iteration's write";
  // Another line is other words (negative control: nothing remembered is stale).
  const auto elsewhere = at(consumer, access::read, "loop.py:12");
  ASSERT_TRUE(elsewhere);
  EXPECT_NE(elsewhere->detail, first->detail);
  EXPECT_NE(elsewhere->detail.find("loop.py:12"), std::string::npos) << elsewhere->detail;
}

TEST_F(RaceDetectorTest, ARaceOnMemoryNamedAnewIsWordedWithItsNewName)
{
  std::string label = "buffer:7";
  race_detector named{[&label](std::uintptr_t, std::size_t) { return label; }};
  const access_site site;
  const buffer_use use{.address = data, .bytes = bytes, .mode = access::write};
  const auto race = [&] {
    record w = on(kind::launch, producer);
    w.buffers = {&use, 1};
    EXPECT_FALSE(named.observe(w, 1, site));
    record r = on(kind::launch, consumer);
    r.buffers = {&use, 1};
    auto found = named.observe(r, 1, site);
    record sync = on(kind::host_sync, consumer);
    sync.scope = sync_scope::device;
    (void)named.observe(sync, 1, site);
    return found;
  };
  const auto first = race();
  ASSERT_TRUE(first);
  EXPECT_NE(first->detail.find("buffer:7"), std::string::npos) << first->detail;
  label = "buffer:8";  // the memory exchanged again
  const auto second = race();
  ASSERT_TRUE(second);
  EXPECT_NE(second->detail.find("buffer:8"), std::string::npos) << second->detail;
}

TEST_F(RaceDetectorTest, RangesOfFreedMemoryAreForgotten)
{
  EXPECT_FALSE(write(producer));
  EXPECT_FALSE(write(producer, other_data));
  EXPECT_EQ(detector_.tracked_ranges(), 2U);
  record free_sync = on(kind::free, legacy);
  (void)issue(free_sync, {{.address = data, .bytes = bytes, .mode = access::write}});
  EXPECT_EQ(detector_.tracked_ranges(), 1U);
}

}  // namespace
