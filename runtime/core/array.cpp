#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/ownership.hpp>
#include <handoff/stream_value.hpp>
#include <handoff/trace.hpp>

#include "core/live_views.hpp"
#include "core/producer_state.hpp"
#include "log/logger.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <utility>

namespace handoff {

namespace {

// The release event of a producer: deferred ("wait") when consumer streams must finish first.
void trace_release(producer_ref::state& s) noexcept
{
  trace::exchange_scope scope{trace::event_kind::release, "release"};
  if (!scope.active()) { return; }
  trace::event& e = scope.event();
  e.buffer = s.id();
  std::lock_guard lock{s.mutex_};  // no other reference is left; other threads may still read for the graph
  if (s.ready_on_) { scope.set_producer_stream(*s.ready_on_); }
  if (!s.release_after_.empty()) { scope.set_consumer_stream(s.release_after_.front()); }
}

}  // namespace

std::uint64_t producer_ref::state::id() noexcept
{
  if (parent_) { return parent_.state_->id(); }  // one buffer, however many derived producers
  std::uint64_t current = id_.load(std::memory_order_relaxed);
  if (current != 0) { return current; }
  const std::uint64_t fresh = detail::next_node_id();
  return id_.compare_exchange_strong(current, fresh, std::memory_order_relaxed) ? fresh : current;
}

void producer_ref::state::destroy(state* s) noexcept
{
  thread_local state* queued = nullptr;  // deletions asked for while one runs, last first
  thread_local bool destroying = false;
  if (destroying) {
    s->next_to_destroy_ = std::exchange(queued, s);
    return;
  }
  destroying = true;
  delete s;
  while (queued != nullptr) { delete std::exchange(queued, queued->next_to_destroy_); }
  destroying = false;
}

producer_ref::state::~state()
{
  detail::live_view_released();
  if (trace::enabled()) { trace_release(*this); }
  // A derived producer's release lets go of its root, after the streams it was bound to.
  if (parent_) {
    release_ = [root = std::move(parent_)]() noexcept {};
  }
  if (!release_) { return; }
  if (release_after_.empty()) {
    try {
      release_();
    } catch (...) {
      HANDOFF_LOG_ERROR("a producer's release function threw; the exception was dropped");
    }
    return;
  }
  if (release_after_.size() == 1) {
    defer(release_after_.front(), std::move(release_));
    return;
  }
  // Several consumer streams: each is watched from now, and the last to get there releases.
  struct countdown {
    countdown(std::size_t streams, std::function<void()> then) noexcept : remaining(streams), release(std::move(then))
    {}
    std::atomic<std::size_t> remaining;
    std::function<void()> release;
  };
  std::shared_ptr<countdown> all;
  try {
    all = std::make_shared<countdown>(release_after_.size(), std::move(release_));
  } catch (...) {
    HANDOFF_LOG_ERROR("out of memory ordering a release after {} streams; the producer is kept", release_after_.size());
    return;
  }
  for (stream_binding& consumer : release_after_) {
    defer(consumer, [all]() noexcept {
      if (all->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) { all->release(); }
    });
  }
}

// Runs `release` once the work enqueued on `consumer` by now is done; a held-back producer stream
// of the same device waits for that work too.
void producer_ref::state::defer(stream_binding& consumer, std::function<void()> release) noexcept
{
  std::optional<device::stream_handle> producer;
  std::shared_ptr<const void> producer_owner;
  if (hold_back_ && hold_back_->ctx == consumer.ctx && hold_back_->device == consumer.device) {
    producer = hold_back_->stream;
    producer_owner = hold_back_->stream_owner;  // shared by every consumer stream's release
  }
  if (!consumer.stream_owner && !producer_owner) {
    consumer.ctx->release_after(consumer.device, consumer.stream, std::move(release), producer);
    return;
  }
  // The streams' owners go once the release has run, after the last use of the streams.
  consumer.ctx->release_after(
    consumer.device, consumer.stream,
    [release = std::move(release), owner = std::move(consumer.stream_owner),
     held = std::move(producer_owner)]() noexcept { release(); },
    producer);
}

producer_ref::producer_ref(std::function<void()> release)
{
  try {
    state_ = new state(std::move(release));
  } catch (...) {
    // Out of memory before ownership was established: release now, so nothing leaks.
    if (release) { release(); }
    throw;
  }
}

producer_ref::producer_ref(const producer_ref& other) noexcept : state_(other.state_)
{
  state::acquire(state_);
}

producer_ref& producer_ref::operator=(const producer_ref& other) noexcept
{
  if (this != &other) {
    state::acquire(other.state_);
    state::release(std::exchange(state_, other.state_));
  }
  return *this;
}

producer_ref& producer_ref::operator=(producer_ref&& other) noexcept
{
  if (this != &other) { state::release(std::exchange(state_, std::exchange(other.state_, nullptr))); }
  return *this;
}

producer_ref::~producer_ref()
{
  state::release(state_);
}

std::uint64_t producer_ref::id() const noexcept
{
  return state_ == nullptr ? 0 : state_->id();
}

const std::function<void()>* producer_ref::sole_release() const noexcept
{
  if (state_ == nullptr || state_->references_.load(std::memory_order_acquire) != 1 || !state_->release_) {
    return nullptr;
  }
  return &state_->release_;
}

void producer_ref::visit_stream_owners(void (*visit)(const std::shared_ptr<const void>& owner, void* context),
                                       void* context) const
{
  if (state_ == nullptr || state_->references_.load(std::memory_order_acquire) != 1) { return; }
  std::lock_guard lock{state_->mutex_};
  const auto visit_binding = [&](const stream_binding& binding) {
    if (binding.stream_owner) { visit(binding.stream_owner, context); }
  };
  if (state_->ready_on_) { visit_binding(*state_->ready_on_); }
  for (const stream_binding& after : state_->release_after_) { visit_binding(after); }
  if (state_->hold_back_) { visit_binding(*state_->hold_back_); }
}

producer_ref producer_ref::derived() const
{
  if (state_ == nullptr) { return {}; }
  producer_ref out{std::function<void()>{}};
  out.state_->parent_ = state_->parent_ ? state_->parent_ : *this;
  return out;
}

long producer_ref::use_count() const noexcept
{
  return state_ == nullptr ? 0 : state_->references_.load(std::memory_order_relaxed);
}

namespace {

// A binding is used later, from any thread.
stream_binding thread_independent(stream_binding where) noexcept
{
  if (where.ctx != nullptr) { where.stream = where.ctx->thread_independent(where.device, where.stream); }
  return where;
}

}  // namespace

std::optional<stream_binding> producer_ref::ready_on() const
{
  if (!state_) { return std::nullopt; }
  std::lock_guard lock{state_->mutex_};
  return state_->ready_on_;
}

void producer_ref::set_ready_on(const stream_binding& where) const
{
  if (!state_) { return; }
  stream_binding bound = thread_independent(where);
  std::lock_guard lock{state_->mutex_};
  state_->ready_on_ = std::move(bound);
}

void producer_ref::release_after(const stream_binding& consumer, const std::optional<stream_binding>& producer) const
{
  if (!state_ || consumer.ctx == nullptr) { return; }
  stream_binding bound = thread_independent(consumer);
  std::optional<stream_binding> held;
  if (producer) { held = thread_independent(*producer); }
  std::lock_guard lock{state_->mutex_};
  const auto same = [&](const stream_binding& b) {
    return b.ctx == bound.ctx && b.device == bound.device && b.stream == bound.stream;
  };
  if (std::none_of(state_->release_after_.begin(), state_->release_after_.end(), same)) {
    state_->release_after_.push_back(std::move(bound));
  }
  if (held) { state_->hold_back_ = std::move(held); }
}

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

}  // namespace

