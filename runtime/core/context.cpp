#include <handoff/context.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/stats.hpp>

#include "log/logger.hpp"

namespace handoff {

context::context(device::backend& backend, std::unique_ptr<executor> deferred)
    : backend_(backend), events_(backend), deferred_(std::move(deferred))
{}

context::~context()
{
  // Host functions still queued on streams post to the executor: let every device finish first.
  try {
    const int devices = backend_.device_count();
    for (int device = 0; device < devices; ++device) {
      device_guard on{backend_, device};
      backend_.synchronize_device();
    }
  } catch (const std::exception& e) {
    HANDOFF_LOG_WARN("shutting down: could not wait for the devices ({})", e.what());
  }
  drain();
}

// A release waiting for a consumer stream; the stream's host function hands it to the executor.
struct context::pending_release {
  context* owner;
  std::function<void()> release_producer;

  void run() noexcept
  {
    release_producer();
    release_producer = nullptr;  // and what it holds (the consumer stream's owner), before drain() returns
    owner->finished_one();
  }

  static void on_stream_reached(void* self) noexcept
  {
    // Runs on a backend thread, which must not call into the backend: hand over and return.
    auto* pending = static_cast<pending_release*>(self);
    try {
      pending->owner->deferred_->post([pending]() noexcept {
        pending->run();
        delete pending;
      });
    } catch (...) {
      pending->run();  // could not hand over (out of memory): the stream is done, release here
      delete pending;
    }
  }
};

void context::finished_one() noexcept
{
  std::lock_guard lock{pending_mutex_};
  if (--pending_ == 0) { none_pending_.notify_all(); }
}

void context::drain()
{
  std::unique_lock lock{pending_mutex_};
  none_pending_.wait(lock, [this] { return pending_ == 0; });
}

void context::release_after(int device, device::stream_handle stream, std::function<void()> release) noexcept
{
  std::unique_ptr<pending_release> pending;
  try {
    pending.reset(new pending_release{this, std::move(release)});
    {
      std::lock_guard lock{pending_mutex_};
      ++pending_;
    }
    device_guard on_owner{backend_, device};
    backend_.launch_host_func(stream, &pending_release::on_stream_reached, pending.get());
    (void)pending.release();  // owned by the stream's host function now
    count(counter::deferred_releases);
    return;
  } catch (const std::exception& e) {
    HANDOFF_LOG_WARN("deferred release: cannot enqueue on stream {:#x} ({}); waiting for the stream instead",
                     static_cast<std::uintptr_t>(stream), e.what());
  }
  if (!pending) {  // could not even allocate: wait here, never release early (pending_ untouched)
    try {
      device_guard on_owner{backend_, device};
      backend_.synchronize_stream(stream);
    } catch (...) {}
    release();
    return;
  }
  // Fall back to waiting for the whole stream on the executor.
  const std::shared_ptr<pending_release> job{std::move(pending)};
  try {
    deferred_->post([this, device, stream, job]() noexcept {
      try {
        device_guard on_owner{backend_, device};
        backend_.synchronize_stream(stream);
      } catch (const std::exception& e) {
        HANDOFF_LOG_ERROR("deferred release: synchronizing stream {:#x} failed ({}); releasing",
                          static_cast<std::uintptr_t>(stream), e.what());
      }
      job->run();
    });
  } catch (...) {
    job->run();  // cannot defer at all: the stream may be busy, but leaking is worse
  }
}

}  // namespace handoff
