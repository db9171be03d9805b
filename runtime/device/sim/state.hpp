// The simulated device's state: streams, events, allocations, captures and per-thread state, and
// the steps every backend call opens with (host-function and fault checks, handle lookups that
// record uses of destroyed handles, sticky errors). One mutex guards it.
#pragma once

#include "device/sim/ipc.hpp"
#include "device/sim/names.hpp"
#include "device/sim/work_queue.hpp"

#include <handoff/activity.hpp>
#include <handoff/detail/immovable.hpp>
#include <handoff/error.hpp>
#include <handoff/internal/sim.hpp>

#include <fmt/format.h>
#include <boost/container/small_vector.hpp>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace handoff::device {
namespace sim_detail {

/// Names the calling thread for per-thread state (its current device, its default stream). Unlike
/// std::thread::id, never reused after a thread ends: a new thread starts with nothing current and
/// its own default stream, as in CUDA, where that state is thread-local.
enum class thread_key : std::uint64_t {};
[[nodiscard]] thread_key this_thread_key() noexcept;

/// Keeps state per thread and frees it when the thread ends (CUDA destroys a thread's per-thread
/// default stream with it).
class thread_state_owner : handoff::detail::immovable {
 public:
  virtual ~thread_state_owner() = default;

  /// Called on the ending thread, from its exit, for each owner watched then.
  virtual void forget_thread(thread_key owner) noexcept = 0;
};

/// Starts calling `owner.forget_thread` at every thread's exit; unwatch before `owner` is destroyed.
void watch_thread_exits(thread_state_owner& owner);
void unwatch_thread_exits(thread_state_owner& owner) noexcept;

/// One backend call as its errors and violations name it: the operation key and its arguments,
/// formatted only when a message names them (formatting them costs more than most calls do).
class call : handoff::detail::immovable {
 public:
  virtual ~call() = default;

  [[nodiscard]] virtual std::string args() const = 0;

  std::string_view op;

 protected:
  explicit call(std::string_view operation) noexcept : op(operation) {}
};

/// A call with the arguments of `format`.
template <typename... Args>
class call_with final : public call {
 public:
  call_with(std::string_view operation, fmt::format_string<Args...> format, Args... args)
      : call(operation), format_(format), args_(args...)
  {}

  [[nodiscard]] std::string args() const override
  {
    return std::apply([this](const Args&... values) { return fmt::vformat(format_, fmt::make_format_args(values...)); },
                      args_);
  }

 private:
  fmt::string_view format_;  // checked against Args where the call is made
  std::tuple<Args...> args_;
};

/// Work for a stream: what runs, after how long, and whether it is a host function.
struct stream_work {
  std::function<void()> body;  // empty for markers
  std::chrono::nanoseconds delay{0};
  bool host_function{false};
};

/// One operation recorded by a capture: a node of the graph.
struct captured_op {
  stream_work what;
  int device{0};
  std::vector<std::size_t> deps;  // earlier operations of the same capture
};

/// A graph: the operations a capture recorded and how they depend on each other.
struct captured_graph {
  std::vector<captured_op> ops;
  // User objects the graph retains: each runs its release when the last reference (the graph's
  // handle, or a launch still running) is gone.
  std::vector<std::shared_ptr<void>> retained;
};

struct capture_info {
  std::uint64_t id{0};
  const void* origin{nullptr};  // the stream that began the capture
  bool invalidated{false};
  captured_graph graph;
};

enum class stream_kind { created, legacy, per_thread };

struct stream_state {
  int device{0};
  stream_kind kind{stream_kind::created};
  bool blocking{true};
  node_ptr tail;                            // the last work enqueued (or the gate of a hold)
  std::deque<node_ptr> queued;              // its operations not seen done yet, oldest first (no gates)
  std::vector<node_ptr> gates;              // the gates of the holds begun on it, until seen open
  std::shared_ptr<capture_info> capture;    // non-null while capturing
  std::optional<std::size_t> capture_tail;  // its last operation in the capture
};

struct event_state {
  int device{0};
  node_ptr fence;                          // the most recent record; null: never recorded
  std::shared_ptr<capture_info> capture;   // non-null when last recorded in a capture
  std::optional<std::size_t> captured_at;  // the operation it was recorded after, in that capture
  std::shared_ptr<shared_event> ipc;       // an interprocess event: its state in shared memory
};

/// Simulated allocations are host memory aligned as cudaMalloc's are.
inline constexpr std::align_val_t allocation_alignment{256};

struct allocation {
  std::size_t size{0};
  memory_kind kind{memory_kind::device};
  int device{0};
  bool free_pending{false};
  // Device memory other processes may map (its file); null for memory of another kind.
  std::shared_ptr<detail::shared_mapping> segment;
  int ipc_opens{0};        // memory another process shared, mapped here: open_ipc_memory's count
  bool registered{false};  // host memory register_host_memory mapped: not the simulator's to free
};

struct device_state {
  std::unique_ptr<stream_state> legacy;
  std::map<thread_key, std::unique_ptr<stream_state>> per_thread;
  std::vector<node_ptr> retired;    // tails of destroyed streams whose work may still run
  lane* host_functions{nullptr};    // the device's one host-function thread
  std::atomic<bool> halted{false};  // a sticky error poisoned the context: nothing more runs
  std::string sticky_error;         // its name, while halted
  std::uint64_t context_id{0};      // a new one after each reset
};

struct fault {
  int remaining{0};
  std::string error_name;
};

/// A report to the trace (see handoff/activity.hpp), prepared under the state's mutex and sent once
/// it is released: the trace's annotator may run code that calls the backend. Inert unless a launch
/// trace records when it is made.
struct activity_note {
  /// `uses` are copied only where a launch trace records.
  explicit activity_note(activity::kind kind, std::span<const activity::buffer_use> uses = {});

