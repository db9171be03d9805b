// handoff::array: an immutable strided view of memory that keeps its producer alive.
#pragma once

#include <handoff/dlpack.h>
#include <handoff/device.hpp>
#include <handoff/embedding.hpp>
#include <handoff/stream.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <memory>
#include <new>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace handoff {

class context;

/// Shared ownership of a producer. The release function runs exactly once, when the last view
/// or exported tensor referring to it is gone, on whichever thread that happens; it must not throw.
/// Every live producer is counted in `stats().live_views`. Copies share one intrusively counted
/// state (one allocation per producer); copying and destroying references is thread-safe.
class shared_producer {
 public:
  shared_producer() noexcept = default;
  /// Takes ownership: `release` runs once the last copy of this reference is destroyed. A release
  /// function whose captures fit in two pointers is stored without a further allocation.
  explicit shared_producer(std::function<void()> release);
  shared_producer(const shared_producer& other) noexcept;
  shared_producer(shared_producer&& other) noexcept : state_(std::exchange(other.state_, nullptr)) {}
  shared_producer& operator=(const shared_producer& other) noexcept;
  shared_producer& operator=(shared_producer&& other) noexcept;
  ~shared_producer();

  [[nodiscard]] explicit operator bool() const noexcept { return state_ != nullptr; }
  [[nodiscard]] long use_count() const noexcept;

  /// The stream the data is ready on: the stream of the producer's last write, or the consumer
  /// stream it was imported onto. nullopt for host data. Thread-safe.
  [[nodiscard]] std::optional<bound_stream> ready_on() const;
  /// Records the stream of a new write to the data. Thread-safe. The calling thread's per-thread
  /// default stream is recorded as the legacy default stream, which any thread can name.
  void set_ready_on(const bound_stream& where) const;
  /// Makes the release wait for the work enqueued on `consumer` by the time the last reference goes
  /// (see context::release_after), as well as for every stream added before: each stream the data
  /// was handed to (an import's consumer stream; a C consumer's work stream) is added once. A
  /// per-thread default stream as above. `producer` (same context and device), when given, is made
  /// to wait for that same work when the last reference goes, and its `stream_owner` is kept until
  /// the release has run: the CUDA Array Interface asks that the producer's stream run no later work
  /// until the consumer's is done. Thread-safe.
  void release_after(const bound_stream& consumer, const std::optional<bound_stream>& producer = {}) const;

  /// A new producer that keeps this one's root (the producer this one derives from, else this one)
  /// alive, with stream bindings of its own (none yet), as an import of an export of it would have:
  /// a view of a view shares the root producer instead of wrapping it, so re-imports never chain.
  /// Thread-safe.
  /// @throws std::bad_alloc.
  [[nodiscard]] shared_producer derived() const;

  /// The producer's node id in the ownership graph and the trace (its root's, for a derived one);
  /// unique in the process, assigned on first use. 0 for an empty reference. Thread-safe.
  [[nodiscard]] std::uint64_t id() const noexcept;
  /// For an embedding runtime's garbage collector, which must know what a view alone keeps alive
  /// (and may find in a cycle): the release function, when this is the producer's only reference;
  /// nullptr otherwise (others keep what it keeps too). Call with the embedding runtime's lock held
  /// (the GIL): copies of this reference must not be made meanwhile.
  [[nodiscard]] const std::function<void()>* sole_release() const noexcept;
  /// For the same collector: `visit(owner, context)` for each owner of a stream the producer is bound
  /// to (ready on, released after), when this is the producer's only reference. Thread-safe as above.
  void visit_stream_owners(void (*visit)(const std::shared_ptr<const void>& owner, void* context), void* context) const;

  /// The producer's library (its top-level package: "torch", "numpy") as a tracked view of it names
  /// it (see tracked_view), or null. Searches the tracked views: for the graph and the trace only.
  [[nodiscard]] const char* library() const noexcept;

  struct state;  // opaque: the runtime's

 private:
  friend struct ownership_registry;
  state* state_{nullptr};
};

namespace detail {

/// Copies `count` values, the few of a shape, its strides or a call's arguments by a move each:
/// a copy loop becomes a call of memmove, which costs more than such a copy.
template <typename Iterator, typename Value>
void copy_short(Iterator from, std::size_t count, Value* to)
{
  switch (count) {
    case 4:
      to[3] = from[3];
      [[fallthrough]];
    case 3:
      to[2] = from[2];
      [[fallthrough]];
    case 2:
      to[1] = from[1];
      [[fallthrough]];
    case 1:
      to[0] = from[0];
      [[fallthrough]];
    case 0:
      return;
    default:
      std::copy_n(from, count, to);
  }
}

}  // namespace detail

