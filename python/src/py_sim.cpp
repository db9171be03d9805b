// handoff.sim: drive the simulated accelerator from Python (streams, holds, arrays, delayed writes,
// faults).
#include "py_sim.hpp"

#include "py_array.hpp"
#include "py_cpython.hpp"
#include "py_errors.hpp"
#include "py_gil.hpp"
#include "py_owners.hpp"
#include "py_streams.hpp"

#include <handoff/activity.hpp>
#include <handoff/device_guard.hpp>
#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/internal/admission.hpp>
#include <handoff/internal/device_memory.hpp>
#include <handoff/internal/sim.hpp>
#include <handoff/stream_value.hpp>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string_view>

namespace handoff::python {
namespace {

using device::sim_backend;

struct active_sim {
  context& ctx;
  sim_backend& sim;
};

// The simulator `on`'s context drives.
active_sim require_sim(exchange& on)
{
  // Said first: a newcomer running an example without the setting learns what to set.
  context& ctx = on.require_device(
    "handoff.sim runs on the simulated device: set HANDOFF_BACKEND=sim (or sim-rocm) before the process first uses "
    "handoff. It");
  sim_backend* sim = device::as_sim(ctx.backend());
  if (sim == nullptr) {
    throw device_error(
      std::string{ctx.backend().name()}, error_names::not_simulated,
      fmt::format("handoff.sim needs HANDOFF_BACKEND=sim or sim-rocm; the active backend is {}", ctx.backend().name()));
  }
  return {ctx, *sim};
}

// `device` as an ordinal of the simulated backend. @throws value_error when it has no such device.
int checked_device(sim_backend& sim, long long device)
{
  HANDOFF_EXPECTS(device >= 0 && device < sim.device_count(), value_error,
                  fmt::format("device {} does not exist (the simulated backend has {})", device, sim.device_count()));
  return static_cast<int>(device);
}

// Makes `device` current for a scope, after checking that the simulated backend has it.
class current_device {
 public:
  current_device(sim_backend& sim, int device) : guard_(sim, checked_device(sim, device)) {}

 private:
  device_guard guard_;
};

// An owning simulated stream.
class sim_stream {
 public:
  sim_stream(exchange& on, int device, bool non_blocking) : device_(device)
  {
    auto [ctx, sim] = require_sim(on);
    const current_device current{sim, device};
    handle_ = sim.create_stream(non_blocking);
    sim_ = &sim;
    non_blocking_ = non_blocking;
  }
  sim_stream(const sim_stream&) = delete;
  sim_stream& operator=(const sim_stream&) = delete;
  sim_stream(sim_stream&&) = delete;
  sim_stream& operator=(sim_stream&&) = delete;
  ~sim_stream() { sim_->destroy_stream(handle_); }  // pending work still runs, as in CUDA

  [[nodiscard]] std::uintptr_t handle() const noexcept { return static_cast<std::uintptr_t>(handle_); }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] bool non_blocking() const noexcept { return non_blocking_; }
  void synchronize()
  {
    without_gil([this] { sim_->synchronize_stream(handle_); });
  }

 private:
  sim_backend* sim_{nullptr};
  device::stream_handle handle_{};
  int device_;
  bool non_blocking_{false};
};

// A stream argument: a sim.Stream, a handoff.Stream or anything handoff.as_stream accepts, or an
// int (a raw handle; the backend's default stream numbering applies).
device::stream_handle stream_of(py::handle stream)
{
  HANDOFF_EXPECTS(!stream.is_none(), type_error, "a stream is required (stream=...)");
  if (py::isinstance<sim_stream>(stream)) {
    return static_cast<device::stream_handle>(stream.cast<sim_stream&>().handle());
  }
  return static_cast<device::stream_handle>(stream_handle(stream));
}

// The device a stream argument is asked about on: a sim.Stream's own, else the current device (whose
// default streams 0, 1 and 2 name).
int device_of_stream(py::handle stream, sim_backend& sim)
{
  return py::isinstance<sim_stream>(stream) ? stream.cast<sim_stream&>().device() : sim.current_device();
}

// The simulator's answer to `question` about a stream argument.
template <class Answer>
Answer ask_about(exchange& on, py::handle stream, Answer (sim_backend::*question)(device::stream_handle))
{
  auto [ctx, sim] = require_sim(on);
  const current_device current{sim, device_of_stream(stream, sim)};
  return (sim.*question)(stream_of(stream));
}

// sim.hold(stream): a context manager that holds the stream's work from __enter__ to __exit__.
class stream_hold {
 public:
  stream_hold(exchange& on, py::object stream) : on_(&on), stream_(std::move(stream))
  {
    (void)stream_of(stream_);  // a bad argument fails here, not at __enter__
  }