  /// Names `s` (whose handle is `h`) as the record's stream, and its device. Mutex held.
  void on_stream(const stream_state& s, std::uintptr_t h, sim_flavour flavour) noexcept;
  void on_device(int device, sim_flavour flavour) noexcept;
  /// Sends the record, if it is to be sent.
  void send() noexcept;

  bool armed{false};
  activity::record record;
  boost::container::small_vector<activity::buffer_use, 4> buffers;  // a launch's few: no allocation per note
};

/// Sends `note` when it goes, as a host wait of the time it lived, unless an exception ends it.
class blocked_timer {
 public:
  explicit blocked_timer(activity_note& note) noexcept
      : note_(note),
        started_(note.armed ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{}),
        uncaught_(std::uncaught_exceptions())
  {}
  blocked_timer(const blocked_timer&) = delete;
  blocked_timer& operator=(const blocked_timer&) = delete;
  blocked_timer(blocked_timer&&) = delete;
  blocked_timer& operator=(blocked_timer&&) = delete;
  ~blocked_timer()
  {
    if (!note_.armed || std::uncaught_exceptions() > uncaught_) { return; }
    note_.record.blocked_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - started_).count();
    note_.send();
  }

 private:
  activity_note& note_;
  std::chrono::steady_clock::time_point started_;
  int uncaught_;
};

}  // namespace sim_detail

struct sim_backend::impl final : sim_detail::thread_state_owner {
  using call = sim_detail::call;
  using stream_state = sim_detail::stream_state;
  using event_state = sim_detail::event_state;
  using node_ptr = sim_detail::node_ptr;

  struct open_hold {
    node_ptr gate;
    std::uintptr_t stream{0};       // the handle it was begun with, for messages
    sim_detail::thread_key holder;  // the thread that began it, which must end it
  };

  impl(std::vector<int> visible, sim_flavour f);
  impl(const impl&) = delete;
  impl& operator=(const impl&) = delete;
  impl(impl&&) = delete;
  impl& operator=(impl&&) = delete;
  ~impl() override;

  // --- opening a call ----------------------------------------------------------------------------

  /// The checks every throwing call makes before it looks at any state: not from inside a host
  /// function (cudaErrorNotPermitted, and a violation), then an injected fault.
  void open(const call& c);
  /// The same for a noexcept call; false (after logging) when it must not go on.
  bool open_quiet(const call& c) noexcept;
  /// Counts a call of `op` where the calling thread is the one counted (count_calls).
  void count_call(std::string_view op);

  [[nodiscard]] std::string_view backend_name() const noexcept;
  [[nodiscard]] device_error make_error(const call& c, std::string_view error_name, std::string_view text) const;
  [[noreturn]] void fail(const call& c, sim_detail::sim_error code, std::string_view detail = {}) const;
  /// Throws the device's sticky error, if it has one. Mutex held.
  void check_alive(const call& c, int device) const;
  /// Records a use the runtime leaves undefined. Mutex held.
  void record_violation(std::string what);

