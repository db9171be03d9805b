// What a DLPack `stream` argument asks of a producer, per device type (the contract's stream table).
#pragma once

#include <handoff/dlpack.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <string>

namespace handoff {

/// How the producer must order its pending work before the consumer's.
enum class stream_order {
  none,                ///< no ordering (-1; or any CPU-like device with None)
  legacy_default,      ///< CUDA's legacy default stream (None or 1)
  per_thread_default,  ///< CUDA's per-thread default stream (2)
  default_stream,      ///< ROCm's default stream (None or 0)
  handle,              ///< the consumer's stream, given by handle (> 2)
};

/// Which consumer streams an export's producer waits for when the consumer releases the export
/// (its deleter: PyTorch and CuPy call it at their refcount zero, whatever their stream still has
/// queued). A stream that may be destroyed by then is never touched: recording on it is undefined.
enum class export_release : std::uint8_t {
  known_streams,  ///< the default streams (1, 2; ROCm's 0) and streams whose owner the export holds
  every_stream,   ///< raw handles too: the application promises that each consumer stream outlives
                  ///< the exports it was handed (HANDOFF_EXPORT_RELEASE=every-stream)
};

/// A validated consumer stream request.
struct stream_request {
  stream_order order{stream_order::none};
  std::uintptr_t handle{0};  ///< the stream handle when order == handle

  friend bool operator==(const stream_request&, const stream_request&) = default;
};

/// Maps the `stream` argument of `__dlpack__` (nullopt for None) to a request for an array on
/// `device`. Pure: touches no device.
/// @throws value_error naming the value and the device type when the table forbids it.
[[nodiscard]] stream_request classify_stream(DLDeviceType device, std::optional<std::int64_t> stream);

/// True for device types whose memory is ordered by CUDA streams.
[[nodiscard]] constexpr bool is_cuda_device(DLDeviceType device) noexcept
{
  return device == kDLCUDA || device == kDLCUDAHost || device == kDLCUDAManaged;
}

/// True for device types whose memory is ordered by ROCm streams.
[[nodiscard]] constexpr bool is_rocm_device(DLDeviceType device) noexcept
{
  return device == kDLROCM || device == kDLROCMHost;
}

/// True for device types whose memory is ordered by streams (CUDA's or ROCm's).
[[nodiscard]] constexpr bool has_streams(DLDeviceType device) noexcept
{
  return is_cuda_device(device) || is_rocm_device(device);
}

/// The DLPack stream value that names the default stream of `device`'s memory: 1 (the legacy
/// default stream) for CUDA, 0 for ROCm; nullopt for devices without streams. A consumer passes it
/// explicitly, since some producers (PyTorch) read an omitted `stream` as "no synchronization".
[[nodiscard]] constexpr std::optional<std::int64_t> default_stream_value(DLDeviceType device) noexcept
{
  if (is_cuda_device(device)) { return 1; }
  if (is_rocm_device(device)) { return 0; }
  return std::nullopt;
}

/// The DLPack stream value naming native stream `handle` for `device`'s memory: the handle itself,
/// but CUDA's legacy default stream, handle 0, is 1 (cudaStreamLegacy), as DLPack and the CUDA Array
/// Interface spell it; 0 would be ambiguous there.
[[nodiscard]] constexpr std::int64_t stream_value_of(DLDeviceType device, std::uint64_t handle) noexcept
{
  return is_cuda_device(device) && handle == 0 ? 1 : static_cast<std::int64_t>(handle);
}

/// A stream as the caller of an exchange names it, before the data's device type is known: the
/// device's default stream, a DLPack stream value (whose meaning depends on the device type: 0 is
/// ROCm's default stream and invalid for CUDA), or a native handle (a stream object's). Resolved once
/// per call, so that a stream object's protocol is read once.
struct named_stream {
  enum class form : std::uint8_t {
    default_stream,  ///< nothing named: the device's default stream
    dlpack_value,    ///< `value` is a DLPack stream value, read by the stream table
    native_handle,   ///< `value` is a native stream handle
  };
  form how{form::default_stream};
  std::int64_t value{0};
  /// Keeps the stream alive while it is used (a stream object: CuPy, cuda.core and Numba destroy
  /// their stream with it); empty when the caller owns the stream.
  std::shared_ptr<const void> owner;

