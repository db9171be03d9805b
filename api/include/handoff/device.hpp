// The device interface: the one seam between the exchange core and an accelerator runtime.
#pragma once

#include <handoff/dlpack.h>
#include <handoff/detail/immovable.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace handoff::device {

/// A native stream (cudaStream_t, hipStream_t or a simulated stream) as the integer DLPack passes.
enum class stream_handle : std::uintptr_t {};
/// A native event (cudaEvent_t or a simulated event).
enum class event_handle : std::uintptr_t {};

/// The integer a handle is, for messages, maps and the native runtime's calls.
[[nodiscard]] constexpr std::uintptr_t raw(stream_handle handle) noexcept
{
  return static_cast<std::uintptr_t>(handle);
}
[[nodiscard]] constexpr std::uintptr_t raw(event_handle handle) noexcept
{
  return static_cast<std::uintptr_t>(handle);
}

/// An interprocess handle: CUDA's 64 opaque bytes (cudaIpcMemHandle_t, cudaIpcEventHandle_t), or a
/// backend's own description of shared memory; read only by the backend that made it.
struct ipc_handle {
  std::array<std::byte, 128> bytes{};
};

/// A device's UUID (cudaDeviceProp::uuid): what names one device in every process of a node, whose
/// ordinals differ where CUDA_VISIBLE_DEVICES (or HIP_VISIBLE_DEVICES) does.
using device_uuid = std::array<std::byte, 16>;

/// What kind of memory an address belongs to.
enum class memory_kind {
  unregistered,  ///< host memory the backend does not know (plain malloc)
  pinned_host,   ///< page-locked host memory registered with the backend (kDLCUDAHost/kDLROCMHost)
  device,        ///< device memory (kDLCUDA/kDLROCM)
  managed,       ///< unified memory (kDLCUDAManaged)
};

/// Attributes of an address, as cuPointerGetAttributes reports them.
struct pointer_attributes {
  memory_kind kind{memory_kind::unregistered};
  int device{-1};                 ///< owning ordinal; -1 for unregistered memory
  const void* base{nullptr};      ///< start of the allocation that contains the address
  std::size_t size{0};            ///< size of that allocation in bytes
  void* device_pointer{nullptr};  ///< the address usable from the current context
};

/// Whether a stream is capturing into a graph.
enum class capture_status { none, active, invalidated };

/// Which captures forbid the calling thread the calls that could wait on captured work (querying
/// or synchronizing a stream, an event or a device); such a call fails and invalidates the capture.
/// CUDA's cudaStreamCaptureMode, with its values.
enum class capture_mode {
  global = 0,             ///< any capture under way in global mode, on any thread (the default)
  thread_local_only = 1,  ///< the calling thread's own captures
  relaxed = 2,            ///< none
};

/// An accelerator runtime. Every call is checked: a failure throws `handoff::device_error` naming
/// the call, the backend's error name and its text. Calls are thread-safe. Streams, events and
/// allocations belong to the device that was current when they were created.
class backend : handoff::detail::immovable {
 public:
  virtual ~backend() = default;

  /// "cuda", "sim" or "sim-rocm".
  [[nodiscard]] virtual std::string_view name() const noexcept = 0;
  /// The DLPack device type of this backend's device memory (kDLCUDA or kDLROCM).
  [[nodiscard]] virtual DLDeviceType device_type() const noexcept = 0;
  [[nodiscard]] virtual int device_count() = 0;
  /// The calling thread's current device: its current context's, or with none current, the one
  /// the runtime would use (and would make a context current on, at the next call).
  [[nodiscard]] virtual int current_device() = 0;
  /// Whether a context of `device` is current on the calling thread; false while none is.
  [[nodiscard]] virtual bool device_is_current(int device) = 0;
  /// Selects `device` for the calling thread, as cudaSetDevice does (binding its primary context).
  virtual void set_current_device(int device) = 0;
  /// Makes `device` current on top of what was current, as the driver's context stack does: the
  /// previous context (none, a primary or a user-created one) and the runtime's selected device
  /// are restored by the matching pop, and no other device gets a context. device_guard pairs them.
  virtual void push_current_device(int device) = 0;
  /// Undoes the calling thread's latest push_current_device.
  virtual void pop_current_device() noexcept = 0;
  /// An id of `device`'s (primary) context, unique in the process: a reset of the context
  /// (cuDevicePrimaryCtxReset, as numba-cuda's cuda.close() does) gives it a new one, and what was
  /// made in the old one (events, streams, memory) is gone.
  [[nodiscard]] virtual std::uint64_t context_id(int device) = 0;
  /// The id (as context_id's) of the context current on the calling thread, which the events and
  /// streams it creates now belong to: a device's primary context, or one the application made and
  /// made current; 0 while none is.
  [[nodiscard]] virtual std::uint64_t current_context_id() = 0;

