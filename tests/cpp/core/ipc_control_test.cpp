// The shared state of the hand-off across processes: the handle's wire format and its refusals, and
// the holds protocol a producer and its consumers run on a share's slot.
#include "core/ipc_control.hpp"

#include <handoff/error.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string_view>

namespace handoff::ipc::detail {
namespace {

wire_handle sample()
{
  wire_handle h;
  h.pid = 1234;
  h.start_time = 99;
  h.slot = 7;
  h.generation = 3;
  h.backend = "sim";
  h.device = {kDLCUDA, 1};
  h.dtype = {kDLFloat, 32, 1};
  h.shape = {2, 3};
  h.strides = {3, 1};
  h.offset = 512;
  h.allocation_size = 4096;
  h.memory.bytes[0] = std::byte{42};
  h.event.bytes[5] = std::byte{7};
  return h;
}

TEST(IpcHandleTest, RoundTrips)
{
  const wire_handle h = sample();
  const auto bytes = encode(h);
  EXPECT_LT(bytes.size(), 512U);
  const wire_handle back = decode(bytes);
  EXPECT_EQ(back.pid, 1234);
  EXPECT_EQ(back.slot, 7U);
  EXPECT_EQ(back.backend, "sim");
  EXPECT_EQ(back.shape, h.shape);
  EXPECT_EQ(back.strides, h.strides);
  EXPECT_EQ(back.offset, 512U);
  EXPECT_EQ(back.memory.bytes, h.memory.bytes);
  EXPECT_EQ(back.event.bytes, h.event.bytes);
}

TEST(IpcHandleTest, RefusesWhatIsNoHandleOrWasAltered)
{
  auto bytes = encode(sample());
  EXPECT_THROW((void)decode(std::span{bytes}.first(10)), value_error);
  auto altered = bytes;
  altered[40] ^= std::byte{1};
  EXPECT_THROW((void)decode(altered), value_error);
  std::vector<std::byte> junk(bytes.size(), std::byte{0});
  EXPECT_THROW((void)decode(junk), value_error);
  bytes.push_back(std::byte{0});  // trailing bytes
  EXPECT_THROW((void)decode(bytes), value_error);
}

// The handle's checksum is no signature: a forged handle whose array reaches past the memory it shares
// is refused as it is read, before anything is mapped.
TEST(IpcHandleTest, RefusesAnArrayOutsideTheMemoryItShares)
{
  const auto decoded = [](auto&& change) {
    wire_handle h = sample();  // float32 [2, 3] at byte 512 of 4096
    change(h);
    return decode(encode(h));
  };
  EXPECT_NO_THROW((void)decoded([](wire_handle& h) { h.offset = 4096 - 24; }));  // its last byte is the last
  EXPECT_THROW((void)decoded([](wire_handle& h) { h.offset = 4096 - 23; }), value_error);
  EXPECT_THROW((void)decoded([](wire_handle& h) { h.offset = std::numeric_limits<std::uint64_t>::max(); }),
               value_error);
  EXPECT_THROW((void)decoded([](wire_handle& h) {
                 h.shape = {std::int64_t{1} << 24};
                 h.strides = {1};
               }),
               value_error);
  // Negative strides reach below the first element.
  EXPECT_NO_THROW((void)decoded([](wire_handle& h) {
    h.shape = {4};
    h.strides = {-1};
    h.offset = 12;
  }));
  EXPECT_THROW((void)decoded([](wire_handle& h) {
                 h.shape = {4};
                 h.strides = {-1};
                 h.offset = 8;
               }),
               value_error);
  EXPECT_THROW((void)decoded([](wire_handle& h) {
                 h.shape = {2};
                 h.strides = {std::int64_t{1} << 62};
               }),
               value_error);  // an element's byte offset overflows
  EXPECT_THROW((void)decoded([](wire_handle& h) { h.shape = {-2, 3}; }), value_error);
  // An empty array reads nothing, wherever it says it is.
  EXPECT_NO_THROW((void)decoded([](wire_handle& h) {
    h.shape = {0, 3};
    h.offset = 1 << 20;
    h.allocation_size = 0;
  }));
  try {
    (void)decoded([](wire_handle& h) {
      h.shape = {std::int64_t{1} << 24};
      h.strides = {1};
    });
  } catch (const value_error& e) {
    EXPECT_NE(std::string_view{e.what()}.find("does not lie inside the 4096 bytes it shares"), std::string_view::npos)
      << e.what();
  }
}

TEST(IpcHandleTest, RefusesADtypeDLPackDoesNotDefine)
{
  wire_handle h = sample();
  h.dtype = {kDLFloat, 24, 1};
  EXPECT_THROW((void)decode(encode(h)), value_error);
  h.dtype = {kDLFloat, 32, 4};  // a vector type
  EXPECT_THROW((void)decode(encode(h)), value_error);
  h.dtype = {kDLBfloat, 16, 1};
  EXPECT_NO_THROW((void)decode(encode(h)));
}

TEST(IpcSlotTest, ConsumersCountThemselvesInOnlyWhileTheShareIsHeld)
{
  auto slot = std::make_unique<share_slot>();
  slot->word.store(pack_word(5, 1));  // the producer's own hold
  const claim first = claim_share(*slot, 5, 100, 1);
  ASSERT_NE(first.entry, nullptr);
  EXPECT_EQ(holds_of(slot->word.load()), 2U);
  EXPECT_EQ(first.entry->state.load(), static_cast<std::uint32_t>(entry_state::open));
  EXPECT_EQ(claim_share(*slot, 4, 100, 1).entry, nullptr);  // a stale generation: another share
  slot->word.store(pack_word(5, 0));                        // nobody holds it: it is being released
  EXPECT_EQ(claim_share(*slot, 5, 100, 1).entry, nullptr);
  slot->word.store(pack_word(5, 1));
  for (std::size_t i = 1; i < consumers_per_share; ++i) { ASSERT_NE(claim_share(*slot, 5, 100, 1).entry, nullptr); }
  EXPECT_TRUE(claim_share(*slot, 5, 100, 1).full);
}

TEST(IpcSlotTest, AProcessTakesBackItsOwnReleasedEntryWithTheHoldItStillCounts)
{
  auto slot = std::make_unique<share_slot>();
  slot->word.store(pack_word(5, 1));
  const claim first = claim_share(*slot, 5, 100, 1);
  ASSERT_NE(first.entry, nullptr);
  first.entry->state.store(static_cast<std::uint32_t>(entry_state::released));  // not yet counted out

  const claim other = claim_share(*slot, 5, 101, 1);  // another process: a place of its own
  ASSERT_NE(other.entry, nullptr);
  EXPECT_NE(other.entry, first.entry);
  EXPECT_EQ(holds_of(slot->word.load()), 3U);
  EXPECT_EQ(claim_share(*slot, 4, 100, 1).entry, nullptr);  // another share: not this process's entry
  EXPECT_EQ(first.entry->state.load(), static_cast<std::uint32_t>(entry_state::released));

  const claim again = claim_share(*slot, 5, 100, 1);
  EXPECT_EQ(again.entry, first.entry);
  EXPECT_EQ(first.entry->state.load(), static_cast<std::uint32_t>(entry_state::open));
  EXPECT_EQ(holds_of(slot->word.load()), 3U);  // its hold was still counted: none added
  EXPECT_FALSE(free_released(*first.entry));   // the producer's poll leaves it, and its hold, alone

  first.entry->state.store(static_cast<std::uint32_t>(entry_state::released));
  EXPECT_TRUE(free_released(*first.entry));  // now counted out
  EXPECT_EQ(first.entry->state.load(), static_cast<std::uint32_t>(entry_state::free));
}

TEST(IpcSlotTest, ATicketIsTakenOnce)
{
  auto slot = std::make_unique<share_slot>();
  slot->tickets.store(1);
  take_ticket(*slot);
  take_ticket(*slot);
  EXPECT_EQ(slot->tickets.load(), 0U);
  EXPECT_EQ(slot->tickets_used.load(), 1U);
}

}  // namespace
}  // namespace handoff::ipc::detail
