// DLPack: importing a producer's managed tensor (its deleter run exactly once) and exporting views.
#include <handoff/array.hpp>
#include <handoff/dtype.hpp>
#include <handoff/embedding.hpp>
#include <handoff/error.hpp>
#include <handoff/internal/trace_scope.hpp>
#include <handoff/ownership.hpp>
#include <handoff/stream_value.hpp>
#include <handoff/trace.hpp>

#include "core/block_cache.hpp"
#include "core/layout.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>

namespace handoff {

// ---------------------------------------------------------------------------------------------
// Import

namespace {

template <typename Managed>
void invoke_deleter(void* tensor) noexcept
{
  auto* managed = static_cast<Managed*>(tensor);
  managed->deleter(managed);
}

// True for a tensor handoff exported itself (export_versioned, export_legacy): its deleter runs no
// code of the embedding's, and takes what a release it runs needs (the GIL) itself.
template <typename Managed>
bool exported_by_handoff(const Managed* tensor) noexcept;

template <typename Managed>
shared_producer adopt(Managed* tensor, deleter_runner run_deleter)
{
  return shared_producer{[tensor, run_deleter]() noexcept {
    if (tensor->deleter == nullptr) { return; }
    if (run_deleter != nullptr && !exported_by_handoff(tensor)) {
      run_deleter(&invoke_deleter<Managed>, tensor);
    } else {
      tensor->deleter(tensor);
    }
  }};
}

// The dtypes nearly every exchange uses, known without a table search.
bool is_common(DLDataType dtype) noexcept
{
  if (dtype.lanes != 1) { return false; }
  const auto power_of_two_bytes = dtype.bits == 8 || dtype.bits == 16 || dtype.bits == 32 || dtype.bits == 64;
  switch (dtype.code) {
    case kDLInt:
    case kDLUInt:
      return power_of_two_bytes;
    case kDLFloat:
      return dtype.bits == 16 || dtype.bits == 32 || dtype.bits == 64;
    case kDLBool:
      return dtype.bits == 8;
    case kDLComplex:
      return dtype.bits == 64 || dtype.bits == 128;
    default:
      return false;
  }
}

array_layout layout_of(const DLTensor& t, bool readonly)
{
  HANDOFF_EXPECTS(t.ndim >= 0, value_error, fmt::format("DLPack tensor has negative ndim ({})", t.ndim));
  HANDOFF_EXPECTS(t.ndim == 0 || t.shape != nullptr, value_error,
                  fmt::format("DLPack tensor has ndim {} but a null shape", t.ndim));
  HANDOFF_EXPECTS(
    is_dlpack_device_type(t.device.device_type), value_error,
    fmt::format("DLPack tensor's device type {} is not a DLPack device type", static_cast<int>(t.device.device_type)));
  HANDOFF_EXPECTS(t.device.device_id >= 0, value_error,
                  fmt::format("DLPack tensor's device id {} is negative", t.device.device_id));
  if (!is_common(t.dtype)) { (void)dtype_name(t.dtype); }  // throws buffer_error for dtypes handoff cannot describe
  array_layout layout;
  layout.device = on_one_cpu(t.device);
  layout.dtype = t.dtype;
  layout.readonly = readonly;
  const auto ndim = static_cast<std::size_t>(t.ndim);
  layout.shape.assign(t.shape, t.shape + ndim);
  if (t.strides != nullptr) {
    layout.strides.assign(t.strides, t.strides + ndim);
  } else {
    layout.strides.resize(ndim);
    detail::fill_contiguous_strides(layout.shape, layout.strides.data());
  }
  // In integers: an offset past the producer's allocation is its error, but must not make ours undefined.
  layout.data =
    t.data == nullptr ? nullptr : reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(t.data) + t.byte_offset);
  return layout;
}

}  // namespace

