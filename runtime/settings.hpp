// handoff's settings from the environment (HANDOFF_*), read as users write them.
#pragma once

#include <string>

namespace handoff::detail {

/// Environment variable `name` without surrounding blanks; empty when unset or blank.
[[nodiscard]] std::string setting(const char* name);

/// A setting that names one of several choices (a backend, a policy, a level), in lower case: each
/// choice is accepted in any case. Empty when unset or blank.
[[nodiscard]] std::string setting_choice(const char* name);

}  // namespace handoff::detail
