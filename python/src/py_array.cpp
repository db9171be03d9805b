// handoff.Array: properties and the producer side of DLPack and the array interfaces.
#include "py_array.hpp"

#include "py_support.hpp"

#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/runtime.hpp>
#include <handoff/stats.hpp>

#include <fmt/format.h>

#include <algorithm>

namespace handoff::python {
namespace {

py::tuple int_tuple(std::span<const std::int64_t> values, std::int64_t scale = 1)
{
  py::tuple out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), PyLong_FromLongLong(values[i] * scale));
  }
  return out;
}

py::tuple byte_strides(const array& view) { return int_tuple(view.strides(), static_cast<std::int64_t>(view.itemsize())); }

// The DLPack version a consumer asked for; nullopt selects the legacy capsule.
std::optional<DLPackVersion> requested_version(py::handle max_version)
{
  if (max_version.is_none()) { return std::nullopt; }
  const bool pair = PyTuple_Check(max_version.ptr()) && PyTuple_GET_SIZE(max_version.ptr()) == 2 &&
                    PyLong_Check(PyTuple_GET_ITEM(max_version.ptr(), 0)) &&
                    PyLong_Check(PyTuple_GET_ITEM(max_version.ptr(), 1));
  HANDOFF_EXPECTS(pair, type_error, "max_version must be None or a (major, minor) tuple of ints");
  const auto major = py::reinterpret_borrow<py::int_>(PyTuple_GET_ITEM(max_version.ptr(), 0)).cast<long long>();
  const auto minor = py::reinterpret_borrow<py::int_>(PyTuple_GET_ITEM(max_version.ptr(), 1)).cast<long long>();
  if (major < 1) { return std::nullopt; }
  // Same major: stamp the consumer's minor if older than ours, so it can read every field we set.
  const auto stamped_minor = major == 1 ? std::clamp<long long>(minor, 0, DLPACK_MINOR_VERSION) : DLPACK_MINOR_VERSION;
  return DLPackVersion{DLPACK_MAJOR_VERSION, static_cast<std::uint32_t>(stamped_minor)};
}

bool same_device(DLDevice a, DLDevice b) noexcept
{
  return a.device_type == b.device_type && a.device_id == b.device_id;
}

std::string device_text(DLDevice device)
{
  return fmt::format("{} device {} (({}, {}))", device_type_name(device.device_type), device.device_id,
                     static_cast<int>(device.device_type), device.device_id);
}

// CUDA Array Interface v3 of CUDA-resident data; `stream` is where the data is ready, so that the
// consumer can order its work after it (None when unknown: nothing to wait for).
py::dict cuda_array_interface(const py_array& a)
{
  const array& view = a.view;
  if (!is_cuda_device(view.device().device_type)) {
    throw py::attribute_error(fmt::format("__cuda_array_interface__ is for CUDA memory; this array is on {}",
                                          device_text(view.device())));
  }
  std::string type;
  try {
    type = typestr(view.dtype());
  } catch (const buffer_error& e) {
    throw py::attribute_error(e.what());
  }
  py::dict out;
  out["shape"] = int_tuple(view.shape());
  out["typestr"] = type;
  out["data"] = py::make_tuple(reinterpret_cast<std::uintptr_t>(view.data()), view.readonly());
  out["strides"] = view.is_c_contiguous() ? py::object(py::none()) : py::object(byte_strides(view));
  py::list descr;
  descr.append(py::make_tuple("", type));
  out["descr"] = descr;
  out["version"] = 3;
  const auto ready = view.owner().ready_on();
  if (ready) {
    const auto handle = static_cast<std::uintptr_t>(ready->stream);
    out["stream"] = handle == 0 ? 1 : handle;  // CUDA's legacy default stream is 0 as a handle, 1 here
  } else {
    out["stream"] = py::none();
  }
  return out;
}

}  // namespace

