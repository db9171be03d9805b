#include "device/sim/names.hpp"

#include <array>

namespace handoff::device::sim_detail {
namespace {

struct error_info {
  sim_error code;
  std::string_view cuda_name;
  std::string_view hip_name;
  std::string_view text;
};

constexpr std::array error_table{
  error_info{sim_error::invalid_value, "cudaErrorInvalidValue", "hipErrorInvalidValue", "invalid argument"},
  error_info{sim_error::invalid_device, "cudaErrorInvalidDevice", "hipErrorInvalidDevice", "invalid device ordinal"},
  error_info{sim_error::invalid_handle, "cudaErrorInvalidResourceHandle", "hipErrorInvalidHandle",
             "invalid resource handle"},
  error_info{sim_error::memory_allocation, "cudaErrorMemoryAllocation", "hipErrorOutOfMemory", "out of memory"},
  error_info{sim_error::not_permitted, "cudaErrorNotPermitted", "hipErrorNotPermitted",
             "operation not permitted (a host function must not call the runtime)"},
  error_info{sim_error::capture_unsupported, "cudaErrorStreamCaptureUnsupported", "hipErrorStreamCaptureUnsupported",
             "operation not permitted when stream is capturing"},
  error_info{sim_error::capture_invalidated, "cudaErrorStreamCaptureInvalidated", "hipErrorStreamCaptureInvalidated",
             "operation failed due to a previous error during capture"},
  error_info{sim_error::capture_implicit, "cudaErrorStreamCaptureImplicit", "hipErrorStreamCaptureImplicit",
             "operation would make the legacy stream depend on a capturing blocking stream"},
  error_info{sim_error::capture_isolation, "cudaErrorStreamCaptureIsolation", "hipErrorStreamCaptureIsolation",
             "dependency created on uncaptured work in another stream"},
  error_info{sim_error::capture_unmatched, "cudaErrorStreamCaptureUnmatched", "hipErrorStreamCaptureUnmatched",
             "capture was not initiated in this stream"},
  error_info{sim_error::captured_event, "cudaErrorCapturedEvent", "hipErrorCapturedEvent",
             "operation not permitted on an event last recorded in a capturing stream"},
  error_info{sim_error::illegal_state, "cudaErrorIllegalState", "hipErrorIllegalState",
             "the operation cannot be performed in the present state"},
  error_info{sim_error::device_uninitialized, "cudaErrorDeviceUninitialized", "hipErrorInvalidContext",
             "invalid device context"},
  error_info{sim_error::map_failed, "cudaErrorMapBufferObjectFailed", "hipErrorMapFailed",
             "mapping of buffer object failed"},
  error_info{sim_error::peer_access_unsupported, "cudaErrorPeerAccessUnsupported", "hipErrorPeerAccessUnsupported",
             "peer access is not supported between these two devices"},
};

// Errors a fault may name that the simulation never raises by itself.
constexpr std::array<std::pair<std::string_view, std::string_view>, 3> injected_texts{{
  {"IllegalAddress", "an illegal memory access was encountered"},
  {"LaunchFailure", "unspecified launch failure"},
  {"InsufficientDriver", "CUDA driver version is insufficient for CUDA runtime version"},
}};

struct operation_info {
  std::string_view key;
  std::string_view cuda_call;
  std::string_view hip_call;
};

constexpr std::array operation_table{
  operation_info{"device_count", "cudaGetDeviceCount", "hipGetDeviceCount"},
  operation_info{"current_device", "cudaGetDevice", "hipGetDevice"},
  operation_info{"uuid", "cudaGetDeviceProperties", "hipGetDeviceProperties"},
  operation_info{"set_current_device", "cudaSetDevice", "hipSetDevice"},
  operation_info{"push_current_device", "cuCtxPushCurrent", "hipCtxPushCurrent"},
  operation_info{"create_stream", "cudaStreamCreateWithFlags", "hipStreamCreateWithFlags"},
  operation_info{"stream_device", "cuStreamGetDevice", "hipStreamGetDevice"},
  operation_info{"stream_is_blocking", "cudaStreamGetFlags", "hipStreamGetFlags"},
  operation_info{"stream_capture_status", "cudaStreamIsCapturing", "hipStreamIsCapturing"},
  operation_info{"stream_capture_id", "cudaStreamGetCaptureInfo", "hipStreamGetCaptureInfo"},
  operation_info{"query_stream", "cudaStreamQuery", "hipStreamQuery"},
  operation_info{"synchronize_stream", "cudaStreamSynchronize", "hipStreamSynchronize"},
  operation_info{"synchronize_device", "cudaDeviceSynchronize", "hipDeviceSynchronize"},
  operation_info{"exchange_capture_mode", "cudaThreadExchangeStreamCaptureMode", "hipThreadExchangeStreamCaptureMode"},
  operation_info{"create_event", "cudaEventCreateWithFlags", "hipEventCreateWithFlags"},
  operation_info{"record_event", "cudaEventRecord", "hipEventRecord"},
  operation_info{"query_event", "cudaEventQuery", "hipEventQuery"},
  operation_info{"synchronize_event", "cudaEventSynchronize", "hipEventSynchronize"},
  operation_info{"stream_wait_event", "cudaStreamWaitEvent", "hipStreamWaitEvent"},
  operation_info{"attributes", "cuPointerGetAttributes", "hipPointerGetAttributes"},
  operation_info{"allocate", "cudaMallocAsync", "hipMallocAsync"},
  operation_info{"copy_async", "cudaMemcpyAsync", "hipMemcpyAsync"},
  operation_info{"launch_host_func", "cudaLaunchHostFunc", "hipLaunchHostFunc"},
  operation_info{"enqueue_fill", "simEnqueueFill", "simEnqueueFill"},
  operation_info{"enqueue_sleep", "simEnqueueSleep", "simEnqueueSleep"},
  operation_info{"launch_kernel", "cudaLaunchKernel", "hipLaunchKernel"},
  operation_info{"begin_capture", "cudaStreamBeginCapture", "hipStreamBeginCapture"},
  operation_info{"end_capture", "cudaStreamEndCapture", "hipStreamEndCapture"},
  operation_info{"launch_graph", "cudaGraphLaunch", "hipGraphLaunch"},
  operation_info{"allocate_pinned_host", "cudaMallocHost", "hipHostMalloc"},
  operation_info{"allocate_managed", "cudaMallocManaged", "hipMallocManaged"},
  operation_info{"free_sync", "cudaFree", "hipFree"},
  operation_info{"context_id", "cuCtxGetId", "hipDevicePrimaryCtxGetState"},
  operation_info{"release_with_capture", "cudaGraphRetainUserObject", "hipGraphRetainUserObject"},
  operation_info{"ipc_memory_handle", "cudaIpcGetMemHandle", "hipIpcGetMemHandle"},
  operation_info{"create_ipc_event", "cudaEventCreateWithFlags", "hipEventCreateWithFlags"},
  operation_info{"ipc_event_handle", "cudaIpcGetEventHandle", "hipIpcGetEventHandle"},
  operation_info{"register_host_memory", "cudaHostRegister", "hipHostRegister"},
  operation_info{"stream_write_value", "cuStreamWriteValue64", "hipStreamWriteValue64"},
  operation_info{"stream_wait_value", "cuStreamWaitValue64", "hipStreamWaitValue64"},
  operation_info{"hold", "simStreamHold", "simStreamHold"},
  operation_info{"pending", "simStreamPending", "simStreamPending"},
  operation_info{"held", "simStreamHeld", "simStreamHeld"},
  operation_info{"waits_for_hold", "simStreamWaitsForHold", "simStreamWaitsForHold"},
  operation_info{"synchronize_unheld", "simSynchronizeUnheld", "simSynchronizeUnheld"},
};

// Not injectable: they are noexcept (a failure there can only be logged), or open what another
// process shared (which no single-process test can make succeed).
constexpr std::array quiet_table{
  operation_info{"open_ipc_memory", "cudaIpcOpenMemHandle", "hipIpcOpenMemHandle"},
  operation_info{"open_ipc_event", "cudaIpcOpenEventHandle", "hipIpcOpenEventHandle"},
  operation_info{"destroy_stream", "cudaStreamDestroy", "hipStreamDestroy"},
  operation_info{"destroy_event", "cudaEventDestroy", "hipEventDestroy"},
  operation_info{"deallocate", "cudaFreeAsync", "hipFreeAsync"},
  operation_info{"pop_current_device", "cuCtxPopCurrent", "hipCtxPopCurrent"},
  operation_info{"close_ipc_memory", "cudaIpcCloseMemHandle", "hipIpcCloseMemHandle"},
  operation_info{"unregister_host_memory", "cudaHostUnregister", "hipHostUnregister"},
};

constexpr auto operation_keys = [] {
  std::array<std::string_view, operation_table.size()> keys{};
  for (std::size_t i = 0; i < operation_table.size(); ++i) { keys[i] = operation_table[i].key; }
  return keys;
}();

}  // namespace

std::string_view error_name(sim_error code, sim_flavour flavour) noexcept
{
  for (const auto& info : error_table) {
    if (info.code == code) { return flavour == sim_flavour::cuda ? info.cuda_name : info.hip_name; }
  }
  return "simErrorUnknown";
}

std::string_view error_text(sim_error code) noexcept
{
  for (const auto& info : error_table) {
    if (info.code == code) { return info.text; }
  }
  return "unknown error";
}

std::string_view error_text(std::string_view name) noexcept
{
  for (const auto& info : error_table) {
    if (info.cuda_name == name || info.hip_name == name) { return info.text; }
  }
  for (const auto& [suffix, text] : injected_texts) {
    if (name.ends_with(suffix)) { return text; }
  }
  return "injected fault";
}

std::string_view call_name(std::string_view operation, sim_flavour flavour) noexcept
{
  const auto spelled = [flavour](const operation_info& info) {
    return flavour == sim_flavour::cuda ? info.cuda_call : info.hip_call;
  };
  for (const auto& info : operation_table) {
    if (info.key == operation) { return spelled(info); }
  }
  for (const auto& info : quiet_table) {
    if (info.key == operation) { return spelled(info); }
  }
  return operation;
}

std::span<const std::string_view> fault_operations() noexcept
{
  return operation_keys;
}

}  // namespace handoff::device::sim_detail
