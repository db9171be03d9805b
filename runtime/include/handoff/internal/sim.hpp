// Internal: the simulated accelerator ("sim", "sim-rocm"), a device that runs on the CPU with CUDA's
// stream semantics, and the hooks the tests and the Python `handoff.sim` module drive it with
// (holds on streams, delayed writes, faults, captures). Applications make one through device::make_backend.
#pragma once

#include <handoff/activity.hpp>
#include <handoff/device.hpp>

#include <chrono>
#include <cstddef>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace handoff::device {

/// Which runtime a simulated device imitates: its DLPack device type, its stream numbering and the
/// names of its errors.
enum class sim_flavour {
  cuda,  ///< "sim": kDLCUDA; legacy default stream 1 (also 0), per-thread default stream 2
  rocm,  ///< "sim-rocm": kDLROCM; default (null) stream 0; 1 and 2 are not stream handles
};

namespace sim_detail {
struct captured_graph;
struct node;
}  // namespace sim_detail

class sim_backend;

/// A hold on a simulated stream (sim_backend::hold): while it is held, nothing enqueued on the
/// stream after the hold began runs. Ends (the held work runs) at release() or destruction. Move-only;
/// it must not outlive its backend.
class sim_hold {
 public:
  sim_hold() noexcept = default;
  sim_hold(sim_hold&& other) noexcept;
  sim_hold& operator=(sim_hold&& other) noexcept;
  sim_hold(const sim_hold&) = delete;
  sim_hold& operator=(const sim_hold&) = delete;
  ~sim_hold();

  /// Ends the hold: the work enqueued on the stream since it began runs. Idempotent. A hold ends
  /// on the thread that began it; ending it elsewhere is recorded in sim_backend::violations().
  void release() noexcept;
  /// True until release().
  [[nodiscard]] bool active() const noexcept { return gate_ != nullptr; }

 private:
  friend class sim_backend;
  sim_hold(sim_backend& sim, std::shared_ptr<sim_detail::node> gate) noexcept;

  sim_backend* sim_{nullptr};
  std::shared_ptr<sim_detail::node> gate_;
};

/// A graph captured from a simulated stream (cudaGraph_t after cudaStreamEndCapture). Each
/// sim_backend::launch_graph submits a fresh copy of its operations, so it can be launched any
/// number of times (the instantiation CUDA asks for is part of each launch). Copies share the graph.
class sim_graph {
 public:
  /// How many operations the capture recorded (work, host functions, event records and waits).
  [[nodiscard]] std::size_t size() const noexcept;

 private:
  friend class sim_backend;
  std::shared_ptr<const sim_detail::captured_graph> graph_;
};

/// A simulated accelerator with `device_count` devices. Memory is host memory owned by a simulated
/// device and answered for by an allocation table; streams are asynchronous in-order queues run by
/// a pool of worker threads; events, waits, the legacy and per-thread default streams and graph
/// capture follow CUDA's rules. Errors carry CUDA's names ("sim") or HIP's ("sim-rocm").
///
/// Strict where CUDA is: host functions run one at a time on a device's one host-function lane and
/// may not call the backend (cudaErrorNotPermitted); a sticky error halts its device for good; a
/// call that takes a destroyed stream or event fails with cudaErrorInvalidResourceHandle
/// (hipErrorInvalidHandle), and the use, which CUDA leaves undefined, is recorded (violations()).
/// Tests order races with hold() instead of timing them.
///
/// @note Every call is thread-safe. The destructor waits for all enqueued work to finish, then
///       frees every allocation still in the table; it never throws.
class sim_backend final : public backend {
 public:
  /// The most devices a simulated backend may have.
  static constexpr int max_devices = 64;

  /// A process's view of a simulated node of `max_devices` devices: its ordinals are the node's
  /// devices `visible` lists, in that order, as CUDA_VISIBLE_DEVICES makes them; empty: the first
  /// `device_count`. A device's uuid() and the handles of its memory name the node's device.
  /// @throws handoff::value_error when `device_count` is not in [1, max_devices], or `visible` is
  ///         not `device_count` distinct devices of the node.
  sim_backend(int device_count, sim_flavour flavour, std::vector<int> visible = {});
  ~sim_backend() override;
  sim_backend(const sim_backend&) = delete;
  sim_backend& operator=(const sim_backend&) = delete;
  sim_backend(sim_backend&&) = delete;
  sim_backend& operator=(sim_backend&&) = delete;

