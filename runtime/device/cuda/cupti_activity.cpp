// CUPTI's driver API callbacks turned into handoff::activity records. A kernel's arguments are laid
// out with cuFuncGetParamInfo (cuKernelGetParamInfo for a library's kernel), or read from the buffer
// they were packed into, and each aligned 8-byte word of them (a pointer argument, or a pointer inside
// a struct argument, as PyTorch's and CuPy's kernels take theirs) is matched against the memory the
// process is known to have: the allocations and mappings CUPTI's callbacks report while subscribed,
// and the arrays handoff saw exchanged.
#include "device/cuda/cupti_activity.hpp"
#include "device/cuda/driver_entry.hpp"

#include "log/logger.hpp"

#include <handoff/activity.hpp>
#include <handoff/internal/activity_trace.hpp>

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_* driver prototypes; header only, nothing is linked
#include <cuda_runtime_api.h>
#include <cupti.h>
#include <fmt/format.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

namespace handoff::device::cuda {
namespace {

using activity::access;
using activity::buffer_use;
using activity::stream_class;

// CUPTI's entry points, from the library dlopen found.
struct cupti_api {
  decltype(&cuptiSubscribe) subscribe{nullptr};
  decltype(&cuptiUnsubscribe) unsubscribe{nullptr};
  decltype(&cuptiEnableCallback) enable_callback{nullptr};
  decltype(&cuptiGetResultString) result_string{nullptr};
};

// The driver calls the callbacks make (a callback may call the driver; those calls are not traced).
// Each is asked for at the version its prototype names: the newest version of a name can take other
// arguments (CUDA 13's cuCtxGetDevice also takes a context).
struct driver_api {
  PFN_cuFuncGetParamInfo_v12040 func_param_info{nullptr};
  PFN_cuKernelGetParamInfo_v12040 kernel_param_info{nullptr};
  PFN_cuStreamGetFlags_v5050 stream_flags{nullptr};
  PFN_cuStreamGetDevice_v12080 stream_device{nullptr};
  PFN_cuStreamIsCapturing_v10000 stream_is_capturing{nullptr};
  PFN_cuCtxGetDevice_v2000 ctx_device{nullptr};
#if CUDA_VERSION >= 13000
  PFN_cuCtxGetDevice_v13000 device_of_context{nullptr};  // a named context's device
#endif
};

// The driver API calls a launch trace listens to.
// One callback a line, with a condition among them.
// clang-format off
constexpr std::array watched_callbacks{
  CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel,
  CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx,
  CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel,
  CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch,
  CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpy,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpy_ptds,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2_ptds,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2_ptds,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2,
  CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2_ptds,
  CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async,
  CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuMemsetD16Async,
  CUPTI_DRIVER_TRACE_CBID_cuMemsetD16Async_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async,
  CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuStreamCreate,
  CUPTI_DRIVER_TRACE_CBID_cuStreamCreateWithPriority,
  CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy_v2,
  CUPTI_DRIVER_TRACE_CBID_cuEventRecord,
  CUPTI_DRIVER_TRACE_CBID_cuEventRecord_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags,
  CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent,
  CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize,
  CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize,
#if CUDA_VERSION >= 13000
  CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize_v2,  // CUDA 13's cudaDeviceSynchronize
#endif
  CUPTI_DRIVER_TRACE_CBID_cuEventSynchronize,
  CUPTI_DRIVER_TRACE_CBID_cuStreamQuery,
  CUPTI_DRIVER_TRACE_CBID_cuStreamQuery_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuEventQuery,
  CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2,
  CUPTI_DRIVER_TRACE_CBID_cuMemAllocPitch_v2,
  CUPTI_DRIVER_TRACE_CBID_cuMemAllocManaged,
  CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync,
  CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync,
  CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuMemFree_v2,
  CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync,
  CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync_ptsz,
  CUPTI_DRIVER_TRACE_CBID_cuMemMap,    // virtual memory management (PyTorch's expandable
  CUPTI_DRIVER_TRACE_CBID_cuMemUnmap,  // segments, for one)
};
// clang-format on

// Words below it are sizes, counts and flags, never device addresses: not looked up.
constexpr std::uintptr_t no_pointer_below = std::uintptr_t{1} << 20;

// The handles the backend uses for the default streams (DLPack's 1 and 2).
constexpr std::uint64_t legacy_handle = 1;
constexpr std::uint64_t per_thread_handle = 2;

std::int64_t steady_ns() noexcept
{
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
    .count();
}

// Everything the callbacks share. Leaked: CUPTI may call back while the process exits.
struct watcher {
  std::mutex mutex;  // the subscription and the count
  int watchers{0};
  std::optional<std::string> load_failure;  // set once loading failed: it is not tried again
  void* library{nullptr};
  std::string library_path;
  cupti_api cupti;
  driver_api driver;
  CUpti_SubscriberHandle subscriber{nullptr};

