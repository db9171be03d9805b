#include "core/context_impl.hpp"

#include <handoff/activity.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/embedding.hpp>
#include <handoff/internal/counters.hpp>

#include "log/logger.hpp"

#include <algorithm>
#include <string>

namespace handoff {

std::string detail::what_failed()
{
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception of unknown type";
  }
}

context::impl::impl(device::backend& backend, const embedding& hooks, event_pool& events,
                    std::unique_ptr<executor> deferred)
    : backend_(backend),
      hooks_(hooks),
      events_(events),
      shared_(std::make_shared<shared_state>(this)),
      deferred_(std::move(deferred))
{}

void context::impl::finished_one(const pending_release& pending) noexcept
{
  count_.remove(pending.where, pending.sequence);
}

void context::impl::release_after(int device, device::stream_handle stream, std::function<void()> release,
                                  std::optional<device::stream_handle> producer) noexcept
{
  pending_release* pending = nullptr;
  stream = thread_independent(device, stream);  // it may be waited for on another thread
  if (stream != backend_.legacy_default_stream()) {
    // A consumer may work on another device than the data's (peer access): the event that
    // watches its stream must be of the stream's device.
    try {
      device = backend_.stream_device(stream);
    } catch (...) {}  // enqueue_release finds out what is wrong with the stream
  }
  bool counted = false;
  try {
    pending = new pending_release{.shared = shared_,
                                  .where = {device, stream},
                                  .sequence = 0,  // given by the count, below
                                  .release_producer = std::move(release),
                                  .producer = producer,
                                  .graph_gone = false,
                                  .failed_waits = {}};
    pending->sequence = count_.add(pending->where);
    counted = true;
    std::lock_guard lock{shared_->mutex};
    shared_->outstanding.insert(pending);
  } catch (...) {
    if (counted) { finished_one(*pending); }
    if (pending != nullptr) { release = std::move(pending->release_producer); }
    delete pending;  // could not even allocate: wait here, never release early
    try {
      wait_for_stream(device, stream);
    } catch (...) {
      HANDOFF_LOG_ERROR("deferred release: out of memory, and stream {:#x} cannot be waited for; its producer is kept",
                        raw(stream));
      return;
    }
    release();
    return;
  }
  enqueue_unless_capturing(pending);
}

void context::impl::enqueue_unless_capturing(pending_release* pending) noexcept
{
  const auto [device, stream] = pending->where;
  bool capturing = false;
  try {
    device_guard on_owner{backend_, device};  // made current once, for the query and the record
    // The legacy stream reports a capture of a blocking stream, which a record on it would break.
    capturing = backend_.stream_capture_status(stream) != device::capture_status::none;
    if (!capturing) {
      enqueue_release(pending, /*device_is_current=*/true);
      return;
    }
    // The captured work reads the data at every launch of the graph: the release waits for the graph
    // to be gone, then for the stream's own work as any release does.
    // (The legacy stream is only part of another stream's capture, and must not be touched.)
    if (!pending->graph_gone && stream != backend_.legacy_default_stream() && release_with_graph(pending)) { return; }
  } catch (...) {}  // enqueue_release finds out what is wrong with the stream
  if (capturing) {
    enqueue_later(pending);
  } else {
    enqueue_release(pending, /*device_is_current=*/false);
  }
}

void context::impl::enqueue_release(pending_release* pending, bool device_is_current) noexcept
{
  const auto [device, stream] = pending->where;  // copied below: clang 14 cannot capture bindings
  try {
    std::optional<device_guard> on_owner;
    if (!device_is_current) { on_owner.emplace(backend_, device); }
    std::lock_guard lock{watch_mutex_};
    release_group* open = nullptr;
    for (auto it = watched_.rbegin(); it != watched_.rend(); ++it) {  // the stream's newest group
      if (it->where != pending->where) { continue; }
      if (!it->sealed) { open = &*it; }
      break;
    }
    if (open != nullptr) {
      // Re-recorded: the event now also covers the work this release waits for. The earlier
      // releases of the group wait a little longer, never less.
      open->releases.push_back(pending);
      try {
        backend_.record_event(open->reached.get(), stream);
      } catch (...) {
        open->releases.pop_back();
        throw;
      }
    } else {
      release_group group{.where = pending->where,
                          .reached = events_.record(device, stream),
                          .releases = {pending},
                          .sealed = false,
                          .failed_polls = {}};
      watched_.push_back(std::move(group));
      open = &watched_.back();
      if (!polling_) {
        polling_ = true;
        poll_later(detail::min_release_poll);
      }
    }
    count(counter::deferred_releases);
    // Still under watch_mutex_: the group's event is not given back (and re-recorded elsewhere)
    // before the producer's wait has captured this record.
    if (pending->producer) { hold_back(*pending->producer, stream, open->reached.get()); }
    return;
  } catch (const std::exception& e) {
    // Said once per release: a failure that passes has it recorded at a later attempt.
    if (pending->failed_waits.failures == 0) {
      HANDOFF_LOG_WARN("deferred release: cannot record an event on stream {:#x} ({}); waiting for the stream instead",
                       raw(stream), e.what());
      if (pending->producer) {
        HANDOFF_LOG_WARN(
          "deferred release: so producer stream {:#x} cannot wait for it; its later work is not ordered "
          "after the consumer's",
          raw(*pending->producer));
      }
    }
  }
  try {
    deferred_->post([this, pending]() noexcept { wait_then_release(pending); });
  } catch (...) {
    wait_then_release(pending);  // cannot defer at all: wait here
  }
}

