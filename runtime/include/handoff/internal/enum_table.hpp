#pragma once
// A value for each enumerator, kept in a table indexed by the enumerator (as spdlog keeps its level
// names) rather than written out as one switch per enumeration. The table is checked as it is made,
// at compile time: its entries list the enumerators in order, one each, so a lookup is one index.

#include <array>
#include <cstddef>
#include <stdexcept>
#include <string_view>
#include <type_traits>

namespace handoff::detail {

template <class Enum, class Value>
struct enum_entry {
  Enum key;
  Value value;
};

/// Whether `entries` give consecutive enumerators in order (from any first one), one entry each.
template <class Enum, class Value, std::size_t N>
constexpr bool lists_in_order(const enum_entry<Enum, Value> (&entries)[N]) noexcept
{
  for (std::size_t i = 0; i < N; ++i) {
    if (static_cast<std::size_t>(entries[i].key) != static_cast<std::size_t>(entries[0].key) + i) { return false; }
  }
  return true;
}

/// The table of `entries`; a compile-time error unless they list the enumerators in order.
template <class Enum, class Value = std::string_view, std::size_t N>
consteval std::array<enum_entry<Enum, Value>, N> make_enum_table(const enum_entry<Enum, Value> (&entries)[N])
{
  static_assert(std::is_enum_v<Enum>);
  if (!lists_in_order(entries)) {
    throw std::invalid_argument("make_enum_table: list the enumerators in order, one entry each");
  }
  std::array<enum_entry<Enum, Value>, N> table{};
  for (std::size_t i = 0; i < N; ++i) { table[i] = entries[i]; }
  return table;
}

/// The value `table` gives `key`, or `otherwise` for an enumerator it does not list.
template <class Enum, class Value, std::size_t N>
constexpr Value look_up(const std::array<enum_entry<Enum, Value>, N>& table, Enum key,
                        std::type_identity_t<Value> otherwise) noexcept
{
  // Below the first key, the unsigned difference wraps past N.
  const std::size_t index = static_cast<std::size_t>(key) - static_cast<std::size_t>(table[0].key);
  return index < N ? table[index].value : otherwise;
}

}  // namespace handoff::detail