  // --- lookups (mutex held) ----------------------------------------------------------------------

  [[nodiscard]] int current_locked() const;
  /// The current device for a call that works on it: as in CUDA, the call gives the device a
  /// context (lazily, on first use) if it has none, and fails with its sticky error.
  int using_current(const call& c);
  /// set_current_device and push_current_device.
  void make_current(std::string_view op, int device, bool push);
  stream_state& per_thread_stream(sim_detail::thread_key owner, int device);
  /// Frees what `owner` had (its current device, pushes, per-thread default streams) when it ends.
  void forget_thread(sim_detail::thread_key owner) noexcept override;
  /// The stream behind a handle (default streams: the current device's), or nullptr.
  stream_state* find_stream(std::uintptr_t h);
  /// The stream behind `h`; fails (and records a violation if it was destroyed) when there is none.
  stream_state& stream(const call& c, stream_handle h);
  event_state& event(const call& c, event_handle h);
  /// A fresh handle value, never reused, so that a destroyed handle is always recognized.
  std::uintptr_t issue_handle() noexcept;

  template <class F>
  void for_each_stream(int device, F&& f)
  {
    auto& dev = devices[static_cast<std::size_t>(device)];
    f(*dev.legacy);
    for (auto& [owner, s] : dev.per_thread) { f(*s); }
    for (auto& [h, s] : streams) {
      if (s->device == device) { f(*s); }
    }
  }

  // --- work (mutex held) -------------------------------------------------------------------------

  /// CUDA's rule: while a blocking stream captures, touching its device's legacy stream is an
  /// error that invalidates the capture (the legacy stream would depend on captured work).
  void check_legacy_use(const call& c, const stream_state& s);
  /// CUDA's rule for the calls that could wait on captured work (queries and synchronizations of
  /// streams, events and devices): the calling thread's capture mode forbids them while a capture
  /// is under way (in global mode: any thread's; thread-local: its own), and such a call fails and
  /// invalidates the capture.
  void check_unsafe_call(const call& c);
  /// How work of `device` is submitted: skipped once the device is halted; host functions on its lane.
  sim_detail::work submission(int device, sim_detail::stream_work w);
  /// What the next operation of `s` waits for: its previous one, `extra`, and CUDA's implicit
  /// legacy-stream dependencies.
  std::vector<node_ptr> next_deps_locked(stream_state& s, node_ptr extra = nullptr);
  /// Appends work to `s` with CUDA's implicit legacy-stream dependencies.
  node_ptr enqueue_locked(stream_state& s, sim_detail::stream_work w, node_ptr extra = nullptr);
  /// Makes `n` the last operation of `s`, counted by pending().
  void append_locked(stream_state& s, node_ptr n);
  /// Records work into the capture of `s`; returns its operation index.
  std::size_t capture_locked(stream_state& s, sim_detail::stream_work w, std::optional<std::size_t> extra = {});
  /// The public entry point for stream work: checks, then captures or enqueues. Work enqueued (not
  /// captured: a graph's work runs when it is launched) is described to `note` when one is given.
  void enqueue(const call& c, stream_handle h, sim_detail::stream_work w, sim_detail::activity_note* note = nullptr);
  /// Keeps in `note` only the memory the allocation table holds (a copy's host side is not the
  /// device's to order). Mutex held.
  void keep_device_memory(sim_detail::activity_note& note) const;
  std::vector<node_ptr> device_tails_locked(int device);
  /// The hold of the calling thread that one of `targets` waits for, if any. Mutex held.
  [[nodiscard]] const open_hold* own_hold_before(const std::vector<node_ptr>& targets);
  /// Fails, rather than wait for ever, when one of `targets` waits for a hold the calling thread
  /// keeps: that thread cannot end it while it waits. Mutex held.
  void refuse_held_wait(const call& c, const std::vector<node_ptr>& targets);
  /// Blocks (mutex not held) until `target` is done, then fails if the device halted meanwhile.
  void wait_on_device(const call& c, int device, const std::vector<node_ptr>& targets);

