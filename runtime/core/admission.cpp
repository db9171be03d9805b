// Which device owns memory, and whether a context's backend orders it: the door every view of
// device data passes (see <handoff/internal/admission.hpp>).
#include <handoff/error.hpp>
#include <handoff/internal/admission.hpp>
#include <handoff/stream_value.hpp>

#include <fmt/format.h>

#include <cstdint>
#include <string>

namespace handoff {

bool is_stream_ordered(const context& ctx, const array& view) noexcept
{
  const DLDeviceType type = view.device().device_type;
  return ctx.backend().device_type() == kDLROCM ? is_rocm_device(type) : is_cuda_device(type);
}

void require_stream_ordered(const context& ctx, const array& view)
{
  if (!is_stream_ordered(ctx, view)) {
    throw device_error(std::string{ctx.backend().name()}, error_names::wrong_backend,
                       fmt::format("a {} array cannot be ordered by the {} backend",
                                   device_type_name(view.device().device_type), ctx.backend().name()));
  }
}

namespace {

// The device the array claims, where no allocation says otherwise. Work and releases are put on its
// streams later, so a device the backend does not have is refused now, not when a release fails.
int claimed_device(context& ctx, DLDevice claimed)
{
  const int count = ctx.backend().device_count();
  HANDOFF_EXPECTS(claimed.device_id >= 0 && claimed.device_id < count, value_error,
                  fmt::format("the array claims {} device {}, but the {} backend has {} device(s)",
                              device_type_name(claimed.device_type), claimed.device_id, ctx.backend().name(), count));
  return claimed.device_id;
}

// Refuses a view whose bytes run past the memory the backend knows: every reader would run off it.
// One allocation covers the usual view; a range its first byte's allocation does not cover (a
// mapping a virtual-memory allocator grew, as PyTorch's expandable segments) must end in memory of
// the same kind on the same device. `at_data` is what the backend said of the view's data pointer.
void require_known_range(context& ctx, const array& view, const device::pointer_attributes& at_data)
{
  const auto range = byte_range_of(view.layout());  // validate_layout checked that it exists
  if (!range || range->high == range->low) { return; }
  const auto address = reinterpret_cast<std::uintptr_t>(view.data());
  std::uintptr_t first = 0;
  std::uintptr_t last = 0;
  const bool wraps =
    __builtin_add_overflow(address, range->low, &first) || __builtin_add_overflow(address, range->high - 1, &last);
  const auto extent = [&] {
    // In unsigned arithmetic: a range from far below the data to far above it spans more than
    // int64_t counts.
    const auto bytes = static_cast<std::uint64_t>(range->high) - static_cast<std::uint64_t>(range->low);
    return fmt::format("the array's {} bytes from {:#x}", bytes, wraps ? address : first);
  };
  HANDOFF_EXPECTS(!wraps, value_error, fmt::format("{} wrap around the address space", extent()));
  device::backend& b = ctx.backend();
  const device::pointer_attributes start =
    first == address ? at_data : b.attributes(reinterpret_cast<const void*>(first));
  HANDOFF_EXPECTS(start.kind != device::memory_kind::unregistered, value_error,
                  fmt::format("{} start outside any allocation of the {} backend", extent(), b.name()));
  const auto base = reinterpret_cast<std::uintptr_t>(start.base);
  if (last - base < start.size) { return; }
  const device::pointer_attributes end = b.attributes(reinterpret_cast<const void*>(last));
  HANDOFF_EXPECTS(end.kind == start.kind && end.device == start.device, value_error,
                  fmt::format("{} run past the end of their allocation ({} bytes from {:#x}) into memory the {} "
                              "backend does not know as the same device's",
                              extent(), start.size, base, b.name()));
}

// The device that owns the memory at `view`'s data pointer, of which the backend said `where`.
int owning_device(context& ctx, const array& view, const device::pointer_attributes& where)
{
  const DLDevice claimed = view.device();
  const bool device_memory = claimed.device_type == kDLCUDA || claimed.device_type == kDLROCM;
  if (device_memory) {
    // Managed memory is device memory to its users: PyTorch with a managed allocator and RMM's
    // managed resource export it as kDLCUDA, on the device that uses it.
    if (where.kind == device::memory_kind::managed) { return claimed_device(ctx, claimed); }
    HANDOFF_EXPECTS(where.kind == device::memory_kind::device, value_error,
                    fmt::format("the array claims {} device {} memory, but {:#x} is not device memory of the {} "
                                "backend",
                                device_type_name(claimed.device_type), claimed.device_id,
                                reinterpret_cast<std::uintptr_t>(view.data()), ctx.backend().name()));
    HANDOFF_EXPECTS(
      where.device == claimed.device_id, value_error,
      fmt::format("the array claims device {}, but its memory belongs to device {}", claimed.device_id, where.device));
    return where.device;
  }
  // A host-accessible claim (pinned, managed) is read by the host: copied to the CPU, or handed to it
  // as it is. Memory only a device can read would fault there.
  HANDOFF_EXPECTS(where.kind != device::memory_kind::device, value_error,
                  fmt::format("the array claims {} memory, but {:#x} is device memory of device {} of the {} "
                              "backend, which the host cannot read",
                              device_type_name(claimed.device_type), reinterpret_cast<std::uintptr_t>(view.data()),
                              where.device, ctx.backend().name()));
  // Pinned and managed memory report device 0 in DLPack; record where the allocation was made.
  return where.device >= 0 ? where.device : ctx.backend().current_device();
}

}  // namespace

int owning_device(context& ctx, const array& view)
{
  if (view.data() == nullptr) { return claimed_device(ctx, view.device()); }  // empty: nothing to look up
  return owning_device(ctx, view, ctx.backend().attributes(view.data()));
}

int admit(context& ctx, const array& view)
{
  require_stream_ordered(ctx, view);
  if (view.data() == nullptr) { return claimed_device(ctx, view.device()); }  // empty: no bytes to check
  const device::pointer_attributes where = ctx.backend().attributes(view.data());
  const int device = owning_device(ctx, view, where);
  require_known_range(ctx, view, where);
  return device;
}

}  // namespace handoff