  stream_hold& enter()
  {
    HANDOFF_EXPECTS(!hold_.active(), value_error,
                    "this hold is active already; nest another sim.hold(stream) to hold the stream twice");
    auto [ctx, sim] = require_sim(*on_);
    const current_device current{sim, device_of_stream(stream_, sim)};
    hold_ = sim.hold(stream_of(stream_));
    return *this;
  }
  void exit() noexcept { hold_.release(); }

  [[nodiscard]] const py::object& stream() const noexcept { return stream_; }
  [[nodiscard]] bool active() const noexcept { return hold_.active(); }

 private:
  exchange* on_;
  py::object stream_;  // kept while held: the hold is a use of it
  device::sim_hold hold_;
};

// What sim.to_numpy(..., wait=False) returns: the host copy enqueued, and an event recorded after it.
class pending_copy {
 public:
  pending_copy(sim_backend& sim, int device, device::event_handle done, py::object out)
      : sim_(&sim), device_(device), done_(done), out_(std::move(out))
  {}
  pending_copy(const pending_copy&) = delete;
  pending_copy& operator=(const pending_copy&) = delete;
  pending_copy(pending_copy&&) = delete;
  pending_copy& operator=(pending_copy&&) = delete;
  ~pending_copy() { sim_->destroy_event(done_); }  // the NumPy array is kept until the copy lands

  [[nodiscard]] bool done()
  {
    const current_device current{*sim_, device_};
    return sim_->query_event(done_);
  }

  [[nodiscard]] py::object result()
  {
    without_gil([this] {
      const current_device current{*sim_, device_};
      sim_->synchronize_event(done_);
    });
    return out_;
  }

