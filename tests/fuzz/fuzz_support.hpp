// What the harnesses share: an aborting check, values drawn from fuzz input with a bias towards
// the edges, and the invariants every layout handoff accepts must satisfy.
#pragma once

#include <handoff/array.hpp>
#include <handoff/dtype.hpp>
#include <handoff/error.hpp>

#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <span>

/// Aborts with the failed condition, so that libFuzzer records the input as a crash.
#define HANDOFF_FUZZ_CHECK(condition)                                                    \
  do {                                                                                   \
    if (!(condition)) {                                                                  \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #condition); \
      std::abort();                                                                      \
    }                                                                                    \
  } while (false)

namespace handoff::fuzz {

/// An integer that is small (where the rules change), at a limit, or anything at all.
inline std::int64_t edgy_integer(FuzzedDataProvider& in)
{
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0:
      return in.ConsumeIntegralInRange<std::int64_t>(-3, 8);
    case 1: {
      constexpr std::int64_t limits[] = {std::numeric_limits<std::int64_t>::min(),
                                         std::numeric_limits<std::int64_t>::max(),
                                         std::int64_t{1} << 31,
                                         std::int64_t{1} << 32,
                                         std::int64_t{1} << 61,
                                         std::int64_t{1} << 62,
                                         -(std::int64_t{1} << 62)};
      return in.PickValueInArray(limits);
    }
    case 2:
      return in.ConsumeIntegralInRange<std::int64_t>(-64, 64) * 4;  // byte strides of small elements
    default:
      return in.ConsumeIntegral<std::int64_t>();
  }
}

/// Mostly a value in [low, high], where valid layouts live; otherwise an edgy_integer.
inline std::int64_t mostly_small(FuzzedDataProvider& in, std::int64_t low, std::int64_t high)
{
  return in.ConsumeIntegralInRange(0, 3) == 0 ? edgy_integer(in) : in.ConsumeIntegralInRange(low, high);
}

/// Storage a harness points tensors into: accepted layouts that fall inside it are read whole.
struct arena {
  alignas(16) std::byte bytes[1024]{};

  [[nodiscard]] bool holds(const std::byte* first, std::int64_t length) const noexcept
  {
    const auto begin = reinterpret_cast<std::uintptr_t>(bytes);
    const auto at = reinterpret_cast<std::uintptr_t>(first);
    return length >= 0 && at >= begin && at <= begin + sizeof bytes &&
           static_cast<std::uint64_t>(length) <= begin + sizeof bytes - at;
  }
};

/// Checks what an accepted layout promises: one stride per dimension, non-negative extents, an
/// element count and byte size within int64, a non-null pointer when non-empty, a dtype handoff can
/// name, and a byte range that does not overflow. When that range lies inside `storage`, reads
/// every element through the strides (AddressSanitizer catches a read outside it).
inline void check_layout(const array_layout& layout, const arena& storage)
{
  HANDOFF_FUZZ_CHECK(layout.shape.size() == layout.strides.size());
  HANDOFF_FUZZ_CHECK(layout.shape.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()));
  (void)dtype_name(layout.dtype);  // throws for a dtype that should have been refused
  const auto item = static_cast<std::int64_t>(itemsize(layout.dtype));
  HANDOFF_FUZZ_CHECK(item > 0);
  std::int64_t elements = 1;
  for (const auto extent : layout.shape) {
    HANDOFF_FUZZ_CHECK(extent >= 0);
    HANDOFF_FUZZ_CHECK(!__builtin_mul_overflow(elements, extent, &elements));
  }
  std::int64_t bytes = 0;
  HANDOFF_FUZZ_CHECK(!__builtin_mul_overflow(elements, item, &bytes));
  HANDOFF_FUZZ_CHECK(elements == 0 || layout.data != nullptr);
  const auto range = byte_range_of(layout);
  HANDOFF_FUZZ_CHECK(range.has_value());  // every element's byte offset fits in int64
  HANDOFF_FUZZ_CHECK(range->low <= 0 && (elements == 0 || range->high >= item));
  if (elements == 0 || elements > 4096) { return; }
  const auto* base = static_cast<const std::byte*>(layout.data);
  // Pointer arithmetic outside an object is undefined: compare addresses as integers first.
  // The span between the lowest and the highest element may itself exceed int64.
  std::intptr_t first = 0;
  std::int64_t span = 0;
  if (__builtin_add_overflow(static_cast<std::intptr_t>(reinterpret_cast<std::uintptr_t>(base)), range->low, &first) ||
      __builtin_sub_overflow(range->high, range->low, &span) ||
      !storage.holds(reinterpret_cast<const std::byte*>(first), span)) {
    return;
  }
  volatile std::byte sink{};
  const std::size_t ndim = layout.shape.size();
  std::int64_t index[16]{};
  HANDOFF_FUZZ_CHECK(ndim <= 16);
  for (std::int64_t n = 0; n < elements; ++n) {
    std::int64_t offset = 0;
    for (std::size_t d = 0; d < ndim; ++d) { offset += index[d] * layout.strides[d] * item; }
    HANDOFF_FUZZ_CHECK(offset >= range->low && offset + item <= range->high);
    for (std::int64_t b = 0; b < item; ++b) { sink = base[offset + b]; }
    for (std::size_t d = ndim; d-- > 0;) {  // next index, row-major
      if (++index[d] < layout.shape[d]) { break; }
      index[d] = 0;
    }
  }
  (void)sink;
}

}  // namespace handoff::fuzz
