#include "log/logger.hpp"

#include <handoff/log.hpp>

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>

#include <cstdlib>
#include <memory>
#include <string_view>

namespace handoff::detail {
namespace {

std::shared_ptr<spdlog::logger> make_logger() noexcept
{
  try {
    std::shared_ptr<spdlog::logger> made;
    if (const char* path = std::getenv("HANDOFF_LOG_FILE"); path != nullptr && *path != '\0') {
      try {
        made = std::make_shared<spdlog::logger>("handoff", std::make_shared<spdlog::sinks::basic_file_sink_mt>(path));
      } catch (const spdlog::spdlog_ex&) {
        made.reset();  // unwritable path: fall back to stderr below
      }
    }
    if (!made) {
      made = std::make_shared<spdlog::logger>("handoff", std::make_shared<spdlog::sinks::stderr_sink_mt>());
    }
    made->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [handoff] [%l] [tid %t] %v");
    auto level = spdlog::level::warn;
    if (const char* name = std::getenv("HANDOFF_LOG_LEVEL"); name != nullptr && *name != '\0') {
      auto parsed = spdlog::level::from_str(name);
      // from_str answers `off` for unknown names; only accept `off` when it was asked for.
      if (parsed != spdlog::level::off || std::string_view{name} == "off") { level = parsed; }
    }
    made->set_level(level);
    made->flush_on(spdlog::level::warn);
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
