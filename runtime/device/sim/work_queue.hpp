// The simulated device's work queue: every piece of stream work (a copy, a host function, a fill,
// an event record, a wait) is a node in a dependency graph. A node depends on the previous node of
// its stream (in-order queues), on the event it waits for, and on the implicit dependencies of the
// legacy default stream. A node runs on a pool of worker threads once its dependencies are done; a
// delay is an Asio timer, so sleeping work never holds a worker. Dependencies always point to nodes
// submitted earlier, so the graph is acyclic and every node completes, unless it waits for a gate
// (a test's hold on a stream) that is never opened.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace handoff::device::sim_detail {

struct node;
using node_ptr = std::shared_ptr<node>;

/// A host-function lane: host functions submitted to one lane run one at a time, in the order they
/// become ready, as CUDA runs a device's host functions on one thread.
class lane;

/// What a node does once its dependencies are done.
struct work {
  std::function<void()> body;  ///< empty for markers (event records, waits, joins)
  std::chrono::nanoseconds delay{0};
  /// Set when the device's context is poisoned by a sticky error: the body is skipped (the node
  /// still completes, so that nothing waits for ever), as a faulted context runs nothing more.
  const std::atomic<bool>* halted{nullptr};
  lane* serial{nullptr};  ///< a host function: runs on this lane, marked as inside a host function
};

/// True on a thread while it runs a host function (to refuse runtime calls made from one).
[[nodiscard]] bool inside_host_function() noexcept;

[[nodiscard]] bool is_done(const node_ptr& n);
/// Blocks until `n` (null: nothing) is done.
void wait_for(const node_ptr& n);

/// Who holds a gate: the simulator's thread_key of the thread whose hold it is (never 0).
using gate_holder = std::uint64_t;
inline constexpr gate_holder any_holder = 0;

/// True while `n` is a gate that has not been opened.
[[nodiscard]] bool is_closed_gate(const node_ptr& n);

/// Runs ready nodes on an io_context served by a few threads.
class worker_pool {
 public:
  worker_pool();
  worker_pool(const worker_pool&) = delete;
  worker_pool& operator=(const worker_pool&) = delete;
  worker_pool(worker_pool&&) = delete;
  worker_pool& operator=(worker_pool&&) = delete;
  ~worker_pool();

  /// Waits for every submitted node, then stops and joins the workers. Idempotent.
  void shutdown() noexcept;

  /// A new lane for host functions, owned by the pool.
  [[nodiscard]] lane& make_lane();

  /// A node that does `w` once every node in `deps` (null entries ignored) is done.
  node_ptr submit(work w, const std::vector<node_ptr>& deps);

  /// A gate: a node that does nothing and completes once `open_gate` opened it and every node in
  /// `deps` is done, so that work submitted after it, depending on it, waits until it is opened.
  node_ptr submit_gate(gate_holder holder, const std::vector<node_ptr>& deps);
  /// Opens `gate`. Idempotent.
  void open_gate(const node_ptr& gate);
  /// A closed gate of `holder` (any_holder: of any) that `target` waits for, directly or through
  /// other nodes; null when there is none. Submissions and openings must not run meanwhile (the
  /// simulator's mutex).
  [[nodiscard]] node_ptr closed_gate_before(const node_ptr& target, gate_holder holder);

 private:
  struct state;
  std::unique_ptr<state> state_;
};

}  // namespace handoff::device::sim_detail
