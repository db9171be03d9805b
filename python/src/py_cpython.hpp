// The few raw CPython idioms the bindings share, spelled once: Python's own rules for what counts
// as an int, reading one that may not fit, an attribute that may be missing, and what is remembered
// per Python object.
#pragma once

#include <pybind11/pybind11.h>
#include <handoff/detail/immovable.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <utility>

namespace handoff::python {

namespace py = pybind11;

/// True for an int that is no bool: a bool is an int to CPython, but never a count, a pointer or a
/// stream to handoff.
[[nodiscard]] inline bool is_int(PyObject* value) noexcept
{
  return PyLong_Check(value) && !PyBool_Check(value);
}

/// A Python int read as an int64: its value where it fits, else the side it overflows on.
struct int64_reading {
  std::int64_t value{0};
  int overflow{0};  ///< -1: below the int64 range, +1: above it, 0: `value` is exact

  [[nodiscard]] bool fits() const noexcept { return overflow == 0; }
  /// The value clamped to the int64 range.
  [[nodiscard]] std::int64_t saturated() const noexcept
  {
    return overflow > 0 ? INT64_MAX : overflow < 0 ? INT64_MIN : value;
  }
};

/// Reads `value`, an int (see is_int), whatever its size. Sets no Python error.
[[nodiscard]] inline int64_reading read_int64(PyObject* value) noexcept
{
  int overflow = 0;
  const long long read = PyLong_AsLongLongAndOverflow(value, &overflow);
  return {static_cast<std::int64_t>(read), overflow};
}

/// Sets the exception being raised, if any, aside while the scope runs code that may call Python (a
/// deleter, a release, a frame walk), and raises it again at the end: what the scope raised itself
/// is discarded. Holds the GIL's caller's error indicator only: make it with the GIL held.
class error_scope {
 public:
  error_scope() noexcept
  {
    if (PyErr_Occurred() != nullptr) { PyErr_Fetch(&type_, &value_, &traceback_); }
  }
  error_scope(const error_scope&) = delete;
  error_scope& operator=(const error_scope&) = delete;
  error_scope(error_scope&&) = delete;
  error_scope& operator=(error_scope&&) = delete;
  ~error_scope()
  {
    // What the scope's code left is dropped either way; the cheap checks first (the common case
    // is no error at all).
    if (type_ != nullptr || PyErr_Occurred() != nullptr) { PyErr_Restore(type_, value_, traceback_); }
  }

 private:
  PyObject* type_{nullptr};
  PyObject* value_{nullptr};
  PyObject* traceback_{nullptr};
};

/// getattr(object, name, <missing>): a null object when the attribute is missing. Only an
/// AttributeError means that; any other exception (a property that raises) propagates.
[[nodiscard]] inline py::object optional_attribute(py::handle object, PyObject* name)
{
  PyObject* value = nullptr;
#if PY_VERSION_HEX >= 0x030D0000
  if (PyObject_GetOptionalAttr(object.ptr(), name, &value) < 0) { throw py::error_already_set(); }
#else
  if (_PyObject_LookupAttr(object.ptr(), name, &value) < 0) { throw py::error_already_set(); }
#endif
  return py::reinterpret_steal<py::object>(value);
}

/// A reference a C++ frame owns while it calls Python code. A daemon thread that finalization ends
/// in that code (CPython's pthread_exit, the GIL already given up) unwinds through the frame: a
/// py::object would then drop its reference without the GIL; this one leaves it to the ending
/// process. Move-only.
class call_argument {
 public:
  call_argument() noexcept = default;
  explicit call_argument(py::object object) noexcept : object_(object.release().ptr()) {}
  call_argument(call_argument&& other) noexcept : object_(std::exchange(other.object_, nullptr)) {}
  call_argument& operator=(call_argument&&) = delete;
  call_argument(const call_argument&) = delete;
  call_argument& operator=(const call_argument&) = delete;
  ~call_argument();

  [[nodiscard]] py::handle get() const noexcept { return object_ != nullptr ? object_ : Py_None; }

 private:
  PyObject* object_{nullptr};
};

/// `text` as an interned Python string, for names looked up on every call (made once, kept for the
/// life of the process). @throws py::error_already_set when Python cannot make it.
[[nodiscard]] inline PyObject* interned(const char* text)
{
  PyObject* name = PyUnicode_InternFromString(text);
  if (name == nullptr) { throw py::error_already_set(); }
  return name;
}

/// A function of any calling convention as PyMethodDef stores it, a PyCFunction.
template <typename Function>
PyCFunction as_cfunction(Function* function) noexcept
{
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(function));
}

/// What is remembered per Python object (a type, a dtype, a code object and an offset in it): the
/// cache holds a reference to each object a key names, so that no other object is made at its
/// address while remembered, and forgets everything when `most` are remembered (a program may make
/// such objects as it goes). `object_of(key)` is the object a key names. Used with the GIL held,
/// which guards it; made once and never destroyed, as Python may be gone when the process exits.
template <class Key, class Value, class Hash = std::hash<Key>>
class object_cache : handoff::detail::immovable {
 public:
  using object_of_key = PyObject* (*)(const Key&) noexcept;

  object_cache(std::size_t most, object_of_key object_of) : most_{most}, object_of_{object_of} {}

  /// What `key` is remembered as, or nullptr.
  [[nodiscard]] Value* find(const Key& key)
  {
    // The key found last is compared first: callers ask for the same one many times in a row (each
    // launch of a loop from one line), and a hash table lookup costs several times more.
    if (last_ != nullptr && last_->first == key) { return &last_->second; }
    const auto found = known_.find(key);
    if (found == known_.end()) { return nullptr; }
    last_ = &*found;  // a node's address outlives rehashes; forget() drops it
    return &found->second;
  }

  /// Remembers `value` for `key` (not yet remembered), taking a reference to its object.
  Value& remember(const Key& key, Value value)
  {
    if (known_.size() >= most_) { forget(); }
    Value& kept = known_.emplace(key, std::move(value)).first->second;
    Py_INCREF(object_of_(key));
    return kept;
  }

  void forget() noexcept
  {
    last_ = nullptr;
    for (const auto& [key, _] : known_) { Py_DECREF(object_of_(key)); }
    known_.clear();
  }

 private:
  std::unordered_map<Key, Value, Hash> known_;
  typename std::unordered_map<Key, Value, Hash>::value_type* last_{nullptr};  // what find() found last
  std::size_t most_;
  object_of_key object_of_;
};

}  // namespace handoff::python
