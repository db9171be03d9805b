/* The C functions the `handoff` Python module offers to extensions, as a capsule named
 * HANDOFF_PY_API_CAPSULE (the attribute `_C_API` of `handoff._handoff`), in the manner of NumPy's C
 * API. An extension built against these headers links nothing of handoff's and keeps working with
 * every handoff whose table has the same major version (later minors only append functions).
 * <handoff/pybind11.hpp> is the C++ face of this table; C extensions may call it directly. Every
 * function is called holding the GIL and returns NULL or -1 with a Python error set on failure. */
#ifndef HANDOFF_PYTHON_C_API_H
#define HANDOFF_PYTHON_C_API_H

#include <Python.h>

#include <handoff/dlpack.h>

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* NOLINTBEGIN(modernize-use-using): a C header. */

#define HANDOFF_PY_API_CAPSULE "handoff._handoff._C_API"
#define HANDOFF_PY_API_MAJOR 1
#define HANDOFF_PY_API_MINOR 1

/* Memory an extension describes: what handoff.view takes. */
typedef struct handoff_array_desc {
  void* data;
  int32_t ndim;
  const int64_t* shape;
  const int64_t* strides; /* in elements, as in DLPack; NULL: row-major */
  DLDataType dtype;
  DLDevice device;
  intptr_t stream; /* the native handle of the stream the data is ready on; 0: unknown */
  int32_t readonly;
} handoff_array_desc;

/* What a handoff.Array holds; the pointers stay valid while the array object lives. */
typedef struct handoff_array_info {
  void* data;
  int32_t ndim;
  const int64_t* shape;
  const int64_t* strides; /* in elements */
  DLDataType dtype;
  DLDevice device;
  intptr_t stream; /* the native handle of the stream the data is ready on (CUDA's legacy default
                    * stream: 1, cudaStreamLegacy); 0: none, unknown, or ROCm's default stream */
  int32_t readonly;
} handoff_array_info;

typedef struct handoff_py_api {
  uint32_t major;
  uint32_t minor;
  /* handoff.view(...): a new handoff.Array of `desc`'s memory, holding `owner` (may be NULL). */
  PyObject* (*view)(const handoff_array_desc* desc, PyObject* owner);
  /* handoff.Array.__dlpack__ of `array` with these arguments (each None, or as __dlpack__ takes
   * them), the capsule holding `instance` too. */
  PyObject* (*export_dlpack)(PyObject* instance, PyObject* array, PyObject* stream, PyObject* max_version,
                             PyObject* dl_device, PyObject* copy);
  /* handoff.asarray(object, stream=stream): `stream` None means the enclosing handoff.stream block,
   * else the device's default stream. */
  PyObject* (*asarray)(PyObject* object, PyObject* stream);
  /* Fills `out` from a handoff.Array; -1 with TypeError for anything else. */
  int (*describe)(PyObject* array, handoff_array_info* out);
  /* Since minor 1. handoff.asarray(object, stream=stream) into *out (a new reference): 0; 1, with no
   * Python error set, when `object` speaks no array protocol (it does not fit: a caller may try
   * something else); -1 with the Python error any other failure raised (the producer's own,
   * handoff.DeviceError, KeyboardInterrupt, MemoryError), which a caller must let propagate. */
  int (*import_array)(PyObject* object, PyObject* stream, PyObject** out);
} handoff_py_api;

/* NOLINTEND(modernize-use-using) */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* HANDOFF_PYTHON_C_API_H */