void validate_layout(const array_layout& layout)
{
  if (checked_nbytes(layout) == 0) { return; }
  HANDOFF_EXPECTS(layout.data != nullptr, value_error, "data is a null pointer but the array has elements");
  // Every consumer computes element addresses from the strides: they must not overflow.
  HANDOFF_EXPECTS(range_of(layout, static_cast<std::int64_t>(itemsize(layout.dtype))).has_value(), value_error,
                  fmt::format("strides ({}, in elements) overflow: an element's byte offset does not fit in 64 bits",
                              fmt::join(layout.strides, ", ")));
}

std::optional<byte_range> byte_range_of(const array_layout& layout) noexcept
{
  return range_of(layout, static_cast<std::int64_t>(itemsize(layout.dtype)));
}

array::array(array_layout layout, producer_ref owner) : layout_(std::move(layout)), owner_(std::move(owner))
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

namespace {

// Row-major strides of `shape`, written to `strides` (shape.size() entries). The product wraps
// instead of overflowing (undefined) for a shape whose element count does not fit in int64:
// validate_layout refuses such a shape, and these strides are computed before it runs.
void fill_contiguous_strides(std::span<const std::int64_t> shape, std::int64_t* strides) noexcept
{
  std::int64_t step = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    strides[i] = step;
    (void)__builtin_mul_overflow(step, shape[i] > 0 ? shape[i] : 1, &step);
  }
}

}  // namespace

std::vector<std::int64_t> contiguous_strides(std::span<const std::int64_t> shape)
{
  std::vector<std::int64_t> strides(shape.size());
  fill_contiguous_strides(shape, strides.data());
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
  fill_contiguous_strides(layout.shape, layout.strides.data());
  const std::int64_t bytes = checked_nbytes(layout);
  return {std::move(layout), static_cast<std::size_t>(bytes)};
}

