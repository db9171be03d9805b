// The tables that name enumerators: a lookup per entry, the fallback outside them, and the names
// the trace writes (its file and `show` read them back).
#include <handoff/activity.hpp>
#include <handoff/internal/enum_table.hpp>
#include <handoff/trace.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <string_view>

namespace {

using handoff::detail::look_up;
using handoff::detail::make_enum_table;

enum class level : std::uint8_t { low = 3, middle = 4, high = 5, beyond = 6 };

constexpr auto level_names =
  make_enum_table<level>({{level::low, "low"}, {level::middle, "middle"}, {level::high, "high"}});

// What make_enum_table checks at compile time (a table that fails it is a compile error).
static_assert(handoff::detail::lists_in_order<level, std::string_view>({{level::middle, "m"}, {level::high, "h"}}));
static_assert(!handoff::detail::lists_in_order<level, std::string_view>({{level::middle, "m"}, {level::low, "l"}}));
static_assert(!handoff::detail::lists_in_order<level, std::string_view>({{level::low, "l"}, {level::high, "h"}}));
static_assert(!handoff::detail::lists_in_order<level, std::string_view>({{level::low, "l"}, {level::low, "l"}}));

TEST(EnumTableTest, LooksUpEachEntryAndFallsBackOutsideTheTable)
{
  EXPECT_EQ(look_up(level_names, level::low, "?"), "low");
  EXPECT_EQ(look_up(level_names, level::middle, "?"), "middle");
  EXPECT_EQ(look_up(level_names, level::high, "?"), "high");
  EXPECT_EQ(look_up(level_names, level::beyond, "?"), "?");
  EXPECT_EQ(look_up(level_names, static_cast<level>(0), "?"), "?");  // below the first entry
}

TEST(EnumTableTest, TheTraceNamesEveryKindActionAndAccess)
{
  using handoff::trace::action;
  using handoff::trace::event_kind;
  using handoff::trace::name;
  EXPECT_EQ(name(event_kind::import_data), "import");
  EXPECT_EQ(name(event_kind::export_data), "export");
  EXPECT_EQ(name(event_kind::release), "release");
  EXPECT_EQ(name(event_kind::held), "held");
  EXPECT_EQ(name(event_kind::launch), "launch");
  EXPECT_EQ(name(event_kind::copy), "copy");
  EXPECT_EQ(name(event_kind::sync), "sync");
  EXPECT_EQ(name(event_kind::stream), "stream");
  EXPECT_EQ(name(event_kind::memory), "memory");
  EXPECT_EQ(name(static_cast<event_kind>(200)), "?");
  EXPECT_EQ(name(action::none), "none");
  EXPECT_EQ(name(action::wait), "wait");
  EXPECT_EQ(name(action::elided), "elided");
  EXPECT_EQ(name(action::unordered), "unordered");
  EXPECT_EQ(name(action::refused), "refused");
  EXPECT_EQ(name(handoff::activity::access::read), "read");
  EXPECT_EQ(name(handoff::activity::access::write), "write");
  EXPECT_EQ(name(handoff::activity::access::read_write), "read-write");
  EXPECT_EQ(name(static_cast<handoff::activity::access>(0)), "?");
}

}  // namespace
