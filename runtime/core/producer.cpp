// shared_producer: shared ownership of a producer, its stream bindings, and its deferred release.
#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/trace.hpp>

#include "core/block_cache.hpp"
#include "core/live_views.hpp"
#include "core/producer_state.hpp"
#include "log/logger.hpp"

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <utility>

namespace handoff {

namespace {

// The release event of a producer: deferred ("wait") when consumer streams must finish first.
void trace_release(shared_producer::state& s) noexcept
{
  trace::exchange_scope scope{trace::event_kind::release, "release"};
  if (!scope.active()) { return; }
  trace::event& e = scope.event();
  e.buffer = s.id();
  std::lock_guard lock{s.lock_};  // no other reference is left; other threads may still read for the graph
  if (s.ready_on_) { scope.set_producer_stream(*s.ready_on_); }
  if (!s.release_after_.empty()) { scope.set_consumer_stream(s.release_after_.front()); }
}

using state_blocks = detail::thread_block_cache<sizeof(shared_producer::state)>;
static_assert(alignof(shared_producer::state) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__);

// The thread's destruction of producers: whether one runs, and the deletions asked for meanwhile,
// last first. One thread-local reached through one call: in a shared library each use of a
// thread-local is a call (__tls_get_addr), which GCC makes again after every call in between.
struct destructions {
  bool running{false};
  shared_producer::state* queued{nullptr};
};

[[gnu::noinline]] destructions& this_threads_destructions() noexcept
{
  thread_local destructions mine;
  return mine;
}

}  // namespace

shared_producer::state* shared_producer::state::make(std::function<void()>&& release)
{
  return new (state_blocks::allocate()) state(std::move(release));  // noexcept
}

std::uint64_t shared_producer::state::id() noexcept
{
  if (parent_) { return parent_.state_->id(); }  // one buffer, however many derived producers
  std::uint64_t current = id_.load(std::memory_order_relaxed);
  if (current != 0) { return current; }
  const std::uint64_t fresh = detail::next_node_id();
  return id_.compare_exchange_strong(current, fresh, std::memory_order_relaxed) ? fresh : current;
}

void shared_producer::state::destroy(state* s) noexcept
{
  destructions& thread = this_threads_destructions();
  if (thread.running) {
    s->next_to_destroy_ = std::exchange(thread.queued, s);
    return;
  }
  thread.running = true;
  const auto dispose = [](state* gone) noexcept {
    gone->~state();
    state_blocks::deallocate(gone);
  };
  dispose(s);
  while (thread.queued != nullptr) { dispose(std::exchange(thread.queued, thread.queued->next_to_destroy_)); }
  thread.running = false;
}

shared_producer::state::~state()
{
  detail::live_view_released();
  if (trace::enabled()) { trace_release(*this); }
  // A derived producer's release lets go of its root, after the streams it was bound to.
  if (parent_) {
    release_ = [root = std::move(parent_)]() noexcept {};
  }
  if (!release_) { return; }
  if (release_after_.empty()) {
    try {
      release_();
    } catch (...) {
      HANDOFF_LOG_ERROR("a producer's release function threw; the exception was dropped");
    }
    return;
  }
  if (release_after_.size() == 1) {
    defer(release_after_.front(), std::move(release_));
    return;
  }
  // Several consumer streams: each is watched from now, and the last to get there releases.
  struct countdown {
    countdown(std::size_t streams, std::function<void()> then) noexcept : remaining(streams), release(std::move(then))
    {}
    std::atomic<std::size_t> remaining;
    std::function<void()> release;
  };
  std::shared_ptr<countdown> all;
  try {
    all = std::make_shared<countdown>(release_after_.size(), std::move(release_));
  } catch (...) {
    HANDOFF_LOG_ERROR("out of memory ordering a release after {} streams; the producer is kept", release_after_.size());
    return;
  }
  for (bound_stream& consumer : release_after_) {
    defer(consumer, [all]() noexcept {
      if (all->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) { all->release(); }
    });
  }
}

// Runs `release` once the work enqueued on `consumer` by now is done; a held-back producer stream
// of the same device waits for that work too.
void shared_producer::state::defer(bound_stream& consumer, std::function<void()> release) noexcept
{
  std::optional<device::stream_handle> producer;
  std::shared_ptr<const void> producer_owner;
  if (hold_back_ && hold_back_->ctx == consumer.ctx && hold_back_->device == consumer.device) {
    producer = hold_back_->stream;
    producer_owner = hold_back_->stream_owner;  // shared by every consumer stream's release
  }
  if (!consumer.stream_owner && !producer_owner) {
    consumer.ctx->release_after(consumer.device, consumer.stream, std::move(release), producer);
    return;
  }
  // The streams' owners go once the release has run, after the last use of the streams.
  consumer.ctx->release_after(
    consumer.device, consumer.stream,
    [release = std::move(release), owner = std::move(consumer.stream_owner),
     held = std::move(producer_owner)]() noexcept { release(); },
    producer);
}

shared_producer::shared_producer(std::function<void()> release)
{
  try {
    state_ = state::make(std::move(release));
  } catch (...) {
    // Out of memory before ownership was established: release now, so nothing leaks.
    if (release) { release(); }
    throw;
  }
}

shared_producer::shared_producer(const shared_producer& other) noexcept : state_(other.state_)
{
  state::acquire(state_);
}

shared_producer& shared_producer::operator=(const shared_producer& other) noexcept
{
  if (this != &other) {
    state::acquire(other.state_);
    state::release(std::exchange(state_, other.state_));
  }
  return *this;
}

shared_producer& shared_producer::operator=(shared_producer&& other) noexcept
{
  if (this != &other) { state::release(std::exchange(state_, std::exchange(other.state_, nullptr))); }
  return *this;
}

shared_producer::~shared_producer()
{
  state::release(state_);
}

std::uint64_t shared_producer::id() const noexcept
{
  return state_ == nullptr ? 0 : state_->id();
}

const std::function<void()>* shared_producer::sole_release() const noexcept
{
  if (state_ == nullptr || state_->references_.load(std::memory_order_acquire) != 1 || !state_->release_) {
    return nullptr;
  }
  return &state_->release_;
}

void shared_producer::visit_stream_owners(void (*visit)(const std::shared_ptr<const void>& owner, void* context),
                                          void* context) const
{
  if (state_ == nullptr || state_->references_.load(std::memory_order_acquire) != 1 ||
      !state_->keeps_stream_owner_.load(std::memory_order_acquire)) {
    return;
  }
  std::lock_guard lock{state_->lock_};
  const auto visit_binding = [&](const bound_stream& binding) {
    if (binding.stream_owner) { visit(binding.stream_owner, context); }
  };
  if (state_->ready_on_) { visit_binding(*state_->ready_on_); }
  for (const bound_stream& after : state_->release_after_) { visit_binding(after); }
  if (state_->hold_back_) { visit_binding(*state_->hold_back_); }
}

shared_producer shared_producer::derived() const
{
  if (state_ == nullptr) { return {}; }
  shared_producer out{std::function<void()>{}};
  out.state_->parent_ = state_->parent_ ? state_->parent_ : *this;
  return out;
}

long shared_producer::use_count() const noexcept
{
  return state_ == nullptr ? 0 : state_->references_.load(std::memory_order_relaxed);
}

namespace {

// A binding is used later, from any thread.
bound_stream thread_independent(bound_stream where) noexcept
{
  if (where.ctx != nullptr) { where.stream = where.ctx->thread_independent(where.device, where.stream); }
  return where;
}

}  // namespace

std::optional<bound_stream> shared_producer::ready_on() const
{
  if (!state_) { return std::nullopt; }
  std::lock_guard lock{state_->lock_};
  return state_->ready_on_;
}

void shared_producer::set_ready_on(const bound_stream& where) const
{
  if (!state_) { return; }
  // Swapped in, so that the binding it replaces (whose owner may be a Python object, which its
  // release decrements) goes after the lock: nothing but the swap is done under it.
  std::optional<bound_stream> replaced{thread_independent(where)};
  const bool keeps_owner = replaced->stream_owner != nullptr;
  std::lock_guard lock{state_->lock_};
  if (keeps_owner) { state_->keeps_stream_owner_.store(true, std::memory_order_release); }
  std::swap(state_->ready_on_, replaced);
}

void shared_producer::release_after(const bound_stream& consumer, const std::optional<bound_stream>& producer) const
{
  if (!state_ || consumer.ctx == nullptr) { return; }
  bound_stream bound = thread_independent(consumer);
  std::optional<bound_stream> held;
  if (producer) { held = thread_independent(*producer); }
  std::lock_guard lock{state_->lock_};
  if (bound.stream_owner || (held && held->stream_owner)) {
    state_->keeps_stream_owner_.store(true, std::memory_order_release);
  }
  const auto same = std::find_if(state_->release_after_.begin(), state_->release_after_.end(), [&](const auto& b) {
    return b.ctx == bound.ctx && b.device == bound.device && b.stream == bound.stream;
  });
  if (same == state_->release_after_.end()) {
    state_->release_after_.push_back(std::move(bound));
  } else if (!same->stream_owner) {
    // The same stream named again: by a caller that holds it alive this time, the owner is kept.
    same->stream_owner = std::move(bound.stream_owner);
  }
  if (held) { std::swap(state_->hold_back_, held); }  // the replaced one goes after the lock, as above
}

}  // namespace handoff