  [[nodiscard]] static named_stream dlpack(std::int64_t value) { return {form::dlpack_value, value, {}}; }
  /// @throws value_error for a handle above INT64_MAX: no DLPack stream value names it (the stream
  /// table would read it as a negative value, -1 among them: no ordering at all).
  [[nodiscard]] static named_stream native(std::uint64_t handle, std::shared_ptr<const void> owner)
  {
    if (handle > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) { throw_unnamed_handle(handle); }
    return {form::native_handle, static_cast<std::int64_t>(handle), std::move(owner)};
  }
  [[nodiscard]] bool is_default() const noexcept { return how == form::default_stream; }

 private:
  [[noreturn]] static void throw_unnamed_handle(std::uint64_t handle);
};

/// True for pinned host memory (kDLCUDAHost, kDLROCMHost): host memory that device streams may
/// also read and write.
[[nodiscard]] constexpr bool is_pinned_host(DLDeviceType device) noexcept
{
  return device == kDLCUDAHost || device == kDLROCMHost;
}

/// The DLPack stream value that names `stream` to a producer of data on `device`: the device's
/// default stream value for the default stream, the value itself, or the handle's value
/// (stream_value_of); nullopt for devices without streams, whose producers take only None.
/// Pinned host memory gets None too, -1 aside: PyTorch's pinned tensors are CPU tensors to it and
/// take only None or -1, cuda.core ignores the value, and a producer that follows the stream table
/// reads None as the device's default stream, which the consumer then orders itself after
/// (exchange::import, producer_answer::ordered_for_default_stream).
[[nodiscard]] std::optional<std::int64_t> dlpack_stream_value(const named_stream& stream, DLDeviceType device) noexcept;

/// What `stream` asks of data on `device` (classify_stream of its value; a native handle only
/// names a stream of a device with streams).
/// @throws value_error as classify_stream does, or for a native handle and a device without streams.
[[nodiscard]] stream_request request_for(const named_stream& stream, DLDeviceType device);

/// True for device types whose memory the host can read and write directly (pinned, managed).
[[nodiscard]] constexpr bool is_host_accessible(DLDeviceType device) noexcept
{
  return device == kDLCUDAHost || device == kDLCUDAManaged || device == kDLROCMHost;
}

/// `device` as DLPack numbers it: the CPU is device 0. A producer that numbers it otherwise (an id per
/// host thread pool) still means the one host, and its data must not look moved to a consumer that
/// asks for (kDLCPU, 0).
[[nodiscard]] constexpr DLDevice on_one_cpu(DLDevice device) noexcept
{
  if (device.device_type == kDLCPU) { device.device_id = 0; }
  return device;
}

/// A device type DLPack defines, and its names: for messages ("CUDA host") and for the trace's
/// tools ("cuda_host").
struct device_type_info {
  DLDeviceType type;
  const char* name;
  const char* label;
};

/// Every device type DLPack defines (kDLCPU, kDLCUDA, ... kDLTrn; 5 and 6 are not), in its order.
[[nodiscard]] std::span<const device_type_info> dlpack_device_types() noexcept;

/// True when `type` is a device type DLPack defines.
[[nodiscard]] bool is_dlpack_device_type(std::int64_t type) noexcept;

/// Name of a device type for messages ("CUDA", "ROCm host", ...).
[[nodiscard]] const char* device_type_name(DLDeviceType device) noexcept;

/// A device for messages: "CUDA device 0 ((2, 0))".
[[nodiscard]] std::string device_text(DLDevice device);

}  // namespace handoff
