// handoff::exchange: the exchange policy that every front end runs (the Python module, the DLPack C
// exchange API, the pybind11 helper's table, a C++ application): imports, exports, hand-overs.
#pragma once

#include <handoff/array.hpp>
#include <handoff/context.hpp>
#include <handoff/detail/immovable.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/embedding.hpp>
#include <handoff/interface.hpp>
#include <handoff/stream_value.hpp>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace handoff {

/// Why an exchange has no device context, which the errors of the operations that need one say.
struct absent_backend {
  std::string setting;     ///< how the backend was chosen, e.g. "HANDOFF_BACKEND=auto"
  std::string error_name;  ///< the error that stopped the backend's start; empty when none was asked for
  std::string reason;      ///< that error's message
  /// CUDA data that needs ordering is refused (nothing can order it: `auto` found no usable CUDA
  /// device) rather than exchanged as it comes (the application asked for no backend).
  bool refuses_unordered{false};
};

/// Where an exchange finds its device context when an operation first needs one: the process's
/// runtime starts its backend then, so that exchanges of host data never start a device runtime.
class context_source : detail::immovable {
 public:
  virtual ~context_source() = default;

  /// The device context, started on the first call; null when there is none (absent() says why).
  /// @throws device_error when the backend cannot be used (it failed to start; the process is a
  ///         child forked after its parent started it).
  [[nodiscard]] virtual context* device_context() = 0;
  /// Why device_context() is null.
  [[nodiscard]] virtual const absent_backend& absent() = 0;
};

/// What a consumer asks of an import besides the data: its stream, and the array API's arguments.
struct import_request {
  named_stream consumer;           ///< the stream the consumer works on
  std::optional<DLDevice> device;  ///< where the result must be (nullopt: where the data is)
  std::optional<bool> copy;        ///< the array API's `copy`
};

/// What a producer told the importer, as the front end read it.
struct producer_answer {
  std::string_view name;             ///< the producer's type, for messages (read only with `claimed`)
  std::optional<DLDevice> claimed;   ///< what its `__dlpack_device__` said, when asked
  bool honoured_arguments{false};    ///< it took `max_version`, and so `dl_device` and `copy`
  bool ordered_for_consumer{false};  ///< it was given the consumer's stream, and orders for it
  /// It was given None for pinned host memory (dlpack_stream_value), or the legacy default stream
  /// in place of the per-thread one, which it refused: what it orders, it orders before the
  /// device's default stream, which the consumer stream is then ordered after.
  bool ordered_for_default_stream{false};
};

/// What a consumer asks of an export: DLPack's `__dlpack__` arguments.
struct export_request {
  /// The consumer's stream, as an import names it: a DLPack stream value (`named_stream::dlpack`),
  /// nothing (None), or a native handle; its `owner`, when known, keeps it alive.
  named_stream stream;
  std::optional<DLPackVersion> max_version;  ///< nullopt: a consumer older than DLPack 1.0
  std::optional<DLDevice> dl_device;
  std::optional<bool> copy;
};

/// A tensor an export made, versioned or legacy (the other is null). Its deleter belongs to
/// whoever takes it.
struct exported_tensor {
  DLManagedTensorVersioned* versioned{nullptr};
  DLManagedTensor* legacy{nullptr};
};

/// What an import through a producer's DLPack C exchange API table asks of the producer's object:
/// the front end answers, the exchange decides.
class table_producer : detail::immovable {
 public:
  virtual ~table_producer() = default;

  /// Whether the tensor's memory holds the conjugates of its values (PyTorch's lazy conjugation),
  /// which `__dlpack__` refuses and the table hands over as it is. Asked of complex data only.
  /// @throws what asking the producer throws.
  [[nodiscard]] virtual bool lazily_conjugated() = 0;
  /// The stream the producer's work on `device` is enqueued on (nullopt in `stream`: the default
  /// stream). False when the producer cannot say (its error logged and cleared).
  [[nodiscard]] virtual bool current_work_stream(DLDevice device, std::optional<std::int64_t>& stream) noexcept = 0;
};

