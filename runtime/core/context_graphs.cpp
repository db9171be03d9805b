#include "core/context_impl.hpp"

#include "log/logger.hpp"

namespace handoff {

bool context::impl::release_with_graph(pending_release* pending) noexcept
{
  // On a backend thread, which must not call the backend: the executor takes it from there.
  const auto graph_gone = [](void* raw) noexcept {
    auto* p = static_cast<pending_release*>(raw);
    const std::lock_guard lock{p->shared->mutex};  // the context stays while the release is handed over
    impl* owner = p->live_owner();
    if (owner == nullptr) { return; }  // abandoned at exit
    p->graph_gone = true;
    owner->count_.bind_to_graph(p->sequence, false);
    try {
      owner->deferred_->post([owner, p]() noexcept { owner->enqueue_unless_capturing(p); });
    } catch (...) {
      HANDOFF_LOG_ERROR("deferred release: out of memory after its graph was destroyed; its producer is kept");
      owner->finished_one(*p);
    }
  };
  try {
    count_.bind_to_graph(pending->sequence, true);  // before: the graph may go at once
    backend_.release_with_capture(pending->where.second, graph_gone, pending);
    HANDOFF_LOG_DEBUG("deferred release: stream {:#x} is capturing; the release waits for the graph to be destroyed",
                      raw(pending->where.second));
    return true;
  } catch (...) {
    count_.bind_to_graph(pending->sequence, false);
    return false;  // no graph of its own to wait for (the legacy stream in another's capture)
  }
}

void context::impl::enqueue_later(pending_release* pending) noexcept
{
  // Its stream captures (an event recorded now would become a node of the graph, and could not be
  // queried), or failed to be asked: enqueued again a little later, without holding the executor.
  const auto look_again = [shared = shared_, pending]() noexcept {
    std::unique_lock lock{shared->mutex};
    impl* owner = pending->live_owner();
    if (owner == nullptr) { return; }  // abandoned at exit
    lock.unlock();
    owner->enqueue_unless_capturing(pending);
  };
  try {
    deferred_->post_after(detail::retry_interval, look_again);
  } catch (...) {
    HANDOFF_LOG_ERROR("deferred release: out of memory to ask stream {:#x} again later; its producer is kept",
                      raw(pending->where.second));
    finished_one(*pending);
  }
}

}  // namespace handoff