 private:
  sim_backend* sim_;
  int device_;
  device::event_handle done_;
  py::object out_;
};

array& sim_array(py::handle object, active_sim& s)
{
  array* found = as_array(object);
  HANDOFF_EXPECTS(found != nullptr, type_error, "expected a handoff.Array made by handoff.sim");
  array& view = *found;
  HANDOFF_EXPECTS(is_stream_ordered(s.ctx, view), buffer_error,
                  fmt::format("this array is on device type {}, not on the simulated device",
                              static_cast<int>(view.device().device_type)));
  HANDOFF_EXPECTS(view.is_c_contiguous(), buffer_error, "handoff.sim works on contiguous arrays only");
  return view;
}

// `value` as an integer in [low, high], for an integer dtype named `name`: an int, or a float with an
// integral value. @throws type_error, or std::overflow_error (OverflowError) naming the value.
template <typename Int>
Int integer_element(py::handle value, std::string_view name)
{
  long double number = 0;
  if (PyFloat_Check(value.ptr()) != 0) {
    const double d = PyFloat_AS_DOUBLE(value.ptr());
    HANDOFF_EXPECTS(std::isfinite(d) && std::trunc(d) == d, value_error,
                    fmt::format("fill value {} is not an integer, as a {} array needs", d, name));
    number = d;
  } else {
    HANDOFF_EXPECTS(is_int(value.ptr()), type_error,
                    fmt::format("fill value must be a number, not {}", type_name(value)));
    const int64_reading as_signed = read_int64(value.ptr());
    if (as_signed.overflow > 0) {
      number = static_cast<long double>(PyLong_AsUnsignedLongLong(value.ptr()));
      if (PyErr_Occurred() != nullptr) {
        PyErr_Clear();
        number = std::numeric_limits<long double>::infinity();
      }
    } else {
      number = as_signed.overflow < 0 ? -std::numeric_limits<long double>::infinity()
                                      : static_cast<long double>(as_signed.value);
    }
  }
  if (number < static_cast<long double>(std::numeric_limits<Int>::min()) ||
      number > static_cast<long double>(std::numeric_limits<Int>::max())) {
    throw std::overflow_error(fmt::format("fill value {} does not fit in {} (its range is {} to {})",
                                          py::repr(value).cast<std::string>(), name, +std::numeric_limits<Int>::min(),
                                          +std::numeric_limits<Int>::max()));
  }
  return static_cast<Int>(number);
}

// `value` as a floating-point number of `Float`: an int or float; a finite one beyond its range is an
// OverflowError (infinities and NaN are kept).
template <typename Float>
Float float_element(py::handle value, std::string_view name)
{
  HANDOFF_EXPECTS(PyFloat_Check(value.ptr()) != 0 || is_int(value.ptr()), type_error,
                  fmt::format("fill value must be a number, not {}", type_name(value)));
  const double d = PyFloat_AsDouble(value.ptr());
  if (d == -1.0 && PyErr_Occurred() != nullptr) { throw py::error_already_set(); }  // an int beyond a double
  if (std::isfinite(d) && std::fabs(d) > static_cast<double>(std::numeric_limits<Float>::max())) {
    throw std::overflow_error(fmt::format("fill value {} does not fit in {}", d, name));
  }
  return static_cast<Float>(d);
}

// The bytes of `value` converted to `dtype`, for a fill pattern.
std::vector<std::byte> element_bytes(py::handle value, DLDataType dtype)
{
  const auto name = dtype_name(dtype);
  std::vector<std::byte> out(itemsize(dtype));
  const auto put = [&out](auto v) { std::memcpy(out.data(), &v, sizeof v); };
  if (name == "bool") {
    const int truth = PyObject_IsTrue(value.ptr());
    if (truth < 0) { throw py::error_already_set(); }
    put(static_cast<std::uint8_t>(truth));
  } else if (name == "float32") {
    put(float_element<float>(value, name));
  } else if (name == "float64") {
    put(float_element<double>(value, name));
  } else if (name == "int8") {
    put(integer_element<std::int8_t>(value, name));
  } else if (name == "int16") {
    put(integer_element<std::int16_t>(value, name));
  } else if (name == "int32") {
    put(integer_element<std::int32_t>(value, name));
  } else if (name == "int64") {
    put(integer_element<std::int64_t>(value, name));
  } else if (name == "uint8") {
    put(integer_element<std::uint8_t>(value, name));
  } else if (name == "uint16") {
    put(integer_element<std::uint16_t>(value, name));
  } else if (name == "uint32") {
    put(integer_element<std::uint32_t>(value, name));
  } else if (name == "uint64") {
    put(integer_element<std::uint64_t>(value, name));
  } else {
    throw buffer_error(fmt::format("handoff.sim.fill does not support dtype {}", name));
  }
  return out;
}

// A delay argument in seconds, as the simulator's nanoseconds. @throws value_error for a negative
// or non-finite one, std::overflow_error (OverflowError) for one longer than int64 nanoseconds.
std::chrono::nanoseconds seconds(double delay, const char* argument)
{
  HANDOFF_EXPECTS(std::isfinite(delay) && delay >= 0.0, value_error,
                  fmt::format("{} must be a non-negative number of seconds, not {}", argument, delay));
  constexpr double longest = static_cast<double>(std::numeric_limits<std::int64_t>::max()) / 1e9;
  if (delay >= longest) {
    throw std::overflow_error(fmt::format(
      "{}={} s is longer than the simulator can wait (under {:.3g} s, in nanoseconds)", argument, delay, longest));
  }
  return std::chrono::nanoseconds{static_cast<std::int64_t>(delay * 1e9)};
}

py::object zeros(exchange& on, py::handle shape_arg, const std::string& dtype_text, int device,
                 const std::string& memory, py::handle stream_arg)
{
  auto s = require_sim(on);
  const auto dtype = dtype_from_name(dtype_text);
  HANDOFF_EXPECTS(dtype.has_value(), value_error, fmt::format("unknown dtype '{}'", dtype_text));
  std::vector<std::int64_t> shape;
  if (PyLong_Check(shape_arg.ptr())) {
    shape.push_back(shape_arg.cast<std::int64_t>());
  } else {
    for (const auto extent : shape_arg) { shape.push_back(extent.cast<std::int64_t>()); }
  }
  // The layout first: a bad shape allocates nothing.
  auto [layout, bytes] = row_major_layout({s.sim.device_type(), device}, *dtype, shape);
  const current_device current{s.sim, device};
  const bool stream_ordered = !stream_arg.is_none();
  HANDOFF_EXPECTS(!stream_ordered || memory == "device", value_error,
                  fmt::format("stream= allocates device memory stream-ordered; memory='{}' is not", memory));
  const auto stream = stream_ordered ? stream_of(stream_arg) : s.sim.legacy_default_stream();
  const std::size_t allocated = std::max<std::size_t>(bytes, 1);
  void* data = nullptr;
  if (memory == "device") {
    data = s.sim.allocate(allocated, stream);
  } else if (memory == "pinned") {
    data = s.sim.allocate_pinned_host(allocated);
  } else if (memory == "managed") {
    data = s.sim.allocate_managed(allocated);
  } else {
    throw value_error(fmt::format("memory='{}' is not one of 'device', 'pinned', 'managed'", memory));
  }
  sim_backend* sim = &s.sim;
  // Freed as cudaFree does, once the device is idle: a write may still be pending on any stream. Or,
  // allocated on a stream, freed on it as cudaFreeAsync does (the stream kept until then).
  shared_producer owner = stream_ordered
                            ? shared_producer{[sim, data, stream, keep = stream_keep_alive(stream_arg)]() noexcept {
                                sim->deallocate(data, stream);
                              }}
                            : shared_producer{[sim, data]() noexcept {
                                try {
                                  sim->free_sync(data);
                                } catch (...) {  // the backend is shutting down and frees what is left itself
                                }
                              }};
  // The device type of each kind of memory is the exchange's to say (managed memory has none on ROCm).
  layout.device = *dlpack_device_of(s.sim.attributes(data), s.sim.device_type());
  // No stream has seen this fresh allocation yet, so it is zeroed directly: returned ready, like a
  // zero-filled allocation the device has finished writing.
  std::memset(data, 0, bytes);
  layout.data = data;
  array view{std::move(layout), std::move(owner)};
  view.owner().set_ready_on({.ctx = &s.ctx,
                             .device = device,
                             .stream = stream,
                             .stream_owner = stream_ordered ? stream_keep_alive(stream_arg) : nullptr});
  return wrap(std::move(view), "handoff.sim");
}

// A kernel launch of the simulator: it takes `delay` on `stream` and reads `reads` and writes
// `writes` as far as a launch trace knows (its body changes no memory).
void launch(exchange& on, const std::string& name, py::handle reads, py::handle writes, py::handle stream, double delay)
{
  auto s = require_sim(on);
  std::vector<activity::buffer_use> uses;
  std::optional<int> device;
  const auto add = [&](py::handle arrays, activity::access mode, const char* argument) {
    HANDOFF_EXPECTS(!py::isinstance<py::str>(arrays) && py::hasattr(arrays, "__iter__"), type_error,
                    fmt::format("{} must be a sequence of arrays, not {}", argument, type_name(arrays)));
    for (const auto item : arrays) {
      array* found = as_array(item);
      HANDOFF_EXPECTS(found != nullptr, type_error,
                      fmt::format("{} holds {}, not a handoff.Array", argument, type_name(item)));
      const DLDevice where = found->device();
      const bool reached =
        where.device_type == s.sim.device_type() ||
        where.device_type == (s.sim.flavour() == device::sim_flavour::cuda ? kDLCUDAHost : kDLROCMHost) ||
        where.device_type == kDLCUDAManaged;
      HANDOFF_EXPECTS(reached, type_error,
                      fmt::format("{} holds an array of {} memory, which the simulated device does not reach", argument,
                                  device_type_name(where.device_type)));
      const auto address = reinterpret_cast<std::uintptr_t>(found->data());
      const auto bytes = static_cast<std::size_t>(found->nbytes());
      if (where.device_type == s.sim.device_type()) {
        device = device.value_or(where.device_id);
        HANDOFF_EXPECTS(where.device_id == *device, value_error,
                        fmt::format("the arrays are on devices {} and {}: simulated devices have no peer access",
                                    *device, where.device_id));
      }
      const auto same = std::find_if(uses.begin(), uses.end(), [&](const activity::buffer_use& u) {
        return u.address == address && u.bytes == bytes;
      });
      if (same != uses.end()) {
        same->mode = static_cast<activity::access>(static_cast<unsigned>(same->mode) | static_cast<unsigned>(mode));
      } else {
        uses.push_back({.address = address, .bytes = bytes, .mode = mode});
      }
    }
  };
  add(reads, activity::access::read, "reads");
  add(writes, activity::access::write, "writes");
  HANDOFF_EXPECTS(!name.empty() && name.find('\0') == std::string::npos, value_error,
                  "a kernel needs a name, with no NUL character in it");
  const auto handle = stream_of(stream);
  const auto wait = seconds(delay, "delay");
  const current_device current{s.sim, device.value_or(s.sim.current_device())};
  if (device) {
    const int launched_on = s.sim.stream_device(handle);
    HANDOFF_EXPECTS(launched_on == *device, value_error,
                    fmt::format("the arrays are on device {} and the stream on device {}: simulated devices have no "
                                "peer access",
                                *device, launched_on));
  }
  s.sim.launch_kernel(handle, name.c_str(), uses, wait);
}

void fill(exchange& on, py::handle target, py::handle value, py::handle stream, double delay)
{
  auto s = require_sim(on);
  array& view = sim_array(target, s);
  HANDOFF_EXPECTS(!view.readonly(), buffer_error, "cannot fill a read-only array");
  const auto pattern = element_bytes(value, view.dtype());
  const auto handle = stream_of(stream);
  const int device = owning_device(s.ctx, view);
  const current_device current{s.sim, device};
  if (view.nbytes() > 0) {
    s.sim.enqueue_fill_bytes(handle, view.data(), static_cast<std::size_t>(view.nbytes()), pattern,
                             seconds(delay, "delay"));
  }
  view.owner().set_ready_on(
    {.ctx = &s.ctx, .device = device, .stream = handle, .stream_owner = stream_keep_alive(stream)});
}

py::object to_numpy(exchange& on, py::handle source, py::handle stream, bool wait)
{
  auto s = require_sim(on);
  const array& view = sim_array(source, s);
  const auto handle = stream_of(stream);
  const int device = owning_device(s.ctx, view);
  py::module_ numpy = py::module_::import("numpy");
  py::tuple shape(view.shape().size());
  for (std::size_t i = 0; i < view.shape().size(); ++i) { shape[i] = view.shape()[i]; }
  const std::string name{dtype_name(view.dtype())};
  py::object out = numpy.attr("empty")(shape, name == "bfloat16" ? "uint16" : name);
  const auto host = reinterpret_cast<void*>(out.attr("ctypes").attr("data").cast<std::uintptr_t>());
  const auto bytes = static_cast<std::size_t>(view.nbytes());
  if (bytes > 0) {
    const current_device current{s.sim, device};
    s.sim.copy_async(host, view.data(), bytes, handle);
  }
  if (!wait) {
    // The stream's device's event: a stream of a peer device may read this device's array.
    const int reader = [&] {
      const current_device current{s.sim, device};
      return s.sim.stream_device(handle);
    }();
    const current_device current{s.sim, reader};
    keep_alive_until_done(s.ctx, reader, handle, out);  // whether or not the result is asked for
    const auto done = s.sim.create_event();
    try {
      s.sim.record_event(done, handle);
    } catch (...) {
      s.sim.destroy_event(done);
      throw;
    }
    return py::cast(std::make_unique<pending_copy>(s.sim, reader, done, std::move(out)));
  }
  try {
    without_gil([&] {
      const current_device current{s.sim, device};
      s.sim.synchronize_stream(handle);
    });
  } catch (...) {
    // The copy may still be queued: `out` must outlive it.
    keep_alive_until_done(s.ctx, device, handle, out);
    throw;
  }
  return out;
}

void synchronize(exchange& on, py::handle device)
{
  auto s = require_sim(on);
  const bool an_int = is_int(device.ptr());
  HANDOFF_EXPECTS(device.is_none() || an_int, type_error,
                  fmt::format("device must be None or an int, not {}", type_name(device)));
  const int first = device.is_none() ? 0 : checked_device(s.sim, device.cast<long long>());  // with the GIL
  const int last = device.is_none() ? s.sim.device_count() - 1 : first;
  without_gil([&] {
    for (int d = first; d <= last; ++d) {
      const current_device current{s.sim, d};
      s.sim.synchronize_device();
    }
  });
}

// sim.Stream: a stream of a simulated device, owned by its Python object.
void bind_stream_class(py::module_& m, exchange& on)
{
  py::class_<sim_stream>(m, "Stream", "An owning stream of the simulated device.")
    .def(
      py::init([&on](int device, bool non_blocking) { return std::make_unique<sim_stream>(on, device, non_blocking); }),
      py::arg("device") = 0, py::kw_only(), py::arg("non_blocking") = false,
      "Creates a stream on simulated device `device`; destroyed when the object goes, its pending work still "
      "running. A non-blocking stream does not synchronize with the legacy default stream.")
    .def_property_readonly("handle", &sim_stream::handle, "The native stream handle, an int.")
    .def_property_readonly("device", &sim_stream::device, "The simulated device the stream is on.")
    .def_property_readonly("non_blocking", &sim_stream::non_blocking,
                           "True when the stream does not synchronize with the legacy default stream.")
    .def(
      "__cuda_stream__", [](const sim_stream& s) { return py::make_tuple(0, s.handle()); },
      "The CUDA stream protocol: (0, handle).")
    .def("synchronize", &sim_stream::synchronize, "Blocks until the stream's work is done (GIL released).")
    .def("__repr__", [](const sim_stream& s) {
      return fmt::format("handoff.sim.Stream({:#x}, device={}{})", s.handle(), s.device(),
                         s.non_blocking() ? ", non_blocking=True" : "");
    });
}

// Simulated arrays and the work enqueued on them: fills, launches, copies.
void bind_memory_and_work(py::module_& m, exchange& on)
{
  m.def(
    "zeros",
    [&on](py::handle shape, const std::string& dtype, int device, const std::string& memory, py::handle stream) {
      return zeros(on, shape, dtype, device, memory, stream);
    },
    py::arg("shape"), py::arg("dtype") = "float32", py::arg("device") = 0, py::kw_only(), py::arg("memory") = "device",
    py::arg("stream") = py::none(),
    "A zero-filled array on a simulated device ('device'), or in pinned host or managed memory. With `stream`, "
    "device memory allocated on that stream and freed on it when released (cudaMallocAsync, cudaFreeAsync); "
    "otherwise freed once the device is idle (cudaFree).");
  m.def(
    "launch",
    [&on](const std::string& name, py::handle reads, py::handle writes, py::handle stream, double delay) {
      launch(on, name, reads, writes, stream, delay);
    },
    py::arg("name"), py::kw_only(), py::arg("reads") = py::tuple(), py::arg("writes") = py::tuple(), py::arg("stream"),
    py::arg("delay") = 0.0,
    "Enqueues on `stream` a kernel `name` that takes `delay` seconds and reads `reads` and writes `writes` "
    "(sequences of simulated arrays). It changes no memory: a launch trace records what it uses, and its race "
    "detector checks that. Returns at once.");
  m.def(
    "fill",
    [&on](py::handle target, py::handle value, py::handle stream, double delay) {
      fill(on, target, value, stream, delay);
    },
    py::arg("array"), py::arg("value"), py::kw_only(), py::arg("stream"), py::arg("delay") = 0.0,
    "Enqueues on `stream`: wait `delay` seconds, then write `value` everywhere. Returns at once.");
  m.def(
    "to_numpy", [&on](py::handle source, py::handle stream, bool wait) { return to_numpy(on, source, stream, wait); },
    py::arg("array"), py::kw_only(), py::arg("stream"), py::arg("wait") = true,
    "Enqueues a copy to a new NumPy array on `stream`, waits for the stream and returns the NumPy array; "
    "with wait=False, returns a PendingCopy at once (for a read behind a held stream).");
  py::class_<pending_copy>(m, "PendingCopy", "A host copy sim.to_numpy(..., wait=False) enqueued.")
    .def("done", &pending_copy::done, "True once the copy has landed (it never blocks).")
    .def("result", &pending_copy::result,
         "Waits for the copy (GIL released) and returns its NumPy array. On the thread that holds work the "
         "copy waits for, raises DeviceError (handoffErrorHoldDeadlock) instead of waiting for ever.");
  m.def(
    "set_copy_delay", [&on](double delay) { require_sim(on).sim.set_copy_duration(seconds(delay, "delay")); },
    py::arg("delay"),
    "Makes every later device copy take `delay` seconds on its stream (default 0), as a real copy takes time.");
  m.def(
    "live_allocations", [&on] { return require_sim(on).sim.live_allocations(); },
    "How many simulated allocations are not freed yet (deferred frees count until they have run).");
}

// The gate ordering tests hold a producer with (sim.hold), and the waits around it.
void bind_holds_and_waits(py::module_& m, exchange& on)
{
  py::class_<stream_hold>(m, "Hold", "A hold on a stream (sim.hold): a context manager.")
    .def("__enter__", &stream_hold::enter, py::return_value_policy::reference_internal)
    .def(
      "__exit__", [](stream_hold& h, const py::args&) { h.exit(); },
      "Ends the hold: the work enqueued on the stream since __enter__ runs.")
    .def_property_readonly("stream", &stream_hold::stream, "The stream it holds.")
    .def_property_readonly("active", &stream_hold::active, "True inside the block.");
  m.def(
    "hold",
    [&on](py::object stream) {
      return stream_hold{on, std::move(stream)};
    },
    py::arg("stream"),
    "A context manager: nothing enqueued on `stream` inside the block runs until the block ends, so that a test "
    "holds a producer exactly as long as it needs. Work enqueued before the block is not held.");
  m.def(
    "pending", [&on](py::handle stream) { return ask_about(on, stream, &sim_backend::pending); }, py::arg("stream"),
    "How many operations enqueued on `stream` are not done yet (a hold itself is not counted).");
  m.def(
    "held", [&on](py::handle stream) { return ask_about(on, stream, &sim_backend::held); }, py::arg("stream"),
    "True while a sim.hold(stream) block is open.");
  m.def(
    "waits_for_hold", [&on](py::handle stream) { return ask_about(on, stream, &sim_backend::waits_for_hold); },
    py::arg("stream"),
    "True while the last work enqueued on `stream` cannot run before an open sim.hold block ends (a hold of "
    "`stream`, or of a stream it waits for): a consumer waits for a held producer.");
  m.def(
    "synchronize", [&on](py::handle device) { synchronize(on, device); }, py::arg("device") = py::none(),
    "Waits for all work on a device (or all).");
  m.def(
    "synchronize_unheld",
    [&on] {
      auto s = require_sim(on);
      without_gil([&] { s.sim.synchronize_unheld(); });
    },
    "Waits for all the work that does not wait for an open sim.hold block: inside one, what can run has run.");
  m.def(
    "drain",
    [&on] {
      if (context* ctx = on.device_context()) {
        if (sim_backend* sim = device::as_sim(ctx->backend()); sim != nullptr && sim->holds_of_this_thread() > 0) {
          throw device_error(std::string{sim->name()}, sim_backend::hold_deadlock_error,
                             "sim.drain() inside sim.hold(...): the deferred releases it waits for may wait for "
                             "the held work, which this thread cannot release while it waits; drain after the block");
        }
        without_gil([ctx] { ctx->drain(); });
      }
    },
    "Waits for the releases deferred so far. Refused inside a sim.hold block (it could wait for ever).");
}

// Faults a test injects, and what the simulation saw the process do that CUDA forbids.
void bind_faults(py::module_& m, exchange& on)
{
  m.def(
    "inject_fault",
    [&on](const std::string& op, int count, const std::string& error) {
      require_sim(on).sim.inject_fault(op, count, error);
    },
    py::arg("operation"), py::arg("count") = 1, py::arg("error") = "cudaErrorLaunchFailure",
    "Makes the next `count` calls of a device operation fail with `error` (a DeviceError).");
  m.def(
    "clear_faults", [&on] { require_sim(on).sim.clear_faults(); }, "Removes every fault inject_fault set.");
  m.def(
    "_count_calls", [&on](bool counting) { require_sim(on).sim.count_calls(counting); }, py::arg("on"),
    "Counts the calls this thread makes from now on, by operation, or stops (sim.count_calls).");
  m.def(
    "_call_counts",
    [&on] {
      py::dict counts;
      for (const auto& [op, n] : require_sim(on).sim.call_counts()) { counts[py::str(op)] = n; }
      return counts;
    },
    "The counts since counting began, by operation (sim.count_calls).");
  m.def(
    "inject_sticky_fault",
    [&on](long long device, const std::string& error) {
      auto s = require_sim(on);
      s.sim.inject_sticky_fault(checked_device(s.sim, device), error);
    },
    py::arg("device") = 0, py::arg("error") = "cudaErrorIllegalAddress",
    "Poisons a device's context as a faulting kernel does: every later call on it raises `error`, and "
    "work already queued there, host functions included, never runs.");
  m.def(
    "clear_sticky_fault",
    [&on](long long device) {
      auto s = require_sim(on);
      s.sim.clear_sticky_fault(checked_device(s.sim, device));
    },
    py::arg("device") = 0, "Makes a device usable again (tests only: CUDA needs a new process).");
  m.def(
    "violations",
    [&on] {
      py::list out;
      for (const auto& violation : require_sim(on).sim.violations()) { out.append(violation); }
      return out;
    },
    "What the process did that CUDA leaves undefined or forbids: uses of destroyed streams or events, "
    "runtime calls from host functions.");
  m.def(
    "clear_violations", [&on] { require_sim(on).sim.clear_violations(); }, "Forgets the violations recorded so far.");
}

// The current device, and a device reset as a library may do one.
void bind_devices(py::module_& m, exchange& on)
{
  m.def(
    "current_device", [&on] { return require_sim(on).sim.current_device(); },
    "The device current on the calling thread (the one the runtime would use where none is).");
  m.def(
    "set_device",
    [&on](long long device) {
      auto s = require_sim(on);
      s.sim.set_current_device(checked_device(s.sim, device));
    },
    py::arg("device"), "Makes `device` current on the calling thread, as cudaSetDevice does.");
  m.def(
    "reset_device",
    [&on](long long device) {
      auto s = require_sim(on);
      const int checked = checked_device(s.sim, device);
      without_gil([&] { s.sim.reset_device(checked); });
    },
    py::arg("device") = 0,
    "Resets a device's context as numba-cuda's cuda.close() does (cuDevicePrimaryCtxReset): waits for its work, "
    "then destroys its streams, events and memory; its next use gets a new context.");
}

// Graphs captured from a stream, and their launches.
void bind_graphs(py::module_& m, exchange& on)
{
  py::class_<device::sim_graph>(m, "Graph", "A graph captured from a stream (sim.end_capture).")
    .def("__len__", &device::sim_graph::size,
         "How many operations the capture recorded (work, host functions, event records and waits).")
    .def(
      "launch",
      [&on](const device::sim_graph& graph, py::handle stream) {
        require_sim(on).sim.launch_graph(graph, stream_of(stream));
      },
      py::arg("stream"), "Enqueues a run of the graph on `stream`; each launch runs its work once.");
  m.def(
    "begin_capture", [&on](py::handle stream) { require_sim(on).sim.begin_capture(stream_of(stream)); },
    py::arg("stream"),
    "Starts capturing the work enqueued on `stream` (and on streams that join it) into a Graph; end_capture "
    "returns it.");
  m.def(
    "end_capture", [&on](py::handle stream) { return require_sim(on).sim.end_capture(stream_of(stream)); },
    py::arg("stream"),
    "Ends the capture begun on `stream`; returns the captured Graph, which runs only when launched.");
}

}  // namespace

void bind_sim(py::module_& parent, exchange& on)
{
  py::module_ m = parent.def_submodule("_sim", "The simulated accelerator (HANDOFF_BACKEND=sim or sim-rocm).");
  bind_stream_class(m, on);
  bind_memory_and_work(m, on);
  bind_holds_and_waits(m, on);
  bind_faults(m, on);
  bind_devices(m, on);
  bind_graphs(m, on);
}

}  // namespace handoff::python