  std::mutex memory_mutex;                                                  // what the callbacks learn
  std::map<std::uintptr_t, std::size_t> allocations;                        // device memory by base address
  std::unordered_map<CUfunction, std::vector<std::size_t>> argument_sizes;  // by argument index
  std::unordered_map<CUstream, stream_class> classes;

  static watcher& get()
  {
    static auto* instance = new watcher;  // NOLINT(cppcoreguidelines-owning-memory): leaked, see above
    return *instance;
  }

  std::string load();
  std::string subscribe();
  void handle(CUpti_CallbackId id, const CUpti_CallbackData& data) noexcept;

  // The stream a call names: the default streams as the backend names them, a created stream's class.
  struct named_stream {
    std::uint64_t handle{0};
    stream_class klass{stream_class::legacy};
    int device{0};
  };
  named_stream stream_of(CUstream stream, bool per_thread_call);
  int current_device() const noexcept;
  // Device memory that holds `address` (an exchanged array first): what a pointer argument touches.
  std::optional<buffer_use> device_memory(std::uintptr_t address, std::size_t bytes, access mode);
  std::vector<std::size_t> argument_layout(CUfunction f);
};

std::string result_text(const cupti_api& api, CUptiResult result)
{
  const char* text = nullptr;
  if (api.result_string == nullptr || api.result_string(result, &text) != CUPTI_SUCCESS || text == nullptr) {
    return fmt::format("CUPTI error {}", static_cast<int>(result));
  }
  return text;
}

template <class F>
bool symbol(void* library, const char* name, F& out)
{
  out = reinterpret_cast<F>(::dlsym(library, name));
  return out != nullptr;
}

// Asks for an entry point at `version`, the one its prototype (a PFN_*_v<version>) names. Why it is
// not usable; empty when found.
template <class F>
std::string driver_entry(const char* name, F& out, unsigned int version)
{
  const cudaError_t status = find_driver_entry(name, out, version);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    return fmt::format("the CUDA driver is not usable ({}: {})", cudaGetErrorName(status), cudaGetErrorString(status));
  }
  if (out == nullptr) {
    return fmt::format("the CUDA driver has no {} as of CUDA {}.{}", name, version / 1000, version % 1000 / 10);
  }
  return {};
}

std::string watcher::load()
{
  if (load_failure) { return *load_failure; }
  if (library != nullptr) { return {}; }
  std::string tried;
  for (const std::string& candidate : cupti_candidates()) {
    if (void* found = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      library = found;
      library_path = candidate;
      break;
    }
    const char* why = ::dlerror();
    tried += fmt::format("\n  {}: {}", candidate, why != nullptr ? why : "not found");
  }
  std::string failure;
  if (library == nullptr) {
    failure = fmt::format(
      "CUPTI (libcupti.so, part of the CUDA toolkit) was not found; set HANDOFF_CUPTI_LIBRARY "
      "to its path. Tried:{}",
      tried);
  } else if (!symbol(library, "cuptiSubscribe", cupti.subscribe) ||
             !symbol(library, "cuptiUnsubscribe", cupti.unsubscribe) ||
             !symbol(library, "cuptiEnableCallback", cupti.enable_callback) ||
             !symbol(library, "cuptiGetResultString", cupti.result_string)) {
    failure = fmt::format("{} is not a CUPTI with the callback API", library_path);
  } else {
    // Checked now, so that a machine without a driver says so before anything is subscribed.
    std::vector<std::string> problems{driver_entry("cuFuncGetParamInfo", driver.func_param_info, 12040),
                                      driver_entry("cuKernelGetParamInfo", driver.kernel_param_info, 12040),
                                      driver_entry("cuStreamGetFlags", driver.stream_flags, 5050),
                                      driver_entry("cuStreamGetDevice", driver.stream_device, 12080),
                                      driver_entry("cuStreamIsCapturing", driver.stream_is_capturing, 10000),
                                      driver_entry("cuCtxGetDevice", driver.ctx_device, 2000)};
#if CUDA_VERSION >= 13000
    problems.push_back(driver_entry("cuCtxGetDevice", driver.device_of_context, 13000));
#endif
    for (const std::string& problem : problems) {
      if (!problem.empty()) {
        failure = fmt::format("CUPTI was found ({}), but {}", library_path, problem);
        break;
      }
    }
  }
  if (!failure.empty()) { load_failure = failure; }
  return failure;
}

void CUPTIAPI on_callback(void* user, CUpti_CallbackDomain domain, CUpti_CallbackId id, const void* data)
{
  if (domain != CUPTI_CB_DOMAIN_DRIVER_API || data == nullptr) { return; }
  static_cast<watcher*>(user)->handle(id, *static_cast<const CUpti_CallbackData*>(data));
}

std::string watcher::subscribe()
{
  const CUptiResult subscribed = cupti.subscribe(&subscriber, &on_callback, this);
  if (subscribed != CUPTI_SUCCESS) {
    subscriber = nullptr;
    return fmt::format("CUPTI refused a subscriber: {}{}", result_text(cupti, subscribed),
                       subscribed == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
                         ? " (another tool, such as Nsight Systems or a profiler, holds CUPTI's one subscription)"
                         : "");
  }
  for (const CUpti_CallbackId id : watched_callbacks) {
    const CUptiResult enabled = cupti.enable_callback(1, subscriber, CUPTI_CB_DOMAIN_DRIVER_API, id);
    if (enabled != CUPTI_SUCCESS) {
      (void)cupti.unsubscribe(subscriber);
      subscriber = nullptr;
      return fmt::format("CUPTI could not enable callback {}: {}", static_cast<unsigned>(id),
                         result_text(cupti, enabled));
    }
  }
  return {};
}

int watcher::current_device() const noexcept
{
  CUdevice device = 0;
  return driver.ctx_device != nullptr && driver.ctx_device(&device) == CUDA_SUCCESS ? static_cast<int>(device) : 0;
}

watcher::named_stream watcher::stream_of(CUstream stream, bool per_thread_call)
{
  const auto raw = reinterpret_cast<std::uintptr_t>(stream);
  if (raw == reinterpret_cast<std::uintptr_t>(CU_STREAM_PER_THREAD) || (raw == 0 && per_thread_call)) {
    return {.handle = per_thread_handle, .klass = stream_class::per_thread, .device = current_device()};
  }
  if (raw == 0 || raw == reinterpret_cast<std::uintptr_t>(CU_STREAM_LEGACY)) {
    return {.handle = legacy_handle, .klass = stream_class::legacy, .device = current_device()};
  }
  named_stream out{.handle = raw, .klass = stream_class::blocking, .device = current_device()};
  // A capturing stream is not asked: the driver refuses cuStreamGetDevice and cuStreamGetFlags during
  // a capture, and the refusal invalidates it. Its work is launched from its device, the current one,
  // and its class is known if the trace saw it made.
  CUstreamCaptureStatus capturing = CU_STREAM_CAPTURE_STATUS_NONE;
  const bool may_ask =
    driver.stream_is_capturing(stream, &capturing) == CUDA_SUCCESS && capturing == CU_STREAM_CAPTURE_STATUS_NONE;
  CUdevice device = 0;
  if (may_ask && driver.stream_device(stream, &device) == CUDA_SUCCESS) { out.device = static_cast<int>(device); }
  std::lock_guard lock{memory_mutex};
  if (const auto known = classes.find(stream); known != classes.end()) {
    out.klass = known->second;
  } else if (unsigned int flags = 0; may_ask && driver.stream_flags(stream, &flags) == CUDA_SUCCESS) {
    out.klass = (flags & CU_STREAM_NON_BLOCKING) != 0 ? stream_class::non_blocking : stream_class::blocking;
    classes.emplace(stream, out.klass);
  }
  return out;
}

std::optional<buffer_use> watcher::device_memory(std::uintptr_t address, std::size_t bytes, access mode)
{
  if (address == 0) { return std::nullopt; }
  if (const auto exchanged = activity::exchanged_at(address)) {
    // A pointer into an exchanged array: the array (a kernel's own extent is not known).
    return buffer_use{.address = exchanged->address, .bytes = bytes != 0 ? bytes : exchanged->bytes, .mode = mode};
  }
  std::lock_guard lock{memory_mutex};
  auto it = allocations.upper_bound(address);
  if (it == allocations.begin()) { return std::nullopt; }
  --it;
  if (address - it->first >= it->second) { return std::nullopt; }
  // Known only by its allocation (a caching allocator's segment holds many arrays): a kernel's
  // pointer names the memory from that address; two uses meet when they name the same one.
  return buffer_use{.address = address, .bytes = bytes != 0 ? bytes : 1, .mode = mode};
}

std::vector<std::size_t> watcher::argument_layout(CUfunction f)
{
  {
    std::lock_guard lock{memory_mutex};
    if (const auto known = argument_sizes.find(f); known != argument_sizes.end()) { return known->second; }
  }
  // A launch names a CUfunction, or a library's CUkernel cast to one (the CUDA runtime's kernels, and
  // cuda.core's), which cuFuncGetParamInfo does not take: asked again as a kernel, unless the
  // function was valid and merely took no arguments (CUDA_ERROR_INVALID_VALUE: no argument 0).
  CUresult ended = CUDA_SUCCESS;
  const auto layout = [&ended](auto param_info) {
    std::vector<std::size_t> sizes;
    for (std::size_t index = 0;; ++index) {
      std::size_t offset = 0;
      std::size_t size = 0;
      if (ended = param_info(index, &offset, &size); ended != CUDA_SUCCESS) { return sizes; }
      sizes.push_back(size);
    }
  };
  std::vector<std::size_t> sizes = layout([&](std::size_t index, std::size_t* offset, std::size_t* size) {
    return driver.func_param_info(f, index, offset, size);
  });
  if (sizes.empty() && ended != CUDA_ERROR_INVALID_VALUE) {
    sizes = layout([&](std::size_t index, std::size_t* offset, std::size_t* size) {
      return driver.kernel_param_info(reinterpret_cast<CUkernel>(f), index, offset, size);
    });
  }
  std::lock_guard lock{memory_mutex};
  argument_sizes.emplace(f, sizes);
  return sizes;
}

template <class Params>
const Params& params_of(const CUpti_CallbackData& data) noexcept
{
  return *static_cast<const Params*>(data.functionParams);
}

// One driver call as the detector records it: what it did, on which stream, and the device memory
// it touches. Decoded by kind of call: launches, copies and sets; streams and events; host waits;
// memory.
class decoded_call {
 public:
  enum class outcome {
    other_call,  // not a call of the kind asked
    nothing,     // a call of that kind that records nothing
    activity,    // an activity to report
  };