/// The exchange policy over one device context: which stream a consumer works on, what it must wait
/// for, what is kept until when, what is copied, and what is counted (stats()) and traced. Every
/// operation orders with events, never blocking the host, except the transfers to the host that
/// the consumer asked for (waited for in the embedding's blocking section).
/// @note Thread-safe: an exchange's one mutable state, its export-release policy, is atomic; the
///       context synchronizes the rest.
class exchange {
 public:
  /// An exchange over `device_context`, which must outlive it, whose imports run their producers'
  /// deleters with that context's embedding's `run_deleter`.
  explicit exchange(context& device_context) noexcept
      : ctx_(&device_context), run_deleter_(device_context.hooks().run_deleter)
  {}
  /// An exchange with no device backend: host data is exchanged, device data as it comes, or, where
  /// `why` refuses unordered exchanges, refused where it needs ordering.
  /// @param run_deleter how its imports run their producers' deleters (null: where the last view goes)
  explicit exchange(absent_backend why, deleter_runner run_deleter = nullptr)
      : absent_(std::move(why)), run_deleter_(run_deleter)
  {}
  /// An exchange over the context `source` gives when an operation first needs one; `source` must
  /// outlive the exchange.
  /// @param run_deleter how its imports run their producers' deleters: that of the embedding the
  ///        source's context is made with
  explicit exchange(context_source& source, deleter_runner run_deleter = nullptr) noexcept
      : source_(&source), run_deleter_(run_deleter)
  {}

  /// Takes `tensor` as an array whose producer's deleter runs, exactly once, with this exchange's
  /// deleter runner (import_dlpack's rules; no stream is bound). Consumers that import with their
  /// own checks first, such as a DLPack capsule's, take the tensor so.
  [[nodiscard]] array take_tensor(DLManagedTensorVersioned* tensor) const
  {
    return import_dlpack(tensor, run_deleter_);
  }
  /// Legacy form of `take_tensor`.
  [[nodiscard]] array take_tensor(DLManagedTensor* tensor) const { return import_dlpack(tensor, run_deleter_); }

  /// Which consumer streams the releases of this exchange's later exports wait for (the process's
  /// exchange starts with HANDOFF_EXPORT_RELEASE's, every other with known_streams).
  [[nodiscard]] export_release export_release_policy() const noexcept
  {
    return export_release_.load(std::memory_order_relaxed);
  }
  /// Sets the policy for this exchange's later exports. @return the policy it replaces.
  export_release set_export_release(export_release policy) noexcept
  {
    return export_release_.exchange(policy, std::memory_order_relaxed);
  }

  /// The device context (started, for a context_source); null without a device backend.
  /// @throws what context_source::device_context throws.
  [[nodiscard]] context* device_context() const { return source_ != nullptr ? source_->device_context() : ctx_; }
  /// The device context. @throws device_error naming `what` needed one, when there is none.
  [[nodiscard]] context& require_device(const char* what) const;

  // --- imports: each counted in stats().imports --------------------------------------------------

  /// Completes, in place, the import of `view`, which a producer handed over as `answer` says (the
  /// array of a consumed capsule), for `request`: checks that the data is on the device the
  /// producer claimed (the consumer stream was given in that device's numbering), admits device
  /// data as every import is (its memory checked, every byte, against the backend's allocations,
  /// ordered or not), binds it to the consumer stream (its producer then outlives the work enqueued
  /// there), and applies `device` and `copy` where the producer did not.
  /// @throws value_error for data on another device than claimed, or past its allocation;
  ///         device_error for data of the device family the backend does not order; what binding
  ///         and transfer throw.
  void import(array& view, const import_request& request, const producer_answer& answer);

  /// The import of a tensor a producer's DLPack C exchange API table made, without synchronizing:
  /// admitted as import() admits, the consumer stream waits for the producer's current work
  /// stream. nullopt, the tensor released, where `__dlpack__` must be asked instead (a lazily
  /// conjugated tensor; a question the producer failed to answer).
  /// @throws as import() for data it does not admit (the tensor released).
  [[nodiscard]] std::optional<array> import_from_table(DLManagedTensorVersioned* tensor, const named_stream& consumer,
                                                       table_producer& producer);

