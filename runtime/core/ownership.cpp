#include <handoff/context.hpp>
#include <handoff/ownership.hpp>

#include "core/producer_state.hpp"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <unordered_map>

namespace handoff {

namespace detail {

std::uint64_t next_node_id() noexcept
{
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

}  // namespace detail

namespace {

// A test-and-set lock: registering a view is a handful of stores, shorter than a mutex's own
// bookkeeping; a snapshot, the one long holder, is rare, and waiters yield to it.
class spin_lock {
 public:
  void lock() noexcept
  {
    while (locked_.exchange(true, std::memory_order_acquire)) {
      while (locked_.load(std::memory_order_relaxed)) { std::this_thread::yield(); }
    }
  }
  void unlock() noexcept { locked_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> locked_{false};
};

}  // namespace

namespace {

stream_node node_of(const stream_binding& binding)
{
  const auto type = binding.ctx != nullptr ? binding.ctx->backend().device_type() : kDLCUDA;
  return {.device = {type, binding.device}, .handle = static_cast<std::uint64_t>(binding.stream)};
}

void describe(buffer_node& buffer, const DLTensor& t)
{
  buffer.device = t.device;
  buffer.dtype = t.dtype;
  buffer.shape.assign(t.shape, t.shape + t.ndim);
  std::int64_t elements = 1;
  for (const auto extent : buffer.shape) { elements *= extent; }
  buffer.nbytes = elements * static_cast<std::int64_t>((t.dtype.bits * t.dtype.lanes + 7) / 8);
}

void describe(buffer_node& buffer, const array& view)
{
  buffer.device = view.device();
  buffer.dtype = view.dtype();
  buffer.shape.assign(view.shape().begin(), view.shape().end());
  buffer.nbytes = view.nbytes();
}

}  // namespace

// The intrusive list of tracked views. Trivially destructible, so that views may leave it after
// static destruction (a consumer releasing an exported tensor at exit).
struct ownership_registry {
  spin_lock lock;
  tracked_view* head{nullptr};

  static ownership_registry& get() noexcept
  {
    static constinit ownership_registry registry;
    return registry;
  }

  void link(tracked_view& v) noexcept
  {
    std::lock_guard guard{lock};
    v.next_ = head;
    if (head != nullptr) { head->prev_ = &v; }
    head = &v;
  }

  void unlink(tracked_view& v) noexcept
  {
    std::lock_guard guard{lock};
    if (v.prev_ != nullptr) {
      v.prev_->next_ = v.next_;
    } else {
      head = v.next_;
    }
    if (v.next_ != nullptr) { v.next_->prev_ = v.prev_; }
  }

  ownership_graph snapshot()
  {
    ownership_graph graph;
    std::unordered_map<const producer_ref::state*, std::size_t> buffer_index;
    std::lock_guard guard{lock};
    // Oldest first: the list is newest first.
    std::vector<const tracked_view*> views;
    for (const tracked_view* v = head; v != nullptr; v = v->next_) { views.push_back(v); }
    std::reverse(views.begin(), views.end());
    for (const tracked_view* v : views) {
      producer_ref::state* state = v->owner_->state_;
      if (state == nullptr) { continue; }
      auto [at, added] = buffer_index.try_emplace(state, graph.buffers.size());
      if (added) {
        buffer_node& buffer = graph.buffers.emplace_back();
        buffer.id = state->id();
        buffer.library = state->library_.load(std::memory_order_relaxed);
        buffer.holders = state->references_.load(std::memory_order_relaxed);
        if (v->array_ != nullptr) {
          describe(buffer, *v->array_);
        } else {
          describe(buffer, *v->tensor_);
        }
        std::lock_guard bindings{state->mutex_};
        if (state->ready_on_) { buffer.ready_on = node_of(*state->ready_on_); }
        for (const stream_binding& after : state->release_after_) { buffer.released_after.push_back(node_of(after)); }
      }
      graph.views.push_back({.id = v->id(), .buffer = graph.buffers[at->second].id, .holder = v->holder_});
    }
    return graph;
  }

  std::vector<std::uint64_t> ids()
  {
    std::vector<std::uint64_t> ids;
    std::lock_guard guard{lock};
    for (const tracked_view* v = head; v != nullptr; v = v->next_) { ids.push_back(v->id()); }
    return ids;
  }
};

tracked_view::tracked_view(const array& view, const char* holder) noexcept
    : array_(&view), owner_(&view.owner()), holder_(holder)
{
  ownership_registry::get().link(*this);
}

tracked_view::tracked_view(const DLTensor& tensor, const producer_ref& owner, const char* holder) noexcept
    : tensor_(&tensor), owner_(&owner), holder_(holder)
{
  ownership_registry::get().link(*this);
}

tracked_view::~tracked_view()
{
  ownership_registry::get().unlink(*this);
}

std::uint64_t tracked_view::id() const noexcept
{
  std::uint64_t current = id_.load(std::memory_order_relaxed);
  if (current != 0) { return current; }
  const std::uint64_t fresh = detail::next_node_id();
  return id_.compare_exchange_strong(current, fresh, std::memory_order_relaxed) ? fresh : current;
}

ownership_graph ownership_snapshot()
{
  return ownership_registry::get().snapshot();
}

std::vector<std::uint64_t> tracked_view_ids()
{
  return ownership_registry::get().ids();
}

}  // namespace handoff
