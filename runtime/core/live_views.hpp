// Private: the gauges behind stats().live_views and stats().pending_releases.
#pragma once

namespace handoff::detail {
void live_view_added() noexcept;
void live_view_released() noexcept;
/// A deferred release was asked for (`+1`), or has run or been given up (`-1`).
void pending_releases_changed(int delta) noexcept;
}  // namespace handoff::detail