  /// The import of validated CUDA Array Interface data owned by `owner`: the device is what the
  /// backend knows of the pointer, and every byte is checked as import() checks it; the interface's
  /// `stream` (the producer's) is waited for, and, where it is certain to be alive then
  /// (`producer_stream_owner` keeps a stream object), made to wait for the consumer's work on the
  /// data when the view is released.
  /// @throws value_error for memory past its allocation; buffer_error for memory the device does
  ///         not know.
  [[nodiscard]] array import_interface(cuda_interface interface, shared_producer owner, const import_request& request,
                                       std::shared_ptr<const void> producer_stream_owner = {});

  /// The import of host data from a protocol that has no streams (`__array_interface__`, the buffer
  /// protocol): `device` and `copy` applied.
  [[nodiscard]] array import_host(array view, const import_request& request);

  /// Counts an import of host data that a front end read itself (a C++ extension's argument read
  /// through the buffer protocol, a NumPy array read from its fields), with no device or copy
  /// asked for: host data needs no binding or transfer, so this is all of the policy that applies.
  /// The front end's own trace scope records the import; import_host opens one of its own.
  void count_host_import() const noexcept;

  /// A new view of `source`'s data (a view handoff made) for `consumer`, ordered as exporting it to
  /// the consumer and importing the result would be, sharing `source`'s root producer instead of
  /// wrapping it: a chain of re-imports keeps one producer alive, not one per hop.
  [[nodiscard]] array share(const array& source, const named_stream& consumer);

  /// Data a consumer made on `work_stream` and handed over as `view` (the C exchange API's
  /// `managed_tensor_to_py_object`, the tensor imported): admitted as import() admits, ready there,
  /// and released after the work enqueued there.
  /// @throws device_error for device memory the backend cannot order; value_error for memory past
  ///         its allocation.
  [[nodiscard]] array adopt(array view, const named_stream& work_stream);

  // --- a library's own memory ----------------------------------------------------------------------

  /// A view of memory a library describes itself (to export its own arrays): `layout` checked as an
  /// array's, its device and dtype ones DLPack defines (validate_description); device memory checked
  /// against the device it claims (every byte it reaches) and recorded as ready on `ready` (default:
  /// unknown, so exports order after the device's legacy default stream).
  /// @throws value_error for a bad layout or device, or memory that is not the claimed device's;
  ///         buffer_error for a dtype DLPack does not define; device_error for device data that needs
  ///         ordering and cannot get it.
  [[nodiscard]] array view(array_layout layout, shared_producer owner, const named_stream& ready = {});

  /// A new row-major array like `prototype` (shape, dtype, device), on `on` for device memory (the C
  /// exchange API's allocator): ready there, and freed in its order.
  /// @throws buffer_error for a device the backend does not serve; value_error for a bad shape.
  [[nodiscard]] array allocate(const DLTensor& prototype, const named_stream& on);

  // --- exports: each counted in stats().exports --------------------------------------------------

  /// Exports `view` as DLPack's `__dlpack__` does: classifies the consumer's stream for the view's
  /// device, makes it wait for the stream the data is ready on, keeps the producer until the work
  /// the consumer enqueued there is done (export_release), copies where `dl_device` or `copy` ask,
  /// and stamps the version the consumer can read.
  /// @throws value_error for a stream the device does not take; buffer_error when the export cannot
  ///         be made as asked (read-only data to a legacy consumer, an unreachable `dl_device`, a
  ///         copy that `copy=False` forbids); device_error when ordering fails.
  [[nodiscard]] exported_tensor export_dlpack(const array& view, const export_request& request);

  /// Hands `view` to a consumer that works on `consumer` and holds nothing of its own (the DLPack C
  /// exchange API's no-sync calls): its stream waits for the data's, and the producer is kept until
  /// the work enqueued there by the tensor's deletion is done, whatever the export-release policy
  /// (the consumer's stream is its own to name). Returns the tensor. For stream=-1 nothing is
  /// ordered, and a backend that cannot be used is no error (as for export_dlpack).
  /// @throws device_error for a consumer stream where there is no usable backend, or ordering fails.
  [[nodiscard]] DLManagedTensorVersioned* hand_over(const array& view, const named_stream& consumer);
  /// hand_over for a consumer that borrows the view's own description (a bare DLTensor).
  void lend(const array& view, const named_stream& consumer);

