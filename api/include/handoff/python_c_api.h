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
#define HANDOFF_PY_API_MINOR 3

/* Since minor 3, as a description's `stream`: the stream of the enclosing handoff.stream block (the
 * calling thread's or task's) for device memory, where the block's stream is on the data's device;
 * else unknown, as 0. */
#define HANDOFF_STREAM_ENCLOSING (-1)

/* Memory an extension describes: what handoff.view takes. */
typedef struct handoff_array_desc {
  void* data;
  int32_t ndim;
  const int64_t* shape;
  const int64_t* strides; /* in elements, as in DLPack; NULL: row-major */
  DLDataType dtype;
  DLDevice device;
  intptr_t stream; /* the native handle of the stream the data is ready on; 0: unknown;
                    * HANDOFF_STREAM_ENCLOSING: the enclosing handoff.stream block's */
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

/* Since minor 2. A view of imported or described data that an extension holds without a Python
 * object (what <handoff/pybind11.hpp>'s array holds): reference-counted, under the GIL. */
typedef struct handoff_view handoff_view;

/* Since minor 2. What an instance of a def_dlpack class holds: fills *out (its pointers valid until
 * the next call on the calling thread) and returns 0, or returns -1 with a Python error set. */
typedef int (*handoff_describe_fn)(PyObject* self, void* context, handoff_array_desc* out);

/* Since minor 2. What view_to_python returns a view as. */
typedef enum handoff_framework {
  HANDOFF_FRAMEWORK_HANDOFF = 0, /* a handoff.Array */
  HANDOFF_FRAMEWORK_NUMPY = 1,   /* numpy.ndarray */
  HANDOFF_FRAMEWORK_TORCH = 2,   /* torch.Tensor */
  HANDOFF_FRAMEWORK_JAX = 3,     /* jax.Array */
  HANDOFF_FRAMEWORK_CUPY = 4     /* cupy.ndarray */
} handoff_framework;

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
  /* Since minor 2: views without a Python object. */
  /* import_array's import as a view: 0 with *out a new view and *info its description (valid while the
   * view lives); 1, nothing set, when `object` speaks no array protocol; -1 with the Python error. */
  int (*import_view)(PyObject* object, PyObject* stream, handoff_view** out, handoff_array_info* info);
  /* view()'s view of `desc`'s memory, holding `owner` (may be NULL), as a new view; NULL with the error. */
  handoff_view* (*make_view)(const handoff_array_desc* desc, PyObject* owner, handoff_array_info* info);
  void (*retain_view)(handoff_view* view);
  void (*release_view)(handoff_view* view);
  /* The view as a `framework` array (handoff_framework), zero-copy, holding the view's data: through
   * the framework's from_dlpack, which orders device data for its current stream. A new reference. */
  PyObject* (*view_to_python)(handoff_view* view, int framework);
  /* Gives `type` __dlpack__, __dlpack_device__, __cuda_array_interface__ (CUDA memory only) and
   * __array_interface__ (CPU memory only), with handoff.Array's semantics, for the memory `describe`
   * says an instance holds (called with `context`, which `context_owner` keeps valid: it is held
   * as long as the methods; may be NULL). Exported data holds the instance. 0, or -1 with the error. */
  int (*def_dlpack)(PyObject* type, handoff_describe_fn describe, void* context, PyObject* context_owner);
} handoff_py_api;

/* NOLINTEND(modernize-use-using) */

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* HANDOFF_PYTHON_C_API_H */
