// The stream rules of an exchange: what an export orders, and what an import promises.
#pragma once

#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/interface.hpp>
#include <handoff/stream_value.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <span>

namespace handoff {

/// The DLPack version an export stamps for a consumer that reads at most `consumer_max`: nullopt
/// (the legacy, unversioned capsule) when it gave none or a major version below 1; ours otherwise,
/// with the consumer's minor when it is older, so that it can read every field set.
[[nodiscard]] std::optional<DLPackVersion> export_version(std::optional<DLPackVersion> consumer_max) noexcept;

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

/// How the host waits where an exchange must block it (a copy to the host, a host view): `body(state)`
/// runs on the calling thread and may throw, which must propagate. The Python module releases the
/// GIL around it, so that other threads run while this one waits.
using blocking_section = void (*)(void (*body)(void* state), void* state);
/// Installs `section` for every later transfer_array (nullptr: the body runs as it is).
void set_blocking_section(blocking_section section) noexcept;

/// What an exchange hands over for `how` (plan_export, plan_import): the view itself; a compact copy
/// (host data copied on the host; device data through the active backend, in stream order, a copy
/// to the host waited for); or the host view of host-accessible memory (waited for). Waits run in
/// the installed blocking section.
/// @throws device_error when device data needs a backend and none is active, or a device call
///         fails; buffer_error when the backend does not order that memory.
[[nodiscard]] array transfer_array(const array& view, transfer how);

/// Which consumer streams an export's producer waits for when the consumer releases the export
/// (its deleter: PyTorch and CuPy call it at their refcount zero, whatever their stream still has
/// queued). A stream that may be destroyed by then is never touched: recording on it is undefined.
enum class export_release : std::uint8_t {
  known_streams,  ///< the default streams (1, 2; ROCm's 0) and streams whose owner the export holds
  every_stream,   ///< raw handles too: the application promises that each consumer stream outlives
                  ///< the exports it was handed (HANDOFF_EXPORT_RELEASE=every-stream)
};
/// Sets the policy for every later export. Thread-safe.
void set_export_release(export_release policy) noexcept;
/// The policy in force (the runtime starts with HANDOFF_EXPORT_RELEASE's, default known_streams).
[[nodiscard]] export_release current_export_release() noexcept;

/// Prepares the export of `view` to a consumer asking for `consumer` (its `stream` as classify_stream
/// reads it for the view's device; `consumer_owner`, possibly empty, keeps that stream alive), `how` as
/// plan_export chose: the array to hand over instead of the view (transfer_array's), or null for the
/// view itself (the common export, which allocates nothing); either is ordered for the consumer
/// where it stays on the device (order_export). Needs no device runtime when nothing is to be
/// ordered or copied (host data, stream=-1).
/// @throws what transfer_array and order_export throw.
[[nodiscard]] std::unique_ptr<const array> prepare_export(const array& view, stream_request consumer, transfer how,
                                                          std::shared_ptr<const void> consumer_owner = {});

/// Makes the device of the data a producer says it holds (its `__dlpack_device__`) current for the
/// scope of the call to its `__dlpack__`: producers order the *current* device's streams (PyTorch
/// records on the current device's stream), so a consumer calls them with the data's device current,
/// as CuPy's does. Nothing for data that is not device memory of the active backend's family.
class producer_device_scope {
 public:
  /// @throws device_error when the device cannot be made current.
  explicit producer_device_scope(DLDevice claimed);

