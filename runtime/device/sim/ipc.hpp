// The simulated device across processes: device memory and interprocess events in shared memory
// files named by their handles, and a watch that holds a stream's work until another process's
// stream gets somewhere (a record, a written value).
#pragma once

#include "device/sim/work_queue.hpp"

#include <handoff/internal/shared_memory.hpp>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace handoff::device::sim_detail {

/// Device memory that other processes may map lives in a shared memory file: this header, then
/// the allocation's bytes at `data_offset`.
struct shared_allocation_header {
  std::uint64_t magic;
  std::array<std::byte, 16> token;  // a handle names this, so that a stale or forged one is refused
  std::uint64_t size;
  std::int32_t device;
};
inline constexpr std::size_t data_offset = 4096;  // the data keeps cudaMalloc's alignment (and a page's)

/// An interprocess event's state, in its shared memory file: each record takes the next number, and
/// the exporting process's device marks it reached, in order.
struct shared_event_state {
  std::uint64_t magic;
  std::array<std::byte, 16> token;
  std::int32_t device;
  std::int32_t pid;  // the process that created it
  std::uint64_t start_time;
  std::atomic<std::uint64_t> recorded;   // the number of the latest record
  std::atomic<std::uint64_t> completed;  // the latest record the device got to
  std::atomic<std::uint32_t> destroyed;  // its creator destroyed it: opened copies must not be used
};

/// An interprocess event of this process: made here (exporter) or opened from another's handle.
struct shared_event {
  detail::shared_mapping mapping;
  shared_event_state* state{nullptr};
  bool exporter{false};
  std::uint64_t serial{0};
  node_ptr last_signal;           // records reach the shared state in order (mutex of the backend held)
  std::uint64_t local_record{0};  // the latest record made in this process (0: none)
};

/// Holds work until a condition outside this process's graph holds: a thread polls the conditions
/// (backing off while nothing changes) and opens each one's latch once it holds.
class ipc_watch {
 public:
  explicit ipc_watch(worker_pool& pool);
  ipc_watch(const ipc_watch&) = delete;
  ipc_watch& operator=(const ipc_watch&) = delete;
  ipc_watch(ipc_watch&&) = delete;
  ipc_watch& operator=(ipc_watch&&) = delete;
  ~ipc_watch();

  /// A latch opened once `ready()` returns true (asked on the watch's thread, never under the
  /// backend's mutex).
  node_ptr when(std::function<bool()> ready);
  /// Opens every latch still held (the backend is going) and ends the thread. Idempotent.
  void stop() noexcept;

 private:
  void run();

  struct watched {
    node_ptr latch;
    std::function<bool()> ready;
  };
  worker_pool& pool_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<watched> watched_;
  bool stopping_{false};
  std::thread thread_;  // last: started once the rest exists
};

}  // namespace handoff::device::sim_detail
