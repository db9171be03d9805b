#include "py_owners.hpp"

#include "py_gil.hpp"

#include <array>

namespace handoff::python {
namespace {

void release_reference(PyObject* object) noexcept
{
  with_gil([object] { Py_DECREF(object); });
}

// The two ways a view keeps a Python object, named so that the garbage collector can find them (see
// visit_kept_python_objects). Types of this file alone: GCC then compares their type_info by address,
// where a type with external linkage pays a string compare on every miss (keeps_python_objects runs
// for each new handoff.Array).

// A producer's release that lets go of one reference to a Python object (python_owner's).
struct python_reference_release {
  PyObject* object;
  void operator()() const noexcept { release_reference(object); }
};

// What lets go of the one reference to a Python stream object that stream_keep_alive takes.
struct python_reference_deleter {
  void operator()(const void* object) const noexcept
  {
    release_reference(static_cast<PyObject*>(const_cast<void*>(object)));
  }
};

}  // namespace

std::shared_ptr<const void> stream_keep_alive(py::handle stream_object)
{
  if (stream_object.is_none() || PyLong_Check(stream_object.ptr()) != 0) { return {}; }
  PyObject* raw = stream_object.inc_ref().ptr();
  return std::shared_ptr<const void>{raw, python_reference_deleter{}};
}

void keep_alive_until_done(context& ctx, int device, device::stream_handle stream, py::handle object) noexcept
{
  PyObject* raw = object.inc_ref().ptr();
  ctx.release_after(device, stream, [raw]() noexcept { release_reference(raw); });
}

shared_producer python_owner(py::handle object)
{
  return shared_producer{python_reference_release{object.inc_ref().ptr()}};
}

int visit_kept_python_objects(const shared_producer& owner, visitproc visit, void* arg)
{
  if (const auto* release = owner.sole_release()) {
    if (const auto* reference = release->target<python_reference_release>()) { Py_VISIT(reference->object); }
  }
  // A stream object's keep-alive holds its one reference, and may be shared by several bindings:
  // visited once, and only when every copy of it is one of these bindings.
  struct kept_stream {
    const void* object{nullptr};
    long copies{0};
    long seen{0};
  };
  struct tally {
    std::array<kept_stream, 8> streams{};
    std::size_t count{0};
  } found;
  owner.visit_stream_owners(
    [](const std::shared_ptr<const void>& keep_alive, void* raw) {
      auto& t = *static_cast<tally*>(raw);
      if (std::get_deleter<python_reference_deleter>(keep_alive) == nullptr) { return; }
      for (std::size_t i = 0; i < t.count; ++i) {
        if (t.streams[i].object == keep_alive.get()) {
          ++t.streams[i].seen;
          return;
        }
      }
      if (t.count < t.streams.size()) { t.streams[t.count++] = {keep_alive.get(), keep_alive.use_count(), 1}; }
    },
    &found);
  for (std::size_t i = 0; i < found.count; ++i) {
    const kept_stream& s = found.streams[i];
    if (s.seen == s.copies) { Py_VISIT(static_cast<PyObject*>(const_cast<void*>(s.object))); }
  }
  return 0;
}

bool keeps_python_objects(const shared_producer& owner)
{
  // An object the collector cannot see into (a NumPy array, bytes) closes no cycle it could find.
  if (const auto* release = owner.sole_release(); release != nullptr) {
    if (const auto* reference = release->target<python_reference_release>();
        reference != nullptr && PyObject_IS_GC(reference->object) != 0) {
      return true;
    }
  }
  bool found = false;
  owner.visit_stream_owners(
    [](const std::shared_ptr<const void>& kept, void* raw) {
      *static_cast<bool*>(raw) |= std::get_deleter<python_reference_deleter>(kept) != nullptr;
    },
    &found);
  return found;
}

}  // namespace handoff::python
