#include "log/logger.hpp"

#include <handoff/log.hpp>

#include "settings.hpp"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>

#include <fmt/format.h>

#include <array>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace handoff::detail {
namespace {

// HANDOFF_LOG_LEVEL's names: spdlog's (with its `warning` and `err`) and Python logging's (`WARNING`,
// `CRITICAL`, `FATAL`), in any case (setting_choice lowers it).
std::optional<spdlog::level::level_enum> level_named(std::string_view name)
{
  using enum spdlog::level::level_enum;
  static constexpr std::array<std::pair<std::string_view, spdlog::level::level_enum>, 10> levels{{
    {"trace", trace},
    {"debug", debug},
    {"info", info},
    {"warn", warn},
    {"warning", warn},
    {"error", err},
    {"err", err},
    {"critical", critical},
    {"fatal", critical},
    {"off", off},
  }};
  for (const auto& [spelling, level] : levels) {
    if (spelling == name) { return level; }
  }
  return std::nullopt;
}

std::shared_ptr<spdlog::logger> make_logger() noexcept
{
  try {
    std::vector<std::string> unapplied;  // settings the logger cannot follow, said once it exists
    std::shared_ptr<spdlog::sinks::sink> sink;
    if (const std::string path = setting("HANDOFF_LOG_FILE"); !path.empty()) {
      try {
        // Makes the folders the path names, as every spdlog file sink does.
        sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(path);
      } catch (const spdlog::spdlog_ex& e) {
        unapplied.push_back(fmt::format("HANDOFF_LOG_FILE={}: {}; logging to stderr", path, e.what()));
      }
    }
    if (!sink) { sink = std::make_shared<spdlog::sinks::stderr_sink_mt>(); }
    auto made = std::make_shared<spdlog::logger>("handoff", std::move(sink));
    made->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [handoff] [%l] [tid %t] %v");
    auto level = spdlog::level::warn;
    if (const std::string name = setting_choice("HANDOFF_LOG_LEVEL"); !name.empty()) {
      if (const auto named = level_named(name)) {
        level = *named;
      } else {
        unapplied.push_back(fmt::format(
          "HANDOFF_LOG_LEVEL={} is not a level (trace, debug, info, warn, error, critical or off, in any case); "
          "warn applies",
          setting("HANDOFF_LOG_LEVEL")));
      }
    }
    made->set_level(level);
    made->flush_on(spdlog::level::warn);
    for (const std::string& message : unapplied) { made->warn(message); }
    return made;
  } catch (...) {
    return nullptr;
  }
}

}  // namespace

spdlog::logger& logger() noexcept
{
  static const std::shared_ptr<spdlog::logger> instance = make_logger();
  if (instance) { return *instance; }
  static spdlog::logger silent{"handoff"};  // no sinks: logging is a no-op
  return silent;
}

}  // namespace handoff::detail

namespace handoff {

void log_debug(std::string_view message) noexcept
{
  try {
    HANDOFF_LOG_DEBUG("{}", message);
  } catch (...) {  // a failing sink must not fail the caller
  }
}

void log_warning(std::string_view message) noexcept
{
  try {
    HANDOFF_LOG_WARN("{}", message);
  } catch (...) {  // a failing sink must not fail the caller
  }
}

}  // namespace handoff