  void* allocate_locked(const call& c, std::size_t bytes, memory_kind kind);
  /// Device memory in a shared memory file, so that other processes can map it (cudaMalloc's memory
  /// can be shared with cudaIpcGetMemHandle). Mutex held.
  void* allocate_shareable_locked(const call& c, std::size_t bytes, int device);
  void release_allocation(std::uintptr_t base) noexcept;
  /// Frees an allocation's memory (its shared memory file, or the heap's); the table entry is the caller's.
  static void free_memory(std::uintptr_t base, const sim_detail::allocation& info) noexcept;
  /// The watch over other processes' progress, started on first use. Mutex held.
  sim_detail::ipc_watch& watch();
  /// A shared interprocess event's record, in order after this process's earlier records of it.
  void signal_record(event_state& e, const node_ptr& reached);
  /// True when an interprocess event's latest record was made by another process (waits and queries
  /// then read the shared state); records a violation for an opened event its exporter destroyed.
  /// Mutex held.
  bool recorded_elsewhere(const call& c, const event_state& e);
  /// Fails the call unless `address` is an aligned 64-bit word of memory the device reaches (device
  /// memory, or host memory allocated pinned or registered), as cuStreamWriteValue64 requires. Mutex held.
  void require_device_word(const call& c, const void* address) const;
  /// Whether the shared state shows `record` reached (or its process ended, when it never will).
  static bool shared_record_reached(const sim_detail::shared_event& shared, std::uint64_t record) noexcept;

  sim_flavour flavour;
  int device_count;
  std::vector<int> node_devices;  // by ordinal: the simulated node's device each is

  /// The node's device that ordinal `device` of this process is (CUDA_VISIBLE_DEVICES's mapping).
  [[nodiscard]] int node_device(int device) const noexcept { return node_devices[static_cast<std::size_t>(device)]; }

  mutable std::mutex mutex;  // guards everything below except the faults and the pool
  std::vector<sim_detail::device_state> devices;
  std::unordered_map<std::uintptr_t, std::unique_ptr<stream_state>> streams;
  std::unordered_map<std::uintptr_t, std::unique_ptr<event_state>> events;
  std::unordered_set<std::uintptr_t> destroyed_streams;
  std::unordered_set<std::uintptr_t> destroyed_events;
  std::uintptr_t next_handle{0x5100};
  std::uint64_t next_capture_id{0};
  std::uint64_t next_context_id{0};
  std::vector<std::string> violations;
  std::vector<open_hold> holds;                                  // begun, not ended
  std::map<std::uintptr_t, sim_detail::allocation> allocations;  // by base address
  std::unordered_map<sim_detail::thread_key, int> current;       // the threads with a context current: its device
  // Each thread's current device before its pushes; nullopt where none was.
  std::unordered_map<sim_detail::thread_key, std::vector<std::optional<int>>> pushed;
  std::unordered_map<sim_detail::thread_key, capture_mode> capture_modes;  // the threads not in global mode
  struct open_capture {
    std::shared_ptr<sim_detail::capture_info> info;
    sim_detail::thread_key owner;  // the thread that began it
  };
  std::unordered_map<std::uint64_t, open_capture> open_captures;  // begun (all in global mode), not ended
  std::vector<bool> has_context;  // per device: used, so CUDA would have made its primary context
  // sim-rocm names each thread's default stream by a handle of its own (1 and 2 are not handles there).
  std::unordered_map<sim_detail::thread_key, std::uintptr_t> rocm_thread_streams;
  std::unordered_map<std::uintptr_t, sim_detail::thread_key> rocm_thread_stream_owner;

  std::mutex fault_mutex;  // guards the faults and the call counts
  std::unordered_map<std::string, sim_detail::fault> faults;
  // The thread whose calls are counted (count_calls), 0 for none; its counts by operation key.
  std::atomic<std::uint64_t> counting_thread{0};
  std::unordered_map<std::string_view, std::size_t> call_counts;

  std::atomic<std::chrono::nanoseconds::rep> copy_duration{0};  // how long each copy_async occupies its stream

  // Memory other processes shared, mapped here: (their pid, their file's serial) -> base address.
  std::map<std::pair<int, std::uint64_t>, std::uintptr_t> imported;
  std::unique_ptr<sim_detail::ipc_watch> ipc_watcher;  // stopped before the pool drains

  sim_detail::worker_pool pool;  // last: destroyed (drained) first
};

}  // namespace handoff::device
