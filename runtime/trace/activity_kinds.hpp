// Private: what the trace says of each kind of device activity, in one table for the recorder and
// the race detector.
#pragma once

#include <handoff/activity.hpp>
#include <handoff/internal/enum_table.hpp>
#include <handoff/trace.hpp>

#include <string_view>

namespace handoff::trace::detail {

struct activity_kind_facts {
  event_kind event;       // the trace event it becomes
  const char* op;         // the event's `op` (a host wait's says what it waited for: null here)
  std::string_view noun;  // what a hazard's text calls it
};

inline constexpr auto activity_kinds = handoff::detail::make_enum_table<activity::kind, activity_kind_facts>({
  {activity::kind::launch, {event_kind::launch, "kernel", "kernel"}},
  {activity::kind::copy, {event_kind::copy, "copy", "copy"}},
  {activity::kind::set, {event_kind::copy, "set", "memset"}},
  {activity::kind::stream_create, {event_kind::stream, "create", "operation"}},
  {activity::kind::stream_destroy, {event_kind::stream, "destroy", "operation"}},
  {activity::kind::event_record, {event_kind::stream, "record", "operation"}},
  {activity::kind::stream_wait, {event_kind::stream, "wait", "operation"}},
  {activity::kind::host_sync, {event_kind::sync, nullptr, "operation"}},
  {activity::kind::host_query, {event_kind::sync, nullptr, "operation"}},
  {activity::kind::allocate, {event_kind::memory, "allocate", "allocation"}},
  {activity::kind::free, {event_kind::memory, "free", "free"}},
});

[[nodiscard]] constexpr activity_kind_facts facts(activity::kind k) noexcept
{
  return handoff::detail::look_up(activity_kinds, k, {event_kind::stream, "?", "operation"});
}

}  // namespace handoff::trace::detail
