// Array layouts: their validation, byte ranges and row-major strides, and the array that binds one to a producer.
#include <handoff/array.hpp>
#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/stream_value.hpp>

#include "core/layout.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace handoff {

namespace {

// Multiplies non-negative values, reporting overflow past int64.
bool checked_multiply(std::int64_t a, std::int64_t b, std::int64_t& out) noexcept
{
  return !__builtin_mul_overflow(a, b, &out);
}

// byte_range_of for `item`-byte elements (validate_layout has it already). In elements first, in
// one pass with no early exit: an empty array's range is empty whatever its other extents and
// strides would overflow to.
std::optional<byte_range> range_of(const array_layout& layout, std::int64_t item) noexcept
{
  std::int64_t low = 0;
  std::int64_t high = 0;
  bool empty = false;
  bool overflow = false;
  for (std::size_t i = 0; i < layout.shape.size(); ++i) {
    std::int64_t reach = 0;
    empty |= layout.shape[i] == 0;
    overflow |= __builtin_mul_overflow(layout.shape[i] - 1, layout.strides[i], &reach);
    overflow |= reach < 0 ? __builtin_add_overflow(low, reach, &low) : __builtin_add_overflow(high, reach, &high);
  }
  if (empty) { return byte_range{}; }
  byte_range range;
  overflow |= __builtin_mul_overflow(low, item, &range.low);
  overflow |= __builtin_mul_overflow(high, item, &range.high);
  overflow |= __builtin_add_overflow(range.high, item, &range.high);
  if (overflow) { return std::nullopt; }
  return range;
}

}  // namespace

namespace {

// The checks of validate_layout that need no data pointer; returns the size in bytes.
std::int64_t checked_nbytes(const array_layout& layout)
{
  HANDOFF_EXPECTS(
    layout.shape.size() == layout.strides.size(), value_error,
    fmt::format("strides has {} entries but shape has {} dimensions", layout.strides.size(), layout.shape.size()));
  HANDOFF_EXPECTS(layout.dtype.lanes == 1 && layout.dtype.bits > 0, buffer_error,
                  fmt::format("unsupported dtype (code {}, bits {}, lanes {})", layout.dtype.code, layout.dtype.bits,
                              layout.dtype.lanes));
  std::int64_t elements = 1;
  for (std::size_t i = 0; i < layout.shape.size(); ++i) {
    HANDOFF_EXPECTS(layout.shape[i] >= 0, value_error, fmt::format("shape[{}] is negative ({})", i, layout.shape[i]));
    HANDOFF_EXPECTS(
      checked_multiply(elements, layout.shape[i], elements), value_error,
      fmt::format("shape {} overflows: its element count does not fit in 64 bits", fmt::join(layout.shape, "x")));
  }
  std::int64_t bytes = 0;
  HANDOFF_EXPECTS(
    checked_multiply(elements, static_cast<std::int64_t>(itemsize(layout.dtype)), bytes), value_error,
    fmt::format("shape {} overflows: its size in bytes does not fit in 64 bits", fmt::join(layout.shape, "x")));
  return bytes;
}

// True when validate_layout would accept `layout`: its checks in one pass over the axes, without
// their messages. False says only "look closer": the checks below then find what is wrong, if
// anything. Every import and export validates a layout.
bool plainly_valid(const array_layout& layout) noexcept
{
  const std::size_t ndim = layout.shape.size();
  if (ndim != layout.strides.size() || layout.dtype.lanes != 1 || layout.dtype.bits == 0) { return false; }
  const std::int64_t* shape = layout.shape.data();
  const std::int64_t* strides = layout.strides.data();
  std::int64_t elements = 1;
  std::int64_t low = 0;  // in elements, as range_of
  std::int64_t high = 0;
  bool suspect = false;
  for (std::size_t i = 0; i < ndim; ++i) {
    std::int64_t reach = 0;
    suspect |= shape[i] < 0;  // and then counted as 0, so that shape[i] - 1 cannot overflow
    suspect |= __builtin_mul_overflow(elements, shape[i], &elements);
    suspect |= __builtin_mul_overflow(std::max<std::int64_t>(shape[i], 0) - 1, strides[i], &reach);
    suspect |= reach < 0 ? __builtin_add_overflow(low, reach, &low) : __builtin_add_overflow(high, reach, &high);
  }
  const auto item = static_cast<std::int64_t>(itemsize(layout.dtype));
  std::int64_t bytes = 0;
  suspect |= __builtin_mul_overflow(elements, item, &bytes);
  if (suspect) { return false; }
  if (bytes == 0) { return true; }  // an empty array: no data, and no range, to check
  suspect |= layout.data == nullptr;
  suspect |= __builtin_mul_overflow(low, item, &low);
  suspect |= __builtin_mul_overflow(high, item, &high);
  suspect |= __builtin_add_overflow(high, item, &high);
  return !suspect;
}

// Why `device` is not a DLPack device, or null when it is one.
const char* why_not_a_device(DLDevice device) noexcept
{
  if (!is_dlpack_device_type(device.device_type)) { return "DLPack defines no such device type"; }
  if (device.device_id < 0) { return "its id is negative"; }
  if (device.device_type == kDLCPU && device.device_id != 0) { return "the CPU is device 0"; }
  return nullptr;
}

}  // namespace

