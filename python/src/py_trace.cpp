#include "py_trace.hpp"

#include "py_array.hpp"
#include "py_cpython.hpp"
#include "py_gil.hpp"

#include <handoff/activity.hpp>
#include <handoff/dtype.hpp>
#include <handoff/error.hpp>
#include <handoff/exchange.hpp>
#include <handoff/ownership.hpp>

#include <fmt/format.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace handoff::python {

// Library names are kept for the life of the process: events and graph nodes point at them.
// Only touched holding the GIL.
const char* intern_library(std::string_view name)
{
  struct name_hash {
    using is_transparent = void;  // found by a string_view, without making a string per lookup
    std::size_t operator()(std::string_view key) const noexcept { return std::hash<std::string_view>{}(key); }
  };
  static auto* names =
    new std::unordered_set<std::string, name_hash, std::equal_to<>>;  // NOLINT(cppcoreguidelines-owning-memory): leaked
  if (const auto found = names->find(name); found != names->end()) { return found->c_str(); }
  return names->emplace(name).first->c_str();
}

namespace {

// The top-level package of `type`'s module: "torch" for torch.Tensor; null for builtins. A type
// freed and another made at its address would keep the old name: a label, never a use.
const char* library_of_type(PyTypeObject* type) noexcept
{
  static auto* known = new std::unordered_map<PyTypeObject*, const char*>;  // NOLINT: leaked, as above
  const char* library = nullptr;
  try {
    if (const auto found = known->find(type); found != known->end()) {
      library = found->second;
    } else {
      PyObject* module = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), "__module__");
      Py_ssize_t size = 0;
      const char* text =
        module != nullptr && PyUnicode_Check(module) ? PyUnicode_AsUTF8AndSize(module, &size) : nullptr;
      if (text != nullptr) {
        const std::string_view name{text, static_cast<std::size_t>(size)};
        const std::string_view package = name.substr(0, name.find('.'));
        if (package != "builtins") { library = intern_library(package); }
      }
      Py_XDECREF(module);
      PyErr_Clear();
      known->emplace(type, library);
    }
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
  return library;
}

// What handoff._trace registers at import (library_of_file): the library a source file belongs to.
// The package hands it over, so that the extension never imports the package it is part of.
PyObject* file_classifier = nullptr;

// The library `filename` belongs to (see file_classifier), remembered per file name; None for user
// code, and while nothing is registered. Holds the GIL.
PyObject* library_of_file(PyObject* filename) noexcept
{
  static PyObject* cache = PyDict_New();
  if (cache == nullptr || file_classifier == nullptr) { return Py_None; }
  // The few files the last walks passed, by identity (a code object's file name is one object), in
  // front of the dictionary: every event walks the same frames again. Each entry holds its file name,
  // so that no other object takes its address; the libraries are the dictionary's.
  struct recent_file {
    PyObject* filename{nullptr};
    PyObject* library{nullptr};
  };
  static std::array<recent_file, 4> recent{};
  static std::size_t next = 0;
  for (const recent_file& r : recent) {
    if (r.filename == filename) { return r.library; }
  }
  PyObject* library = PyDict_GetItemWithError(cache, filename);
  if (library == nullptr) {
    PyObject* made = PyObject_CallOneArg(file_classifier, filename);
    if (made == nullptr) {
      PyErr_Clear();
      return Py_None;
    }
    const int stored = PyDict_SetItem(cache, filename, made);
    Py_DECREF(made);  // the cache holds it
    if (stored != 0) {
      PyErr_Clear();
      return Py_None;
    }
    library = made;
  }
  recent_file& replaced = recent.at(next);
  next = (next + 1) % recent.size();
  Py_INCREF(filename);
  Py_XDECREF(replaced.filename);
  replaced = {filename, library};
  return library;
}

