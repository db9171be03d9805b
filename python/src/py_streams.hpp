// Stream objects as handoff.as_stream reads them (a handoff.Stream, an int handle, or an object
// with __cuda_stream__(), .cuda_stream or .ptr), resolved here so that an import onto a stream
// object calls no Python code of handoff's and makes no handoff.Stream.
#pragma once

#include <handoff/stream_value.hpp>

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <optional>

namespace handoff::python {

namespace py = pybind11;

/// The native handle of the stream that handoff.as_stream(stream) makes, without making it: a
/// handoff.Stream's own, an int as it is, or what __cuda_stream__(), .cuda_stream or .ptr says.
/// @throws type_error for a bool or what is no stream, value_error for a handle outside
///         [0, 2**63) or a negative device; what the object's own attributes raise propagates.
[[nodiscard]] std::uint64_t stream_handle(py::handle stream);

/// A `stream` argument as a named_stream, read once: None is the default stream, an int a DLPack
/// stream value (checked: no bool, within int64), anything else a stream object's native handle,
/// the object kept as its owner (it may own the stream).
/// @throws what stream_handle throws for what is no stream; value_error for an int out of range.
[[nodiscard]] named_stream stream_named_by(py::handle stream);

/// What keeps stream `handle` alive as long as `producer`: the stream object the producer holds as its
/// `stream` attribute, when that names `handle` (a CUDA Array Interface producer must keep the
/// stream its interface names alive, and Numba's device arrays hold theirs so). Empty when nothing
/// says so: no such attribute, no stream object (a bare int, a handoff.Stream made from one), or
/// another stream.
/// @throws what the producer's attributes and the stream object's protocols raise, but "no stream".
[[nodiscard]] std::shared_ptr<const void> stream_held_by(py::handle producer, std::uint64_t handle);

/// The `stream` argument that names `stream` to the `__dlpack__` of data on `device`: None or an
/// int (dlpack_stream_value).
/// @throws value_error for a stream the device type does not take, where the producer is not given
///         it to say so (pinned host memory).
[[nodiscard]] py::object stream_argument_for(const named_stream& stream, DLDeviceType device);

/// The stream of the innermost open `handoff.stream(...)` block of this context (a handoff.Stream),
/// or None.
[[nodiscard]] py::object enclosing_stream();

/// The stream of the enclosing `handoff.stream(...)` block when it serves `device`'s data (device
/// memory, and a block stream of no device or of the data's), else None.
[[nodiscard]] py::object enclosing_stream_for(DLDevice device);

/// What keeps stream `handle` alive when the enclosing `handoff.stream(...)` block names it by a
/// stream object (CuPy's, PyTorch's, ...), or when a framework this thread calls (framework_call)
/// names it; empty otherwise (no block, a bare handle, another stream).
[[nodiscard]] std::shared_ptr<const void> enclosing_stream_owner(std::uint64_t handle);

/// The consumer stream of a framework handoff hands an array to (its from_dlpack): what keeps it
/// alive until the framework's array is released, for `handle` (nullopt: any stream it names).
struct framework_stream {
  std::optional<std::uint64_t> handle;
  std::shared_ptr<const void> owner;
};

/// For its scope, exports on this thread to the stream `stream` names are to a consumer whose
/// stream is alive when it releases them (enclosing_stream_owner): their producers are kept until
/// the work it then enqueued there is done. Scopes nest.
class framework_call {
 public:
  explicit framework_call(const framework_stream& stream) noexcept;
  ~framework_call();
  framework_call(const framework_call&) = delete;
  framework_call& operator=(const framework_call&) = delete;
  framework_call(framework_call&&) = delete;
  framework_call& operator=(framework_call&&) = delete;

 private:
  const framework_stream* outer_;
};

/// Creates `_stream_var`, the context variable of the open `handoff.stream(...)` blocks, and binds
/// `_resolve_stream`, `_check_stream` and `_set_stream_type`, which handoff._streams uses.
void bind_streams(py::module_& m);

}  // namespace handoff::python
