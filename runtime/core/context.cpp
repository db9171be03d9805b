#include <handoff/context.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/stats.hpp>

#include "log/logger.hpp"

#include <vector>

namespace handoff {
namespace {

// How often the executor looks whether a capture that holds back a release has ended.
constexpr std::chrono::milliseconds capture_poll{1};

std::uintptr_t raw(device::stream_handle s) noexcept
{
  return static_cast<std::uintptr_t>(s);
}

}  // namespace

// What queued host functions and executor jobs reach of their context. `owner` becomes null when
// the context goes with releases still pending: they are abandoned, and touch nothing if their
// host function runs after all.
struct context::shared_state {
  explicit shared_state(context* live) noexcept : owner(live) {}
  std::mutex mutex;
  context* owner;
};

// A release waiting for a consumer stream; the stream's host function hands it to the executor.
struct context::pending_release {
  std::shared_ptr<shared_state> shared;
  stream_key where;
  std::function<void()> release_producer;

  // On the executor (or, failing that, where the stream reached it), while the context lives.
  void run(context& owner) noexcept
  {
    release_producer();
    release_producer = nullptr;  // and what it holds (the consumer stream's owner), before drain() returns
    owner.finished_one(where);
  }

  // The context, unless the release was abandoned. Call with shared->mutex held.
  [[nodiscard]] context* live_owner() const noexcept { return shared->owner; }

  static void on_stream_reached(void* self) noexcept
  {
    // Runs on a backend thread, which must not call into the backend: hand over and return.
    auto* pending = static_cast<pending_release*>(self);
    std::lock_guard lock{pending->shared->mutex};
    context* owner = pending->live_owner();
    if (owner == nullptr) { return; }  // abandoned at exit: the process is ending, leave it
    try {
      owner->deferred_->post([pending, owner]() noexcept {
        pending->run(*owner);
        delete pending;
      });
    } catch (...) {
      pending->run(*owner);  // could not hand over (out of memory): the stream is done, release here
      delete pending;
    }
  }
};

context::context(device::backend& backend, std::unique_ptr<executor> deferred)
    : backend_(backend), events_(backend), shared_(std::make_shared<shared_state>(this)), deferred_(std::move(deferred))
{}

context::~context()
{
  // Host functions still queued post to the executor: let the streams that have them get there.
  std::vector<stream_key> streams;
  {
    std::lock_guard lock{pending_mutex_};
    for (const auto& [where, count] : by_stream_) { streams.push_back(where); }
  }
  for (const auto& [device, stream] : streams) {
    try {
      device_guard on{backend_, device};
      const bool capturing = stream != backend_.legacy_default_stream() &&
                             backend_.stream_capture_status(stream) != device::capture_status::none;
      if (!capturing) { backend_.synchronize_stream(stream); }  // synchronizing a capture would invalidate it
    } catch (const std::exception& e) {
      HANDOFF_LOG_WARN("shutting down: could not wait for stream {:#x} of device {} ({})", raw(stream), device,
                       e.what());
    }
  }
  if (!drain_for(exit_drain_limit)) {
    std::size_t abandoned = 0;
    {
      std::lock_guard lock{pending_mutex_};
      abandoned = pending_;
    }
    HANDOFF_LOG_WARN(
      "shutting down: {} stream-ordered release(s) did not run within {} s (their stream never got "
      "there: a capture never ended, or a device error); their producers are left to the ending process",
      abandoned, exit_drain_limit.count());
  }
  std::lock_guard lock{shared_->mutex};
  shared_->owner = nullptr;
}

void context::finished_one(stream_key where) noexcept
{
  std::lock_guard lock{pending_mutex_};
  if (const auto it = by_stream_.find(where); it != by_stream_.end() && --it->second == 0) { by_stream_.erase(it); }
  if (--pending_ == 0) { none_pending_.notify_all(); }
}

void context::drain()
{
  std::unique_lock lock{pending_mutex_};
  none_pending_.wait(lock, [this] { return pending_ == 0; });
}

bool context::drain_for(std::chrono::nanoseconds limit)
{
  std::unique_lock lock{pending_mutex_};
  return none_pending_.wait_for(lock, limit, [this] { return pending_ == 0; });
}

void context::release_after(int device, device::stream_handle stream, std::function<void()> release) noexcept
{
  pending_release* pending = nullptr;
  try {
    pending = new pending_release{shared_, {device, stream}, std::move(release)};
    std::lock_guard lock{pending_mutex_};
    ++pending_;
    ++by_stream_[pending->where];
  } catch (...) {
    delete pending;  // could not even allocate: wait here, never release early
    try {
      device_guard on_owner{backend_, device};
      backend_.synchronize_stream(stream);
    } catch (...) {}
    release();
    return;
  }
  bool capturing = false;
  if (stream != backend_.legacy_default_stream()) {  // the legacy stream never captures; asking could break a capture
    try {
      device_guard on_owner{backend_, device};
      capturing = backend_.stream_capture_status(stream) != device::capture_status::none;
    } catch (...) {}  // enqueue_release finds out what is wrong with the stream
  }
  if (capturing) {
    when_not_capturing(pending);
  } else {
    enqueue_release(pending);
  }
}

void context::enqueue_release(pending_release* pending) noexcept
{
  const auto [device, stream] = pending->where;  // copied below: clang 14 cannot capture bindings
  try {
    device_guard on_owner{backend_, device};
    backend_.launch_host_func(stream, &pending_release::on_stream_reached, pending);
    count(counter::deferred_releases);
    return;
  } catch (const std::exception& e) {
    HANDOFF_LOG_WARN("deferred release: cannot enqueue on stream {:#x} ({}); waiting for the stream instead",
                     raw(stream), e.what());
  }
  // Fall back to waiting for the whole stream on the executor. If even that fails, nothing says
  // when the consumer is done: the producer is kept (leaked), never released early.
  const auto wait_then_release = [this, pending, device = device, stream = stream]() noexcept {
    try {
      device_guard on_owner{backend_, device};
      backend_.synchronize_stream(stream);
    } catch (const std::exception& e) {
      HANDOFF_LOG_ERROR(
        "deferred release: waiting for stream {:#x} failed ({}); its producer is kept, not "
        "released while the consumer may still read it",
        raw(stream), e.what());
      finished_one(pending->where);
      return;
    }
    pending->run(*this);
    delete pending;
  };
  try {
    deferred_->post(wait_then_release);
  } catch (...) {
    wait_then_release();  // cannot defer at all: wait here
  }
}

void context::when_not_capturing(pending_release* pending) noexcept
{
  // A host function enqueued now would become a node of the graph: run at every launch, or never.
  // Wait (without holding the executor) for the capture to end, then enqueue it in stream order.
  const auto look_again = [shared = shared_, pending]() noexcept {
    std::unique_lock lock{shared->mutex};
    context* owner = pending->live_owner();
    if (owner == nullptr) { return; }  // abandoned at exit
    lock.unlock();
    const auto [device, stream] = pending->where;
    bool capturing = false;
    try {
      device_guard on_owner{owner->backend_, device};
      capturing = owner->backend_.stream_capture_status(stream) != device::capture_status::none;
    } catch (...) {}  // enqueue_release finds out what is wrong with the stream
    if (capturing) {
      owner->when_not_capturing(pending);
    } else {
      owner->enqueue_release(pending);
    }
  };
  try {
    deferred_->post_after(capture_poll, look_again);
  } catch (...) {
    HANDOFF_LOG_ERROR("deferred release: cannot wait for the capture on stream {:#x} to end; its producer is kept",
                      raw(pending->where.second));
    finished_one(pending->where);
  }
}

}  // namespace handoff