// Where a frame is, as "file:line" (interned: events and the race detector's sites point at it),
// remembered per (code, offset): CPython finds a line by scanning the code's line table from the
// start, and a key holding the code object would hash its contents on every event.
const char* where_of(PyFrameObject* frame, PyCodeObject* code)
{
  using key = std::pair<PyCodeObject*, int>;
  struct key_hash {
    std::size_t operator()(const key& k) const noexcept
    {
      return std::hash<const void*>{}(k.first) ^ (static_cast<std::size_t>(k.second) * 0x9E3779B97F4A7C15U);
    }
  };
  // NOLINTNEXTLINE(cppcoreguidelines-owning-memory): never destroyed (object_cache)
  static auto* known = new object_cache<key, const char*, key_hash>{
    4096, [](const key& k) noexcept { return reinterpret_cast<PyObject*>(k.first); }};
  const key here{code, PyFrame_GetLasti(frame)};
  if (const char* const* found = known->find(here)) { return *found; }
  Py_ssize_t size = 0;
  const char* text = PyUnicode_AsUTF8AndSize(code->co_filename, &size);
  if (text == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  return known->remember(here,
                         activity::intern(fmt::format("{}:{}", std::string_view{text, static_cast<std::size_t>(size)},
                                                      PyFrame_GetLineNumber(frame))));
}

// intern_library(name) for a name library_of_file returned, looked up by the object (the classifier's
// cache keeps each name's object alive): no string is made per frame.
const char* interned(PyObject* library, const char* name)
{
  static auto* by_object = new std::unordered_map<PyObject*, const char*>;  // NOLINT: leaked, as above
  const auto [it, inserted] = by_object->try_emplace(library, nullptr);
  if (inserted) { it->second = intern_library(name); }
  return it->second;
}

// Where Python code is on this thread: the first frame of user code, the first library other than
// handoff that the walk out to it passes (the standard library included), and the last one that is
// not the standard library (the one user code called).
struct python_location {
  const char* where{nullptr};  // interned
  const char* innermost{nullptr};
  const char* outermost{nullptr};
};

// Holds the GIL, inside an error_scope: an error the walk leaves set is the scope's to drop.
python_location locate() noexcept
{
  python_location out;
  PyFrameObject* frame = PyEval_GetFrame();
  Py_XINCREF(frame);
  try {
    while (frame != nullptr) {
      PyCodeObject* code = PyFrame_GetCode(frame);
      PyObject* filename = code->co_filename;
      PyObject* library = library_of_file(filename);
      if (library == Py_None) {
        out.where = where_of(frame, code);
        Py_DECREF(code);
        break;
      }
      Py_DECREF(code);
      const char* name = PyUnicode_AsUTF8(library);
      if (name != nullptr && std::string_view{name} != "handoff") {
        const char* kept = interned(library, name);
        if (out.innermost == nullptr) { out.innermost = kept; }
        if (std::string_view{name} != "python") { out.outermost = kept; }
      }
      PyFrameObject* back = PyFrame_GetBack(frame);
      Py_DECREF(frame);
      frame = back;
    }
  } catch (const std::exception&) {
    out.where = nullptr;
  }
  Py_XDECREF(frame);
  return out;
}

// The location parked_location keeps for the thread while it runs without the GIL.
thread_local std::optional<python_location> parked;

// Fills `where` (the first frame of user code) and, for an export, the consumer (the library whose
// code asked for it, when it is not user code); for device activity, the library user code called.
// Only on a thread that holds the GIL (a release on a consumer's thread has no Python caller), or,
// for device activity, one that parked its location before letting the GIL go.
void annotate(trace::event& e) noexcept
{
  const bool activity = trace::is_activity(e.kind);
  if (Py_IsInitialized() == 0 || !holds_gil()) {
    if (activity && parked) {
      e.where = parked->where;
      if (e.library == nullptr) { e.library = parked->outermost; }
    }
    return;
  }
  const error_scope set_aside;  // a refused exchange is annotated while its error is set
  const python_location here = locate();
  e.where = here.where;
  if (activity) {
    if (e.library == nullptr) { e.library = here.outermost; }
  } else if (e.kind == trace::event_kind::export_data && e.consumer == nullptr && here.innermost != nullptr) {
    e.consumer = here.innermost;
  }
}

py::object name_or_none(const char* name)
{
  return name != nullptr ? py::object(py::str(name)) : py::object(py::none());
}

py::object device_tuple(DLDevice device)
{
  return py::make_tuple(static_cast<int>(device.device_type), device.device_id);
}

py::object stream_or_none(const std::optional<trace::stream_id>& stream)
{
  return stream ? py::object(py::int_(stream->handle)) : py::object(py::none());
}

py::object dtype_text(DLDataType dtype)
{
  try {
    return py::str(std::string{dtype_name(dtype)});
  } catch (const std::exception&) {
    return py::none();
  }
}

py::dict event_dict(const trace::event& e)
{
  py::dict out;
  trace::for_each_field(e, [&](const char* field, const auto& value) {
    using value_type = std::decay_t<decltype(value)>;
    py::object item;
    if constexpr (std::is_same_v<value_type, std::string_view>) {
      item = py::str(value.data(), value.size());
    } else if constexpr (std::is_same_v<value_type, const char*>) {
      item = name_or_none(value);
    } else if constexpr (std::is_integral_v<value_type>) {
      item = py::int_(value);
    } else if constexpr (std::is_same_v<value_type, std::optional<DLDevice>>) {
      item = value ? device_tuple(*value) : py::object(py::none());
    } else if constexpr (std::is_same_v<value_type, std::optional<std::span<const std::int64_t>>>) {
      if (value) {
        py::list shape;
        for (const auto extent : *value) { shape.append(extent); }
        item = shape;
      } else {
        item = py::none();
      }
    } else if constexpr (std::is_same_v<value_type, std::optional<DLDataType>>) {
      item = value ? dtype_text(*value) : py::object(py::none());
    } else if constexpr (std::is_same_v<value_type, std::optional<trace::stream_id>>) {
      item = stream_or_none(value);
    } else if constexpr (std::is_same_v<value_type, std::optional<std::int64_t>>) {
      item = value ? py::object(py::int_(*value)) : py::object(py::none());
    } else if constexpr (std::is_same_v<value_type, trace::optional_text>) {
      item = value.text.empty() ? py::object(py::none()) : py::object(py::str(value.text.data(), value.text.size()));
    } else if constexpr (std::is_same_v<value_type, std::span<const trace::buffer_ref>>) {
      py::list buffers;
      for (const trace::buffer_ref& b : value) {
        py::dict use;
        use["address"] = py::int_(b.address);
        use["nbytes"] = py::int_(b.nbytes);
        const std::string_view mode = trace::name(b.mode);
        use["access"] = py::str(mode.data(), mode.size());
        use["buffer"] =
          b.buffer != 0 ? py::object(py::str(fmt::format("buffer:{}", b.buffer))) : py::object(py::none());
        buffers.append(std::move(use));
      }
      item = buffers;
    } else {
      static_assert(std::is_same_v<value_type, std::optional<trace::node_ref>>, "a field type the dict lacks");
      item = value ? py::object(py::str(fmt::format("{}:{}", value->kind, value->id))) : py::object(py::none());
    }
    out[field] = std::move(item);
  });
  return out;
}

py::list event_list(const std::vector<trace::event>& events)
{
  py::list out;
  for (const trace::event& e : events) { out.append(event_dict(e)); }
  return out;
}

std::string stream_node_id(const stream_node& s)
{
  return fmt::format("stream:{}:{}:{:#x}", static_cast<int>(s.device.device_type), s.device.device_id, s.handle);
}

py::dict graph_dict()
{
  const ownership_graph graph = ownership_snapshot();
  py::list nodes;
  py::list edges;
  std::unordered_set<std::string> streams;
  const auto add_stream = [&](const stream_node& s, const std::string& buffer, const char* kind) {
    std::string id = stream_node_id(s);
    if (streams.insert(id).second) {
      py::dict node;
      node["id"] = id;
      node["kind"] = "stream";
      node["device"] = device_tuple(s.device);
      node["handle"] = s.handle;
      nodes.append(node);
    }
    py::dict edge;
    edge["src"] = buffer;
    edge["dst"] = id;
    edge["kind"] = kind;
    edges.append(edge);
  };
  for (const buffer_node& b : graph.buffers) {
    const std::string id = fmt::format("buffer:{}", b.id);
    py::dict node;
    node["id"] = id;
    node["kind"] = "buffer";
    node["library"] = name_or_none(b.library);
    node["device"] = b.device ? device_tuple(*b.device) : py::object(py::none());
    py::list shape;
    for (const auto extent : b.shape) { shape.append(extent); }
    node["shape"] = shape;
    node["dtype"] = b.dtype ? dtype_text(*b.dtype) : py::object(py::none());
    node["nbytes"] = b.nbytes;
    node["holders"] = b.holders;
    nodes.append(node);
    for (const auto& stream : b.ready_on) { add_stream(stream, id, "ready-on"); }
    for (const stream_node& after : b.released_after) { add_stream(after, id, "released-after"); }
  }
  for (const view_node& v : graph.views) {
    py::dict node;
    node["id"] = fmt::format("view:{}", v.id);
    node["kind"] = "view";
    node["holder"] = name_or_none(v.holder);
    nodes.append(node);
    py::dict edge;
    edge["src"] = fmt::format("view:{}", v.id);
    edge["dst"] = fmt::format("buffer:{}", v.buffer);
    edge["kind"] = "view-of";
    edges.append(edge);
  }
  py::dict out;
  out["nodes"] = nodes;
  out["edges"] = edges;
  return out;
}

}  // namespace

