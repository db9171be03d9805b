// Internal: the array API's `device` and `copy` rules, and what they make (the exchange's transfers).
#pragma once

#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/stream_value.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>

namespace handoff {

/// The DLPack version an export stamps for a consumer that reads at most `consumer_max`: nullopt
/// (the legacy, unversioned capsule) when it gave none or a major version below 1; ours otherwise,
/// with the consumer's minor when it is older, so that it can read every field set.
[[nodiscard]] inline std::optional<DLPackVersion> export_version(std::optional<DLPackVersion> consumer_max) noexcept
{
  if (!consumer_max || consumer_max->major < 1) { return std::nullopt; }
  const std::uint32_t minor = consumer_max->major == DLPACK_MAJOR_VERSION
                                ? std::min<std::uint32_t>(consumer_max->minor, DLPACK_MINOR_VERSION)
                                : DLPACK_MINOR_VERSION;
  return DLPackVersion{DLPACK_MAJOR_VERSION, minor};
}

/// What handing `view` over to `target` with the array API's `copy` makes.
enum class transfer {
  none,         ///< the view itself
  same_device,  ///< a copy on the view's device
  to_host,      ///< a copy in host memory
  host_view,    ///< the view's host-accessible memory (pinned, managed) as CPU data, not copied
};

/// The export of `view` to `target` (nullopt: its own device) with `copy` (nullopt: only if needed):
/// host-accessible memory moves to the CPU as a host view unless a copy is asked for, other device
/// memory by a copy.
/// @throws buffer_error when `target` is neither the view's device nor the CPU, or a copy is needed
///         and `copy` is false.
[[nodiscard]] transfer plan_export(const array& view, std::optional<DLDevice> target, std::optional<bool> copy);

/// The import of `view`, as its producer handed it over, for a consumer asking for `target` and
/// `copy` where the producer could not honour them: plan_export's rules, but nothing more when
/// `producer_copied` (it honoured copy=True already).
/// @throws buffer_error as plan_export.
[[nodiscard]] transfer plan_import(const array& view, std::optional<DLDevice> target, std::optional<bool> copy,
                                   bool producer_copied);

/// What an exchange hands over for `how`: the view itself; a compact copy (host data copied on the
/// host; device data through `ctx`'s backend, in stream order, a copy to the host waited for); or
/// the host view of host-accessible memory (waited for). Waits run in `ctx`'s blocking
/// section (embedding::block_host).
/// @throws device_error when device data needs a backend and `ctx` is null, or a device call
///         fails; buffer_error when the backend does not order that memory.
[[nodiscard]] array transfer_array(context* ctx, const array& view, transfer how);

/// Prepares the export of `view` to a consumer asking for `consumer` (`consumer_owner`, possibly
/// empty, keeps that stream alive; `policy` says whether a bare handle is waited for at release),
/// `how` as plan_export chose: the array to hand over instead of
/// the view (transfer_array's), or null for the view itself (the common export, which allocates
/// nothing); either is ordered for the consumer where it stays on the device (order_export).
/// @throws what transfer_array and order_export throw.
[[nodiscard]] std::unique_ptr<const array> prepare_export(context* ctx, const array& view, stream_request consumer,
                                                          transfer how, export_release policy,
                                                          std::shared_ptr<const void> consumer_owner = {});

}  // namespace handoff