/// The extents of one axis list (a shape or its strides): up to `inline_capacity` values live in
/// the object itself, so that arrays of the usual ranks need no allocation; more go to the heap.
/// A contiguous range of `std::int64_t`, convertible to `std::span<const std::int64_t>`.
class extents {
 public:
  static constexpr std::size_t inline_capacity = 6;

  extents() noexcept = default;
  extents(std::span<const std::int64_t> values) { assign(values.begin(), values.end()); }  // NOLINT: implicit
  extents(const std::vector<std::int64_t>& values) : extents(std::span<const std::int64_t>{values}) {}  // NOLINT
  extents(std::initializer_list<std::int64_t> values) { assign(values.begin(), values.end()); }
  extents(const extents& other)
  {
    if (other.heap_) {
      assign(other.begin(), other.end());
    } else {
      copy_inline(other);
    }
  }
  extents(extents&& other) noexcept { take(other); }
  extents& operator=(const extents& other)
  {
    if (this != &other) {
      if (other.heap_ || heap_) {
        assign(other.begin(), other.end());
      } else {
        copy_inline(other);
      }
    }
    return *this;
  }
  extents& operator=(extents&& other) noexcept
  {
    if (this != &other) {
      heap_.reset();
      take(other);
    }
    return *this;
  }
  extents& operator=(std::span<const std::int64_t> values)
  {
    assign(values.begin(), values.end());
    return *this;
  }
  extents& operator=(const std::vector<std::int64_t>& values) { return *this = std::span<const std::int64_t>{values}; }
  extents& operator=(std::initializer_list<std::int64_t> values)
  {
    assign(values.begin(), values.end());
    return *this;
  }
  ~extents() = default;

  /// Replaces the contents with [first, last).
  template <typename Iterator>
  void assign(Iterator first, Iterator last)
  {
    const auto count = static_cast<std::size_t>(std::distance(first, last));
    size_ = 0;
    reserve(count);
    detail::copy_short(first, count, data());
    size_ = count;
  }
  void assign(std::size_t count, std::int64_t value)
  {
    size_ = 0;
    reserve(count);
    std::fill_n(data(), count, value);
    size_ = count;
  }
  /// Grows or shrinks to `count` values; new ones are zero.
  void resize(std::size_t count)
  {
    reserve(count);
    if (count > size_) { std::fill(data() + size_, data() + count, std::int64_t{0}); }
    size_ = count;
  }
  void reserve(std::size_t count)
  {
    if (count > capacity_) { grow(count); }
  }
  void push_back(std::int64_t value)
  {
    if (size_ == capacity_) { grow(2 * capacity_); }
    data()[size_++] = value;
  }
  void clear() noexcept { size_ = 0; }

  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  [[nodiscard]] bool empty() const noexcept { return size_ == 0; }
  [[nodiscard]] std::int64_t* data() noexcept { return heap_ ? heap_.get() : inline_data(); }
  [[nodiscard]] const std::int64_t* data() const noexcept { return heap_ ? heap_.get() : inline_data(); }
  [[nodiscard]] std::int64_t* begin() noexcept { return data(); }
  [[nodiscard]] std::int64_t* end() noexcept { return data() + size_; }
  [[nodiscard]] const std::int64_t* begin() const noexcept { return data(); }
  [[nodiscard]] const std::int64_t* end() const noexcept { return data() + size_; }
  [[nodiscard]] std::int64_t& operator[](std::size_t i) noexcept { return data()[i]; }
  [[nodiscard]] std::int64_t operator[](std::size_t i) const noexcept { return data()[i]; }

  friend bool operator==(const extents& a, const extents& b) noexcept
  {
    return std::equal(a.begin(), a.end(), b.begin(), b.end());
  }

 private:
  void grow(std::size_t count)
  {
    auto bigger = std::make_unique_for_overwrite<std::int64_t[]>(count);
    std::copy(begin(), end(), bigger.get());
    heap_ = std::move(bigger);
    capacity_ = count;
  }
  // Bytes, not values: the buffer is left uninitialized (zeroing it costs more than the rest of
  // an import) and copied whole, a fixed size the compiler copies without a call.
  [[nodiscard]] std::int64_t* inline_data() noexcept { return std::launder(reinterpret_cast<std::int64_t*>(inline_)); }
  [[nodiscard]] const std::int64_t* inline_data() const noexcept
  {
    return std::launder(reinterpret_cast<const std::int64_t*>(inline_));
  }
  void copy_inline(const extents& other) noexcept
  {
    std::memcpy(inline_, other.inline_, sizeof inline_);
    size_ = other.size_;
  }
  void take(extents& other) noexcept
  {
    if (other.heap_) {
      heap_ = std::move(other.heap_);
      size_ = other.size_;
      capacity_ = other.capacity_;
    } else {
      copy_inline(other);
      capacity_ = inline_capacity;
    }
    other.size_ = 0;
    other.capacity_ = inline_capacity;
  }

