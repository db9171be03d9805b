// handoff::array: an immutable strided view of memory that keeps its producer alive.
#pragma once

#include <handoff/device.hpp>
#include <handoff/dlpack.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace handoff {

class context;

/// A stream of a context's backend, on a device: where device data is ready, or which consumer
/// stream must be done with it before its producer is released.
struct stream_binding {
  context* ctx{nullptr};
  int device{0};
  device::stream_handle stream{};
};

/// Shared ownership of a producer. The release function runs exactly once, when the last view
/// or exported tensor referring to it is gone, on whichever thread that happens; it must not throw.
/// Every live producer is counted in `stats().live_views`.
class producer_ref {
 public:
  producer_ref() = default;
  /// Takes ownership: `release` runs once the last copy of this reference is destroyed.
  explicit producer_ref(std::function<void()> release);

  [[nodiscard]] explicit operator bool() const noexcept { return static_cast<bool>(state_); }
  [[nodiscard]] long use_count() const noexcept { return state_.use_count(); }

  /// The stream the data is ready on: the stream of the producer's last write, or the consumer
  /// stream it was imported onto. nullopt for host data. Thread-safe.
  [[nodiscard]] std::optional<stream_binding> ready_on() const;
  /// Records the stream of a new write to the data. Thread-safe.
  void set_ready_on(const stream_binding& where) const;
  /// Makes the release wait for the work enqueued on `consumer` by the time the last reference
  /// goes (see context::release_after). Set once, at import.
  void release_after(const stream_binding& consumer) const;

 private:
  struct state;
  std::shared_ptr<state> state_;
};

/// Layout of a strided array. Strides are in elements, as in DLPack.
struct array_layout {
  void* data{nullptr};  ///< first element (DLPack's data + byte_offset)
  DLDevice device{kDLCPU, 0};
  DLDataType dtype{kDLFloat, 32, 1};
  std::vector<std::int64_t> shape;
  std::vector<std::int64_t> strides;
  bool readonly{false};
};

/// A view of memory owned by a producer. Copies share the producer. Not synchronized: the
/// producer's stream ordering is handled at import and export, never by the view itself.
class array {
 public:
  /// Validates `layout` (non-negative shape, one stride per dimension, byte size within int64, a
  /// non-null pointer when non-empty) and binds it to `owner`.
  /// @throws value_error naming the field that is wrong.
  array(array_layout layout, producer_ref owner);

  [[nodiscard]] const array_layout& layout() const noexcept { return layout_; }
  [[nodiscard]] void* data() const noexcept { return layout_.data; }
  [[nodiscard]] DLDevice device() const noexcept { return layout_.device; }
  [[nodiscard]] DLDataType dtype() const noexcept { return layout_.dtype; }
  [[nodiscard]] std::span<const std::int64_t> shape() const noexcept { return layout_.shape; }
  [[nodiscard]] std::span<const std::int64_t> strides() const noexcept { return layout_.strides; }
  [[nodiscard]] bool readonly() const noexcept { return layout_.readonly; }
  [[nodiscard]] std::int32_t ndim() const noexcept { return static_cast<std::int32_t>(layout_.shape.size()); }
  [[nodiscard]] std::int64_t size() const noexcept;
  [[nodiscard]] std::size_t itemsize() const noexcept;
  [[nodiscard]] std::int64_t nbytes() const noexcept;
  /// True when the elements are laid out row-major without gaps (strides of size-1 dims ignored).
  [[nodiscard]] bool is_c_contiguous() const noexcept;
  [[nodiscard]] const producer_ref& owner() const noexcept { return owner_; }

 private:
  array_layout layout_;
  producer_ref owner_;
};

/// Row-major strides, in elements, for `shape`.
[[nodiscard]] std::vector<std::int64_t> contiguous_strides(std::span<const std::int64_t> shape);

/// The highest DLPack version handoff produces and understands.
inline constexpr DLPackVersion dlpack_version{DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};

/// Takes ownership of a producer's versioned tensor. On every path, success or exception, its
/// deleter runs exactly once: when the last view of the result is gone, or before throwing.
/// @throws buffer_error for an unknown major version, unsupported dtype or packed sub-byte data;
///         value_error for an invalid layout.
[[nodiscard]] array import_dlpack(DLManagedTensorVersioned* tensor);
/// Legacy form of `import_dlpack`; the result is never read-only (the format cannot say).
[[nodiscard]] array import_dlpack(DLManagedTensor* tensor);

/// Options of an export.
struct export_options {
  DLPackVersion version{dlpack_version};  ///< version stamped on a versioned tensor
  bool copied{false};                     ///< set DLPACK_FLAG_BITMASK_IS_COPIED
};

/// Exports `view` as a versioned tensor that holds its producer until the deleter runs. Strides
/// are always filled in. Never returns null.
[[nodiscard]] DLManagedTensorVersioned* export_versioned(const array& view, export_options options = {});
/// Exports `view` as a legacy tensor. @throws buffer_error when `view` is read-only.
[[nodiscard]] DLManagedTensor* export_legacy(const array& view);

/// A compact row-major copy of host-resident `view` in memory handoff owns.
/// @throws buffer_error when the memory is not host-accessible.
[[nodiscard]] array copy_to_host(const array& view);

}  // namespace handoff