 private:
  std::optional<device_guard> guard_;
};

/// The stream a validated DLPack request names on `backend`; nullopt when it asks for no ordering.
[[nodiscard]] std::optional<device::stream_handle> resolve_stream(device::backend& backend, stream_request request);

/// The device that owns `view`'s memory, from the pointer's attributes (not the current device).
/// @throws value_error when the view claims another device than the one its memory belongs to, or
///         device memory that the backend does not know.
[[nodiscard]] int owning_device(context& ctx, const array& view);

/// A view of memory a library describes itself (to export its own arrays): `layout` checked as an
/// array's; for CUDA or ROCm memory with an active backend, the memory checked against the device it
/// claims (every byte it reaches, not only the first), and the data recorded as ready on `ready` (the producer's
/// stream, kept alive by `ready_owner`; order none: unknown, so exports order after the device's legacy default
/// stream). Without a backend (`ctx` null) device memory is exchanged as it comes.
/// @throws value_error for a bad layout, or memory that is not the claimed device's (or that runs past
///         its allocation); device_error when the backend is of the other device family.
[[nodiscard]] array make_view(context* ctx, array_layout layout, producer_ref owner, stream_request ready,
                              std::shared_ptr<const void> ready_owner = {});

/// Export half: orders the work pending on the stream `view` is ready on (its producer's last
/// write; the device's legacy default stream when unknown) before the work the consumer will
/// enqueue on the requested stream, and keeps `view`'s producer until the work the consumer has
/// enqueued there by the time the export is released is done, when that stream is certain to be
/// alive then (export_release; `consumer_owner`, possibly empty, keeps it so). Never blocks the host.
/// @throws device_error when the view is on a device and no backend is active (`ctx` null), or
///         the backend is of another family (a CUDA array with a ROCm backend).
void order_export(context* ctx, const array& view, stream_request consumer,
                  std::shared_ptr<const void> consumer_owner = {});

/// A new view of `source`'s data (a view handoff made) for a consumer that works on `consumer`:
/// ordered as exporting `source` to that consumer and importing the result would be (the consumer's
/// stream waits for the stream the data is ready on; the new view is ready on the consumer's stream
/// and its producer outlives the work enqueued there), but sharing `source`'s root producer
/// (producer_ref::derived) rather than wrapping an export of it: a chain of re-imports keeps one
/// producer alive, not one per hop.
/// @throws what order_export and consumer_binding throw.
[[nodiscard]] array share_view(const array& source, const named_stream& consumer);

/// Import half: records that `view`'s data is ready on `consumer` (of `device`), and defers the
/// release of its producer until the work enqueued on `consumer` by then is done. `consumer_owner`
/// (may be empty) keeps the consumer stream alive until then.
void bind_import(context& ctx, const array& view, int device, device::stream_handle consumer,
                 std::shared_ptr<const void> consumer_owner = {});

/// Where a device view imported for `consumer` is bound: nullopt when nothing orders it (data
/// without streams, stream=-1, memory no active backend orders). The binding holds `consumer.owner`.
/// @throws value_error for a stream the data's device does not take (checked whether or not a
///         backend orders the memory here); device_error when the data needs ordering and nothing
///         can give it (require_ordering).
[[nodiscard]] std::optional<stream_binding> consumer_binding(const array& view, const named_stream& consumer);

/// Export half for a consumer that works on `consumer` and holds nothing of its own (the DLPack C
/// exchange API's no-sync calls): orders the data's pending work before it (order_export), and keeps
/// the producer until the work enqueued on `consumer` by the view's release is done. Nothing for data
/// without streams.
/// @throws what order_export and consumer_binding throw.
void hand_over(const array& view, const named_stream& consumer);

/// Work on `device` of `ctx`'s backend bound to `stream` (resolved by the stream table of the
/// device's type), which `stream.owner` keeps alive with the binding.
/// @throws value_error for a stream the device type does not take, or stream=-1, which names none.
[[nodiscard]] stream_binding binding_on(context& ctx, DLDevice device, named_stream stream);

/// A device view imported for `consumer`: bind_import at its consumer_binding, when it has one. Its
/// data is then ready there, and its producer outlives the work the consumer enqueues there.
void bind_to_consumer(const array& view, const named_stream& consumer);

/// Import half of a CUDA Array Interface v3 exchange, whose producer may have work in progress on
/// `producer` (its `stream` as classify_stream reads it for CUDA; none when absent): orders that
/// work before `consumer`'s (stream_view::wait), binds the view as bind_import does, and keeps the
/// interface's other promise: the producer's stream runs no later work until the consumer's work on
/// the data is done. That work is known when the view is released: the producer's stream then waits
/// on the event the release records on `consumer` (context::release_after), provided it cannot be
/// destroyed by then (using a destroyed stream is undefined):
/// - the legacy default stream (1), except after a blocking consumer stream, whose earlier work the
///   legacy stream's later work waits for anyway (counted in waits_elided);
/// - the importing thread's per-thread default stream (2), through the legacy default stream, which
///   every thread can name: a wait there holds back the later work of every blocking stream of the
///   device, that per-thread stream included (none needed after a legacy default consumer);
/// - a stream handle that `producer_owner` keeps alive (the stream object the producer holds);
///   when the producer is blocking and the consumer the legacy default stream, none is needed.
/// Any other handle may be destroyed before the release (an interface's `stream` is a bare int, and
/// libraries destroy a stream with its object): it is not touched; only the producer is kept alive
/// until the consumer's work is done.
/// @throws what stream_view::wait throws.
void bind_interface_import(context& ctx, const array& view, int device, device::stream_handle consumer,
                           std::shared_ptr<const void> consumer_owner, stream_request producer,
                           std::shared_ptr<const void> producer_owner = {});

/// The DLPack device of memory the active backend (of `backend_type`, kDLCUDA or kDLROCM) describes by
/// `where`: the backend's type and device for device memory, kDLCUDAManaged (device 0) for managed
/// memory, kDLCUDAHost or kDLROCMHost (device 0) for pinned host memory; nullopt for memory the
/// backend does not know.
/// @throws buffer_error for managed memory on ROCm, which DLPack has no device type for.
[[nodiscard]] std::optional<DLDevice> dlpack_device_of(const device::pointer_attributes& where,
                                                       DLDeviceType backend_type);

/// Imports validated CUDA Array Interface data owned by `owner` for `consumer`: the device is what
/// the active backend knows of the pointer (dlpack_device_of; an empty array's null pointer is on
/// the current device), and the exchange is bind_interface_import's, with `producer_stream_owner`
/// (may be empty) keeping the interface's `stream` alive when something proves it (the stream
/// object the producer holds).
/// @throws device_error when there is no backend; buffer_error for memory the backend does not know.
[[nodiscard]] array import_cuda_interface(cuda_interface interface, producer_ref owner, const named_stream& consumer,
                                          std::shared_ptr<const void> producer_stream_owner);

/// Import half of an exchange whose producer's work is on `producer` (a request as classify_stream
/// reads the producer's stream for the view's device; none: nothing pending): orders that work
/// before the work enqueued on `consumer` from now on (stream_view::wait), then binds the view
/// there (bind_import), keeping `consumer.stream_owner`.
/// @throws what stream_view::wait throws.
void bind_after_producer(const array& view, const stream_binding& consumer, stream_request producer);

/// A compact copy of device-resident `view`, made in order after the work pending on the stream it
/// is ready on: on the host (`to_host`, waited for, so the copy is usable when this returns) or on
/// the same device (stream-ordered: the copy is ready on that stream and returns at once), in the
/// same kind of memory (managed or pinned memory copies to managed or pinned memory).
/// @throws device_error when a device call fails; nothing is leaked.
[[nodiscard]] array copy_device_array(context& ctx, const array& view, bool to_host);

/// A new row-major array of `shape` and `dtype` in device memory handoff owns, allocated in stream
/// order on `on.stream` of device `on.device` of `on.ctx`'s backend: ready on that stream, and freed
/// there once its last view (and the work bound to it) is gone; `on.stream_owner` is kept until then.
/// Its contents are unspecified.
/// @throws value_error for a negative or overflowing shape or a device the backend does not have;
///         buffer_error for a dtype DLPack does not define; device_error when the allocation fails.
[[nodiscard]] array allocate_device_array(const stream_binding& on, DLDataType dtype,
                                          std::span<const std::int64_t> shape);

/// A new row-major array of `shape` and `dtype` in host-accessible memory handoff owns, of `kind`'s
/// device type (kDLCUDAManaged: managed memory; kDLCUDAHost or kDLROCMHost: pinned host memory),
/// allocated on device `on.device` of `on.ctx`'s backend and recorded as ready on `on.stream`. The
/// allocation is not stream-ordered: it is freed, once its last view is gone, when the device is idle.
/// @throws value_error for a shape as allocate_device_array, or a `kind` the host cannot reach;
///         device_error when the allocation fails.
[[nodiscard]] array allocate_host_accessible_array(const stream_binding& on, DLDevice kind, DLDataType dtype,
                                                   std::span<const std::int64_t> shape);

/// The same host-accessible memory (pinned or managed) as a CPU array, once the work pending on
/// the stream it is ready on is done (waited for: a CPU consumer has no stream to order).
/// @throws buffer_error for memory the host cannot reach; device_error when the wait fails.
[[nodiscard]] array host_view(context& ctx, const array& view);

/// The stream to tell a consumer that may synchronize it, rather than wait on it, that `view`'s data
/// is ready on (the CUDA Array Interface's `stream`): the stream it is ready on, nullopt when none is
/// known. When that is the legacy default stream (as for data bound to a per-thread default stream),
/// a pooled event's record is first enqueued there: a synchronization of the legacy stream waits only
/// for work enqueued on it, and that record waits for every blocking stream's work enqueued so far.
/// Never blocks the host.
/// @throws device_error when the record fails.
[[nodiscard]] std::optional<device::stream_handle> published_ready_stream(const array& view);

/// True when `view` lives in memory ordered by the streams of `ctx`'s backend.
[[nodiscard]] bool is_stream_ordered(const context& ctx, const array& view) noexcept;

/// @throws device_error when `view` is not in memory ordered by `ctx`'s backend (a CUDA array with a
///         ROCm backend, or host memory).
void require_stream_ordered(const context& ctx, const array& view);

}  // namespace handoff
