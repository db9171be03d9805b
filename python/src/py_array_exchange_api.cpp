// handoff.Array's DLPack C exchange API. The API's promise to a consumer is that work it launches
// on current_work_stream() may use the tensors it is handed. A handoff array may be ready on another
// stream (its producer's), so handing one out makes the current work stream wait for that stream (an
// event wait: the host is never blocked), and its producer is released only once the work then
// enqueued on the current work stream is done, as for an import onto that stream.
#include "py_array_exchange_api.hpp"

#include "py_array.hpp"
#include "py_dlpack_class.hpp"
#include "py_errors.hpp"
#include "py_gil.hpp"
#include "py_streams.hpp"

#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/internal/trace_scope.hpp>

#include <fmt/format.h>

#include <cxxabi.h>
#include <new>
#include <stdexcept>
#include <string>

namespace handoff::python {
namespace {

constexpr const char* capsule_name = "dlpack_exchange_api";

// The exchange bind_exchange_api was given: the tables' functions have no closure to hold it.
exchange* bound_exchange = nullptr;

// The current work stream of `device`'s consumer (see above): the enclosing handoff.stream block's
// when it serves `device`, else the default stream.
named_stream work_stream(DLDevice device)
{
  return stream_named_by(enclosing_stream_for(device));
}

// The array a table function was given: a handoff.Array's, or the view of what an instance of a
// def_dlpack class describes, made into `described`. @throws type_error for anything else.
const array& array_argument(void* py_object, const char* function, std::optional<array>& described)
{
  const py::handle object{static_cast<PyObject*>(py_object)};
  if (const array* view = py_object != nullptr ? as_array(object) : nullptr) { return *view; }
  if (py_object != nullptr) { described = described_instance(object.ptr()); }
  HANDOFF_EXPECTS(described.has_value(), type_error,
                  fmt::format("{}: expected a handoff.Array or an instance of a def_dlpack class, got {}", function,
                              py_object != nullptr ? type_name(object) : std::string{"NULL"}));
  return *described;
}

template <typename Pointer>
void expect_output(Pointer* out, const char* function)
{
  HANDOFF_EXPECTS(out != nullptr, value_error, fmt::format("{}: the output pointer is NULL", function));
}

// Runs a table function's body: 0, or -1 with the Python error its exception maps to.
template <typename Body>
int c_call(Body&& body) noexcept
{
  try {
    body();
    return 0;
  } catch (...) {
    raise_current_exception();
    return -1;
  }
}

int managed_tensor_from_py_object(void* py_object, DLManagedTensorVersioned** out) noexcept
{
  return c_call([&] {
    constexpr const char* function = "managed_tensor_from_py_object_no_sync";
    const trace::exchange_scope scope{trace::event_kind::export_data, "dlpack-c-api"};
    expect_output(out, function);
    *out = nullptr;
    std::optional<array> described;
    const array& view = array_argument(py_object, function, described);
    *out = bound_exchange->hand_over(view, work_stream(view.device()));
  });
}

int dltensor_from_py_object(void* py_object, DLTensor* out) noexcept
{
  return c_call([&] {
    constexpr const char* function = "dltensor_from_py_object_no_sync";
    trace::exchange_scope scope{trace::event_kind::export_data, "dlpack-c-api"};
    expect_output(out, function);
    std::optional<array> described;
    const array& view = array_argument(py_object, function, described);
    // A class's instance describes its memory per call: nothing of it outlives the call to lend.
    HANDOFF_EXPECTS(!described, buffer_error,
                    fmt::format("{}: a {} describes its memory on each call and holds no shape or strides to lend; "
                                "use managed_tensor_from_py_object_no_sync",
                                function, type_name(py::handle{static_cast<PyObject*>(py_object)})));
    scope.set_view(view);
    HANDOFF_EXPECTS(!view.readonly(), buffer_error,
                    fmt::format("{}: the array is read-only and a DLTensor cannot say so; use "
                                "managed_tensor_from_py_object_no_sync",
                                function));
    bound_exchange->lend(view, work_stream(view.device()));
    // Shape and strides point into the array object: valid while the caller holds it.
    *out = DLTensor{.data = view.data(),
                    .device = view.device(),
                    .ndim = view.ndim(),
                    .dtype = view.dtype(),
                    .shape = const_cast<std::int64_t*>(view.shape().data()),
                    .strides = const_cast<std::int64_t*>(view.strides().data()),
                    .byte_offset = 0};
  });
}

// Takes the tensor whatever happens, as the API asks: on failure its deleter has run.
int managed_tensor_to_py_object(DLManagedTensorVersioned* tensor, void** out) noexcept
{
  return c_call([&] {
    constexpr const char* function = "managed_tensor_to_py_object_no_sync";
    const trace::exchange_scope scope{trace::event_kind::import_data, "dlpack-c-api"};
    HANDOFF_EXPECTS(tensor != nullptr, value_error, fmt::format("{}: the tensor is NULL", function));
    array view = bound_exchange->take_tensor(tensor);  // its deleter runs exactly once from here on
    expect_output(out, function);
    *out = nullptr;
    const named_stream made_on = work_stream(view.device());
    *out = wrap(bound_exchange->adopt(std::move(view), made_on)).release().ptr();
  });
}

int current_work_stream(DLDeviceType device_type, std::int32_t device_id, void** out_current_stream) noexcept
{
  return c_call([&] {
    expect_output(out_current_stream, "current_work_stream");
    const py::object block = enclosing_stream_for({device_type, device_id});
    *out_current_stream =
      block.is_none() ? nullptr : reinterpret_cast<void*>(block.attr("handle").cast<std::uintptr_t>());
  });
}

// The stream a new device allocation is made on: the current work stream, read holding the GIL
// (the allocator may be called without it). Host memory needs none, and never the GIL.
named_stream allocation_stream(DLDevice device)
{
  if (device.device_type == kDLCPU) { return {}; }
  const gil_scope gil;  // declared first: the objects below are released while it is held
  if (!gil.held()) { throw std::runtime_error("the interpreter is shutting down"); }
  return work_stream(device);
}

// The Python exception type name for the exception being handled, as SetError's `kind`.
const char* error_kind() noexcept
{
  try {
    throw;
  } catch (const value_error&) {
    return "ValueError";
  } catch (const buffer_error&) {
    return "BufferError";
  } catch (const type_error&) {
    return "TypeError";
  } catch (const std::bad_alloc&) {
    return "MemoryError";
  } catch (...) {
    return "RuntimeError";
  }
}

// Reports the exception being handled through the allocator's SetError.
void report_allocation_failure(void* error_ctx, void (*set_error)(void*, const char*, const char*)) noexcept
{
  const char* kind = error_kind();
  const char* text = "managed_tensor_allocator failed";
  std::string message;
  try {
    try {
      throw;
    } catch (const std::exception& e) {
      message = fmt::format("managed_tensor_allocator: {}", e.what());
      text = message.c_str();
    }
  } catch (...) {}  // out of memory for the message: the plain text says enough
  if (set_error != nullptr) { set_error(error_ctx, kind, text); }
}

// Called with or without the GIL; reports failures through `set_error`, never as a Python error.
// Not noexcept: a daemon thread that asks for the GIL while the interpreter exits is ended by CPython
// with pthread_exit, whose forced unwind must pass (std::terminate at a noexcept frame otherwise).
int managed_tensor_allocator(DLTensor* prototype, DLManagedTensorVersioned** out, void* error_ctx,
                             void (*set_error)(void* error_ctx, const char* kind, const char* message))
{
  try {
    expect_output(out, "managed_tensor_allocator");
    *out = nullptr;
    HANDOFF_EXPECTS(prototype != nullptr, value_error, "the prototype is NULL");
    const array made = bound_exchange->allocate(*prototype, allocation_stream(prototype->device));
    *out = export_versioned(made);
    return 0;
  } catch (abi::__forced_unwind&) {
    throw;
  } catch (...) {
    // Once Python's exit has begun, SetError (which may take the GIL) would end this thread mid-call:
    // the failure is the return value alone.
    if (!python_is_closing()) { report_allocation_failure(error_ctx, set_error); }
    return -1;
  }
}

const DLPackExchangeAPI table{
  .header = {.version = exchange_api_version, .prev_api = nullptr},
  .managed_tensor_allocator = managed_tensor_allocator,
  .managed_tensor_from_py_object_no_sync = managed_tensor_from_py_object,
  .managed_tensor_to_py_object_no_sync = managed_tensor_to_py_object,
  .dltensor_from_py_object_no_sync = dltensor_from_py_object,
  .current_work_stream = current_work_stream,
};

// def_dlpack classes': handoff.Array's, without the slot they cannot serve (class_exchange_api).
const DLPackExchangeAPI class_table = []() noexcept {
  DLPackExchangeAPI without_dltensor = table;
  without_dltensor.dltensor_from_py_object_no_sync = nullptr;
  return without_dltensor;
}();

}  // namespace

void bind_exchange_api(exchange& on) noexcept
{
  bound_exchange = &on;
}

const DLPackExchangeAPI& array_exchange_api() noexcept
{
  return table;
}

const DLPackExchangeAPI& class_exchange_api() noexcept
{
  return class_table;
}

bool is_handoff_exchange_api(const DLPackExchangeAPI* api) noexcept
{
  return api == &table || api == &class_table;
}

py::capsule exchange_api_capsule(const DLPackExchangeAPI& api)
{
  return py::capsule(const_cast<DLPackExchangeAPI*>(&api), capsule_name);
}

}  // namespace handoff::python
