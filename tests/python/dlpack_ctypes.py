"""DLPack's structs (dlpack.h) mirrored in ctypes, capsule inspection, and hand-made tensors whose
deleters count their calls: what the tests build and take apart DLPack exchanges with."""

from __future__ import annotations

import ctypes

# DLPack device types (dlpack.h).
CPU, CUDA, CUDA_HOST, OPENCL, VULKAN, METAL, VPI, ROCM, ROCM_HOST = 1, 2, 3, 4, 7, 8, 9, 10, 11
EXT_DEV, CUDA_MANAGED, ONEAPI, WEBGPU, HEXAGON, MAIA, TRN = 12, 13, 14, 15, 16, 17, 18

FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1
FLAG_IS_SUBBYTE_TYPE_PADDED = 1 << 2


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    pass


VERSIONED_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensorVersioned))
DLManagedTensorVersioned._fields_ = [
    ("version", DLPackVersion),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", VERSIONED_DELETER),
    ("flags", ctypes.c_uint64),
    ("dl_tensor", DLTensor),
]


class DLManagedTensor(ctypes.Structure):
    """The legacy (unversioned) managed tensor of "dltensor" capsules."""


LEGACY_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("dl_tensor", DLTensor),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", LEGACY_DELETER),
]

_api = ctypes.pythonapi
_api.PyCapsule_GetName.restype = ctypes.c_char_p
_api.PyCapsule_GetName.argtypes = [ctypes.py_object]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def capsule_name(capsule: object) -> str | None:
    name = _api.PyCapsule_GetName(capsule)
    return None if name is None else name.decode()


def versioned_tensor(capsule: object) -> DLManagedTensorVersioned:
    """The DLManagedTensorVersioned inside an unconsumed "dltensor_versioned" capsule."""
    address = _api.PyCapsule_GetPointer(capsule, b"dltensor_versioned")
    return DLManagedTensorVersioned.from_address(address)


def new_capsule(pointer: int, name: bytes | None, destructor: object = None) -> object:
    """A capsule; with no destructor, the test keeps what it points to alive."""
    return _api.PyCapsule_New(pointer, name, None if destructor is None else ctypes.cast(destructor, ctypes.c_void_p))


# The DLPack C exchange API's table (DLPack 1.2/1.3's DLPackExchangeAPI).
TENSOR_OUT = ctypes.POINTER(ctypes.POINTER(DLManagedTensorVersioned))
SET_ERROR = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p)
ALLOCATOR = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(DLTensor), TENSOR_OUT, ctypes.c_void_p, SET_ERROR)
FROM_PY_OBJECT = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, TENSOR_OUT)
TO_PY_OBJECT = ctypes.PYFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(DLManagedTensorVersioned), ctypes.POINTER(ctypes.c_void_p)
)
DLTENSOR_FROM_PY_OBJECT = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.POINTER(DLTensor))
CURRENT_WORK_STREAM = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))


class DLPackExchangeAPI(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("prev_api", ctypes.c_void_p),
        ("managed_tensor_allocator", ALLOCATOR),
        ("managed_tensor_from_py_object_no_sync", FROM_PY_OBJECT),
        ("managed_tensor_to_py_object_no_sync", TO_PY_OBJECT),
        ("dltensor_from_py_object_no_sync", DLTENSOR_FROM_PY_OBJECT),
        ("current_work_stream", CURRENT_WORK_STREAM),
    ]


def exchange_api_of(producer_type: type) -> DLPackExchangeAPI:
    """The table a type offers as `__dlpack_c_exchange_api__` (DLPack 1.3's capsule)."""
    capsule = producer_type.__dlpack_c_exchange_api__  # type: ignore[attr-defined]
    return DLPackExchangeAPI.from_address(_api.PyCapsule_GetPointer(capsule, b"dlpack_exchange_api"))


# A capsule destructor receives the capsule as a raw PyObject*: these take it so, unlike `_api`'s
# functions of the same names (indexing makes a new function object, whose types are its own).
CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_capsule_is_valid = ctypes.pythonapi["PyCapsule_IsValid"]
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]


# Each HandMadeTensor until its deleter has run: as a producer's manager_ctx keeps what its deleter
# needs, so that a release handoff defers to a consumer's stream may run after a test let go of it.
_ALIVE_UNTIL_DELETED: set[HandMadeTensor] = set()


class HandMadeTensor:
    """A DLPack managed tensor built in ctypes whose deleter counts its calls.

    Versioned ("dltensor_versioned") by default, legacy ("dltensor") with `legacy=True`. The fields
    are set by the test to produce tensors that handoff must accept or refuse; either way the
    deleter must run exactly once. `ndim` defaults to len(shape) and may be smaller (or negative);
    `strides` None leaves the pointer NULL. The tensor outlives its capsules, and stays alive until
    its deleter has run (its deleter is Python code this object owns).
    """

    def __init__(
        self,
        data: int | None,
        shape: tuple[int, ...],
        *,
        code: int = 2,
        bits: int = 32,
        lanes: int = 1,
        major: int = 1,
        minor: int = 1,
        flags: int = 0,
        null_shape: bool = False,
        ndim: int | None = None,
        strides: tuple[int, ...] | None = None,
        byte_offset: int = 0,
        device: tuple[int, int] = (CPU, 0),
        legacy: bool = False,
    ) -> None:
        self.deleted = 0
        _ALIVE_UNTIL_DELETED.add(self)
        self.legacy = legacy
        self.name = b"dltensor" if legacy else b"dltensor_versioned"
        self.shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * max(len(strides), 1))(*strides)
        if legacy:
            self.managed = DLManagedTensor()
            self.deleter = LEGACY_DELETER(self._delete)
        else:
            self.managed = DLManagedTensorVersioned()
            self.managed.version = DLPackVersion(major, minor)
            self.managed.flags = flags
            self.deleter = VERSIONED_DELETER(self._delete)
        self.managed.deleter = self.deleter
        self._destructor = CAPSULE_DESTRUCTOR(self._destroy_capsule)
        t = self.managed.dl_tensor
        t.data = data
        t.device = DLDevice(*device)
        t.ndim = len(shape) if ndim is None else ndim
        t.dtype = DLDataType(code, bits, lanes)
        no_pointer = ctypes.cast(None, ctypes.POINTER(ctypes.c_int64))
        t.shape = no_pointer if null_shape else self.shape
        t.strides = no_pointer if self.strides is None else self.strides
        t.byte_offset = byte_offset

    def _delete(self, _managed: object) -> None:
        self.deleted += 1
        _ALIVE_UNTIL_DELETED.discard(self)

    def _destroy_capsule(self, capsule: int) -> None:
        # What producers' capsule destructors do: delete the tensor unless a consumer took it.
        if _capsule_is_valid(capsule, self.name):
            self._delete(None)

    def capsule(self, *, destructor: bool = False) -> object:
        """A capsule of the tensor; with `destructor`, it deletes the tensor when dropped unconsumed,
        as a producer's capsule does. That destructor is Python code, which cannot run while an
        exception is being raised: keep such a capsule in a variable across calls that may raise."""
        return new_capsule(ctypes.addressof(self.managed), self.name, self._destructor if destructor else None)