// The fallback of a release whose event could not be recorded: waits for the whole stream. A wait
// that fails is tried again, the whole enqueue with it; only a stream that keeps failing (a sticky
// device error) has its release abandoned: nothing then says when the consumer is done, and the
// producer is kept, never released early.
void context::impl::wait_then_release(pending_release* pending) noexcept
{
  const auto [device, stream] = pending->where;
  try {
    const relaxed_capture_mode relaxed{backend_};
    wait_for_stream(device, stream);
  } catch (...) {
    const std::string why = detail::what_failed();
    if (!pending->failed_waits.keeps_failing()) {
      HANDOFF_LOG_DEBUG("deferred release: waiting for stream {:#x} of device {} failed ({}); asking again",
                        raw(stream), device, why);
      enqueue_later(pending);
      return;
    }
    HANDOFF_LOG_ERROR(
      "deferred release: stream {:#x} of device {} cannot be waited for ({}, {} times); its producer is kept, not "
      "released while the consumer may still read it",
      raw(stream), device, why, pending->failed_waits.failures);
    finished_one(*pending);
    return;
  }
  std::vector<pending_release*> one{pending};
  run_releases(one);
}

void context::impl::wait_for_stream(int device, device::stream_handle stream)
{
  const device_guard on_owner{backend_, device};
  struct waiting {
    device::backend* backend;
    device::stream_handle stream;
  } wait{&backend_, stream};
  // A synchronization of the legacy default stream waits only for the work enqueued on it; the
  // blocking streams' work it stands for is waited for with the whole device's.
  run_blocking(
    hooks_.block_host,
    [](void* raw) {
      const auto& w = *static_cast<waiting*>(raw);
      if (w.stream == w.backend->legacy_default_stream()) {
        w.backend->synchronize_device();
      } else {
        w.backend->synchronize_stream(w.stream);
      }
    },
    &wait);
}

void context::impl::hold_back(device::stream_handle producer, device::stream_handle consumer,
                              device::event_handle reached) noexcept
{
  try {
    // Asked first: a wait would go into a capturing producer's graph, and a wait on the legacy
    // default stream while a blocking stream of its device captures would invalidate that capture,
    // where asking only fails (cudaErrorStreamCaptureImplicit).
    if (backend_.stream_capture_status(producer) != device::capture_status::none) {
      HANDOFF_LOG_WARN(
        "deferred release: producer stream {:#x} is capturing into a graph; its later work is not "
        "ordered after the consumer's on stream {:#x}",
        raw(producer), raw(consumer));
      return;
    }
    backend_.stream_wait_event(producer, reached);
    count(counter::waits_inserted);
    HANDOFF_LOG_TRACE("producer stream {:#x} waits for consumer stream {:#x}", raw(producer), raw(consumer));
  } catch (const std::exception& e) {
    HANDOFF_LOG_WARN(
      "deferred release: producer stream {:#x} cannot wait for consumer stream {:#x} ({}); its later "
      "work is not ordered after the consumer's",
      raw(producer), raw(consumer), e.what());
  }
}

void context::impl::poll_later(std::chrono::nanoseconds interval) noexcept
{
  const auto poll = [this, shared = shared_, interval]() noexcept {
    {
      std::lock_guard lock{shared->mutex};
      if (shared->owner == nullptr) { return; }  // the context is going: what is watched is abandoned
    }
    poll_releases(interval);
  };
  try {
    deferred_->post_after(interval, poll);
  } catch (...) {
    poll();  // cannot defer (out of memory): look now
  }
}