  // --- backend ---------------------------------------------------------------------------------
  [[nodiscard]] std::string_view name() const noexcept override;
  [[nodiscard]] DLDeviceType device_type() const noexcept override;
  [[nodiscard]] int device_count() override;
  [[nodiscard]] int current_device() override;
  [[nodiscard]] bool device_is_current(int device) override;
  void set_current_device(int device) override;
  void push_current_device(int device) override;
  void pop_current_device() noexcept override;
  [[nodiscard]] std::uint64_t context_id(int device) override;
  [[nodiscard]] std::uint64_t current_context_id() override;
  [[nodiscard]] stream_handle legacy_default_stream() const noexcept override;
  /// "sim": 2 on every thread. "sim-rocm": a value > 2 that names the calling thread's stream.
  [[nodiscard]] stream_handle per_thread_default_stream() const noexcept override;
  [[nodiscard]] stream_handle create_stream(bool non_blocking) override;
  void destroy_stream(stream_handle stream) noexcept override;
  [[nodiscard]] int stream_device(stream_handle stream, std::optional<bool> capturing = std::nullopt) override;
  [[nodiscard]] bool stream_is_blocking(stream_handle stream) override;
  [[nodiscard]] bool query_stream(stream_handle stream) override;
  [[nodiscard]] capture_status stream_capture_status(stream_handle stream) override;
  [[nodiscard]] std::uint64_t stream_capture_id(stream_handle stream) override;
  void synchronize_stream(stream_handle stream) override;
  void synchronize_device() override;
  capture_mode exchange_capture_mode(capture_mode mode) override;
  [[nodiscard]] event_handle create_event() override;
  void destroy_event(event_handle event) noexcept override;
  void record_event(event_handle event, stream_handle stream) override;
  [[nodiscard]] bool query_event(event_handle event) override;
  void synchronize_event(event_handle event) override;
  void stream_wait_event(stream_handle stream, event_handle event) override;
  [[nodiscard]] pointer_attributes attributes(const void* ptr) override;
  [[nodiscard]] void* allocate(std::size_t bytes, stream_handle stream) override;
  void deallocate(void* ptr, stream_handle stream) noexcept override;
  [[nodiscard]] void* allocate_pinned_host(std::size_t bytes) override;
  [[nodiscard]] void* allocate_managed(std::size_t bytes) override;
  /// Frees any allocation of this backend (device memory too) once all work on its device is done,
  /// waiting for it; while that work waits for a hold (hold()), without waiting.
  void free_sync(void* ptr) override;
  void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) override;
  void release_with_capture(stream_handle stream, void (*release)(void* data) noexcept, void* data) override;
  void launch_host_func(stream_handle stream, void (*fn)(void*), void* user_data) override;
  /// The simulator reports its work whenever activity::recording(): nothing to start.
  [[nodiscard]] std::string watch_activity(bool on) override;

  // --- across processes: device memory lives in shared memory files named by its handles ---------
  /// Device memory from `allocate` can be shared (as cudaMalloc's): other kinds cannot
  /// (cudaErrorInvalidValue), nor memory mapped from another process.
  [[nodiscard]] ipc_handle ipc_memory_handle(void* base) override;
  /// The node's device `n` has the UUID whose first bytes spell "handoff-sim" and whose last four are
  /// `n`, big-endian.
  [[nodiscard]] device_uuid uuid(int device) override;
  /// Refused as CUDA refuses it: in the process that made the handle (cudaErrorDeviceUninitialized),
  /// memory that was freed or whose process ended (cudaErrorMapBufferObjectFailed), a handle that
  /// names no memory of this node (cudaErrorInvalidResourceHandle), on another device than the
  /// memory's (simulated devices have no peer access: cudaErrorPeerAccessUnsupported). Opened again
  /// in the same process it gives the same address and counts the opens, each closed once.
  [[nodiscard]] void* open_ipc_memory(const ipc_handle& handle) override;
  void close_ipc_memory(void* ptr) noexcept override;
  [[nodiscard]] event_handle create_ipc_event() override;
  /// cudaErrorInvalidResourceHandle for an event not made by create_ipc_event.
  [[nodiscard]] ipc_handle ipc_event_handle(event_handle event) override;
  /// A wait on the opened event holds the waiting stream until the exporting process's stream
  /// reaches the record; using it after its exporter destroyed it is a violation.
  [[nodiscard]] event_handle open_ipc_event(const ipc_handle& handle) override;
  [[nodiscard]] void* register_host_memory(void* ptr, std::size_t bytes) override;
  void unregister_host_memory(void* ptr) noexcept override;
  /// The address must be memory the device reaches (device memory, or host memory allocated pinned
  /// or registered): else cudaErrorInvalidValue.
  void stream_write_value(stream_handle stream, void* address, std::uint64_t value) override;
  void stream_wait_value(stream_handle stream, void* address, std::uint64_t value) override;

  /// An event with CUDA's flags (cudaEventCreateWithFlags): an interprocess event must also disable
  /// timing (cudaErrorInvalidValue otherwise). Simulated events never time: a timing event is a
  /// plain one.
  [[nodiscard]] event_handle create_event_with_flags(bool interprocess, bool disable_timing);

  // --- simulation extras -----------------------------------------------------------------------
  [[nodiscard]] sim_flavour flavour() const noexcept;

  /// The operation names `inject_fault` accepts: the throwing backend calls ("record_event",
  /// "create_event", "stream_wait_event", "attributes", "set_current_device", ...) and the
  /// extras below ("enqueue_fill", "begin_capture", ...).
  [[nodiscard]] static std::span<const std::string_view> fault_operations() noexcept;

  /// Makes the next `count` calls of `operation` throw `handoff::device_error` named `error_name`
  /// (e.g. "cudaErrorLaunchFailure") before they change any state. A later call for the same
  /// operation replaces the earlier one; `count == 0` removes it.
  /// @throws handoff::value_error for an unknown operation or a negative count.
  void inject_fault(std::string operation, int count, std::string error_name);
  /// Removes every injected fault.
  void clear_faults() noexcept;

  /// Counts the calls the calling thread makes from now on, by operation (the keys
  /// fault_operations() lists, and the few that cannot fail), until `count_calls(false)`; starting
  /// clears the counts. For tests that pin what an exchange asks of the device (each operation is
  /// one or two driver calls on a GPU: "current_device" stands for the thread's current context).
  /// @throws handoff::value_error when a count is under way already (one at a time).
  void count_calls(bool on);
  /// The counts since `count_calls(true)`.
  [[nodiscard]] std::map<std::string, std::size_t, std::less<>> call_counts();

  /// Enqueues on `stream`: wait `delay` (without holding a worker thread), then write `pattern`
  /// repeatedly over `bytes` bytes at `dst`. `bytes` must be a multiple of the pattern's size.
  /// Returns at once; the pattern is copied.
  void enqueue_fill_bytes(stream_handle stream, void* dst, std::size_t bytes, std::span<const std::byte> pattern,
                          std::chrono::nanoseconds delay = {});

  /// Enqueues on `stream`: wait `delay`, then set `count` elements at `dst` to `value`.
  /// e.g. `sim.enqueue_fill(s, floats, n, 1.0f, std::chrono::milliseconds{200})`.
  template <class T>
  requires std::is_trivially_copyable_v<T>
  void enqueue_fill(stream_handle stream, T* dst, std::size_t count, const T& value,
                    std::chrono::nanoseconds delay = {})
  {
    enqueue_fill_bytes(stream, dst, count * sizeof(T), std::as_bytes(std::span<const T, 1>{&value, 1}), delay);
  }

  /// Enqueues on `stream` a wait of `duration` (the stream's later work starts after it).
  void enqueue_sleep(stream_handle stream, std::chrono::nanoseconds duration);

  /// Enqueues on `stream` a kernel named `kernel` (interned where a launch trace records it) that takes
  /// `delay` and uses `buffers` as each says. It changes no memory: a launch trace records what it
  /// reads and writes, and the race detector checks that.
  void launch_kernel(stream_handle stream, const char* kernel, std::span<const activity::buffer_use> buffers,
                     std::chrono::nanoseconds delay = {});

  /// The error name of a wait that the calling thread's own hold would make endless.
  static constexpr const char* hold_deadlock_error = "handoffErrorHoldDeadlock";

  /// Holds `stream` until the returned hold ends: nothing enqueued on it from now on runs until
  /// then, so that a test holds a producer exactly as long as its assertion needs, on any machine.
  /// The hold is itself an operation of the stream, enqueued now: work enqueued before it is not
  /// held (it may be running already) and the hold takes effect after it. Any stream may be held,
  /// the default streams included; a held legacy stream also holds what CUDA's implicit
  /// synchronization makes wait for it (the later work of blocking streams). Holds nest: the work
  /// runs once every hold it is behind has ended.
  ///
  /// A blocking call on the thread that began the hold (synchronize_stream, synchronize_event,
  /// synchronize_device, reset_device) that would wait for held work can never return: it fails
  /// instead with device_error hold_deadlock_error. Other threads' waits just wait, but free_sync,
  /// which a deleter may call while it holds what the holder needs (Python's GIL), returns at once
  /// on any thread while the device's work waits for a hold, and frees once that work is done.
  /// @throws device_error as an enqueue would (a destroyed stream: cudaErrorInvalidResourceHandle),
  ///         and cudaErrorStreamCaptureUnsupported for a capturing stream (its work runs at launches).
  [[nodiscard]] sim_hold hold(stream_handle stream);
  /// How many operations enqueued on `stream` are not done yet (work, host functions, event
  /// records and waits, graph launches; a hold's own place in the stream is not counted).
  [[nodiscard]] std::size_t pending(stream_handle stream);
  /// True while a hold begun on `stream` is active.
  [[nodiscard]] bool held(stream_handle stream);
  /// True while the last operation enqueued on `stream` (holds aside) cannot run before an active
  /// hold ends: one on `stream` itself, or one it waits for through other streams, events and CUDA's
  /// implicit synchronization. An answer of the work's dependencies, not of its timing: what a test
  /// asserts to show that a consumer waits for a held producer.
  [[nodiscard]] bool waits_for_hold(stream_handle stream);
  /// Waits for all the work enqueued on every device that does not wait for an active hold: what
  /// can run has run when it returns, what is held has not. For a test's negative assertion inside
  /// a hold ("nothing was freed, written or read yet"), in place of a sleep.
  void synchronize_unheld();
  /// How many holds the calling thread keeps active.
  [[nodiscard]] std::size_t holds_of_this_thread();

  /// Makes every later `copy_async` take `duration` on its stream, as a real copy takes time
  /// (default: none): it reads its source when it starts and its bytes land when it ends, so a
  /// reader ordered before a copy always sees the destination unwritten.
  /// @throws handoff::value_error for a negative duration.
  void set_copy_duration(std::chrono::nanoseconds duration);

  /// Starts capturing `stream` into a graph (cudaStreamBeginCapture, global mode). Work enqueued
  /// on a capturing stream, host functions included, is recorded as a node of the graph, not run;
  /// streams that wait on an event recorded in the capture join it. While a blocking stream
  /// captures, any use of its device's legacy default stream fails with
  /// cudaErrorStreamCaptureImplicit and invalidates the capture; synchronizing a capturing stream or
  /// its device fails with cudaErrorStreamCaptureUnsupported. The capture is in global mode: until
  /// it ends, a thread not in relaxed mode (exchange_capture_mode) that queries or synchronizes any
  /// stream, event or device fails with cudaErrorStreamCaptureUnsupported and invalidates it.
  void begin_capture(stream_handle stream);
  /// Ends the capture begun on `stream` for it and every stream that joined it.
  /// @return the captured graph: its work runs only when it is launched, once per launch.
  /// @throws device_error cudaErrorStreamCaptureInvalidated when the capture was invalidated.
  [[nodiscard]] sim_graph end_capture(stream_handle stream);
  /// Enqueues a run of `graph` on `stream` (cudaGraphLaunch): its operations start after the
  /// stream's earlier work, in their captured order, and the stream's later work waits for all.
  void launch_graph(const sim_graph& graph, stream_handle stream);

  /// Poisons `device`'s context with a sticky error named `error_name` (e.g.
  /// "cudaErrorIllegalAddress"), as a faulting kernel does: every later call that touches the
  /// device fails with it, and work already queued there, host functions included, never runs.
  /// @throws handoff::value_error for a device that does not exist or an empty name.
  void inject_sticky_fault(int device, std::string error_name);
  /// Makes `device` usable again. CUDA has no such thing short of a new process: for tests only.
  void clear_sticky_fault(int device);
  /// Resets `device`'s context as cuDevicePrimaryCtxReset does (numba-cuda's cuda.close()): waits
  /// for its work, then destroys its streams, events and allocations; its next use gets a new
  /// context (context_id). A later use of a handle made before is a violation, as in CUDA.
  /// @throws handoff::value_error for a device that does not exist.
  void reset_device(int device);

  /// What the program did that CUDA leaves undefined or forbids without always saying so: a use of
  /// a destroyed stream or event (which still fails with an invalid-handle error here), a second
  /// destruction, a runtime call from inside a host function, a hold ended on another thread.
  [[nodiscard]] std::vector<std::string> violations();
  void clear_violations() noexcept;

  /// The devices that have a context: those selected (set_current_device, push_current_device) or
  /// used through the current device (default streams, creating streams or events, allocating),
  /// as CUDA creates a device's primary context. Asking which device is current creates none.
  [[nodiscard]] std::vector<int> devices_with_context();
  /// How many allocations the table holds (deferred frees count until they have run).
  [[nodiscard]] std::size_t live_allocations();
  /// How many threads the simulator keeps state for (a current device, pushed devices, per-thread
  /// default streams). A thread's state is freed when it ends, as CUDA's is.
  [[nodiscard]] std::size_t threads_with_state();

 private:
  friend class sim_hold;
  void end_hold(const std::shared_ptr<sim_detail::node>& gate) noexcept;

  struct impl;
  std::unique_ptr<impl> impl_;
};

/// The simulated backend behind `b`, or nullptr when `b` is not one.
[[nodiscard]] sim_backend* as_sim(backend& b) noexcept;

}  // namespace handoff::device
