// The ownership graph: which buffers are alive, which views hold them, which streams they wait on.
#pragma once

#include <handoff/dlpack.h>
#include <handoff/array.hpp>

#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

namespace handoff {

/// A view's node in the ownership graph for as long as it lives: each holder of a producer that the
/// graph shows (a `handoff.Array`, an exported DLPack tensor) embeds one. Registering and leaving
/// take a short spin lock, so that the graph is always kept. The described view must outlive this
/// object and stay at its address.
class tracked_view {
 public:
  /// Registers `view`, held by `holder` (a static string, e.g. "handoff.Array").
  tracked_view(const array& view, const char* holder) noexcept;
  /// Registers an exported `tensor` of `owner`'s data, held by `holder`.
  tracked_view(const DLTensor& tensor, const producer_ref& owner, const char* holder) noexcept;
  tracked_view(const tracked_view&) = delete;
  tracked_view& operator=(const tracked_view&) = delete;
  tracked_view(tracked_view&&) = delete;
  tracked_view& operator=(tracked_view&&) = delete;
  ~tracked_view();

  /// The view's node id, assigned on first use; unique in the process. Thread-safe.
  [[nodiscard]] std::uint64_t id() const noexcept;

 private:
  friend struct ownership_registry;
  tracked_view* prev_{nullptr};
  tracked_view* next_{nullptr};
  const array* array_{nullptr};
  const DLTensor* tensor_{nullptr};
  const producer_ref* owner_{nullptr};
  const char* holder_{nullptr};
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
  std::optional<stream_node> ready_on;
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