array import_dlpack(DLManagedTensorVersioned* tensor, deleter_runner run_deleter)
{
  HANDOFF_EXPECTS(tensor != nullptr, value_error, "DLPack capsule holds a null DLManagedTensorVersioned");
  shared_producer owner = adopt(tensor, run_deleter);  // from here on, the deleter runs exactly once
  HANDOFF_EXPECTS(tensor->version.major == DLPACK_MAJOR_VERSION, buffer_error,
                  fmt::format("DLPack major version {}.{} is not supported (handoff understands {}.x)",
                              tensor->version.major, tensor->version.minor, DLPACK_MAJOR_VERSION));
  const DLTensor& t = tensor->dl_tensor;
  const bool padded = (tensor->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
  HANDOFF_EXPECTS(t.dtype.bits >= 8 || padded, buffer_error,
                  fmt::format("packed sub-byte dtype ({} bits) is not supported; export it padded", t.dtype.bits));
  return array{layout_of(t, (tensor->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0), std::move(owner)};
}

array import_dlpack(DLManagedTensor* tensor, deleter_runner run_deleter)
{
  HANDOFF_EXPECTS(tensor != nullptr, value_error, "DLPack capsule holds a null DLManagedTensor");
  shared_producer owner = adopt(tensor, run_deleter);
  HANDOFF_EXPECTS(tensor->dl_tensor.dtype.bits >= 8, buffer_error,
                  fmt::format("sub-byte dtype ({} bits) cannot be exchanged through a legacy DLPack capsule",
                              tensor->dl_tensor.dtype.bits));
  return array{layout_of(tensor->dl_tensor, false), std::move(owner)};
}

// ---------------------------------------------------------------------------------------------
// Export

namespace {

// One allocation per export: the managed tensor and the producer it pins, followed by its shape
// and strides (2 * ndim values; at least one, so that a 0-d tensor's pointers are never NULL).
template <typename Managed>
struct exported {
  exported(const array& view, std::int64_t* dims) noexcept
      : managed{describe(view, dims)}, owner{view.owner()}, tracked{managed.dl_tensor, owner, "dlpack"}
  {
    managed.manager_ctx = this;
    managed.deleter = &exported::deleter;
  }

  Managed managed;
  shared_producer owner;
  tracked_view tracked;  // registered once `managed` describes the data
  bool usual{false};     // its block is a kept one (a consumer may change `managed`, not this)

  static std::int64_t* trailing(void* self) noexcept
  {
    return reinterpret_cast<std::int64_t*>(static_cast<std::byte*>(self) + header_size());
  }
  static constexpr std::size_t header_size() noexcept
  {
    return (sizeof(exported) + alignof(std::int64_t) - 1) / alignof(std::int64_t) * alignof(std::int64_t);
  }
  static constexpr std::size_t bytes(std::size_t ndim) noexcept
  {
    return header_size() + sizeof(std::int64_t) * std::max<std::size_t>(2 * ndim, 1);
  }

  static Managed describe(const array& view, std::int64_t* dims) noexcept
  {
    const auto ndim = static_cast<std::size_t>(view.ndim());
    dims[0] = 0;
    // One loop for both (not two calls of memmove, which two copies become): few dimensions.
    const std::int64_t* shape = view.shape().data();
    const std::int64_t* strides = view.strides().data();
    for (std::size_t i = 0; i < ndim; ++i) {
      dims[i] = shape[i];
      dims[ndim + i] = strides[i];
    }
    Managed out{};
    DLTensor& t = out.dl_tensor;
    t.data = view.data();
    t.device = view.device();
    t.ndim = view.ndim();
    t.dtype = view.dtype();
    t.shape = dims;
    t.strides = dims + ndim;  // never NULL (DLPack 1.2); for 0-d both point at one zero
    t.byte_offset = 0;
    return out;
  }

  // Exports of up to this many dimensions take a block of bytes(usual_ndim) from the thread's kept ones.
  static constexpr std::size_t usual_ndim = 4;

  static exported* make(const array& view)
  {
    const auto ndim = static_cast<std::size_t>(view.ndim());
    const bool usual = ndim <= usual_ndim;
    void* memory = usual ? detail::thread_block_cache<bytes(usual_ndim)>::allocate() : ::operator new(bytes(ndim));
    auto* out = new (memory) exported{view, trailing(memory)};  // noexcept from here on
    out->usual = usual;
    if (trace::enabled()) {
      if (trace::exchange_scope* scope = trace::exchange_scope::current();
          scope != nullptr && scope->event().kind == trace::event_kind::export_data) {
        scope->set_view(view, out->tracked.id());
      }
    }
    return out;
  }

  static void deleter(Managed* self) noexcept
  {
    auto* out = static_cast<exported*>(self->manager_ctx);
    const bool usual = out->usual;
    out->~exported();
    if (usual) {
      detail::thread_block_cache<bytes(usual_ndim)>::deallocate(out);
    } else {
      ::operator delete(out);
    }
  }
};

template <typename Managed>
Managed* make_export(const array& view)
{
  return &exported<Managed>::make(view)->managed;
}

template <typename Managed>
bool exported_by_handoff(const Managed* tensor) noexcept
{
  return tensor->deleter == &exported<Managed>::deleter;
}

}  // namespace

DLManagedTensorVersioned* export_versioned(const array& view, export_options options)
{
  // DLPack 1.1 added the flag that says a sub-byte dtype's elements are padded: a 1.0 consumer
  // would read them as packed.
  HANDOFF_EXPECTS(view.dtype().bits >= 8 || options.version.major > 1 || options.version.minor >= 1, buffer_error,
                  fmt::format("a sub-byte dtype needs DLPack 1.1 (its padding flag); the consumer reads {}.{}: pass "
                              "max_version=(1, 1)",
                              options.version.major, options.version.minor));
  auto* managed = make_export<DLManagedTensorVersioned>(view);
  managed->version = options.version;
  managed->flags = (view.readonly() ? DLPACK_FLAG_BITMASK_READ_ONLY : 0) |
                   (options.copied ? DLPACK_FLAG_BITMASK_IS_COPIED : 0) |
                   (view.dtype().bits < 8 ? DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED : 0);
  return managed;
}

DLManagedTensor* export_legacy(const array& view)
{
  HANDOFF_EXPECTS(!view.readonly(), buffer_error,
                  "cannot export a read-only array to a legacy DLPack consumer (it cannot mark it read-only); "
                  "pass max_version=(1, 0) or newer");
  HANDOFF_EXPECTS(view.dtype().bits >= 8, buffer_error,
                  "a sub-byte dtype cannot be exported through a legacy DLPack capsule; pass max_version=(1, 1)");
  return make_export<DLManagedTensor>(view);
}

}  // namespace handoff
