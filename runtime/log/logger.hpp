// The library's spdlog logger ("handoff"); level and sink chosen from the environment.
#pragma once

#include <spdlog/spdlog.h>

namespace handoff::detail {

/// The `handoff` logger. Level from HANDOFF_LOG_LEVEL (trace, debug, info, warn, error, critical,
/// off, in any case, and Python logging's WARNING and FATAL; default warn), sink stderr, or the file
/// named by HANDOFF_LOG_FILE. Never throws: a bad setting falls back to the default, with a warning.
/// Call sites use HANDOFF_LOG_* so a disabled level costs one branch and no formatting.
spdlog::logger& logger() noexcept;

}  // namespace handoff::detail

#define HANDOFF_LOG(level, ...)                                                         \
  do {                                                                                  \
    auto& handoff_logger_ = ::handoff::detail::logger();                                \
    if (handoff_logger_.should_log(level)) { handoff_logger_.log(level, __VA_ARGS__); } \
  } while (false)
#define HANDOFF_LOG_TRACE(...) HANDOFF_LOG(::spdlog::level::trace, __VA_ARGS__)
#define HANDOFF_LOG_DEBUG(...) HANDOFF_LOG(::spdlog::level::debug, __VA_ARGS__)
#define HANDOFF_LOG_INFO(...) HANDOFF_LOG(::spdlog::level::info, __VA_ARGS__)
#define HANDOFF_LOG_WARN(...) HANDOFF_LOG(::spdlog::level::warn, __VA_ARGS__)
#define HANDOFF_LOG_ERROR(...) HANDOFF_LOG(::spdlog::level::err, __VA_ARGS__)