py::capsule export_dlpack(const py_array& self, py::handle stream, py::handle max_version, py::handle dl_device,
                          py::handle copy)
{
  const array& view = self.view;
  const stream_request request = classify_stream(view.device().device_type, stream_argument(stream));
  if (request.order != stream_order::none) {
    const py::gil_scoped_release unlocked;  // device calls only; never blocks on the device
    order_export(active_context(), view, request);
  }
  const auto version = requested_version(max_version);
  const auto target = device_argument(dl_device, "dl_device");
  const auto want_copy = copy_argument(copy);

  const bool moves = target.has_value() && !same_device(*target, view.device());
  HANDOFF_EXPECTS(!moves || target->device_type == kDLCPU, buffer_error,
                  fmt::format("cannot export an array on {} to {}: the device is unreachable from there",
                              device_text(view.device()), device_text(*target)));
  HANDOFF_EXPECTS(!(moves && want_copy == false), buffer_error,
                  fmt::format("exporting to {} needs a copy, but copy=False", device_text(*target)));
  const bool copied = moves || want_copy == true;
  const array out = copied ? copy_to_host(view) : view;

  py::capsule capsule = version ? make_capsule(export_versioned(out, {*version, copied}))
                                : make_capsule(export_legacy(out));
  count(counter::exports);
  return capsule;
}

void bind_array(py::module_& m)
{
  py::class_<py_array>(m, "Array", R"doc(
A zero-copy view of an array imported into handoff. It keeps its producer alive; when the last view
(and every capsule exported from it) is gone, the producer is released.
)doc")
    .def_property_readonly("shape", [](const py_array& a) { return int_tuple(a.view.shape()); })
    .def_property_readonly("strides", [](const py_array& a) { return byte_strides(a.view); },
                           "Strides in bytes, as NumPy reports them.")
    .def_property_readonly("dtype", [](const py_array& a) { return std::string{dtype_name(a.view.dtype())}; })
    .def_property_readonly("device", [](const py_array& a) {
      return py::make_tuple(static_cast<int>(a.view.device().device_type), a.view.device().device_id);
    })
    .def_property_readonly("data_ptr", [](const py_array& a) { return reinterpret_cast<std::uintptr_t>(a.view.data()); })
    .def_property_readonly("readonly", [](const py_array& a) { return a.view.readonly(); })
    .def_property_readonly("ndim", [](const py_array& a) { return a.view.ndim(); })
    .def_property_readonly("size", [](const py_array& a) { return a.view.size(); })
    .def_property_readonly("nbytes", [](const py_array& a) { return a.view.nbytes(); })
    .def("__dlpack__", &export_dlpack, py::kw_only(), py::arg("stream") = py::none(),
         py::arg("max_version") = py::none(), py::arg("dl_device") = py::none(), py::arg("copy") = py::none(),
         "Exports the array as a DLPack capsule (versioned when max_version >= (1, 0)).")
    .def("__dlpack_device__", [](const py_array& a) {
      return py::make_tuple(static_cast<int>(a.view.device().device_type), a.view.device().device_id);
    })
    .def_property_readonly("__array_interface__", [](const py_array& a) -> py::dict {
      const array& view = a.view;
      if (view.device().device_type != kDLCPU) {
        throw py::attribute_error(fmt::format("__array_interface__ is for CPU arrays; this one is on {}",
                                              device_text(view.device())));
      }
      py::dict out;
      out["shape"] = int_tuple(view.shape());
      out["typestr"] = typestr(view.dtype());
      out["data"] = py::make_tuple(reinterpret_cast<std::uintptr_t>(view.data()), view.readonly());
      out["strides"] = view.is_c_contiguous() ? py::object(py::none()) : py::object(byte_strides(view));
      out["version"] = 3;
      return out;
    })
    .def_property_readonly("__cuda_array_interface__", &cuda_array_interface,
                           "CUDA Array Interface v3, with `stream` naming the stream the data is ready on.")
    .def("__repr__", [](const py_array& a) {
      return fmt::format("handoff.Array(shape=({}{}), dtype={}, device=({}, {}))", fmt::join(a.view.shape(), ", "),
                         a.view.ndim() == 1 ? "," : "", dtype_name(a.view.dtype()),
                         static_cast<int>(a.view.device().device_type), a.view.device().device_id);
    });
}

}  // namespace handoff::python
