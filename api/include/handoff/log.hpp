// Writing to handoff's logger from code that does not see spdlog (the Python bindings).
#pragma once

#include <string_view>

namespace handoff {

/// Writes `message` to the `handoff` logger at debug level; does nothing when that level is off.
/// Never throws.
void log_debug(std::string_view message) noexcept;

/// Writes `message` to the `handoff` logger at warning level (stderr by default). Never throws.
void log_warning(std::string_view message) noexcept;

}  // namespace handoff
