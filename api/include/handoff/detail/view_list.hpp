// The list of tracked views behind handoff::tracked_view: inline, because every import and export
// joins and leaves it.
#pragma once

#include <handoff/detail/spin_lock.hpp>

namespace handoff {
class tracked_view;
}

namespace handoff::detail {

/// An intrusive list under a spin lock: joining or leaving is a handful of stores, shorter than a
/// mutex's own bookkeeping. A snapshot, the one long holder, is rare; waiters yield to it.
/// Trivially destructible, so that views may leave it after static destruction.
struct view_list : spin_lock {
  tracked_view* head{nullptr};
};

/// The process's tracked views.
extern view_list tracked_views;

}  // namespace handoff::detail
