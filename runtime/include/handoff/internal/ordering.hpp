// Internal: the stream rules of an exchange on one context, as the exchange's operations compose
// them: what a consumer's stream waits for, what is kept until when.
#pragma once

#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/internal/admission.hpp>
#include <handoff/stream_value.hpp>

#include <memory>
#include <optional>

namespace handoff {

/// Tells the exchange being traced on this thread, if any, that `view` was handed over with no
/// ordering: the trace asks the producer's stream whether it is idle (an unordered hazard).
void note_unordered_export(const array& view) noexcept;

/// Whether a consumer stream `consumer` asks for is certain to be alive when a release deferred behind
/// it runs: a default stream always is; a stream handle when `owner` keeps it, or the application
/// vouches for every consumer stream (`policy` is export_release::every_stream).
[[nodiscard]] bool alive_at_release(stream_request consumer, const std::shared_ptr<const void>& owner,
                                    export_release policy) noexcept;

/// The stream a validated DLPack request names on `backend`; nullopt when it asks for no ordering.
[[nodiscard]] std::optional<device::stream_handle> resolve_stream(device::backend& backend, stream_request request);

/// A view of memory a library describes itself: `layout` checked as an array's; for CUDA or ROCm
/// memory with a backend (`ctx`), the memory checked against the device it claims (every byte it
/// reaches, not only the first), and the data recorded as ready on `ready` (kept alive by
/// `ready_owner`; order none: unknown). Without a backend device memory is exchanged as it comes.
/// @throws value_error for a bad layout, or memory that is not the claimed device's (or that runs past
///         its allocation); device_error when the backend is of the other device family.
[[nodiscard]] array make_view(context* ctx, array_layout&& layout, shared_producer owner, stream_request ready,
                              std::shared_ptr<const void> ready_owner = {});

/// Export half: orders the work pending on the stream `view` is ready on (its producer's last
/// write; the device's legacy default stream when unknown) before the work the consumer will
/// enqueue on the requested stream, and keeps `view`'s producer until the work the consumer has
/// enqueued there by the time the export is released is done, when that stream is certain to be
/// alive then (`policy`; `consumer_owner`, possibly empty, keeps it so). Never blocks the host.
/// @throws device_error when the view is on a device and there is no backend (`ctx` null), or the
///         backend is of another family (a CUDA array with a ROCm backend).
void order_export(context* ctx, const array& view, stream_request consumer, export_release policy,
                  std::shared_ptr<const void> consumer_owner = {});

/// consumer.wait_for(producer), telling whether the consumer's stream captures into a graph, which
/// the wait asks before it records anything; nullopt where it asked nothing (the same stream).
/// @throws what bound_stream::wait_for throws.
[[nodiscard]] std::optional<bool> wait_telling_capture(const bound_stream& consumer, device::stream_handle producer);

/// The context that orders `view`'s exchange: `ctx` itself.
/// @throws device_error when there is none (`ctx` null): device memory cannot be ordered without a backend.
[[nodiscard]] context& context_to_order(context* ctx, const array& view);

/// A consumer's stream made to wait for the stream its data is ready on.
struct waiting_consumer {
  bound_stream binding;
  std::optional<bool> captures;  ///< whether its stream captures into a graph, where the wait asked
};

/// The stream `consumer` asks for (not stream=-1), bound on `device` of `ctx` (the device that owns
/// `view`'s data) and kept alive by `owner` (may be empty), made to wait for the stream `view` is
/// ready on: its producer's last write, or the device's legacy default stream where that is unknown or
/// another context's.
/// @throws what bound_stream::wait_for throws.
[[nodiscard]] waiting_consumer consumer_waiting_for_ready(context& ctx, const array& view, int device,
                                                          stream_request consumer, std::shared_ptr<const void> owner);

/// The ordering half of an export, alone: the consumer's stream waits for the stream `view` is
/// ready on. That consumer stream, bound on the data's device; nullopt when nothing is asked.
/// @throws as order_export.
[[nodiscard]] std::optional<bound_stream> order_for_consumer(context* ctx, const array& view, stream_request consumer);

/// Import half: records that `view`'s data is ready on `consumer`, and defers the release of its
/// producer until the work enqueued on `consumer` by then is done; the consumer's `stream_owner` (may
/// be empty) keeps the stream alive until then. `consumer_captures`: whether `consumer` captures into
/// a graph, where a wait before found it out (nullopt: asked here).
void bind_import(const array& view, const bound_stream& consumer, std::optional<bool> consumer_captures = std::nullopt);

/// Work on `device` of `ctx`'s backend bound to `stream` (resolved by the stream table of the
/// device's type), which `stream.owner` keeps alive with the binding.
/// @throws value_error for a stream the device type does not take, or stream=-1, which names none.
[[nodiscard]] bound_stream binding_on(context& ctx, DLDevice device, named_stream stream);

/// Import half of a CUDA Array Interface v3 exchange, whose producer may have work in progress on
/// `producer` (its `stream` as classify_stream reads it for CUDA; none when absent): orders that
/// work before `consumer`'s, binds the view as bind_import does, and keeps the interface's other
/// promise: the producer's stream runs no later work until the consumer's work on the data is done.
/// That work is known when the view is released: the producer's stream then waits on the event the
/// release records on `consumer` (context::release_after), provided it cannot be destroyed by then:
/// - the legacy default stream (1), except after a blocking consumer stream, whose earlier work the
///   legacy stream's later work waits for anyway (counted in waits_elided);
/// - the importing thread's per-thread default stream (2), through the legacy default stream;
/// - a stream handle that `producer_owner` keeps alive (the stream object the producer holds).
/// Any other handle may be destroyed before the release: it is not touched.
/// @throws what bound_stream::wait_for throws.
void bind_interface_import(const array& view, const bound_stream& consumer, stream_request producer,
                           std::shared_ptr<const void> producer_owner = {});

/// Import half of an exchange whose producer's work is on `producer` (a request as classify_stream
/// reads the producer's stream for the view's device; none: nothing pending): orders that work
/// before the work enqueued on `consumer` from now on, then binds the view there (bind_import).
/// @throws what bound_stream::wait_for throws.
void bind_after_producer(const array& view, const bound_stream& consumer, stream_request producer);

/// The stream to tell a consumer that may synchronize it that `view`'s data is ready on; nullopt when
/// none is known. When that is the legacy default stream, a pooled event's record is first enqueued
/// there (see exchange::interface_stream). Never blocks the host.
/// @throws device_error when the record fails.
[[nodiscard]] std::optional<device::stream_handle> published_ready_stream(const array& view);

}  // namespace handoff
