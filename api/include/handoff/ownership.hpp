// The ownership graph: which buffers are alive, which views hold them, which streams they wait on.
#pragma once

#include <handoff/dlpack.h>
#include <handoff/array.hpp>
#include <handoff/detail/view_list.hpp>

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

namespace handoff {

/// A view's node in the ownership graph for as long as it lives: each holder of a producer that the
/// graph shows (a `handoff.Array`, an exported DLPack tensor) embeds one. Joining and leaving the
/// list of views take a short spin lock, so that the graph is always kept. The described view must
/// outlive this object and stay at its address.
class tracked_view {
 public:
  /// Registers `view`, held by `holder` (a static string, e.g. "handoff.Array"), of data made by
  /// `library` (its producer's top-level package, when known; a string that lives as long as the
  /// process).
  tracked_view(const array& view, const char* holder, const char* library = nullptr) noexcept
      : array_(&view), owner_(&view.owner()), holder_(holder), library_(library)
  {
    join();
  }
  /// Registers an exported `tensor` of `owner`'s data, held by `holder`.
  tracked_view(const DLTensor& tensor, const shared_producer& owner, const char* holder) noexcept
      : tensor_(&tensor), owner_(&owner), holder_(holder)
  {
    join();
  }
  tracked_view(const tracked_view&) = delete;
  tracked_view& operator=(const tracked_view&) = delete;
  tracked_view(tracked_view&&) = delete;
  tracked_view& operator=(tracked_view&&) = delete;
  ~tracked_view()
  {
    detail::view_list& list = detail::tracked_views;
    list.lock();
    (prev_ != nullptr ? prev_->next_ : list.head) = next_;
    if (next_ != nullptr) { next_->prev_ = prev_; }
    list.unlock();
  }

  /// The view's node id, assigned on first use; unique in the process. Thread-safe.
  [[nodiscard]] std::uint64_t id() const noexcept;
  /// The library of the data, as registered, or null.
  [[nodiscard]] const char* library() const noexcept { return library_; }

 private:
  friend struct ownership_registry;

  void join() noexcept
  {
    detail::view_list& list = detail::tracked_views;
    list.lock();
    next_ = list.head;
    if (next_ != nullptr) { next_->prev_ = this; }
    list.head = this;
    list.unlock();
  }

  tracked_view* prev_{nullptr};
  tracked_view* next_{nullptr};
  const array* array_{nullptr};
  const DLTensor* tensor_{nullptr};
  const shared_producer* owner_{nullptr};
  const char* holder_{nullptr};
  const char* library_{nullptr};
  mutable std::atomic<std::uint64_t> id_{0};
};

/// A stream of the graph: where a buffer's data is ready, or what its release waits for.
struct stream_node {
  DLDevice device{kDLCPU, 0};
  std::uint64_t handle{0};
};

/// A live producer's data. Its layout is its first tracked view's (absent when no tracked view
/// holds it: a C++ caller's own `handoff::array`).
struct buffer_node {
  std::uint64_t id{0};
  const char* library{nullptr};  ///< the producer's top-level package, when the importer said
  std::optional<DLDevice> device;
  std::vector<std::int64_t> shape;
  std::optional<DLDataType> dtype;
  std::int64_t nbytes{0};
  long holders{0};  ///< references to the producer: views, exported tensors, pending work
  /// The streams its data is ready on: one per producer that holds it (views re-imported from a
  /// view keep their own bindings, and share the buffer).
  std::vector<stream_node> ready_on;
  std::vector<stream_node> released_after;
};

/// A tracked view of a buffer.
struct view_node {
  std::uint64_t id{0};
  std::uint64_t buffer{0};
  const char* holder{nullptr};
};

/// A consistent snapshot of the graph: buffers in order of first appearance.
struct ownership_graph {
  std::vector<buffer_node> buffers;
  std::vector<view_node> views;
};

/// Takes a snapshot of the tracked views and the buffers they hold. Thread-safe; registering views
/// waits while it copies.
[[nodiscard]] ownership_graph ownership_snapshot();

/// The ids of the tracked views alive now (cheaper than a snapshot). Thread-safe.
[[nodiscard]] std::vector<std::uint64_t> tracked_view_ids();

}  // namespace handoff
