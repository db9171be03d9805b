#include <handoff/error.hpp>
#include <handoff/stream_value.hpp>

#include <fmt/format.h>

namespace handoff {

namespace {

constexpr device_type_info dlpack_types[] = {
  {kDLCPU, "CPU", "cpu"},
  {kDLCUDA, "CUDA", "cuda"},
  {kDLCUDAHost, "CUDA host", "cuda_host"},
  {kDLOpenCL, "OpenCL", "opencl"},
  {kDLVulkan, "Vulkan", "vulkan"},
  {kDLMetal, "Metal", "metal"},
  {kDLVPI, "VPI", "vpi"},
  {kDLROCM, "ROCm", "rocm"},
  {kDLROCMHost, "ROCm host", "rocm_host"},
  {kDLExtDev, "ExtDev", "ext_dev"},
  {kDLCUDAManaged, "CUDA managed", "cuda_managed"},
  {kDLOneAPI, "oneAPI", "oneapi"},
  {kDLWebGPU, "WebGPU", "webgpu"},
  {kDLHexagon, "Hexagon", "hexagon"},
  {kDLMAIA, "MAIA", "maia"},
  {kDLTrn, "Trainium", "trn"},
};

const device_type_info* find_type(std::int64_t type) noexcept
{
  for (const device_type_info& known : dlpack_types) {
    if (known.type == type) { return &known; }
  }
  return nullptr;
}

}  // namespace

std::span<const device_type_info> dlpack_device_types() noexcept
{
  return dlpack_types;
}

const char* device_type_name(DLDeviceType device) noexcept
{
  const device_type_info* known = find_type(device);
  return known != nullptr ? known->name : "unknown";
}

bool is_dlpack_device_type(std::int64_t type) noexcept
{
  return find_type(type) != nullptr;
}

stream_request classify_stream(DLDeviceType device, std::optional<std::int64_t> stream)
{
  const auto invalid = [&](const char* why) {
    return value_error(fmt::format("stream={} is invalid for a {} array: {}",
                                   stream ? fmt::format("{}", *stream) : "None", device_type_name(device), why));
  };
  const auto handle = [](std::int64_t value) {
    return stream_request{stream_order::handle, static_cast<std::uintptr_t>(value)};
  };

  if (is_cuda_device(device)) {
    if (!stream || *stream == 1) { return {stream_order::legacy_default, 0}; }
    if (*stream == -1) { return {stream_order::none, 0}; }
    if (*stream == 2) { return {stream_order::per_thread_default, 0}; }
    if (*stream > 2) { return handle(*stream); }
    if (*stream == 0) {
      throw invalid("0 is disallowed for CUDA (ambiguous); use 1 for the legacy default stream or 2 for per-thread");
    }
    throw invalid("expected None, -1, 1, 2 or a stream handle > 2");
  }
  if (is_rocm_device(device)) {
    if (!stream || *stream == 0) { return {stream_order::default_stream, 0}; }
    if (*stream == -1) { return {stream_order::none, 0}; }
    if (*stream > 2) { return handle(*stream); }
    if (*stream == 1 || *stream == 2) {
      throw invalid("1 and 2 are disallowed for ROCm; use 0 for the default stream");
    }
    throw invalid("expected None, -1, 0 or a stream handle > 2");
  }
  if (!stream) { return {stream_order::none, 0}; }
  throw invalid("arrays on this device are not stream-ordered; pass stream=None");
}

std::optional<std::int64_t> dlpack_stream_value(const named_stream& stream, DLDeviceType device) noexcept
{
  if (!has_streams(device)) { return std::nullopt; }
  if (is_pinned_host(device)) {
    return stream.how == named_stream::form::dlpack_value && stream.value == -1 ? std::optional<std::int64_t>{-1}
                                                                                : std::nullopt;
  }
  switch (stream.how) {
    case named_stream::form::default_stream:
      return default_stream_value(device);
    case named_stream::form::dlpack_value:
      return stream.value;
    case named_stream::form::native_handle:
      return stream_value_of(device, static_cast<std::uint64_t>(stream.value));
  }
  return std::nullopt;
}

void named_stream::throw_unnamed_handle(std::uint64_t handle)
{
  throw value_error(
    fmt::format("native stream handle {:#x} is above INT64_MAX: no DLPack stream value names it", handle));
}

stream_request request_for(const named_stream& stream, DLDeviceType device)
{
  switch (stream.how) {
    case named_stream::form::default_stream:
      return classify_stream(device, std::nullopt);
    case named_stream::form::dlpack_value:
      return classify_stream(device, stream.value);
    case named_stream::form::native_handle:
      HANDOFF_EXPECTS(
        has_streams(device), value_error,
        fmt::format("a stream object names no stream of {} data, which has no streams", device_type_name(device)));
      return classify_stream(device, stream_value_of(device, static_cast<std::uint64_t>(stream.value)));
  }
  return {};
}

std::string device_text(DLDevice device)
{
  return fmt::format("{} device {} (({}, {}))", device_type_name(device.device_type), device.device_id,
                     static_cast<int>(device.device_type), device.device_id);
}

}  // namespace handoff
