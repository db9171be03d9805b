// handoff::ipc: zero-copy hand-off of arrays between processes of one node, ordered on both sides.
#pragma once

#include <handoff/array.hpp>
#include <handoff/exchange.hpp>
#include <handoff/stream_value.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace handoff::ipc {

/// How `share` is asked to treat the data.
struct share_options {
  /// The array API's `copy` for host memory, which must be copied once into shared memory:
  /// false refuses (buffer_error), anything else copies. Device memory is never copied.
  std::optional<bool> copy;
  /// The handle travels without a hold in this process (a multiprocessing message): the array is
  /// kept until a consumer has opened the handle once and released what it opened.
  bool in_flight{false};
};

/// A share: the handle to send, and the producer's hold on the array while this process keeps it.
struct shared {
  std::vector<std::byte> handle;     ///< a few hundred bytes; send them any way
  std::shared_ptr<const void> hold;  ///< keeps the array while alive (null for an in-flight share)
};

/// What a handle describes, read without opening it.
struct handle_description {
  int producer_pid{0};
  DLDevice device{kDLCPU, 0};
  DLDataType dtype{};
  std::vector<std::int64_t> shape;
  std::int64_t nbytes{0};
  std::string backend;      ///< the producer's backend ("sim", "cuda"; "none" for host memory)
  bool host_memory{false};  ///< host memory copied into shared memory
  bool in_flight{false};
};

/// Shares `x` with other processes of this node. Device memory is shared zero-copy (its
/// allocation's handle and the offset of `x` in it) and an interprocess event from a pool is recorded
/// on the stream the data is ready on (`ready`: the default names x's own ready stream, else the
/// device's default), for every share; where the device cannot make interprocess events, the stream
/// writes the share's number to a flag in shared memory instead (a stream memory operation). Host
/// memory is copied once into shared memory.
/// @note The producer keeps `x` while `hold` is alive, then until every consumer released what it
///       opened and the work its stream had by then is done (told through shared memory, polled by a
///       service thread: neither process's host ever waits). A consumer process that ends is noticed
///       within a fraction of a second and its opens released at once.
/// @throws buffer_error for memory that cannot be shared (pinned or managed memory, a stream-ordered
///         pool that is not shareable, host memory with `copy` false); device_error when ordering fails.
[[nodiscard]] shared share(exchange& on, const array& x, const named_stream& ready, share_options options = {});

/// Opens in this process a handle another process of this node made: maps the memory zero-copy (once
/// per allocation and process, the mapping shared by the arrays that use it) and makes `consumer`
/// wait on the device for the share's event; the host never waits. The result is ready on `consumer`
/// and, once released, tells the producer after the work enqueued there by then is done.
/// @throws value_error for bytes that are no handle, a forged or corrupted one, one from another node or
///         boot or for another backend; buffer_error for a handle of this very process, one whose
///         producer ended, or whose share was released (its memory freed); device_error as the device fails.
[[nodiscard]] array open(exchange& on, std::span<const std::byte> handle, const named_stream& consumer);

/// What `handle` describes. @throws value_error as open() does for a malformed handle.
[[nodiscard]] handle_description describe(std::span<const std::byte> handle);

/// Looks at the consumers of this process's shares now, as the service thread does on its own a few
/// times a millisecond while they are busy (for tests that must know a release was seen).
void poll_consumers() noexcept;

/// At exit, while the runtime is alive: stops watching consumers and removes this process's shared
/// memory files (arrays still shared are left to the ending process). Idempotent; never throws.
void shutdown() noexcept;

/// For tests, the negative control of the back signal: when off, a consumer tells its producer that
/// it is done with an array as soon as it drops it, without waiting for its stream. Returns the
/// previous setting.
bool set_back_signal(bool on) noexcept;

}  // namespace handoff::ipc