  std::size_t size_{0};
  std::size_t capacity_{inline_capacity};
  std::unique_ptr<std::int64_t[]> heap_;
  alignas(std::int64_t) std::byte inline_[inline_capacity * sizeof(std::int64_t)];
};

/// Layout of a strided array. Strides are in elements, as in DLPack.
struct array_layout {
  void* data{nullptr};  ///< first element (DLPack's data + byte_offset)
  DLDevice device{kDLCPU, 0};
  DLDataType dtype{kDLFloat, 32, 1};
  extents shape;
  extents strides;
  bool readonly{false};
};

/// A view of memory owned by a producer. Copies share the producer. Not synchronized: the
/// producer's stream ordering is handled at import and export, never by the view itself.
class array {
 public:
  /// Validates `layout` (non-negative shape, one stride per dimension, byte size and the byte
  /// offset of every element within int64, a non-null pointer when non-empty) and binds it to `owner`.
  /// @throws value_error naming the field that is wrong.
  array(array_layout layout, shared_producer owner);

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
  [[nodiscard]] const shared_producer& owner() const noexcept { return owner_; }

 private:
  array_layout layout_;
  shared_producer owner_;
};

/// Checks what `array`'s constructor checks, without binding an owner.
/// @throws value_error naming the field that is wrong, buffer_error for a vector dtype.
void validate_layout(const array_layout& layout);

/// Checks that the device and the dtype are ones DLPack defines, which no producer's DLPack tensor
/// vouches for in memory a library describes itself (exchange::view, the pybind11 helper; an
/// import's are checked as it is read). The rest of the layout is validate_layout's.
/// @throws value_error for a device DLPack does not define (a type it does not know, a negative id);
///         buffer_error for a dtype it does not define.
void validate_description(const array_layout& layout);

/// The bytes the elements of a layout reach, relative to its `data`: [low, high).
struct byte_range {
  std::int64_t low{0};
  std::int64_t high{0};
};

/// The byte range of `layout`'s elements ({0, 0} when it has none); nullopt when an element's
/// byte offset does not fit in 64 bits. Expects non-negative extents and one stride per dimension.
[[nodiscard]] std::optional<byte_range> byte_range_of(const array_layout& layout) noexcept;

/// Row-major strides, in elements, for `shape`.
[[nodiscard]] extents contiguous_strides(std::span<const std::int64_t> shape);

/// The row-major layout of `shape` and `dtype` on `device`, with no data yet, and its size in bytes.
/// @throws value_error for a negative or overflowing shape, buffer_error for a dtype DLPack does
///         not define.
[[nodiscard]] std::pair<array_layout, std::size_t> row_major_layout(DLDevice device, DLDataType dtype,
                                                                    std::span<const std::int64_t> shape);

/// A new row-major array of `shape` and `dtype` in host memory handoff owns; its contents are
/// unspecified. @throws as row_major_layout, and std::bad_alloc.
[[nodiscard]] array allocate_host_array(DLDataType dtype, std::span<const std::int64_t> shape);

/// The highest DLPack version handoff produces and understands.
inline constexpr DLPackVersion dlpack_version{DLPACK_MAJOR_VERSION, DLPACK_MINOR_VERSION};

/// Takes ownership of a producer's versioned tensor. On every path, success or exception, its
/// deleter runs exactly once: when the last view of the result is gone, or before throwing, through
/// `run_deleter` where given (an embedding's, embedding.hpp) unless handoff exported the tensor itself.
/// @throws buffer_error for an unknown major version, unsupported dtype or packed sub-byte data;
///         value_error for an invalid layout.
[[nodiscard]] array import_dlpack(DLManagedTensorVersioned* tensor, deleter_runner run_deleter = nullptr);
/// Legacy form of `import_dlpack`; the result is never read-only (the format cannot say).
[[nodiscard]] array import_dlpack(DLManagedTensor* tensor, deleter_runner run_deleter = nullptr);

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
