// The CUDA backend: the runtime API (linked statically) for everything, and the few driver entry
// points it needs (pointer attributes, the current context) looked up at run time, so the library
// never links libcuda and loads on machines without a driver.
#include "device/cuda/cuda_backend.hpp"
#ifdef HANDOFF_HAS_CUPTI
#include "device/cuda/cupti_activity.hpp"
#include "device/cuda/driver_entry.hpp"
#endif

#include "log/logger.hpp"

#include <handoff/error.hpp>

#include <cudaTypedefs.h>  // PFN_* driver prototypes; header only, nothing is linked
#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace handoff::device::cuda {
namespace {

[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line)
{
  (void)cudaGetLastError();  // clear a non-sticky error so later calls do not report it again
  const char* name = cudaGetErrorName(status);
  const char* text = cudaGetErrorString(status);
  throw device_error("cuda", name, fmt::format("{} failed at {}:{}: {}: {}", call, file, line, name, text));
}

// A query's answer (cudaStreamQuery, cudaEventQuery): true when the work is done, false while it is
// not ready; any other status throws as HANDOFF_CUDA_TRY does.
bool query_done(cudaError_t status, const char* call, const char* file, int line)
{
  if (status == cudaErrorNotReady) { return false; }
  if (status != cudaSuccess) [[unlikely]] { throw_cuda_error(status, call, file, line); }
  return true;
}

}  // namespace
}  // namespace handoff::device::cuda

/// Checks a CUDA runtime query: whether the work it asks about is done (query_done).
#define HANDOFF_CUDA_QUERY_DONE(call) ::handoff::device::cuda::query_done((call), #call, __FILE__, __LINE__)

