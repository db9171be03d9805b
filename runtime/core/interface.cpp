#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/interface.hpp>

#include <fmt/format.h>

#include <vector>

namespace handoff {
namespace {

constexpr std::string_view array_protocol = "__array_interface__";
constexpr std::string_view cuda_protocol = "__cuda_array_interface__";

template <typename T>
const T& required(const std::optional<T>& value, std::string_view protocol, const char* key)
{
  HANDOFF_EXPECTS(value.has_value(), value_error, fmt::format("{} has no '{}' key", protocol, key));
  return *value;
}

// What both protocols say alike: shape, typestr, mask and strides. The data is left unset.
array_layout common_layout(const interface_dict& dict, std::string_view protocol)
{
  array_layout layout;
  layout.shape = required(dict.shape, protocol, "shape");
  for (std::size_t i = 0; i < layout.shape.size(); ++i) {
    HANDOFF_EXPECTS(layout.shape[i] >= 0, value_error,
                    fmt::format("{} 'shape'[{}] is negative ({})", protocol, i, layout.shape[i]));
  }
  layout.dtype = dtype_from_typestr(required(dict.typestr, protocol, "typestr"), fmt::format("{} 'typestr'", protocol));
  if (dict.masked) { throw not_implemented_error(fmt::format("{} with a mask is not supported", protocol)); }
  if (dict.strides) {
    layout.strides =
      element_strides(layout.shape, *dict.strides, itemsize(layout.dtype), fmt::format("{} 'strides'", protocol));
  } else {
    layout.strides = contiguous_strides(layout.shape);
  }
  return layout;
}

void set_pointer(array_layout& layout, const interface_dict& dict, std::string_view protocol)
{
  const interface_pointer& data = required(dict.data, protocol, "data");
  HANDOFF_EXPECTS(data.address >= 0, value_error,
                  fmt::format("{} 'data'[0] is a negative pointer ({})", protocol, data.address));
  layout.data = reinterpret_cast<void*>(static_cast<std::uintptr_t>(data.address));
  layout.readonly = data.readonly;
}

// validate_layout (sizes that overflow, a null pointer), its messages naming the protocol.
void check_layout(const array_layout& layout, std::string_view protocol)
{
  try {
    validate_layout(layout);
  } catch (const value_error& e) {
    throw value_error(fmt::format("{}: {}", protocol, e.what()));
  }
}

void check_array_version(const interface_dict& dict)
{
  if (dict.version) {
    HANDOFF_EXPECTS(*dict.version == 3, value_error,
                    fmt::format("{} 'version' {} is not known (expected 3)", array_protocol, *dict.version));
  }
}

}  // namespace

array_layout validate_array_interface(const interface_dict& dict)
{
  check_array_version(dict);
  array_layout layout = common_layout(dict, array_protocol);
  set_pointer(layout, dict, array_protocol);
  check_layout(layout, array_protocol);
  return layout;
}

array_layout validate_array_interface(const interface_dict& dict, const interface_buffer& buffer)
{
  check_array_version(dict);
  array_layout layout = common_layout(dict, array_protocol);
  const std::int64_t offset = dict.offset.value_or(0);
  HANDOFF_EXPECTS(offset >= 0 && offset <= buffer.length, value_error,
                  fmt::format("{} 'offset' {} is outside the {}-byte buffer", array_protocol, offset, buffer.length));
  layout.data = static_cast<std::byte*>(buffer.data) + offset;
  layout.readonly = buffer.readonly;
  check_layout(layout, array_protocol);
  // NumPy does not check that the elements lie within the buffer; reading them would be out of bounds.
  const auto range = byte_range_of(layout);
  HANDOFF_EXPECTS(range && range->low >= -offset && range->high <= buffer.length - offset, value_error,
                  fmt::format("{} 'shape' and 'strides' from 'offset' {} reach outside the {}-byte buffer of 'data'",
                              array_protocol, offset, buffer.length));
  return layout;
}

cuda_interface validate_cuda_array_interface(const interface_dict& dict)
{
  const std::int64_t version = required(dict.version, cuda_protocol, "version");
  HANDOFF_EXPECTS(version >= 0 && version <= 3, value_error,
                  fmt::format("{} 'version' {} is not known (handoff reads 0 to 3)", cuda_protocol, version));
  cuda_interface out;
  out.layout = common_layout(dict, cuda_protocol);
  set_pointer(out.layout, dict, cuda_protocol);
  if (dict.stream) {
    HANDOFF_EXPECTS(*dict.stream != 0, value_error,
                    fmt::format("{} 'stream' 0 is disallowed (ambiguous); use 1 for the legacy default stream or 2 "
                                "for per-thread",
                                cuda_protocol));
    HANDOFF_EXPECTS(*dict.stream >= -1, value_error,
                    fmt::format("{} 'stream' {} is not a stream: expected 1 (legacy default), 2 (per-thread "
                                "default), a stream handle or -1 (no ordering)",
                                cuda_protocol, *dict.stream));
    out.stream = dict.stream;
  }
  check_layout(out.layout, cuda_protocol);
  return out;
}

extents element_strides(std::span<const std::int64_t> shape, std::span<const std::int64_t> bytes, std::size_t item,
                        std::string_view field)
{
  HANDOFF_EXPECTS(bytes.size() == shape.size(), value_error,
                  fmt::format("{} has {} entries but the shape has {}", field, bytes.size(), shape.size()));
  HANDOFF_EXPECTS(item > 0, buffer_error, fmt::format("{}: elements of 0 bytes cannot be exchanged", field));
  const auto size = static_cast<std::int64_t>(item);
  extents out;
  out.reserve(bytes.size());
  extents contiguous;  // made only for an axis that needs it
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] % size == 0) {
      out.push_back(bytes[i] / size);
      continue;
    }
    HANDOFF_EXPECTS(shape[i] == 1, buffer_error,
                    fmt::format("{}[{}] = {} is not a multiple of the item size {}; DLPack strides count elements",
                                field, i, bytes[i], item));
    if (contiguous.empty()) { contiguous = contiguous_strides(shape); }
    out.push_back(contiguous[i]);
  }
  return out;
}

}  // namespace handoff