bool parked_location::park() noexcept
{
  if (Py_IsInitialized() == 0 || !holds_gil()) { return false; }
  try {
    const error_scope set_aside;
    parked = locate();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

void parked_location::unpark() noexcept
{
  parked.reset();
}

const char* producer_naming::library_of(PyObject* producer) noexcept
{
  if (as_array(producer) != nullptr) {  // handoff's own array: its producer's library
    const char* library = library_of_array(producer);
    return library != nullptr ? library : "handoff";
  }
  PyTypeObject* type = Py_TYPE(producer);
  last_type = type;
  last_library = library_of_type(type);
  return last_library;
}

void bind_trace(py::module_& m, exchange& on)
{
  trace::set_annotator(&annotate);
  m.def("_trace_begin", &trace::begin_session, py::arg("limit") = 0, py::arg("activity") = false,
        "Starts recording exchanges (the newest `limit` and older hazards; 0: all), and with `activity` the "
        "device's launches, copies, stream operations and host waits; returns the session's token.");
  m.def(
    "_watch_activity",
    [&on](bool watch) -> py::object {
      context* ctx = nullptr;
      try {
        ctx = &on.require_device("a launch trace");
      } catch (const device_error& e) {
        return py::str(e.backend() == "none" ? std::string{e.what()}
                                             : fmt::format("the {} backend cannot be used: {}", e.backend(), e.what()));
      }
      const std::string reason = without_gil([&] { return ctx->backend().watch_activity(watch); });
      return reason.empty() ? py::object(py::none()) : py::object(py::str(reason));
    },
    py::arg("watch"),
    "Starts (or stops) the backend's reports of device activity; None, or why it cannot report (no backend, "
    "no CUPTI, no driver).");
  m.def("_trace_dropped", &trace::session_dropped, py::arg("token"),
        "How many events an open bounded session no longer keeps.");
  m.def(
    "_trace_events", [](std::uint64_t token) { return event_list(trace::session_events(token)); }, py::arg("token"),
    "The events of an open session so far.");
  m.def(
    "_trace_end", [](std::uint64_t token) { return event_list(trace::end_session(token)); }, py::arg("token"),
    "Ends a session and returns its events.");
  m.def(
    "_trace_held",
    [](std::uint64_t token) {
      const std::vector<std::uint64_t> live = tracked_view_ids();
      const auto now =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
      return event_list(trace::held_events(trace::session_events(token), live, now));
    },
    py::arg("token"), "A `held` event for each view alive now that an exchange of the open session made.");
  m.def(
    "_set_library_of_file",
    [](py::function classify) {
      PyObject* previous = std::exchange(file_classifier, classify.release().ptr());
      Py_XDECREF(previous);
    },
    py::arg("classify"), "Registers handoff._trace.library_of_file, which names the library of a source file.");
  m.def("_ownership_graph", &graph_dict, "A snapshot of the ownership graph as a dict of nodes and edges.");
}

}  // namespace handoff::python