/// Checks a CUDA runtime call; a failure throws handoff::device_error with the call, file:line,
/// the error's name and its text.
#define HANDOFF_CUDA_TRY(call)                                                               \
  do {                                                                                       \
    const cudaError_t handoff_status_ = (call);                                              \
    if (handoff_status_ != cudaSuccess) [[unlikely]] {                                       \
      ::handoff::device::cuda::throw_cuda_error(handoff_status_, #call, __FILE__, __LINE__); \
    }                                                                                        \
  } while (false)

namespace handoff::device::cuda {
namespace {

/// The driver functions the backend calls, from cudaGetDriverEntryPointByVersion.
struct driver_api {
  PFN_cuPointerGetAttributes_v7000 pointer_get_attributes{nullptr};
  PFN_cuCtxGetCurrent_v4000 ctx_get_current{nullptr};
  PFN_cuCtxGetDevice_v2000 ctx_get_device{nullptr};
  PFN_cuCtxPushCurrent_v4000 ctx_push_current{nullptr};
  PFN_cuCtxPopCurrent_v4000 ctx_pop_current{nullptr};
  PFN_cuDeviceGet_v2000 device_get{nullptr};
  PFN_cuDevicePrimaryCtxRetain_v7000 primary_ctx_retain{nullptr};
  PFN_cuGetErrorName_v6000 get_error_name{nullptr};
  PFN_cuGetErrorString_v6000 get_error_string{nullptr};
  PFN_cuThreadExchangeStreamCaptureMode_v10010 thread_exchange_capture_mode{nullptr};
  PFN_cuStreamGetDevice_v12080 stream_get_device{nullptr};
  PFN_cuStreamGetCtx_v9020 stream_get_ctx{nullptr};
  PFN_cuStreamIsCapturing_v10000 stream_is_capturing{nullptr};
  PFN_cuCtxGetId_v12000 ctx_get_id{nullptr};
  // Across processes: looked up on first use (a driver without them still runs the rest).
  PFN_cuStreamWriteValue64_v11070 stream_write_value64{nullptr};
  PFN_cuStreamWaitValue64_v11070 stream_wait_value64{nullptr};
  PFN_cuPointerGetAttribute_v4000 pointer_get_attribute{nullptr};
};

template <class F>
void load_entry_point(const char* symbol, F& fn, unsigned int version)
{
  HANDOFF_CUDA_TRY(find_driver_entry(symbol, fn, version));
  if (fn == nullptr) {
    throw device_error("cuda", "cudaErrorSymbolNotFound",
                       fmt::format("no usable CUDA device: the driver has no {} (version {})", symbol, version));
  }
}

cudaStream_t to_native(stream_handle h) noexcept
{
  return reinterpret_cast<cudaStream_t>(static_cast<std::uintptr_t>(h));
}
cudaEvent_t to_native(event_handle h) noexcept
{
  return reinterpret_cast<cudaEvent_t>(static_cast<std::uintptr_t>(h));
}
bool is_default_stream(stream_handle h) noexcept
{
  return static_cast<std::uintptr_t>(h) <= 2;
}

/// Tolerated in destructors and noexcept calls while the process shuts down.
bool is_shutdown_error(cudaError_t status) noexcept
{
  return status == cudaErrorCudartUnloading || status == cudaErrorContextIsDestroyed;
}

// What a user object a graph retains runs when the graph is gone (release_with_capture).
struct retained_release {
  void (*release)(void* data) noexcept;
  void* data;
  std::atomic<bool> armed;

  static void destroy(void* self) noexcept
  {
    auto* r = static_cast<retained_release*>(self);
    if (r->armed.load(std::memory_order_acquire)) { r->release(r->data); }
    delete r;
  }
};

class cuda_backend final : public backend {
 public:
  cuda_backend()
  {
    int count = 0;
    const cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      throw device_error("cuda", cudaGetErrorName(status),
                         fmt::format("no usable CUDA device: cudaGetDeviceCount failed: {}: {} ({})",
                                     cudaGetErrorName(status), cudaGetErrorString(status), driver_floor_report()));
    }
    if (count == 0) {
      throw device_error("cuda", "cudaErrorNoDevice", "no usable CUDA device: cudaGetDeviceCount found none");
    }
    device_count_ = count;
    load_entry_point("cuPointerGetAttributes", driver_.pointer_get_attributes, 7000);
    load_entry_point("cuCtxGetCurrent", driver_.ctx_get_current, 4000);
    load_entry_point("cuCtxGetDevice", driver_.ctx_get_device, 2000);
    load_entry_point("cuCtxPushCurrent", driver_.ctx_push_current, 4000);
    load_entry_point("cuCtxPopCurrent", driver_.ctx_pop_current, 4000);
    load_entry_point("cuDeviceGet", driver_.device_get, 2000);
    load_entry_point("cuDevicePrimaryCtxRetain", driver_.primary_ctx_retain, 7000);
    primary_contexts_.resize(static_cast<std::size_t>(count));
    uuids_.resize(static_cast<std::size_t>(count));
    load_entry_point("cuGetErrorName", driver_.get_error_name, 6000);
    load_entry_point("cuGetErrorString", driver_.get_error_string, 6000);
    load_entry_point("cuThreadExchangeStreamCaptureMode", driver_.thread_exchange_capture_mode, 10010);
    load_entry_point("cuStreamGetDevice", driver_.stream_get_device, 12080);
    load_entry_point("cuStreamGetCtx", driver_.stream_get_ctx, 9020);
    load_entry_point("cuStreamIsCapturing", driver_.stream_is_capturing, 10000);
    load_entry_point("cuCtxGetId", driver_.ctx_get_id, 12000);
    HANDOFF_LOG_DEBUG("cuda: {} devices", count);
  }

  [[nodiscard]] std::string_view name() const noexcept override { return "cuda"; }
  [[nodiscard]] DLDeviceType device_type() const noexcept override { return kDLCUDA; }
  [[nodiscard]] int device_count() override { return device_count_; }

  // The device of the current context (primary or user-created); with none current, the device
  // the runtime would use. Neither creates a context.
  [[nodiscard]] int current_device() override
  {
    if (current_context() != nullptr) {
      CUdevice device = 0;
      check_driver(driver_.ctx_get_device(&device), "cuCtxGetDevice", nullptr);
      return static_cast<int>(device);
    }
    int device = 0;
    HANDOFF_CUDA_TRY(cudaGetDevice(&device));
    return device;
  }

  [[nodiscard]] bool device_is_current(int device) override
  {
    if (current_context() == nullptr) { return false; }
    if (device_count_ == 1) { return device == 0; }  // a context is current: the one device's
    CUdevice current = 0;
    check_driver(driver_.ctx_get_device(&current), "cuCtxGetDevice", nullptr);
    return static_cast<int>(current) == device;
  }

  void set_current_device(int device) override { HANDOFF_CUDA_TRY(cudaSetDevice(device)); }

  // The device's primary context pushed on the thread's context stack (as CCCL's context guard
  // does): popping restores the previous context, or none, and the runtime's selected device is
  // never touched. cudaSetDevice would bind primary contexts, replace a user-created one, and
  // restoring a thread that had none would create one on its default device.
  void push_current_device(int device) override
  {
    check_driver(driver_.ctx_push_current(primary_context(device)), "cuCtxPushCurrent", nullptr);
  }

  void pop_current_device() noexcept override
  {
    CUcontext popped = nullptr;
    const CUresult status = driver_.ctx_pop_current(&popped);
    if (status != CUDA_SUCCESS && status != CUDA_ERROR_DEINITIALIZED) {
      HANDOFF_LOG_ERROR("cuCtxPopCurrent failed: CUresult {}", static_cast<int>(status));
    }
  }

  [[nodiscard]] std::uint64_t context_id(int device) override
  {
    unsigned long long id = 0;
    check_driver(driver_.ctx_get_id(primary_context(device), &id), "cuCtxGetId", nullptr);
    return static_cast<std::uint64_t>(id);
  }

  [[nodiscard]] std::uint64_t current_context_id() override
  {
    CUcontext current = current_context();
    if (current == nullptr) { return 0; }
    unsigned long long id = 0;
    check_driver(driver_.ctx_get_id(current, &id), "cuCtxGetId", nullptr);
    return static_cast<std::uint64_t>(id);
  }

  // DLPack's 1 and 2 are cudaStreamLegacy and cudaStreamPerThread: the same integers.
  [[nodiscard]] stream_handle legacy_default_stream() const noexcept override { return stream_handle{1}; }
  [[nodiscard]] stream_handle per_thread_default_stream() const noexcept override { return stream_handle{2}; }

  [[nodiscard]] stream_handle create_stream(bool non_blocking) override
  {
    cudaStream_t stream = nullptr;
    const unsigned int flags = non_blocking ? cudaStreamNonBlocking : cudaStreamDefault;
    HANDOFF_CUDA_TRY(cudaStreamCreateWithFlags(&stream, flags));
    return stream_handle{reinterpret_cast<std::uintptr_t>(stream)};
  }

  void destroy_stream(stream_handle stream) noexcept override
  {
    if (is_default_stream(stream)) {
      HANDOFF_LOG_ERROR("cudaStreamDestroy({:#x}): a default stream cannot be destroyed",
                        static_cast<std::uintptr_t>(stream));
      return;
    }
    log_quietly("cudaStreamDestroy", cudaStreamDestroy(to_native(stream)));
  }

  // The driver's call: a stream knows its context, so nothing needs to be current, where the
  // runtime's would initialise a context on the current device of a thread that has none (the
  // service thread running releases).
  // A capturing stream is not asked: the driver refuses cuStreamGetDevice during a capture, and the
  // refusal invalidates the capture (tools/gpu-probe's stream-queries-during-capture: so do
  // cuStreamGetFlags and cuStreamGetId). Its device is then its context's.
  [[nodiscard]] int stream_device(stream_handle stream, std::optional<bool> capturing = std::nullopt) override
  {
    if (device_count_ == 1) { return 0; }  // every stream of the process is the one device's
    if (is_default_stream(stream)) { return current_device(); }
    if (capturing.has_value() ? *capturing : captures(stream)) { return context_device(stream); }
    CUdevice device = 0;
    check_driver(driver_.stream_get_device(to_native(stream), &device), "cuStreamGetDevice", to_native(stream));
    return static_cast<int>(device);
  }

  // A capturing stream is not asked (the driver refuses cuStreamGetFlags during a capture, which
  // invalidates it) and is taken as non-blocking: handoff then orders explicitly, never less.
  [[nodiscard]] bool stream_is_blocking(stream_handle stream) override
  {
    if (is_default_stream(stream)) { return true; }
    if (captures(stream)) { return false; }
    unsigned int flags = 0;
    HANDOFF_CUDA_TRY(cudaStreamGetFlags(to_native(stream), &flags));
    return (flags & cudaStreamNonBlocking) == 0;
  }

  [[nodiscard]] capture_status stream_capture_status(stream_handle stream) override
  {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t asked = cudaStreamIsCapturing(to_native(stream), &status);
    // The legacy stream while a blocking stream captures: asking only fails, using it would
    // invalidate the capture.
    if (asked == cudaErrorStreamCaptureImplicit) {
      (void)cudaGetLastError();
      return capture_status::active;
    }
    HANDOFF_CUDA_TRY(asked);
    switch (status) {
      case cudaStreamCaptureStatusActive:
        return capture_status::active;
      case cudaStreamCaptureStatusInvalidated:
        return capture_status::invalidated;
      default:
        return capture_status::none;
    }
  }

  [[nodiscard]] std::uint64_t stream_capture_id(stream_handle stream) override
  {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long id = 0;
    HANDOFF_CUDA_TRY(cudaStreamGetCaptureInfo(to_native(stream), &status, &id));
    return status == cudaStreamCaptureStatusNone ? 0 : static_cast<std::uint64_t>(id);
  }

  [[nodiscard]] bool query_stream(stream_handle stream) override
  {
    return HANDOFF_CUDA_QUERY_DONE(cudaStreamQuery(to_native(stream)));
  }

  void synchronize_stream(stream_handle stream) override { HANDOFF_CUDA_TRY(cudaStreamSynchronize(to_native(stream))); }

  void synchronize_device() override { HANDOFF_CUDA_TRY(cudaDeviceSynchronize()); }

  // The driver's call: the runtime's would initialise a context on the current device.
  capture_mode exchange_capture_mode(capture_mode mode) override
  {
    auto native = static_cast<CUstreamCaptureMode>(mode);
    check_driver(driver_.thread_exchange_capture_mode(&native), "cuThreadExchangeStreamCaptureMode", nullptr);
    return static_cast<capture_mode>(native);
  }

  [[nodiscard]] event_handle create_event() override
  {
    cudaEvent_t event = nullptr;
    HANDOFF_CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    return event_handle{reinterpret_cast<std::uintptr_t>(event)};
  }

  void destroy_event(event_handle event) noexcept override
  {
    log_quietly("cudaEventDestroy", cudaEventDestroy(to_native(event)));
  }

  void record_event(event_handle event, stream_handle stream) override
  {
    HANDOFF_CUDA_TRY(cudaEventRecord(to_native(event), to_native(stream)));
  }

  [[nodiscard]] bool query_event(event_handle event) override
  {
    return HANDOFF_CUDA_QUERY_DONE(cudaEventQuery(to_native(event)));
  }

  void synchronize_event(event_handle event) override { HANDOFF_CUDA_TRY(cudaEventSynchronize(to_native(event))); }

  void stream_wait_event(stream_handle stream, event_handle event) override
  {
    HANDOFF_CUDA_TRY(cudaStreamWaitEvent(to_native(stream), to_native(event), cudaEventWaitDefault));
  }

  // The address's kind, device and range need no current context (unified addressing); only the
  // device pointer of pinned host memory is per context, and is asked for where one is current.
  // A thread without a context gets none made for it.
  [[nodiscard]] pointer_attributes attributes(const void* ptr) override
  {
    const auto address = static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(ptr));
    unsigned int memory_type = 0;
    int ordinal = -1;
    CUdeviceptr range_start = 0;
    std::size_t range_size = 0;
    unsigned int is_managed = 0;
    std::array<CUpointer_attribute, 5> names{CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                             CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                             CU_POINTER_ATTRIBUTE_IS_MANAGED};
    std::array<void*, 5> values{&memory_type, &ordinal, &range_start, &range_size, &is_managed};
    check_driver(
      driver_.pointer_get_attributes(static_cast<unsigned int>(names.size()), names.data(), values.data(), address),
      "cuPointerGetAttributes", ptr);

    pointer_attributes result;
    if (is_managed != 0) {
      result.kind = memory_kind::managed;
    } else if (memory_type == CU_MEMORYTYPE_DEVICE) {
      result.kind = memory_kind::device;
    } else if (memory_type == CU_MEMORYTYPE_HOST) {
      result.kind = memory_kind::pinned_host;
    } else {
      return result;  // plain host memory: unregistered, device -1
    }
    result.device = ordinal;
    result.base = reinterpret_cast<const void*>(static_cast<std::uintptr_t>(range_start));
    result.size = range_size;
    result.device_pointer = const_cast<void*>(ptr);  // unified addressing: the same address
    if (result.kind == memory_kind::pinned_host && current_context() != nullptr) {
      CUdeviceptr device_pointer = 0;
      auto attribute = CU_POINTER_ATTRIBUTE_DEVICE_POINTER;
      void* value = &device_pointer;
      if (driver_.pointer_get_attributes(1, &attribute, &value, address) == CUDA_SUCCESS && device_pointer != 0) {
        result.device_pointer = reinterpret_cast<void*>(static_cast<std::uintptr_t>(device_pointer));
      }
    }
    return result;
  }

  [[nodiscard]] void* allocate(std::size_t bytes, stream_handle stream) override
  {
    void* ptr = nullptr;
    HANDOFF_CUDA_TRY(cudaMallocAsync(&ptr, bytes, to_native(stream)));
    return ptr;
  }

  void deallocate(void* ptr, stream_handle stream) noexcept override
  {
    if (ptr == nullptr) { return; }
    log_quietly("cudaFreeAsync", cudaFreeAsync(ptr, to_native(stream)));
  }

  [[nodiscard]] void* allocate_pinned_host(std::size_t bytes) override
  {
    void* ptr = nullptr;
    HANDOFF_CUDA_TRY(cudaMallocHost(&ptr, bytes));
    return ptr;
  }

  [[nodiscard]] void* allocate_managed(std::size_t bytes) override
  {
    void* ptr = nullptr;
    HANDOFF_CUDA_TRY(cudaMallocManaged(&ptr, bytes, cudaMemAttachGlobal));
    return ptr;
  }

  void free_sync(void* ptr) override
  {
    if (ptr == nullptr) { return; }
    cudaPointerAttributes attributes{};
    HANDOFF_CUDA_TRY(cudaPointerGetAttributes(&attributes, ptr));
    if (attributes.type == cudaMemoryTypeHost) {
      HANDOFF_CUDA_TRY(cudaFreeHost(ptr));
    } else {
      HANDOFF_CUDA_TRY(cudaFree(ptr));
    }
  }

  void copy_async(void* dst, const void* src, std::size_t bytes, stream_handle stream) override
  {
    HANDOFF_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, to_native(stream)));
  }

  void release_with_capture(stream_handle stream, void (*release)(void* data) noexcept, void* data) override
  {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaGraph_t graph = nullptr;
    HANDOFF_CUDA_TRY(cudaStreamGetCaptureInfo(to_native(stream), &status, nullptr, &graph));
    if (status != cudaStreamCaptureStatusActive || graph == nullptr) {
      throw device_error(
        "cuda", "cudaErrorIllegalState",
        fmt::format("stream {:#x} is not capturing into a graph", static_cast<std::uintptr_t>(stream)));
    }
    // If retaining fails, the object is disarmed before it is dropped: its destructor must not
    // release what the caller still holds.
    auto* armed = new retained_release{release, data, true};
    cudaUserObject_t object = nullptr;
    const cudaError_t created =
      cudaUserObjectCreate(&object, armed, &retained_release::destroy, 1, cudaUserObjectNoDestructorSync);
    if (created != cudaSuccess) {
      delete armed;
      HANDOFF_CUDA_TRY(created);
    }
    const cudaError_t retained = cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove);
    if (retained != cudaSuccess) {
      armed->armed.store(false, std::memory_order_release);
      log_quietly("cudaUserObjectRelease", cudaUserObjectRelease(object, 1));  // runs destroy, disarmed
      HANDOFF_CUDA_TRY(retained);
    }
  }

  // Through CUPTI, loaded at run time: nothing is subscribed while no launch trace runs.
  [[nodiscard]] std::string watch_activity(bool on) override
  {
#ifdef HANDOFF_HAS_CUPTI
    return watch_cupti(on);
#else
    (void)on;
    return "this build of handoff has no CUPTI support (the CUDA toolkit it was built with had no cupti.h)";
#endif
  }

  void launch_host_func(stream_handle stream, void (*fn)(void*), void* user_data) override
  {
    HANDOFF_CUDA_TRY(cudaLaunchHostFunc(to_native(stream), fn, user_data));
  }

  // --- across processes -------------------------------------------------------------------------
  // A handle's first byte says what it shares: memory from cudaMalloc (cudaIpcMemHandle_t), or memory
  // of a shareable stream-ordered pool (the pool's POSIX file descriptor, which the opening process
  // takes from this one with pidfd_getfd, and cuMemPoolExportPointer's data).

  [[nodiscard]] ipc_handle ipc_memory_handle(void* base) override
  {
    ipc_handle out;
    CUmemoryPool pool = nullptr;
    ensure_ipc_entry_points();
    check_driver(driver_.pointer_get_attribute(&pool, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE,
                                               static_cast<CUdeviceptr>(reinterpret_cast<std::uintptr_t>(base))),
                 "cuPointerGetAttribute", base);
    if (pool == nullptr) {
      cudaIpcMemHandle_t handle{};
      HANDOFF_CUDA_TRY(cudaIpcGetMemHandle(&handle, base));
      out.bytes[0] = std::byte{legacy_memory};
      std::memcpy(out.bytes.data() + handle_offset, &handle, sizeof handle);
      return out;
    }
    const int fd = exported_pool(reinterpret_cast<cudaMemPool_t>(pool));
    cudaMemPoolPtrExportData data{};
    HANDOFF_CUDA_TRY(cudaMemPoolExportPointer(&data, base));
    out.bytes[0] = std::byte{pool_memory};
    std::memcpy(out.bytes.data() + handle_offset, &data, sizeof data);
    const std::int32_t pid = ::getpid();
    std::memcpy(out.bytes.data() + handle_offset + sizeof data, &pid, sizeof pid);
    std::memcpy(out.bytes.data() + handle_offset + sizeof data + sizeof pid, &fd, sizeof fd);
    return out;
  }

  [[nodiscard]] device_uuid uuid(int device) override
  {
    HANDOFF_EXPECTS(device >= 0 && device < device_count_, value_error,
                    fmt::format("CUDA device {} does not exist ({} devices)", device, device_count_));
    std::lock_guard lock{ipc_mutex_};
    auto& known = uuids_[static_cast<std::size_t>(device)];
    if (!known) {
      cudaDeviceProp properties{};  // asked once per device: it fills every property
      HANDOFF_CUDA_TRY(cudaGetDeviceProperties(&properties, device));
      known.emplace();
      std::memcpy(known->data(), properties.uuid.bytes, known->size());
    }
    return *known;
  }

  [[nodiscard]] void* open_ipc_memory(const ipc_handle& handle) override
  {
    void* ptr = nullptr;
    if (handle.bytes[0] == std::byte{legacy_memory}) {
      cudaIpcMemHandle_t native{};
      std::memcpy(&native, handle.bytes.data() + handle_offset, sizeof native);
      HANDOFF_CUDA_TRY(cudaIpcOpenMemHandle(&ptr, native, cudaIpcMemLazyEnablePeerAccess));
      return ptr;
    }
    if (handle.bytes[0] != std::byte{pool_memory}) {
      throw device_error("cuda", "cudaErrorInvalidValue", "cudaIpcOpenMemHandle: not a memory handle of this backend");
    }
    cudaMemPoolPtrExportData data{};
    std::int32_t pid = 0;
    std::int32_t fd = -1;
    std::memcpy(&data, handle.bytes.data() + handle_offset, sizeof data);
    std::memcpy(&pid, handle.bytes.data() + handle_offset + sizeof data, sizeof pid);
    std::memcpy(&fd, handle.bytes.data() + handle_offset + sizeof data + sizeof pid, sizeof fd);
    const cudaMemPool_t pool = imported_pool(pid, fd);
    HANDOFF_CUDA_TRY(cudaMemPoolImportPointer(&ptr, pool, &data));
    std::lock_guard lock{ipc_mutex_};
    pool_pointers_.insert(ptr);
    return ptr;
  }

  void close_ipc_memory(void* ptr) noexcept override
  {
    bool from_pool = false;
    {
      std::lock_guard lock{ipc_mutex_};
      from_pool = pool_pointers_.erase(ptr) != 0;
    }
    // An imported pool pointer is freed like any of the pool's (the exporter's memory stays).
    log_quietly(from_pool ? "cudaFree" : "cudaIpcCloseMemHandle",
                from_pool ? cudaFree(ptr) : cudaIpcCloseMemHandle(ptr));
  }

  [[nodiscard]] event_handle create_ipc_event() override
  {
    cudaEvent_t event = nullptr;
    HANDOFF_CUDA_TRY(cudaEventCreateWithFlags(&event, cudaEventInterprocess | cudaEventDisableTiming));
    return event_handle{reinterpret_cast<std::uintptr_t>(event)};
  }

  [[nodiscard]] ipc_handle ipc_event_handle(event_handle event) override
  {
    cudaIpcEventHandle_t handle{};
    HANDOFF_CUDA_TRY(cudaIpcGetEventHandle(&handle, to_native(event)));
    ipc_handle out;
    std::memcpy(out.bytes.data(), &handle, sizeof handle);
    return out;
  }

  [[nodiscard]] event_handle open_ipc_event(const ipc_handle& handle) override
  {
    cudaIpcEventHandle_t native{};
    std::memcpy(&native, handle.bytes.data(), sizeof native);
    cudaEvent_t event = nullptr;
    HANDOFF_CUDA_TRY(cudaIpcOpenEventHandle(&event, native));
    return event_handle{reinterpret_cast<std::uintptr_t>(event)};
  }

  [[nodiscard]] void* register_host_memory(void* ptr, std::size_t bytes) override
  {
    HANDOFF_CUDA_TRY(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
    void* device_ptr = nullptr;
    const cudaError_t mapped = cudaHostGetDevicePointer(&device_ptr, ptr, 0);
    if (mapped != cudaSuccess) {
      log_quietly("cudaHostUnregister", cudaHostUnregister(ptr));
      HANDOFF_CUDA_TRY(mapped);
    }
    return device_ptr;
  }

  void unregister_host_memory(void* ptr) noexcept override
  {
    log_quietly("cudaHostUnregister", cudaHostUnregister(ptr));
  }

  void stream_write_value(stream_handle stream, void* address, std::uint64_t value) override
  {
    ensure_ipc_entry_points();
    check_driver(driver_.stream_write_value64(to_native(stream), reinterpret_cast<CUdeviceptr>(address), value,
                                              CU_STREAM_WRITE_VALUE_DEFAULT),
                 "cuStreamWriteValue64", address);
  }

  void stream_wait_value(stream_handle stream, void* address, std::uint64_t value) override
  {
    ensure_ipc_entry_points();
    check_driver(driver_.stream_wait_value64(to_native(stream), reinterpret_cast<CUdeviceptr>(address), value,
                                             CU_STREAM_WAIT_VALUE_GEQ),
                 "cuStreamWaitValue64", address);
  }

 private:
  static constexpr unsigned char legacy_memory = 1;
  static constexpr unsigned char pool_memory = 2;
  static constexpr std::size_t handle_offset = 8;

  void ensure_ipc_entry_points()
  {
    std::lock_guard lock{ipc_mutex_};
    if (driver_.pointer_get_attribute != nullptr) { return; }
    load_entry_point("cuStreamWriteValue64", driver_.stream_write_value64, 11070);
    load_entry_point("cuStreamWaitValue64", driver_.stream_wait_value64, 11070);
    load_entry_point("cuPointerGetAttribute", driver_.pointer_get_attribute, 4000);
  }

  // The pool's POSIX file descriptor, exported once per pool and kept for the process (a process
  // opening a handle takes its own copy of it). A pool made without that handle type refuses.
  int exported_pool(cudaMemPool_t pool)
  {
    std::lock_guard lock{ipc_mutex_};
    if (const auto it = exported_pools_.find(pool); it != exported_pools_.end()) { return it->second; }
    int fd = -1;
    const cudaError_t status = cudaMemPoolExportToShareableHandle(&fd, pool, cudaMemHandleTypePosixFileDescriptor, 0);
    if (status != cudaSuccess) {
      (void)cudaGetLastError();
      throw device_error("cuda", cudaGetErrorName(status),
                         fmt::format("cudaMemPoolExportToShareableHandle failed: {}: the memory comes from a "
                                     "stream-ordered pool that was not created shareable (cudaMemPoolCreate with "
                                     "handleTypes = cudaMemHandleTypePosixFileDescriptor); the default pool of "
                                     "cudaMallocAsync never is",
                                     cudaGetErrorName(status)));
    }
    exported_pools_.emplace(pool, fd);
    return fd;
  }

  // The pool process `pid` exported as its descriptor `fd`, imported once per process.
  cudaMemPool_t imported_pool(std::int32_t pid, std::int32_t fd)
  {
    std::lock_guard lock{ipc_mutex_};
    const auto key = std::make_pair(pid, fd);
    if (const auto it = imported_pools_.find(key); it != imported_pools_.end()) { return it->second; }
    const long pidfd = ::syscall(SYS_pidfd_open, pid, 0);
    if (pidfd < 0) {
      throw device_error("cuda", "cudaErrorInvalidValue",
                         fmt::format("pidfd_open({}) failed: the process that shared the pool is gone", pid));
    }
    const long local = ::syscall(SYS_pidfd_getfd, static_cast<int>(pidfd), fd, 0);
    ::close(static_cast<int>(pidfd));
    if (local < 0) {
      throw device_error("cuda", "cudaErrorInvalidValue",
                         fmt::format("pidfd_getfd({}, {}) failed: this process may not take the pool's descriptor "
                                     "(ptrace access to the producer is required)",
                                     pid, fd));
    }
    cudaMemPool_t pool = nullptr;
    const cudaError_t status = cudaMemPoolImportFromShareableHandle(
      &pool, reinterpret_cast<void*>(static_cast<std::intptr_t>(local)), cudaMemHandleTypePosixFileDescriptor, 0);
    ::close(static_cast<int>(local));
    HANDOFF_CUDA_TRY(status);
    imported_pools_.emplace(key, pool);
    return pool;
  }

  [[nodiscard]] CUcontext current_context() const
  {
    CUcontext context = nullptr;
    check_driver(driver_.ctx_get_current(&context), "cuCtxGetCurrent", nullptr);
    return context;
  }

  // Retained once per device and kept for the process: the memory or stream that brings handoff
  // to a device means its primary context is in use already, so retaining creates nothing new.
  [[nodiscard]] CUcontext primary_context(int device)
  {
    HANDOFF_EXPECTS(device >= 0 && device < device_count_, value_error,
                    fmt::format("CUDA device {} does not exist ({} devices)", device, device_count_));
    std::lock_guard lock{primary_mutex_};
    CUcontext& context = primary_contexts_[static_cast<std::size_t>(device)];
    if (context == nullptr) {
      CUdevice handle = 0;
      check_driver(driver_.device_get(&handle, device), "cuDeviceGet", nullptr);
      check_driver(driver_.primary_ctx_retain(&context, handle), "cuDevicePrimaryCtxRetain", nullptr);
    }
    return context;
  }

  void check_driver(CUresult status, const char* call, const void* arg) const
  {
    if (status != CUDA_SUCCESS) [[unlikely]] { throw_driver_error(status, call, arg); }
  }

  // Whether `stream` (not a default stream) is capturing: the driver's call, which needs no context.
  bool captures(stream_handle stream)
  {
    CUstreamCaptureStatus status = CU_STREAM_CAPTURE_STATUS_NONE;
    check_driver(driver_.stream_is_capturing(to_native(stream), &status), "cuStreamIsCapturing", to_native(stream));
    return status != CU_STREAM_CAPTURE_STATUS_NONE;
  }

  // The device of the context `stream` belongs to (cuStreamGetCtx may be asked during a capture).
  int context_device(stream_handle stream)
  {
    CUcontext context = nullptr;
    check_driver(driver_.stream_get_ctx(to_native(stream), &context), "cuStreamGetCtx", to_native(stream));
    check_driver(driver_.ctx_push_current(context), "cuCtxPushCurrent", nullptr);
    CUdevice device = 0;
    const CUresult asked = driver_.ctx_get_device(&device);
    pop_current_device();
    check_driver(asked, "cuCtxGetDevice", nullptr);
    return static_cast<int>(device);
  }

  [[noreturn]] void throw_driver_error(CUresult status, const char* call, const void* arg) const
  {
    const char* name = nullptr;
    const char* text = nullptr;
    if (driver_.get_error_name(status, &name) != CUDA_SUCCESS || name == nullptr) { name = "CUDA_ERROR_UNKNOWN"; }
    if (driver_.get_error_string(status, &text) != CUDA_SUCCESS || text == nullptr) { text = "unknown error"; }
    throw device_error("cuda", name, fmt::format("{}({}) failed: {}: {}", call, fmt::ptr(arg), name, text));
  }

  static void log_quietly(const char* call, cudaError_t status) noexcept
  {
    if (status == cudaSuccess) { return; }
    (void)cudaGetLastError();
    if (is_shutdown_error(status)) { return; }
    HANDOFF_LOG_ERROR("{} failed: {}: {}", call, cudaGetErrorName(status), cudaGetErrorString(status));
  }

  int device_count_{0};
  driver_api driver_;
  std::mutex primary_mutex_;
  std::vector<CUcontext> primary_contexts_;  // by ordinal; null until first pushed
  std::mutex ipc_mutex_;
  std::map<cudaMemPool_t, int> exported_pools_;
  std::map<std::pair<std::int32_t, std::int32_t>, cudaMemPool_t> imported_pools_;
  std::set<void*> pool_pointers_;                  // opened from pools: freed, not closed
  std::vector<std::optional<device_uuid>> uuids_;  // by ordinal
};

}  // namespace