  // --- streams and memory, for a front end that orders other libraries' exchanges ---------------

  /// The stream `stream` names for work on data of `data` (its handle resolved by the stream table of
  /// the device type), bound on the device whose streams order that data: the data's device, or for
  /// pinned and managed memory, which DLPack numbers device 0 whatever device works on it, the
  /// stream's own. `stream.owner` goes with it. nullopt for data without streams, where no context
  /// serves that device type, or for stream=-1.
  /// @throws value_error for a stream the device type does not take; device_error when the backend
  ///         cannot tell a stream's device (a destroyed stream, where the backend asks: CUDA with one
  ///         GPU knows every stream is its, and a destroyed one fails when work is put on it).
  [[nodiscard]] std::optional<bound_stream> bind_stream(DLDevice data, const named_stream& stream) const;

  /// Whether a release deferred behind `stream` (for data of `type`) is certain to find it alive, as
  /// exports decide for their consumer's stream (export_release): a default stream, a stream its
  /// owner keeps alive, or any stream when the application vouches for every consumer stream.
  /// @throws value_error for a stream the device type does not take.
  [[nodiscard]] bool may_release_after(const named_stream& stream, DLDeviceType type) const;

  /// The DLPack device of the memory at `data`, as an import of a CUDA Array Interface names it;
  /// nullopt where no context serves device memory or the backend does not know the memory.
  /// @throws buffer_error for managed memory on ROCm, which DLPack has no device type for.
  [[nodiscard]] std::optional<DLDevice> device_of(const void* data) const;

  /// The stream to tell a consumer that may synchronize it, rather than wait on it, that `view`'s
  /// data is ready on (the CUDA Array Interface's `stream`), as a DLPack stream value; nullopt when
  /// none is known. A stream synchronization of the legacy default stream waits only for work
  /// enqueued on it: for data ready there, an event's record is first enqueued there.
  [[nodiscard]] std::optional<std::int64_t> interface_stream(const array& view) const;

 private:
  // Admits `view` (internal/admission.hpp's admit) and binds it to `consumer`'s stream: nullopt for
  // host data, data the consumer orders itself (stream=-1), or with no backend.
  [[nodiscard]] std::optional<bound_stream> consumer_binding(const array& view, const named_stream& consumer) const;
  // device_context(), or null where the backend cannot be used.
  [[nodiscard]] context* usable_context() const noexcept;
  void bind_to_consumer(const array& view, const named_stream& consumer) const;
  void order_hand_over(const array& view, const named_stream& consumer) const;
  void require_ordering(DLDeviceType type) const;
  [[nodiscard]] array transfer(array view, std::optional<DLDevice> target, std::optional<bool> copy,
                               bool producer_copied) const;

  [[nodiscard]] const absent_backend& absent() const { return source_ != nullptr ? source_->absent() : absent_; }
  // The device context `type`'s data needs: null for host data, which never starts a backend.
  [[nodiscard]] context* context_for(DLDeviceType type) const { return type == kDLCPU ? nullptr : device_context(); }

  context* ctx_{nullptr};
  absent_backend absent_;                // why ctx_ is null
  context_source* source_{nullptr};      // when set, gives both
  deleter_runner run_deleter_{nullptr};  // the embedding's, for what this exchange imports
  std::atomic<export_release> export_release_{export_release::known_streams};
};

/// Makes the device of the data a producer says it holds (its `__dlpack_device__`) current for the
/// call to its `__dlpack__`: producers order the *current* device's streams (PyTorch records on the
/// current device's stream), so a consumer calls them with the data's device current, as CuPy's
/// does. Nothing for data that is not device memory of the exchange's backend.
class producer_device_scope {
 public:
  /// @throws device_error when the device cannot be made current.
  producer_device_scope(const exchange& on, DLDevice claimed);

 private:
  std::optional<device_guard> guard_;
};

}  // namespace handoff
