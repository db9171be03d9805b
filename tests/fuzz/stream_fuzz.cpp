// Fuzzes the stream table, handoff::classify_stream, over every device type and stream value: it
// throws nothing but value_error, and its answers are those of the table in the contract.
#include "fuzz_support.hpp"

#include <handoff/stream_value.hpp>

#include <string>

namespace {

using namespace handoff;

// The contract's table, row by row: the answer for `stream` on a device of that family, nullopt
// where it is a ValueError.
std::optional<stream_request> expected(DLDeviceType device, std::optional<std::int64_t> stream)
{
  const auto handle = [&] { return stream_request{stream_order::handle, static_cast<std::uintptr_t>(*stream)}; };
  const stream_request none{stream_order::none, 0};
  if (device == kDLCUDA || device == kDLCUDAHost || device == kDLCUDAManaged) {
    if (!stream || *stream == 1) { return stream_request{stream_order::legacy_default, 0}; }
    if (*stream == -1) { return none; }
    if (*stream == 2) { return stream_request{stream_order::per_thread_default, 0}; }
    if (*stream > 2) { return handle(); }
    return std::nullopt;
  }
  if (device == kDLROCM || device == kDLROCMHost) {
    if (!stream || *stream == 0) { return stream_request{stream_order::default_stream, 0}; }
    if (*stream == -1) { return none; }
    if (*stream > 2) { return handle(); }
    return std::nullopt;
  }
  if (!stream) { return none; }
  return std::nullopt;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size)
{
  FuzzedDataProvider in{data, size};
  // DLDeviceType is an int32 underneath: any value can arrive from a producer.
  const auto device = static_cast<DLDeviceType>(in.ConsumeBool() ? in.ConsumeIntegralInRange<std::int32_t>(-1, 20)
                                                                 : in.ConsumeIntegral<std::int32_t>());
  const std::optional<std::int64_t> stream =
    in.ConsumeIntegralInRange(0, 7) == 0 ? std::nullopt : std::optional<std::int64_t>{fuzz::edgy_integer(in)};
  const auto want = expected(device, stream);
  HANDOFF_FUZZ_CHECK(device_type_name(device) != nullptr);
  try {
    const stream_request got = classify_stream(device, stream);
    HANDOFF_FUZZ_CHECK(want.has_value() && got == *want);
  } catch (const value_error& e) {
    HANDOFF_FUZZ_CHECK(!want.has_value());
    const std::string value = stream ? std::to_string(*stream) : "None";
    HANDOFF_FUZZ_CHECK(std::string{e.what()}.find("stream=" + value) != std::string::npos);
  }
  return 0;
}
