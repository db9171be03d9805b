// Fuzzes the validation of the array-interface dicts (handoff/interface.hpp), as the Python binding
// calls it: `__array_interface__` with a pointer or over a buffer, and `__cuda_array_interface__`.
// Only the documented exceptions escape, an accepted dict satisfies the layout invariants
// (fuzz_support.hpp), and one over a buffer never reaches outside it: every element is read.
#include "fuzz_support.hpp"

#include <handoff/interface.hpp>

#include <string>

namespace {

using namespace handoff;

std::optional<extents> draw_shape(FuzzedDataProvider& in, std::size_t count)
{
  if (in.ConsumeIntegralInRange(0, 7) == 0) { return std::nullopt; }
  extents out;
  for (std::size_t i = 0; i < count; ++i) { out.push_back(fuzz::mostly_small(in, 0, 4)); }
  return out;
}

// Byte strides: mostly a few elements of a common size, forwards or backwards.
extents draw_strides(FuzzedDataProvider& in, std::size_t count)
{
  extents out;
  for (std::size_t i = 0; i < count; ++i) {
    constexpr std::int64_t sizes[] = {1, 2, 4, 8, 16, 3};
    const std::int64_t elements = fuzz::mostly_small(in, -6, 6);
    out.push_back(elements >= -6 && elements <= 6 ? elements * in.PickValueInArray(sizes) : elements);
  }
  return out;
}

std::optional<std::string> draw_typestr(FuzzedDataProvider& in)
{
  switch (in.ConsumeIntegralInRange(0, 7)) {
    case 0:
      return std::nullopt;
    case 1:
      return in.ConsumeRandomLengthString(8);
    default: {
      constexpr const char* typestrs[] = {"|b1", "<i1",  "|u1", "<i2", "<u4", "<i8",  "<f2", "<f4", "<f8",
                                          "<c8", "<c16", ">f4", "=f4", "|f4", "<f16", "<V8", "|O8"};
      return in.PickValueInArray(typestrs);
    }
  }
}

std::optional<std::int64_t> draw_optional(FuzzedDataProvider& in)
{
  if (in.ConsumeBool()) { return std::nullopt; }
  return fuzz::edgy_integer(in);
}

interface_dict draw_dict(FuzzedDataProvider& in, fuzz::arena& storage)
{
  interface_dict dict;
  dict.version =
    in.ConsumeBool() ? std::optional<std::int64_t>{in.ConsumeIntegralInRange<std::int64_t>(-1, 4)} : draw_optional(in);
  const auto ndim = in.ConsumeIntegralInRange<std::size_t>(0, 5);
  dict.shape = draw_shape(in, ndim);
  dict.typestr = draw_typestr(in);
  if (in.ConsumeBool()) {  // strides are optional; a wrong count is a case too
    dict.strides = draw_strides(in, in.ConsumeIntegralInRange(0, 7) == 0 ? ndim + 1 : ndim);
  }
  switch (in.ConsumeIntegralInRange(0, 4)) {
    case 0:
      break;
    case 1:
      dict.data = interface_pointer{fuzz::edgy_integer(in), in.ConsumeBool()};
      break;
    default: {
      const auto at = reinterpret_cast<std::uintptr_t>(storage.bytes + in.ConsumeIntegralInRange(0, 512));
      dict.data = interface_pointer{static_cast<std::int64_t>(at), in.ConsumeBool()};
    }
  }
  dict.offset = draw_optional(in);
  dict.stream = draw_optional(in);
  dict.masked = in.ConsumeIntegralInRange(0, 15) == 0;
  return dict;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size)
{
  FuzzedDataProvider in{data, size};
  fuzz::arena storage;
  const auto protocol = in.ConsumeIntegralInRange(0, 2);
  // The buffer of a `data` object: a window of the arena (AddressSanitizer sees past the arena
  // only, so reads past the window are caught by the explicit check below).
  const auto start = in.ConsumeIntegralInRange<std::size_t>(0, sizeof storage.bytes);
  const interface_buffer buffer{
    storage.bytes + start,
    in.ConsumeIntegralInRange<std::int64_t>(0, static_cast<std::int64_t>(sizeof storage.bytes - start)),
    in.ConsumeBool()};
  const interface_dict dict = draw_dict(in, storage);
  try {
    switch (protocol) {
      case 0:
        fuzz::check_layout(validate_array_interface(dict), storage);
        break;
      case 1: {
        const array_layout layout = validate_array_interface(dict, buffer);
        HANDOFF_FUZZ_CHECK(layout.readonly == buffer.readonly);
        const auto range = byte_range_of(layout);
        HANDOFF_FUZZ_CHECK(range.has_value());
        if (range->high > range->low) {
          const auto first = static_cast<const std::byte*>(layout.data) + range->low;
          HANDOFF_FUZZ_CHECK(first >= static_cast<const std::byte*>(buffer.data));
          HANDOFF_FUZZ_CHECK(first + (range->high - range->low) <=
                             static_cast<const std::byte*>(buffer.data) + buffer.length);
        }
        fuzz::check_layout(layout, storage);
        break;
      }
      default: {
        const cuda_interface parsed = validate_cuda_array_interface(dict);
        HANDOFF_FUZZ_CHECK(dict.version && *dict.version >= 0 && *dict.version <= 3);
        HANDOFF_FUZZ_CHECK(parsed.stream == dict.stream && parsed.stream != 0);
        fuzz::check_layout(parsed.layout, storage);
      }
    }
  } catch (const value_error&) {
  } catch (const buffer_error&) {
  } catch (const not_implemented_error&) {
    HANDOFF_FUZZ_CHECK(dict.masked);
  }
  return 0;
}