  /// The legacy default stream: implicitly synchronizes with every blocking stream of its device.
  [[nodiscard]] virtual stream_handle legacy_default_stream() const noexcept = 0;
  /// The calling thread's per-thread default stream (a blocking stream).
  [[nodiscard]] virtual stream_handle per_thread_default_stream() const noexcept = 0;
  /// Creates a stream on the current device.
  [[nodiscard]] virtual stream_handle create_stream(bool non_blocking) = 0;
  virtual void destroy_stream(stream_handle stream) noexcept = 0;
  /// The device a stream belongs to (a default stream belongs to the current device). `capturing`:
  /// whether the stream captures (stream_capture_status() is not `none`), where the caller has just
  /// asked, so that the backend need not ask again (CUDA refuses a capturing stream's device, and
  /// the refusal invalidates the capture); nullopt: the backend asks where it must.
  [[nodiscard]] virtual int stream_device(stream_handle stream, std::optional<bool> capturing = std::nullopt) = 0;
  /// False for streams created non-blocking, which do not synchronize with the legacy default.
  [[nodiscard]] virtual bool stream_is_blocking(stream_handle stream) = 0;
  /// A capture under way. The legacy default stream reports `active` while a blocking stream of
  /// its device captures: work on it would join, and invalidate, that capture.
  [[nodiscard]] virtual capture_status stream_capture_status(stream_handle stream) = 0;
  /// The id of the capture `stream` takes part in (cudaStreamGetCaptureInfo); 0 when it captures
  /// nothing. Streams that joined one capture share its id.
  [[nodiscard]] virtual std::uint64_t stream_capture_id(stream_handle stream) = 0;
  /// True when all work enqueued on `stream` is done (cudaStreamQuery). Never blocks.
  [[nodiscard]] virtual bool query_stream(stream_handle stream) = 0;
  /// Blocks the calling thread until all work on `stream` is done.
  virtual void synchronize_stream(stream_handle stream) = 0;
  /// Blocks the calling thread until all work on the current device is done.
  virtual void synchronize_device() = 0;
  /// Sets the calling thread's capture mode (cudaThreadExchangeStreamCaptureMode); returns the
  /// mode it replaces. capture_mode_guard pairs the two calls.
  virtual capture_mode exchange_capture_mode(capture_mode mode) = 0;

  /// Creates an event on the current device, timing disabled.
  [[nodiscard]] virtual event_handle create_event() = 0;
  virtual void destroy_event(event_handle event) noexcept = 0;
  /// Captures the work enqueued so far on `stream`. The event and the stream must share a device.
  virtual void record_event(event_handle event, stream_handle stream) = 0;
  /// True once the work captured by the most recent record is done (or if never recorded).
  [[nodiscard]] virtual bool query_event(event_handle event) = 0;
  virtual void synchronize_event(event_handle event) = 0;
  /// Work enqueued on `stream` after this call waits for the event's most recent record, as of
  /// this call. Never blocks the host.
  virtual void stream_wait_event(stream_handle stream, event_handle event) = 0;

  /// Attributes of any address; unregistered host memory is reported as such, not as an error.
  [[nodiscard]] virtual pointer_attributes attributes(const void* ptr) = 0;

