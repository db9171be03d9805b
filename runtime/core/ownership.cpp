#include <handoff/context.hpp>
#include <handoff/ownership.hpp>

#include "core/producer_state.hpp"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

namespace handoff {

namespace detail {

std::uint64_t next_node_id() noexcept
{
  static std::atomic<std::uint64_t> last{0};
  return last.fetch_add(1, std::memory_order_relaxed) + 1;
}

constinit view_list tracked_views;  // usable before and after static construction and destruction

namespace {

// fork() while another thread holds the list's lock would leave it held forever in the child, where
// that thread does not exist: the forking thread takes it first, and both sides let go.
[[maybe_unused]] const bool fork_handled =
  pthread_atfork([] { tracked_views.lock(); }, [] { tracked_views.unlock(); }, [] { tracked_views.unlock(); }) == 0;

}  // namespace

}  // namespace detail

namespace {

stream_node node_of(const bound_stream& binding)
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

void add_once(std::vector<stream_node>& streams, const stream_node& stream)
{
  const auto same = [&](const stream_node& s) {
    return s.handle == stream.handle && s.device.device_type == stream.device.device_type &&
           s.device.device_id == stream.device.device_id;
  };
  if (std::none_of(streams.begin(), streams.end(), same)) { streams.push_back(stream); }
}

void describe(buffer_node& buffer, const array& view)
{
  buffer.device = view.device();
  buffer.dtype = view.dtype();
  buffer.shape.assign(view.shape().begin(), view.shape().end());
  buffer.nbytes = view.nbytes();
}

}  // namespace

// Reads the list of tracked views for the graph.
struct ownership_registry {
  static ownership_graph snapshot()
  {
    ownership_graph graph;
    std::unordered_map<const shared_producer::state*, std::size_t> buffer_index;  // by root
    std::unordered_set<const shared_producer::state*> bound;                      // bindings added
    std::lock_guard guard{detail::tracked_views};
    // Oldest first: the list is newest first.
    std::vector<const tracked_view*> views;
    for (const tracked_view* v = detail::tracked_views.head; v != nullptr; v = v->next_) { views.push_back(v); }
    std::reverse(views.begin(), views.end());
    for (const tracked_view* v : views) {
      shared_producer::state* state = v->owner_->state_;  // a derived producer's: a view of its root's buffer
      if (state == nullptr) { continue; }
      shared_producer::state* root = state->root();
      auto [at, added] = buffer_index.try_emplace(root, graph.buffers.size());
      if (added) {
        buffer_node& buffer = graph.buffers.emplace_back();
        buffer.id = root->id();
        buffer.holders = root->references_.load(std::memory_order_relaxed);
        if (v->array_ != nullptr) {
          describe(buffer, *v->array_);
        } else {
          describe(buffer, *v->tensor_);
        }
      }
      if (bound.insert(state).second) {  // each producer's bindings once: its root's and derived ones'
        buffer_node& buffer = graph.buffers[at->second];
        std::lock_guard bindings{state->lock_};
        if (state->ready_on_) { add_once(buffer.ready_on, node_of(*state->ready_on_)); }
        for (const bound_stream& after : state->release_after_) { add_once(buffer.released_after, node_of(after)); }
      }
      buffer_node& held = graph.buffers[at->second];
      if (held.library == nullptr) { held.library = v->library_; }
      graph.views.push_back({.id = v->id(), .buffer = held.id, .holder = v->holder_});
    }
    return graph;
  }

  static const char* library_of(const shared_producer::state* state) noexcept
  {
    const shared_producer::state* root = state->root();
    std::lock_guard guard{detail::tracked_views};
    for (const tracked_view* v = detail::tracked_views.head; v != nullptr; v = v->next_) {
      if (v->library_ != nullptr && v->owner_->state_ != nullptr && v->owner_->state_->root() == root) {
        return v->library_;
      }
    }
    return nullptr;
  }

  static std::vector<std::uint64_t> ids()
  {
    std::vector<std::uint64_t> ids;
    std::lock_guard guard{detail::tracked_views};
    for (const tracked_view* v = detail::tracked_views.head; v != nullptr; v = v->next_) { ids.push_back(v->id()); }
    return ids;
  }
};

std::uint64_t tracked_view::id() const noexcept
{
  std::uint64_t current = id_.load(std::memory_order_relaxed);
  if (current != 0) { return current; }
  const std::uint64_t fresh = detail::next_node_id();
  return id_.compare_exchange_strong(current, fresh, std::memory_order_relaxed) ? fresh : current;
}

const char* shared_producer::library() const noexcept
{
  return state_ == nullptr ? nullptr : ownership_registry::library_of(state_);
}

ownership_graph ownership_snapshot()
{
  return ownership_registry::snapshot();
}

std::vector<std::uint64_t> tracked_view_ids()
{
  return ownership_registry::ids();
}

}  // namespace handoff
