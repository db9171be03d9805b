// handoff._handoff: the extension module. It composes the py_*.cpp files' parts: each converts
// Python objects into the exchange's requests and its results back; py_interpose.cpp records and
// orders other libraries' exchanges through the runtime's ordering. The releases live in the runtime.
#include "py_arguments.hpp"
#include "py_array.hpp"
#include "py_c_api.hpp"
#include "py_errors.hpp"
#include "py_exchange.hpp"
#include "py_gil.hpp"
#include "py_interfaces.hpp"
#include "py_ipc.hpp"
#include "py_sim.hpp"
#include "py_streams.hpp"
#include "py_trace.hpp"
#include "py_view.hpp"

#include <handoff/context.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/internal/enum_table.hpp>
#include <handoff/ipc.hpp>
#include <handoff/log.hpp>
#include <handoff/runtime.hpp>
#include <handoff/stats.hpp>
#include <handoff/stream_value.hpp>

#include <fmt/format.h>

#include <pybind11/stl.h>

#include <string>

namespace py = pybind11;
using namespace handoff;
using namespace handoff::python;

namespace {

py::dict stats_dict()
{
  const stats_snapshot s = stats();
  py::dict out;
  out["exports"] = s.exports;
  out["imports"] = s.imports;
  out["waits_inserted"] = s.waits_inserted;
  out["waits_elided"] = s.waits_elided;
  out["events_created"] = s.events_created;
  out["events_reused"] = s.events_reused;
  out["deferred_releases"] = s.deferred_releases;
  out["live_views"] = s.live_views;
  out["pending_releases"] = s.pending_releases;
  out["ipc_shares"] = s.ipc_shares;
  out["ipc_opens"] = s.ipc_opens;
  out["ipc_mappings_cached"] = s.ipc_mappings_cached;
  out["ipc_pending_remote_releases"] = s.ipc_pending_remote_releases;
  return out;
}

py::dict runtime_info()
{
  const runtime_description d = describe_runtime();
  py::dict out;
  out["backend"] = d.backend;
  out["device_count"] = d.device_count;
  out["version"] = d.version;
  out["dlpack_version"] = d.dlpack_version;
  out["cuda_compiled"] = d.cuda_compiled;
  out["cuda_runtime"] = d.cuda_runtime.empty() ? py::object(py::none()) : py::object(py::str(d.cuda_runtime));
  out["cuda_driver_minimum"] =
    d.cuda_driver_minimum == 0 ? py::object(py::none()) : py::object(py::int_(d.cuda_driver_minimum));
  out["backend_error"] = d.backend_error.empty() ? py::object(py::none()) : py::object(py::str(d.backend_error));
  return out;
}

constexpr auto stream_order_names =
  handoff::detail::make_enum_table<stream_order, const char*>({{stream_order::none, "none"},
                                                               {stream_order::legacy_default, "legacy_default"},
                                                               {stream_order::per_thread_default, "per_thread_default"},
                                                               {stream_order::default_stream, "default_stream"},
                                                               {stream_order::handle, "handle"}});

// handoff.DeviceError, and the one Python exception type each C++ exception type becomes.
void register_errors(py::module_& m)
{
  PyObject* device_error_type = PyErr_NewExceptionWithDoc(
    "handoff.DeviceError", "A device runtime call failed; `error_name` is the backend's name for the error.",
    PyExc_RuntimeError, nullptr);
  if (device_error_type == nullptr) { throw py::error_already_set(); }
  set_device_error_type(device_error_type);
  m.attr("DeviceError") = py::reinterpret_borrow<py::object>(device_error_type);
  // Each C++ exception type maps to exactly one Python exception type.
  py::register_exception_translator(translate_exception);
}

// The process's side of the module: counters, the export-release policy, exit and fork, the live trace
// socket, what the runtime is.
void bind_process(py::module_& m, exchange& on)
{
  m.def("stats", &stats_dict,
        "Exchange counters since the last reset_stats(), a dict of ints: exports, imports, waits_inserted, "
        "waits_elided, events_created, events_reused, deferred_releases, live_views and pending_releases (deferred "
        "releases asked for and not yet run); across processes ipc_shares, ipc_opens, ipc_mappings_cached (mappings of "
        "other processes' memory open here) and ipc_pending_remote_releases (opens of this process's shares not yet "
        "released by their consumers).");
  m.def("reset_stats", &reset_stats, "Zeroes the counters (live_views and pending_releases keep counting).");
  m.def(
    "set_export_release",
    [&on](const std::string& policy) {
      export_release chosen = export_release::known_streams;
      if (policy == "every-stream") {
        chosen = export_release::every_stream;
      } else if (policy != "known-streams") {
        throw value_error(
          fmt::format("set_export_release: policy must be 'known-streams' or 'every-stream', not '{}'", policy));
      }
      const export_release previous = on.set_export_release(chosen);
      return previous == export_release::every_stream ? "every-stream" : "known-streams";
    },
    py::arg("policy"),
    "Which consumer streams an export's producer waits for when the consumer releases what it imported, and\n"
    "returns the policy it replaces. 'known-streams' (the default): the default streams and a stream object the\n"
    "enclosing handoff.stream block holds; a bare handle may be destroyed by then and is not touched.\n"
    "'every-stream': bare handles too; the application promises that each consumer stream outlives what it\n"
    "imported. HANDOFF_EXPORT_RELEASE sets the policy at start.");
  m.def(
    "_at_exit",
    [] {
      if (context* ctx = started_context()) {  // the releases may need the GIL themselves
        without_gil([ctx] { (void)ctx->drain_at_exit(context::exit_drain_limit); });
      }
      without_gil([] { ipc::shutdown(); });  // this process's shared memory files go
      close_python_gate();                   // later releases leave their Python objects to the ending process
    },
    "Run at exit while Python is alive: waits for the stream-ordered releases still pending, then stops "
    "other threads from taking the GIL back.");
  m.def(
    "_log_warning", [](const std::string& message) { log_warning(message); }, py::arg("message"),
    "Writes a warning to handoff's logger (stderr unless HANDOFF_LOG_FILE says otherwise).");
  m.def("_after_fork_in_child", &reset_after_fork_in_child,
        "Run in a forked child (os.register_at_fork): resets what the parent's threads left in the GIL's gate.");
  m.def("_serve_trace", &serve_trace, "Serves the trace live on a Unix socket; returns its path.");
  m.def("_stop_serving_trace", &stop_serving_trace, "Stops serving the trace live and removes the socket.");
  m.def("_trace_socket_paths", &trace_socket_paths, py::arg("pid"),
        "Where process `pid` serves its trace, if it does: the paths to try, in order.");
  m.def("runtime_info", &runtime_info,
        "The runtime, a dict: backend (its name), device_count, version, dlpack_version ('1.1'), cuda_compiled, "
        "cuda_runtime and cuda_driver_minimum (None without CUDA), and backend_error (why the backend could not "
        "start, else None).");
}

// The contract's rules, asked of the core by the Python front end and its tests.
void bind_contract_rules(py::module_& m)
{
  m.def(
    "_device_type_labels",
    [] {
      py::dict labels;
      for (const device_type_info& type : dlpack_device_types()) {
        labels[py::int_(static_cast<int>(type.type))] = type.label;
      }
      return labels;
    },
    "The short name of each device type DLPack defines, by its code: {1: 'cpu', 2: 'cuda', ...}.");
  m.def(
    "_classify_stream",
    [](int device_type, py::handle stream) {
      const stream_request r = classify_stream(static_cast<DLDeviceType>(device_type), stream_argument(stream));
      return py::make_tuple(handoff::detail::look_up(stream_order_names, r.order, "unknown"), r.handle);
    },
    py::arg("device_type"), py::arg("stream"),
    "The producer's action for a DLPack stream value on a device type (the contract's table).");
  m.def(
    "_parse_cuda_array_interface",
    [](py::handle interface) {
      const cuda_interface parsed = parse_cuda_array_interface(interface);
      py::tuple shape(parsed.layout.shape.size());
      for (std::size_t i = 0; i < parsed.layout.shape.size(); ++i) { shape[i] = py::int_(parsed.layout.shape[i]); }
      return py::make_tuple(shape, parsed.stream ? py::object(py::int_(*parsed.stream)) : py::object(py::none()));
    },
    py::arg("interface"), "Validates a __cuda_array_interface__ dict without touching a device.");
}

}  // namespace

PYBIND11_MODULE(_handoff, m)
{
  m.doc() = "handoff's native core: stream-correct zero-copy array exchange.";
  register_errors(m);
  set_finalizing_thread(py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>());
  if (!embed_process(python_embedding)) {
    log_warning(
      "the process's exchange was in use before handoff's Python module loaded: producers' deleters and "
      "host waits run without regard to the GIL");
  }
  // The composition root of the extension: every binder gets the exchange its calls run, the
  // process's, made with the embedding above.
  exchange& on = process_exchange();
  bind_array(m, on);
  bind_streams(m);
  init_exchange(m, on);
  bind_view(m, on);
  bind_c_api(m, on);
  bind_sim(m, on);
  bind_ipc(m, on);
  bind_trace(m, on);
  bind_interpose(m, on);
  bind_process(m, on);
  bind_contract_rules(m);
  m.attr("__version__") = handoff::version();
}