void context::impl::poll_releases(std::chrono::nanoseconds interval) noexcept
{
  std::list<release_group> watched;
  {
    std::lock_guard lock{watch_mutex_};
    watched.splice(watched.end(), watched_);  // out of reach: no release joins a group being looked at
  }
  for (auto& group : watched) { group.sealed = true; }
  // Grouped by device, so that each device is made current once per look.
  watched.sort([](const release_group& a, const release_group& b) { return a.where.first < b.where.first; });
  std::vector<pending_release*> reached;
  std::list<release_group> waiting;
  const relaxed_capture_mode relaxed{backend_};  // a capture on another thread must not fail the queries
  const activity::bookkeeping own;               // the program waited for none of this
  std::optional<device_guard> on_device;
  int current = -1;  // the device on_device made current
  while (!watched.empty()) {
    auto group = watched.begin();
    const auto [device, stream] = group->where;
    try {
      if (current != device) {
        current = -1;
        on_device.reset();
        on_device.emplace(backend_, device);
        current = device;
      }
      if (!backend_.query_event(group->reached.get())) {
        group->failed_polls.reset();
        waiting.splice(waiting.end(), watched, group);
        continue;
      }
      reached.insert(reached.end(), group->releases.begin(), group->releases.end());
    } catch (...) {
      const std::string why = detail::what_failed();
      if (!group->failed_polls.keeps_failing()) {
        HANDOFF_LOG_DEBUG("deferred release: stream {:#x} of device {} could not be asked ({}); asking again",
                          raw(stream), device, why);
        waiting.splice(waiting.end(), watched, group);
        continue;
      }
      // Nothing says when the consumer is done (a sticky device error): the producers are kept,
      // never released early.
      HANDOFF_LOG_ERROR(
        "deferred release: stream {:#x} of device {} cannot be waited for ({}, for {} polls); {} producer(s) kept",
        raw(stream), device, why, group->failed_polls.failures, group->releases.size());
      for (const auto* pending : group->releases) { finished_one(*pending); }
      group->reached.discard();  // an event that cannot be asked about is not pooled again
    }
    watched.erase(group);  // its event goes back to the pool first: a release may import again
  }
  on_device.reset();
  if (!reached.empty()) { run_releases(reached); }
  std::lock_guard lock{watch_mutex_};
  watched_.splice(watched_.begin(), waiting);  // older than what was added meanwhile
  if (watched_.empty()) {
    polling_ = false;
    return;
  }
  // Look again soon while releases complete; back off while the streams are busy.
  poll_later(reached.empty() ? std::min(interval * 2, std::chrono::nanoseconds{detail::max_release_poll})
                             : detail::min_release_poll);
}

void context::impl::run_releases(std::vector<pending_release*>& releases) noexcept
{
  struct batch {
    impl* owner;
    std::vector<pending_release*>* releases;
  } state{this, &releases};
  const auto body = [](void* raw) noexcept {
    auto* b = static_cast<batch*>(raw);
    // Each release runs with its stream's device current, as where it was asked for: what it frees
    // or finalizes (a peer library's finalizer) works on that device, and binds no context of another.
    std::optional<device_guard> on_device;
    int current = -1;  // the device on_device made current
    for (auto* pending : *b->releases) {
      if (const int device = pending->where.first; device != current) {
        on_device.reset();
        current = device;
        try {
          on_device.emplace(b->owner->backend_, device);
        } catch (...) {}  // released all the same: what it frees says for itself what fails
      }
      pending->run(*b->owner);
      pending_release::retire(pending);
    }
  };
  if (hooks_.run_releases != nullptr) {
    hooks_.run_releases(body, &state);
  } else {
    body(&state);
  }
}

// --- the public face ---------------------------------------------------------------------------------

context::context(device::backend& backend, std::unique_ptr<executor> deferred, embedding hooks)
    : backend_(backend),
      hooks_(hooks),
      events_(backend),
      impl_(std::make_unique<impl>(backend, hooks_, events_, std::move(deferred)))
{}

context::~context() = default;

device::stream_handle context::thread_independent(int device, device::stream_handle stream) noexcept
{
  return impl_->thread_independent(device, stream);
}

void context::release_after(int device, device::stream_handle stream, std::function<void()> release,
                            std::optional<device::stream_handle> producer) noexcept
{
  impl_->release_after(device, stream, std::move(release), producer);
}

void context::drain()
{
  impl_->drain();
}

bool context::drain_for(std::chrono::nanoseconds limit)
{
  return impl_->drain_for(limit);
}

bool context::drain_at_exit(std::chrono::nanoseconds limit) noexcept
{
  return impl_->drain_at_exit(limit);
}

}  // namespace handoff