  decoded_call(watcher& w, CUpti_CallbackId id, const CUpti_CallbackData& data) noexcept
      : w_(w), id_(id), data_(data), entering_(data.callbackSite == CUPTI_API_ENTER)
  {}

  /// Decodes the call; a call the detector does not record is an `other_call`.
  outcome decode()
  {
    for (const auto kind : {&decoded_call::launches, &decoded_call::copies, &decoded_call::sets,
                            &decoded_call::stream_or_event, &decoded_call::host_wait, &decoded_call::memory}) {
      if (const outcome decoded = (this->*kind)(); decoded != outcome::other_call) { return decoded; }
    }
    return outcome::other_call;
  }
  /// Reports the activity decoded; an allocation or a free of memory the detector does not know
  /// records nothing.
  void report();

 private:
  template <class Params>
  [[nodiscard]] const Params& params() const noexcept
  {
    return params_of<Params>(data_);
  }
  [[nodiscard]] bool is(CUpti_CallbackId id) const noexcept { return id_ == id; }
  // How long the host waited in the call, from its entry to its exit.
  [[nodiscard]] std::int64_t blocked() const noexcept
  {
    return data_.correlationData != nullptr ? steady_ns() - static_cast<std::int64_t>(*data_.correlationData) : 0;
  }
  void on(CUstream stream, bool per_thread_call);
  void touch(CUdeviceptr address, std::size_t bytes, access mode);
  void scan(const std::byte* bytes, std::size_t size);
  void launch(CUfunction f, CUstream stream, void** arguments, void** extra, bool per_thread_call);
  void copy(CUdeviceptr dst, CUdeviceptr src, std::size_t bytes, CUstream stream, bool per_thread_call);
  void copy_and_wait(CUdeviceptr dst, CUdeviceptr src, std::size_t bytes, bool per_thread_call);
  void set(CUdeviceptr dst, std::size_t bytes, CUstream stream, bool per_thread_call);
  void allocated(CUdeviceptr address, std::size_t bytes);
  void freed(CUdeviceptr address);
  void unmapped(CUdeviceptr address, std::size_t bytes);
  // Each decodes the calls of one kind.
  outcome launches();
  outcome copies();
  outcome sets();
  outcome stream_or_event();
  outcome stream_created();
  outcome host_wait();
  outcome memory();
  outcome allocation();

