// Private: the live-producer gauge behind stats().live_views.
#pragma once

namespace handoff::detail {
void live_view_added() noexcept;
void live_view_released() noexcept;
}  // namespace handoff::detail
