// handoff._handoff._ipc: the hand-off across processes; the Handle class lives in handoff/ipc.py.
#include "py_ipc.hpp"

#include "py_array.hpp"
#include "py_exchange.hpp"

#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/ipc.hpp>

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <utility>

namespace handoff::python {
namespace {

// The producer's hold on a shared array, for the Handle that carries it.
struct share_hold {
  std::shared_ptr<const void> hold;
};

std::span<const std::byte> bytes_of(const py::bytes& data)
{
  char* buffer = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(data.ptr(), &buffer, &size) != 0) { throw py::error_already_set(); }
  return {reinterpret_cast<const std::byte*>(buffer), static_cast<std::size_t>(size)};
}

py::tuple share(exchange& on, py::handle x, py::handle stream, py::handle copy, bool in_flight)
{
  // The data as handoff sees it: an Array as it is (its own ready stream), anything else imported,
  // ready on `stream` (the stream its data is ready on, where handoff cannot know it).
  py::object imported;
  const array* view = as_array(x);
  if (view == nullptr) {
    imported = asarray(on, x, py::none(), py::none(), stream);
    view = as_array(imported);
  }
  ipc::share_options options;
  options.in_flight = in_flight;
  if (!copy.is_none()) { options.copy = copy.cast<bool>(); }
  const named_stream ready = stream.is_none() ? named_stream{} : consumer_stream(stream);
  ipc::shared made = ipc::share(on, *view, ready, options);
  py::bytes data(reinterpret_cast<const char*>(made.handle.data()), made.handle.size());
  py::object hold = made.hold ? py::cast(share_hold{std::move(made.hold)}) : py::none();
  return py::make_tuple(std::move(data), std::move(hold));
}

py::object open(exchange& on, const py::bytes& handle, py::handle stream)
{
  const named_stream consumer = consumer_stream(stream);
  return wrap(ipc::open(on, bytes_of(handle), consumer));
}

py::dict describe(const py::bytes& handle)
{
  const ipc::handle_description d = ipc::describe(bytes_of(handle));
  py::dict out;
  out["producer_pid"] = d.producer_pid;
  out["device"] = py::make_tuple(static_cast<int>(d.device.device_type), d.device.device_id);
  out["dtype"] = std::string{dtype_name(d.dtype)};
  py::tuple shape(d.shape.size());
  for (std::size_t i = 0; i < d.shape.size(); ++i) { shape[i] = d.shape[i]; }
  out["shape"] = shape;
  out["nbytes"] = d.nbytes;
  out["backend"] = d.backend;
  out["host_memory"] = d.host_memory;
  out["in_flight"] = d.in_flight;
  return out;
}

}  // namespace

void bind_ipc(py::module_& parent, exchange& on)
{
  py::module_ m = parent.def_submodule("_ipc", "The hand-off across processes of one node (see handoff.ipc).");
  // Made by share() only; registered so that pybind11 can return it.
  py::class_<share_hold> hold_type(m, "_Hold",
                                   "The producer's hold on a shared array: the array is kept while it lives.");
  m.def(
    "share",
    [&on](py::handle x, py::handle stream, py::handle copy, bool in_flight) {
      return share(on, x, stream, copy, in_flight);
    },
    py::arg("x"), py::arg("stream"), py::arg("copy"), py::arg("in_flight"),
    "Shares `x`; returns (handle bytes, the producer's hold or None for an in-flight share).");
  m.def(
    "open", [&on](const py::bytes& handle, py::handle stream) { return open(on, handle, stream); }, py::arg("handle"),
    py::arg("stream"),
    "Opens the handle bytes another process made; returns a handoff.Array ordered on the consumer stream.");
  m.def("describe", &describe, py::arg("handle"), "What handle bytes describe, as a dict (checks them).");
  m.def("_set_back_signal", &ipc::set_back_signal, py::arg("on"),
        "Tests only: off, a consumer tells its producer it is done as soon as it drops an array, without waiting "
        "for its stream (the negative control). Returns the previous setting.");
  m.def("_poll", &ipc::poll_consumers,
        "Looks at the consumers of this process's shares now (tests; a service thread does it on its own).");
  m.def("_shutdown", &ipc::shutdown, "Removes this process's shared memory files and stops watching consumers.");
}

}  // namespace handoff::python