void validate_layout(const array_layout& layout)
{
  if (plainly_valid(layout)) { return; }
  if (checked_nbytes(layout) == 0) { return; }
  HANDOFF_EXPECTS(layout.data != nullptr, value_error, "data is a null pointer but the array has elements");
  // Every consumer computes element addresses from the strides: they must not overflow.
  HANDOFF_EXPECTS(range_of(layout, static_cast<std::int64_t>(itemsize(layout.dtype))).has_value(), value_error,
                  fmt::format("strides ({}, in elements) overflow: an element's byte offset does not fit in 64 bits",
                              fmt::join(layout.strides, ", ")));
}

void validate_description(const array_layout& layout)
{
  const DLDevice device = layout.device;
  const char* wrong = why_not_a_device(device);
  HANDOFF_EXPECTS(wrong == nullptr, value_error,
                  fmt::format("device ({}, {}) is not a DLPack device: {}", static_cast<int>(device.device_type),
                              device.device_id, wrong));
  static_cast<void>(dtype_name(layout.dtype));  // buffer_error, naming the dtype, for one DLPack does not define
}

std::optional<byte_range> byte_range_of(const array_layout& layout) noexcept
{
  return range_of(layout, static_cast<std::int64_t>(itemsize(layout.dtype)));
}

array::array(array_layout layout, shared_producer owner) : layout_(std::move(layout)), owner_(std::move(owner))
{
  validate_layout(layout_);
}

std::int64_t array::size() const noexcept
{
  std::int64_t n = 1;
  for (const auto extent : layout_.shape) { n *= extent; }
  return n;
}

std::size_t array::itemsize() const noexcept
{
  return handoff::itemsize(layout_.dtype);
}

std::int64_t array::nbytes() const noexcept
{
  return size() * static_cast<std::int64_t>(itemsize());
}

bool array::is_c_contiguous() const noexcept
{
  std::int64_t expected = 1;
  for (std::size_t i = layout_.shape.size(); i-- > 0;) {
    if (layout_.shape[i] == 0) { return true; }
    if (layout_.shape[i] != 1 && layout_.strides[i] != expected) { return false; }
    expected *= layout_.shape[i];
  }
  return true;
}

namespace detail {

void fill_contiguous_strides(std::span<const std::int64_t> shape, std::int64_t* strides) noexcept
{
  std::int64_t step = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = step;
    (void)__builtin_mul_overflow(step, shape[i] > 0 ? shape[i] : 1, &step);
  }
}

}  // namespace detail

extents contiguous_strides(std::span<const std::int64_t> shape)
{
  extents strides;
  strides.resize(shape.size());
  detail::fill_contiguous_strides(shape, strides.data());
  return strides;
}

std::pair<array_layout, std::size_t> row_major_layout(DLDevice device, DLDataType dtype,
                                                      std::span<const std::int64_t> shape)
{
  (void)dtype_name(dtype);  // a dtype DLPack defines
  array_layout layout;
  layout.device = device;
  layout.dtype = dtype;
  layout.shape.assign(shape.begin(), shape.end());
  layout.strides.resize(shape.size());
  detail::fill_contiguous_strides(layout.shape, layout.strides.data());
  const std::int64_t bytes = checked_nbytes(layout);
  return {std::move(layout), static_cast<std::size_t>(bytes)};
}

}  // namespace handoff