std::string runtime_version()
{
  return fmt::format("{}.{}", CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
}

int minimum_driver_branch() noexcept
{
  // CUDA's minor version compatibility: a runtime of one major version runs on every driver from
  // that major version's first branch on (the CUDA compatibility guide's table), except for the
  // calls a later minor version added: cuStreamGetDevice needs a 12.8 driver (570) on CUDA 12.
  static_assert(CUDART_VERSION >= 12080, "cuStreamGetDevice needs CUDA 12.8");
  return CUDART_VERSION >= 13000 ? 580 : 570;
}

std::string driver_floor_report()
{
  int driver = 0;  // the CUDA version the installed driver supports; 0 when no driver is installed
  const bool known = cudaDriverGetVersion(&driver) == cudaSuccess;
  (void)cudaGetLastError();
  std::string installed = "the installed driver's version is unknown";
  if (known) {
    installed = driver == 0
                  ? "no NVIDIA driver is installed"
                  : fmt::format("the installed driver supports CUDA {}.{}", driver / 1000, driver % 1000 / 10);
  }
  return fmt::format("the CUDA {} runtime linked in needs an NVIDIA driver {} or later; {}", runtime_version(),
                     minimum_driver_branch(), installed);
}

std::unique_ptr<backend> make_backend()
{
  return std::make_unique<cuda_backend>();
}

}  // namespace handoff::device::cuda
