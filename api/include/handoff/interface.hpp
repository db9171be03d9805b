// The array-interface dicts (`__array_interface__` v3, `__cuda_array_interface__` v0 to v3) as C++
// values, and the one validation that turns them into an array layout.
#pragma once

#include <handoff/array.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace handoff {

/// The `data` key as a (pointer, readonly) pair.
struct interface_pointer {
  std::int64_t address{0};  ///< as the dict gave it; a negative value is refused
  bool readonly{false};
};

/// What an interface dict said, key by key, before validation: a key that is absent (or None)
/// is nullopt. The caller has already checked the type of each value (it knows the language the
/// dict came from); every check of the values themselves is made here.
struct interface_dict {
  std::optional<std::int64_t> version;
  std::optional<extents> shape;
  std::optional<std::string> typestr;
  std::optional<extents> strides;         ///< in bytes, one per dimension
  std::optional<interface_pointer> data;  ///< nullopt also when `data` names a buffer object
  std::optional<std::int64_t> offset;     ///< `__array_interface__` only, into a buffer `data`
  std::optional<std::int64_t> stream;     ///< `__cuda_array_interface__` v3 only
  bool masked{false};                     ///< a `mask` other than None
};

/// The memory an `__array_interface__` lies in when its `data` is a buffer object, or absent (the
/// object's own buffer): contiguous, `length` bytes from `data`.
struct interface_buffer {
  void* data{nullptr};
  std::int64_t length{0};
  bool readonly{false};
};

/// A validated `__cuda_array_interface__`, before its pointer is resolved on a device.
struct cuda_interface {
  array_layout layout;                 ///< device left unset: the pointer's attributes decide it
  std::optional<std::int64_t> stream;  ///< v3 `stream`: the producer's stream; nullopt when absent
};

/// Validates an `__array_interface__` whose `data` is a (pointer, readonly) pair. Pure.
/// @throws value_error naming the malformed field (`version` other than 3, missing `shape`,
///         `typestr` or `data`, negative extents, `strides` of the wrong length, a size or an
///         element's byte offset that overflows, a negative or null pointer for non-empty data);
///         buffer_error for a typestr that cannot be exchanged or a stride that is not a whole
///         number of elements; not_implemented_error for a mask.
[[nodiscard]] array_layout validate_array_interface(const interface_dict& dict);

/// Validates an `__array_interface__` whose data lies in `buffer`, from `offset` on (its `data`
/// pointer, when given, is ignored). Besides the checks above, every element must lie within the
/// buffer, which NumPy does not check. The layout takes the buffer's readonly flag.
/// @throws as validate_array_interface; value_error naming `offset` when it is outside the buffer.
[[nodiscard]] array_layout validate_array_interface(const interface_dict& dict, const interface_buffer& buffer);

/// Validates a `__cuda_array_interface__` (v0 to v3). Pure: touches no device.
/// @throws as validate_array_interface (a missing `version` is malformed, v0 to v3 are known);
///         value_error naming `stream` for the disallowed 0.
[[nodiscard]] cuda_interface validate_cuda_array_interface(const interface_dict& dict);

/// Element strides for byte strides `bytes` of an array of `shape` and `item`-byte elements.
/// The stride of an axis of extent 1 never moves to another element, so when it is not a multiple
/// of the item size (NumPy allows that) it is replaced by the contiguous one.
/// @throws value_error when the counts differ; buffer_error when another axis's stride is not a
///         multiple of the item size. Messages begin with `field`.
[[nodiscard]] extents element_strides(std::span<const std::int64_t> shape, std::span<const std::int64_t> bytes,
                                      std::size_t item, std::string_view field);

}  // namespace handoff
