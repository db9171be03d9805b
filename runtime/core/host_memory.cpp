// Host memory handoff owns: new host arrays and compact host copies.
#include <handoff/array.hpp>
#include <handoff/error.hpp>
#include <handoff/stream_value.hpp>

#include <fmt/format.h>

#include <cstddef>
#include <cstring>
#include <memory>

namespace handoff {

array allocate_host_array(DLDataType dtype, std::span<const std::int64_t> shape)
{
  auto [layout, bytes] = row_major_layout({kDLCPU, 0}, dtype, shape);
  if (bytes == 0) {
    return array{std::move(layout), shared_producer{[] {}}};
  }
  auto storage = std::make_unique_for_overwrite<std::byte[]>(bytes);
  layout.data = storage.get();
  std::byte* raw = storage.release();
  return array{std::move(layout), shared_producer{[raw]() noexcept { delete[] raw; }}};
}

namespace {

void copy_strided(std::byte* dst, const std::byte* src, const array& view, std::size_t dim, std::int64_t& written)
{
  const auto item = static_cast<std::int64_t>(view.itemsize());
  const std::int64_t stride_bytes = view.strides()[dim] * item;
  const std::int64_t extent = view.shape()[dim];
  for (std::int64_t i = 0; i < extent; ++i) {
    const std::byte* at = src + i * stride_bytes;
    if (dim + 1 == view.shape().size()) {
      std::memcpy(dst + written, at, static_cast<std::size_t>(item));
      written += item;
    } else {
      copy_strided(dst, at, view, dim + 1, written);
    }
  }
}

}  // namespace

array copy_to_host(const array& view)
{
  HANDOFF_EXPECTS(
    view.device().device_type == kDLCPU, buffer_error,
    fmt::format("a host copy of {} memory needs a device backend", static_cast<int>(view.device().device_type)));
  array copy = allocate_host_array(view.dtype(), view.shape());
  auto* destination = static_cast<std::byte*>(copy.data());
  if (destination != nullptr) {
    if (view.is_c_contiguous()) {
      std::memcpy(destination, view.data(), static_cast<std::size_t>(view.nbytes()));
    } else {
      std::int64_t written = 0;
      copy_strided(destination, static_cast<const std::byte*>(view.data()), view, 0, written);
    }
  }
  return copy;
}

}  // namespace handoff