array allocate_host_array(DLDataType dtype, std::span<const std::int64_t> shape)
{
  auto [layout, bytes] = row_major_layout({kDLCPU, 0}, dtype, shape);
  if (bytes == 0) {
    return array{std::move(layout), producer_ref{[] {}}};
  }
  auto storage = std::make_unique_for_overwrite<std::byte[]>(bytes);
  layout.data = storage.get();
  std::byte* raw = storage.release();
  return array{std::move(layout), producer_ref{[raw]() noexcept { delete[] raw; }}};
}

// ---------------------------------------------------------------------------------------------
// Import

namespace {
std::atomic<deleter_runner> installed_runner{nullptr};
}  // namespace

void set_deleter_runner(deleter_runner runner) noexcept
{
  installed_runner.store(runner, std::memory_order_release);
}

namespace {

template <typename Managed>
void invoke_deleter(void* tensor) noexcept
{
  auto* managed = static_cast<Managed*>(tensor);
  managed->deleter(managed);
}

template <typename Managed>
producer_ref adopt(Managed* tensor)
{
  return producer_ref{[tensor]() noexcept {
    if (tensor->deleter == nullptr) { return; }
    if (const deleter_runner runner = installed_runner.load(std::memory_order_acquire); runner != nullptr) {
      runner(&invoke_deleter<Managed>, tensor);
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
  if (!is_common(t.dtype)) { (void)dtype_name(t.dtype); }  // throws buffer_error for dtypes handoff cannot describe
  array_layout layout;
  layout.device = t.device;
  layout.dtype = t.dtype;
  layout.readonly = readonly;
  const auto ndim = static_cast<std::size_t>(t.ndim);
  layout.shape.assign(t.shape, t.shape + ndim);
  if (t.strides != nullptr) {
    layout.strides.assign(t.strides, t.strides + ndim);
  } else {
    layout.strides.resize(ndim);
    fill_contiguous_strides(layout.shape, layout.strides.data());
  }
  // In integers: an offset past the producer's allocation is its error, but must not make ours undefined.
  layout.data =
    t.data == nullptr ? nullptr : reinterpret_cast<void*>(reinterpret_cast<std::uintptr_t>(t.data) + t.byte_offset);
  return layout;
}

}  // namespace

array import_dlpack(DLManagedTensorVersioned* tensor)
{
  HANDOFF_EXPECTS(tensor != nullptr, value_error, "DLPack capsule holds a null DLManagedTensorVersioned");
  producer_ref owner = adopt(tensor);  // from here on, the deleter runs exactly once
  HANDOFF_EXPECTS(tensor->version.major == DLPACK_MAJOR_VERSION, buffer_error,
                  fmt::format("DLPack major version {}.{} is not supported (handoff understands {}.x)",
                              tensor->version.major, tensor->version.minor, DLPACK_MAJOR_VERSION));
  const DLTensor& t = tensor->dl_tensor;
  const bool padded = (tensor->flags & DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED) != 0;
  HANDOFF_EXPECTS(t.dtype.bits >= 8 || padded, buffer_error,
                  fmt::format("packed sub-byte dtype ({} bits) is not supported; export it padded", t.dtype.bits));
  return array{layout_of(t, (tensor->flags & DLPACK_FLAG_BITMASK_READ_ONLY) != 0), std::move(owner)};
}

array import_dlpack(DLManagedTensor* tensor)
{
  HANDOFF_EXPECTS(tensor != nullptr, value_error, "DLPack capsule holds a null DLManagedTensor");
  producer_ref owner = adopt(tensor);
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
  producer_ref owner;
  tracked_view tracked;  // registered once `managed` describes the data

  static std::int64_t* trailing(void* self) noexcept
  {
    return reinterpret_cast<std::int64_t*>(static_cast<std::byte*>(self) + header_size());
  }
  static constexpr std::size_t header_size() noexcept
  {
    return (sizeof(exported) + alignof(std::int64_t) - 1) / alignof(std::int64_t) * alignof(std::int64_t);
  }
  static std::size_t bytes(std::size_t ndim) noexcept
  {
    return header_size() + sizeof(std::int64_t) * std::max<std::size_t>(2 * ndim, 1);
  }

  static Managed describe(const array& view, std::int64_t* dims) noexcept
  {
    const auto ndim = static_cast<std::size_t>(view.ndim());
    dims[0] = 0;
    std::copy(view.shape().begin(), view.shape().end(), dims);
    std::copy(view.strides().begin(), view.strides().end(), dims + ndim);
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

  static exported* make(const array& view)
  {
    void* memory = ::operator new(bytes(static_cast<std::size_t>(view.ndim())));
    auto* out = new (memory) exported{view, trailing(memory)};  // noexcept from here on
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
    out->~exported();
    ::operator delete(out);
  }
};

template <typename Managed>
Managed* make_export(const array& view)
{
  return &exported<Managed>::make(view)->managed;
}

}  // namespace

DLManagedTensorVersioned* export_versioned(const array& view, export_options options)
{
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

// ---------------------------------------------------------------------------------------------
// Copy

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