  static constexpr std::size_t most_words = 256;  // a kernel's arguments fit in 32 KiB; pointers come first

  watcher& w_;
  CUpti_CallbackId id_;
  const CUpti_CallbackData& data_;
  bool entering_;
  activity::record r_;
  std::vector<buffer_use> buffers_;
  std::size_t words_{0};  // of the kernel's arguments, scanned for addresses
};

void decoded_call::on(CUstream stream, bool per_thread_call)
{
  const watcher::named_stream s = w_.stream_of(stream, per_thread_call);
  r_.stream = s.handle;
  r_.stream_class = s.klass;
  r_.device = {kDLCUDA, s.device};
}

void decoded_call::touch(CUdeviceptr address, std::size_t bytes, access mode)
{
  if (auto use = w_.device_memory(static_cast<std::uintptr_t>(address), bytes, mode)) { buffers_.push_back(*use); }
}

// Each aligned word that may be an address.
void decoded_call::scan(const std::byte* bytes, std::size_t size)
{
  for (std::size_t at = 0; at + sizeof(std::uintptr_t) <= size && words_ < most_words;
       at += sizeof(std::uintptr_t), ++words_) {
    std::uintptr_t value = 0;
    std::memcpy(&value, bytes + at, sizeof value);
    if (value >= no_pointer_below) { touch(static_cast<CUdeviceptr>(value), 0, access::read_write); }
  }
}

void decoded_call::launch(CUfunction f, CUstream stream, void** arguments, void** extra, bool per_thread_call)
{
  r_.kind = activity::kind::launch;
  r_.name = activity::intern(data_.symbolName != nullptr ? data_.symbolName : "?");
  on(stream, per_thread_call);
  if (arguments != nullptr) {
    const std::vector<std::size_t> sizes = w_.argument_layout(f);
    for (std::size_t index = 0; index < sizes.size() && words_ < most_words; ++index) {
      scan(static_cast<const std::byte*>(arguments[index]), sizes[index]);
    }
  } else {  // packed into one buffer, each argument at its own alignment
    const std::span<const std::byte> packed = packed_arguments(extra);
    scan(packed.data(), packed.size());
  }
  // One use per memory: a pointer passed twice (or in and out) is one buffer, read and written.
  std::sort(buffers_.begin(), buffers_.end(),
            [](const buffer_use& a, const buffer_use& b) { return a.address < b.address; });
  buffers_.erase(std::unique(buffers_.begin(), buffers_.end(),
                             [](const buffer_use& a, const buffer_use& b) { return a.address == b.address; }),
                 buffers_.end());
}

void decoded_call::copy(CUdeviceptr dst, CUdeviceptr src, std::size_t bytes, CUstream stream, bool per_thread_call)
{
  r_.kind = activity::kind::copy;
  on(stream, per_thread_call);
  touch(src, bytes, access::read);
  touch(dst, bytes, access::write);
}

// A synchronous copy is a copy on the default stream that the host waits for.
void decoded_call::copy_and_wait(CUdeviceptr dst, CUdeviceptr src, std::size_t bytes, bool per_thread_call)
{
  copy(dst, src, bytes, nullptr, per_thread_call);
  r_.buffers = buffers_;
  activity::report(r_);
  buffers_.clear();
  r_.kind = activity::kind::host_sync;
  r_.scope = activity::sync_scope::copy;
  r_.blocked_ns = blocked();
}

void decoded_call::set(CUdeviceptr dst, std::size_t bytes, CUstream stream, bool per_thread_call)
{
  r_.kind = activity::kind::set;
  on(stream, per_thread_call);
  touch(dst, bytes, access::write);
}

void decoded_call::allocated(CUdeviceptr address, std::size_t bytes)
{
  {
    std::lock_guard lock{w_.memory_mutex};
    w_.allocations.insert_or_assign(static_cast<std::uintptr_t>(address), bytes);
  }
  r_.kind = activity::kind::allocate;
  buffers_.push_back({.address = static_cast<std::uintptr_t>(address), .bytes = bytes, .mode = access::write});
}

void decoded_call::freed(CUdeviceptr address)
{
  std::lock_guard lock{w_.memory_mutex};
  const auto found = w_.allocations.find(static_cast<std::uintptr_t>(address));
  if (found == w_.allocations.end()) { return; }
  r_.kind = activity::kind::free;
  buffers_.push_back({.address = found->first, .bytes = found->second, .mode = access::write});
  w_.allocations.erase(found);
}

// An unmapping ends every mapping in its range.
void decoded_call::unmapped(CUdeviceptr address, std::size_t bytes)
{
  const auto low = static_cast<std::uintptr_t>(address);
  std::lock_guard lock{w_.memory_mutex};
  for (auto it = w_.allocations.lower_bound(low); it != w_.allocations.end() && it->first - low < bytes;) {
    r_.kind = activity::kind::free;
    buffers_.push_back({.address = it->first, .bytes = it->second, .mode = access::write});
    it = w_.allocations.erase(it);
  }
}

decoded_call::outcome decoded_call::launches()
{
  switch (id_) {
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel: {
      const auto& p = params<cuLaunchKernel_params>();
      launch(p.f, p.hStream, p.kernelParams, p.extra, false);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernel_ptsz: {
      const auto& p = params<cuLaunchKernel_ptsz_params>();
      launch(p.f, p.hStream, p.kernelParams, p.extra, true);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz: {
      const auto& p = params<cuLaunchKernelEx_params>();
      launch(p.f, p.config != nullptr ? p.config->hStream : nullptr, p.kernelParams, p.extra,
             is(CUPTI_DRIVER_TRACE_CBID_cuLaunchKernelEx_ptsz));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel:
    case CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz: {
      const auto& p = params<cuLaunchCooperativeKernel_params>();
      launch(p.f, p.hStream, p.kernelParams, nullptr, is(CUPTI_DRIVER_TRACE_CBID_cuLaunchCooperativeKernel_ptsz));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch:
    case CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz: {
      // One operation of its stream (what its nodes touch is not seen): the legacy stream's rule
      // orders other streams by it.
      static_assert(sizeof(cuGraphLaunch_params) == sizeof(cuGraphLaunch_ptsz_params));
      r_.kind = activity::kind::launch;
      r_.name = "cuGraphLaunch";
      on(params<cuGraphLaunch_params>().hStream, is(CUPTI_DRIVER_TRACE_CBID_cuGraphLaunch_ptsz));
      break;
    }
    default:
      return outcome::other_call;
  }
  return outcome::activity;
}

decoded_call::outcome decoded_call::copies()
{
  switch (id_) {
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync_ptsz: {
      const auto& p = params<cuMemcpyAsync_params>();
      copy(p.dst, p.src, p.ByteCount, p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuMemcpyAsync_ptsz));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz: {
      const auto& p = params<cuMemcpyHtoDAsync_v2_params>();
      copy(p.dstDevice, 0, p.ByteCount, p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoDAsync_v2_ptsz));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz: {
      const auto& p = params<cuMemcpyDtoHAsync_v2_params>();
      copy(0, p.srcDevice, p.ByteCount, p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoHAsync_v2_ptsz));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2_ptsz: {
      const auto& p = params<cuMemcpyDtoDAsync_v2_params>();
      copy(p.dstDevice, p.srcDevice, p.ByteCount, p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoDAsync_v2_ptsz));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpy:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpy_ptds: {
      const auto& p = params<cuMemcpy_params>();
      copy_and_wait(p.dst, p.src, p.ByteCount, is(CUPTI_DRIVER_TRACE_CBID_cuMemcpy_ptds));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2_ptds: {
      const auto& p = params<cuMemcpyHtoD_v2_params>();
      copy_and_wait(p.dstDevice, 0, p.ByteCount, is(CUPTI_DRIVER_TRACE_CBID_cuMemcpyHtoD_v2_ptds));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2_ptds: {
      const auto& p = params<cuMemcpyDtoH_v2_params>();
      copy_and_wait(0, p.srcDevice, p.ByteCount, is(CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoH_v2_ptds));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2:
    case CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2_ptds: {
      const auto& p = params<cuMemcpyDtoD_v2_params>();
      copy_and_wait(p.dstDevice, p.srcDevice, p.ByteCount, is(CUPTI_DRIVER_TRACE_CBID_cuMemcpyDtoD_v2_ptds));
      break;
    }
    default:
      return outcome::other_call;
  }
  return outcome::activity;
}

decoded_call::outcome decoded_call::sets()
{
  switch (id_) {
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async:
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async_ptsz: {
      const auto& p = params<cuMemsetD8Async_params>();
      set(p.dstDevice, p.N, p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuMemsetD8Async_ptsz));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD16Async:
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD16Async_ptsz: {
      const auto& p = params<cuMemsetD16Async_params>();
      set(p.dstDevice, p.N * 2, p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuMemsetD16Async_ptsz));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async:
    case CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async_ptsz: {
      const auto& p = params<cuMemsetD32Async_params>();
      set(p.dstDevice, p.N * 4, p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuMemsetD32Async_ptsz));
      break;
    }
    default:
      return outcome::other_call;
  }
  return outcome::activity;
}

decoded_call::outcome decoded_call::stream_created()
{
  CUstream* made = nullptr;
  unsigned int flags = 0;
  if (is(CUPTI_DRIVER_TRACE_CBID_cuStreamCreate)) {
    made = params<cuStreamCreate_params>().phStream;
    flags = params<cuStreamCreate_params>().Flags;
  } else {
    made = params<cuStreamCreateWithPriority_params>().phStream;
    flags = params<cuStreamCreateWithPriority_params>().flags;
  }
  if (made == nullptr) { return outcome::nothing; }
  {
    std::lock_guard lock{w_.memory_mutex};
    w_.classes.insert_or_assign(
      *made, (flags & CU_STREAM_NON_BLOCKING) != 0 ? stream_class::non_blocking : stream_class::blocking);
  }
  r_.kind = activity::kind::stream_create;
  on(*made, false);
  return outcome::activity;
}

decoded_call::outcome decoded_call::stream_or_event()
{
  switch (id_) {
    case CUPTI_DRIVER_TRACE_CBID_cuStreamCreate:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamCreateWithPriority:
      return stream_created();
    case CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy_v2: {
      const CUstream stream = params<cuStreamDestroy_v2_params>().hStream;
      if (!entering_) {  // the handle may be reused now: forget its class
        std::lock_guard lock{w_.memory_mutex};
        w_.classes.erase(stream);
        return outcome::nothing;
      }
      r_.kind = activity::kind::stream_destroy;
      on(stream, false);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecord:
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecord_ptsz: {
      const auto& p = params<cuEventRecord_params>();
      r_.kind = activity::kind::event_record;
      r_.event = reinterpret_cast<std::uintptr_t>(p.hEvent);
      on(p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuEventRecord_ptsz));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags:
    case CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags_ptsz: {
      const auto& p = params<cuEventRecordWithFlags_params>();
      r_.kind = activity::kind::event_record;
      r_.event = reinterpret_cast<std::uintptr_t>(p.hEvent);
      on(p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuEventRecordWithFlags_ptsz));
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent_ptsz: {
      const auto& p = params<cuStreamWaitEvent_params>();
      r_.kind = activity::kind::stream_wait;
      r_.event = reinterpret_cast<std::uintptr_t>(p.hEvent);
      on(p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuStreamWaitEvent_ptsz));
      break;
    }
    default:
      return outcome::other_call;
  }
  return outcome::activity;
}

decoded_call::outcome decoded_call::host_wait()
{
  switch (id_) {
    case CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize_ptsz:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamQuery:
    case CUPTI_DRIVER_TRACE_CBID_cuStreamQuery_ptsz: {
      const bool query = is(CUPTI_DRIVER_TRACE_CBID_cuStreamQuery) || is(CUPTI_DRIVER_TRACE_CBID_cuStreamQuery_ptsz);
      r_.kind = query ? activity::kind::host_query : activity::kind::host_sync;
      r_.scope = activity::sync_scope::stream;
      on(params<cuStreamSynchronize_params>().hStream,
         is(CUPTI_DRIVER_TRACE_CBID_cuStreamSynchronize_ptsz) || is(CUPTI_DRIVER_TRACE_CBID_cuStreamQuery_ptsz));
      r_.blocked_ns = query ? 0 : blocked();
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize:
      r_.kind = activity::kind::host_sync;
      r_.scope = activity::sync_scope::device;
      r_.device = {kDLCUDA, w_.current_device()};
      r_.blocked_ns = blocked();
      break;
#if CUDA_VERSION >= 13000
    case CUPTI_DRIVER_TRACE_CBID_cuCtxSynchronize_v2: {
      const CUcontext context = params<cuCtxSynchronize_v2_params>().ctx;  // null: the current one
      CUdevice device = 0;
      r_.kind = activity::kind::host_sync;
      r_.scope = activity::sync_scope::device;
      r_.device = {kDLCUDA, context != nullptr && w_.driver.device_of_context(&device, context) == CUDA_SUCCESS
                              ? static_cast<int>(device)
                              : w_.current_device()};
      r_.blocked_ns = blocked();
      break;
    }
#endif
    case CUPTI_DRIVER_TRACE_CBID_cuEventSynchronize:
    case CUPTI_DRIVER_TRACE_CBID_cuEventQuery: {
      const bool query = is(CUPTI_DRIVER_TRACE_CBID_cuEventQuery);
      r_.kind = query ? activity::kind::host_query : activity::kind::host_sync;
      r_.scope = activity::sync_scope::event;
      r_.event = reinterpret_cast<std::uintptr_t>(params<cuEventSynchronize_params>().hEvent);
      r_.device = {kDLCUDA, w_.current_device()};
      r_.blocked_ns = query ? 0 : blocked();
      break;
    }
    default:
      return outcome::other_call;
  }
  return outcome::activity;
}

decoded_call::outcome decoded_call::allocation()
{
  switch (id_) {
    case CUPTI_DRIVER_TRACE_CBID_cuMemAlloc_v2: {
      const auto& p = params<cuMemAlloc_v2_params>();
      r_.device = {kDLCUDA, w_.current_device()};
      allocated(*p.dptr, p.bytesize);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocManaged: {
      const auto& p = params<cuMemAllocManaged_params>();
      r_.device = {kDLCUDA, w_.current_device()};
      allocated(*p.dptr, p.bytesize);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocPitch_v2: {
      const auto& p = params<cuMemAllocPitch_v2_params>();
      r_.device = {kDLCUDA, w_.current_device()};
      allocated(*p.dptr, *p.pPitch * p.Height);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync_ptsz: {
      const auto& p = params<cuMemAllocAsync_params>();
      on(p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuMemAllocAsync_ptsz));
      r_.stream_ordered = true;
      allocated(*p.dptr, p.bytesize);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync_ptsz: {
      const auto& p = params<cuMemAllocFromPoolAsync_params>();
      on(p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuMemAllocFromPoolAsync_ptsz));
      r_.stream_ordered = true;
      allocated(*p.dptr, p.bytesize);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemMap: {
      const auto& p = params<cuMemMap_params>();
      r_.device = {kDLCUDA, w_.current_device()};
      allocated(p.ptr, p.size);
      break;
    }
    default:
      return outcome::other_call;
  }
  return outcome::activity;
}

decoded_call::outcome decoded_call::memory()
{
  switch (id_) {
    case CUPTI_DRIVER_TRACE_CBID_cuMemFree_v2:
      r_.device = {kDLCUDA, w_.current_device()};
      r_.blocked_ns = blocked();  // cuMemFree synchronizes the device first
      freed(params<cuMemFree_v2_params>().dptr);
      break;
    case CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync:
    case CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync_ptsz: {
      const auto& p = params<cuMemFreeAsync_params>();
      on(p.hStream, is(CUPTI_DRIVER_TRACE_CBID_cuMemFreeAsync_ptsz));
      r_.stream_ordered = true;
      freed(p.dptr);
      break;
    }
    case CUPTI_DRIVER_TRACE_CBID_cuMemUnmap: {
      const auto& p = params<cuMemUnmap_params>();
      r_.device = {kDLCUDA, w_.current_device()};
      unmapped(p.ptr, p.size);
      break;
    }
    default:
      return allocation();
  }
  return outcome::activity;
}

void decoded_call::report()
{
  if ((r_.kind == activity::kind::free || r_.kind == activity::kind::allocate) && buffers_.empty()) { return; }
  r_.buffers = buffers_;
  activity::report(r_);
}

void watcher::handle(CUpti_CallbackId id, const CUpti_CallbackData& data) noexcept
{
  try {
    if (data.callbackSite == CUPTI_API_ENTER) {
      if (data.correlationData != nullptr) { *data.correlationData = static_cast<std::uint64_t>(steady_ns()); }
      if (id != CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy_v2) { return; }  // reported once done, as it succeeded
    } else if (data.functionReturnValue != nullptr &&
               *static_cast<const CUresult*>(data.functionReturnValue) != CUDA_SUCCESS &&
               id != CUPTI_DRIVER_TRACE_CBID_cuStreamDestroy_v2) {
      return;  // a failed call did nothing (a query that said "not ready" saw nothing done either)
    }
    decoded_call call{*this, id, data};
    if (call.decode() == decoded_call::outcome::activity) { call.report(); }
  } catch (...) {  // a tracing tool never breaks the program it watches: this activity goes untraced
  }
}

}  // namespace

std::vector<std::string> cupti_candidates()
{
  std::vector<std::string> out;
  if (const char* configured = std::getenv("HANDOFF_CUPTI_LIBRARY"); configured != nullptr && *configured != '\0') {
    out.emplace_back(configured);
  }
  out.emplace_back("libcupti.so");
  out.emplace_back(fmt::format("libcupti.so.{}", CUDART_VERSION / 1000));
#ifdef HANDOFF_CUDA_TOOLKIT_ROOT
  out.emplace_back(HANDOFF_CUDA_TOOLKIT_ROOT "/lib64/libcupti.so");
  out.emplace_back(HANDOFF_CUDA_TOOLKIT_ROOT "/extras/CUPTI/lib64/libcupti.so");
#endif
  return out;
}

std::span<const std::byte> packed_arguments(void* const* extra) noexcept
{
  if (extra == nullptr) { return {}; }
  const std::byte* packed = nullptr;
  std::size_t size = 0;
  for (void* const* option = extra; *option != CU_LAUNCH_PARAM_END; option += 2) {
    if (option[0] == CU_LAUNCH_PARAM_BUFFER_POINTER) { packed = static_cast<const std::byte*>(option[1]); }
    if (option[0] == CU_LAUNCH_PARAM_BUFFER_SIZE && option[1] != nullptr) {
      std::memcpy(&size, option[1], sizeof size);
    }
  }
  if (packed == nullptr) { return {}; }
  return {packed, size};
}

std::string watch_cupti(bool on) noexcept
{
  try {
    watcher& w = watcher::get();
    std::lock_guard lock{w.mutex};
    if (!on) {
      if (w.watchers > 0 && --w.watchers == 0 && w.subscriber != nullptr) {
        (void)w.cupti.unsubscribe(w.subscriber);
        w.subscriber = nullptr;
        HANDOFF_LOG_DEBUG("cuda: CUPTI unsubscribed");
      }
      return {};
    }
    if (w.watchers > 0) {
      ++w.watchers;
      return {};
    }
    if (std::string failure = w.load(); !failure.empty()) { return failure; }
    if (std::string failure = w.subscribe(); !failure.empty()) { return failure; }
    w.watchers = 1;
    HANDOFF_LOG_DEBUG("cuda: CUPTI ({}) subscribed to the driver API", w.library_path);
    return {};
  } catch (const std::exception& error) {
    return fmt::format("CUPTI could not be started: {}", error.what());
  }
}

}  // namespace handoff::device::cuda
