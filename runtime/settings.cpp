#include "settings.hpp"

#include <algorithm>
#include <cstdlib>
#include <string_view>

namespace handoff::detail {

std::string setting(const char* name)
{
  const char* raw = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): settings are read at start
  std::string_view value = raw != nullptr ? raw : "";
  constexpr std::string_view blanks = " \t\r\n\v\f";
  value.remove_prefix(std::min(value.find_first_not_of(blanks), value.size()));
  value.remove_suffix(value.size() - std::min(value.find_last_not_of(blanks) + 1, value.size()));
  return std::string{value};
}

std::string setting_choice(const char* name)
{
  std::string value = setting(name);
  std::transform(value.begin(), value.end(), value.begin(),
                 [](char c) { return c >= 'A' && c <= 'Z' ? static_cast<char>(c - 'A' + 'a') : c; });
  return value;
}

}  // namespace handoff::detail
