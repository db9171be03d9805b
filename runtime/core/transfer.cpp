// The array API's `device` and `copy` rules for both directions, and the copies and host views they
// make, waited for in the embedding's blocking section.
#include <handoff/embedding.hpp>
#include <handoff/error.hpp>
#include <handoff/internal/device_memory.hpp>
#include <handoff/internal/ordering.hpp>
#include <handoff/internal/transfer.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>

namespace handoff {

namespace {

bool same_device(DLDevice a, DLDevice b) noexcept
{
  return a.device_type == b.device_type && a.device_id == b.device_id;
}

// The array API's rules for handing `view` over to `target` with `copy`, one for both directions;
// `verb` ("export", "import") names the direction in messages.
transfer plan_transfer(const array& view, std::optional<DLDevice> target, std::optional<bool> copy, const char* verb)
{
  HANDOFF_EXPECTS(!target || target->device_id >= 0, value_error,
                  fmt::format("cannot {} to {}: a device id is never negative", verb, device_text(*target)));
  HANDOFF_EXPECTS(!target || target->device_type != kDLCPU || target->device_id == 0, buffer_error,
                  fmt::format("cannot {} to {}: the CPU is device 0", verb, device_text(*target)));
  const bool moves = target.has_value() && !same_device(*target, view.device());
  HANDOFF_EXPECTS(!moves || target->device_type == kDLCPU, buffer_error,
                  fmt::format("cannot {} an array on {} to {}: the device is unreachable from there", verb,
                              device_text(view.device()), device_text(*target)));
  // Host-accessible memory (pinned, managed) is reused, as the array API asks of copy=None.
  if (moves && is_host_accessible(view.device().device_type) && copy != true) { return transfer::host_view; }
  HANDOFF_EXPECTS(!(moves && copy == false), buffer_error,
                  fmt::format("to {} an array on {} to {} needs a copy, but copy=False", verb,
                              device_text(view.device()), device_text(*target)));
  if (moves) { return transfer::to_host; }
  return copy == true ? transfer::same_device : transfer::none;
}

}  // namespace

transfer plan_export(const array& view, std::optional<DLDevice> target, std::optional<bool> copy)
{
  return plan_transfer(view, target, copy, "export");
}

transfer plan_import(const array& view, std::optional<DLDevice> target, std::optional<bool> copy, bool producer_copied)
{
  const transfer how = plan_transfer(view, target, copy, "import");
  return how == transfer::same_device && producer_copied ? transfer::none : how;
}

namespace {

// Runs `wait` (returning an array) in `ctx`'s blocking section.
template <typename Wait>
array blocking(const context& ctx, Wait&& wait)
{
  struct state_type {
    Wait& wait;
    std::optional<array> result;
  } state{wait, std::nullopt};
  run_blocking(
    ctx.hooks().block_host,
    [](void* raw) { static_cast<state_type*>(raw)->result.emplace(static_cast<state_type*>(raw)->wait()); }, &state);
  return std::move(*state.result);
}

}  // namespace

array transfer_array(context* ctx_or_null, const array& view, transfer how)
{
  if (how == transfer::none) { return view; }
  if (view.device().device_type == kDLCPU) { return copy_to_host(view); }
  if (ctx_or_null == nullptr) {
    throw device_error("none", error_names::no_backend,
                       fmt::format("{} needs a device backend, and none is active",
                                   how == transfer::host_view ? "exporting host-accessible device memory to the CPU"
                                                              : "copying device memory"));
  }
  context& ctx = *ctx_or_null;
  if (how == transfer::host_view) {
    return blocking(ctx, [&] { return host_view(ctx, view); });
  }
  HANDOFF_EXPECTS(is_stream_ordered(ctx, view), buffer_error,
                  fmt::format("the {} backend cannot copy {} memory", ctx.backend().name(),
                              device_type_name(view.device().device_type)));
  if (how == transfer::same_device) { return copy_device_array(ctx, view, false); }  // only enqueues
  return blocking(ctx, [&] { return copy_device_array(ctx, view, true); });
}

namespace {

// prepare_export with a transfer, kept out of line: the common export (the view itself) stays a few
// instructions.
[[gnu::noinline]] std::unique_ptr<const array> transferred_export(context* ctx, const array& view,
                                                                  stream_request consumer, transfer how,
                                                                  export_release policy,
                                                                  std::shared_ptr<const void> owner)
{
  auto made = std::make_unique<const array>(transfer_array(ctx, view, how));
  if (how == transfer::same_device) {
    if (consumer.order != stream_order::none) {
      order_export(ctx, *made, consumer, policy, std::move(owner));
    } else {
      note_unordered_export(*made);
    }
  }
  return made;
}

}  // namespace

std::unique_ptr<const array> prepare_export(context* ctx, const array& view, stream_request consumer, transfer how,
                                            export_release policy, std::shared_ptr<const void> consumer_owner)
{
  if (how != transfer::none) { return transferred_export(ctx, view, consumer, how, policy, std::move(consumer_owner)); }
  if (consumer.order != stream_order::none) {
    order_export(ctx, view, consumer, policy, std::move(consumer_owner));
  } else {
    note_unordered_export(view);
  }
  return nullptr;
}

}  // namespace handoff