  /// Allocates device memory on the current device (stream-ordered on `stream`).
  [[nodiscard]] virtual void* allocate(std::size_t bytes, stream_handle stream) = 0;
  /// Frees memory from `allocate` once the work enqueued on `stream` so far is done.
  virtual void deallocate(void* ptr, stream_handle stream) noexcept = 0;
  /// Allocates page-locked host memory (memory_kind::pinned_host) on the current device, as
  /// cudaMallocHost: not stream-ordered.
  [[nodiscard]] virtual void* allocate_pinned_host(std::size_t bytes) = 0;
  /// Allocates managed memory (memory_kind::managed) on the current device, as cudaMallocManaged:
  /// not stream-ordered.
  [[nodiscard]] virtual void* allocate_managed(std::size_t bytes) = 0;
  /// Frees memory from allocate_pinned_host or allocate_managed once all work on its device is
  /// done, blocking until then (cudaFreeHost, cudaFree).
  virtual void free_sync(void* ptr) = 0;
  /// Enqueues a copy of `bytes` between any two addresses the backend can reach.
  virtual void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) = 0;
  /// Runs `release(data)` once the graph `stream` is capturing into is gone: destroyed, with every
  /// launch of it done (a user object the graph retains: cudaUserObjectCreate and
  /// cudaGraphRetainUserObject). `release` runs on a backend thread and must not call the backend.
  /// @throws device_error when `stream` takes part in no capture of its own (the legacy stream while
  ///         a blocking stream captures included); `release` then never runs.
  virtual void release_with_capture(stream_handle stream, void (*release)(void* data) noexcept, void* data) = 0;
  /// Enqueues a host function; it runs on a backend thread once earlier work on `stream` is done,
  /// and must not call into the backend.
  virtual void launch_host_func(stream_handle stream, void (*fn)(void*), void* user_data) = 0;

  // --- across processes (each throws device_error cudaErrorNotSupported where the backend has none) ---

  /// A handle another process of the node opens to map the allocation whose base is `base`
  /// (cudaIpcGetMemHandle; for memory of a shareable stream-ordered pool, cuMemPoolExportPointer).
  /// @throws device_error for memory that cannot be shared (not the base of device memory; a pool
  ///         that was not made shareable).
  [[nodiscard]] virtual ipc_handle ipc_memory_handle(void* base);
  /// The UUID of device `device` (an ordinal of this process): how a handle names its device to a
  /// process that numbers the node's devices otherwise.
  [[nodiscard]] virtual device_uuid uuid(int device);
  /// Maps memory another process shared on the current device (cudaIpcOpenMemHandle with lazy peer
  /// access); undone with close_ipc_memory. @throws device_error as the runtime refuses it.
  [[nodiscard]] virtual void* open_ipc_memory(const ipc_handle& handle);
  /// Unmaps memory from open_ipc_memory (cudaIpcCloseMemHandle), once the work using it is done.
  virtual void close_ipc_memory(void* ptr) noexcept;
  /// An event another process can wait for (cudaEventCreateWithFlags with cudaEventInterprocess and
  /// cudaEventDisableTiming, as CUDA requires), on the current device; destroyed with destroy_event.
  [[nodiscard]] virtual event_handle create_ipc_event();
  /// The handle of an event from create_ipc_event (cudaIpcGetEventHandle).
  [[nodiscard]] virtual ipc_handle ipc_event_handle(event_handle event);
  /// Opens an event another process shared (cudaIpcOpenEventHandle): it records, queries and is
  /// waited for like a local event; destroyed with destroy_event.
  [[nodiscard]] virtual event_handle open_ipc_event(const ipc_handle& handle);
  /// Maps `bytes` of host memory at `ptr` for the device (cudaHostRegister, portable and mapped) and
  /// returns the address the device uses for it; undone with unregister_host_memory.
  [[nodiscard]] virtual void* register_host_memory(void* ptr, std::size_t bytes);
  virtual void unregister_host_memory(void* ptr) noexcept;
  /// Enqueues a write of `value` to the 64-bit word at device address `address` (cuStreamWriteValue64).
  virtual void stream_write_value(stream_handle stream, void* address, std::uint64_t value);
  /// Enqueues a wait until the 64-bit word at `address` is at least `value` (cuStreamWaitValue64,
  /// CU_STREAM_WAIT_VALUE_GEQ): the stream's later work waits, the host never does.
  virtual void stream_wait_value(stream_handle stream, void* address, std::uint64_t value);

  /// Starts (`on`) or stops reporting this backend's work through handoff::activity::report while
  /// handoff::activity::recording(); calls pair up, and nest. Returns why it cannot, or an empty string
  /// when it does. The default reports nothing.
  [[nodiscard]] virtual std::string watch_activity(bool on)
  {
    (void)on;
    return std::string{name()} + " reports no device activity";
  }
};

}  // namespace handoff::device
