"""Property-based fuzzing of the Python surface: forged DLPack capsules, `__array_interface__` and
`__cuda_array_interface__` dicts, and stream objects, against the contract's errors table.

Every run draws new cases (nothing is derandomized). A failure prints the falsifying example and a
`@reproduce_failure` line that replays it. HANDOFF_FUZZ_EXAMPLES scales the number of examples.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

import handoff

from dlpack_ctypes import (
    CPU,
    CUDA,
    CUDA_HOST,
    CUDA_MANAGED,
    FLAG_IS_COPIED,
    FLAG_IS_SUBBYTE_TYPE_PADDED,
    FLAG_READ_ONLY,
    OPENCL,
    ROCM,
    ROCM_HOST,
    VULKAN,
    HandMadeTensor,
    capsule_name,
)
from support import BACKEND, CUDA_ORDERING_REFUSED, DEFAULT_STREAM, DEVICE_COUNT, SIM, SIM_ROCM, needs_sim, settle_sim

if SIM:
    from handoff import sim
# The oracles of forged device memory know the simulator's allocations and the none backend; on
# CUDA the driver answers for forged pointers and releases wait for real streams.
not_on_cuda = pytest.mark.skipif(BACKEND == "cuda", reason="the oracle models the sim and none backends only")

# The device type of the active backend's memory (CUDA where none is active) and its default stream.
DEVICE_MEMORY = ROCM if SIM_ROCM else CUDA
HOST_MEMORY = ROCM_HOST if SIM_ROCM else CUDA_HOST
CUDA_LIKE = (CUDA, CUDA_HOST, CUDA_MANAGED)
ROCM_LIKE = (ROCM, ROCM_HOST)
INVALID_HANDLE = "hipErrorInvalidHandle" if SIM_ROCM else "cudaErrorInvalidResourceHandle"

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
UINT64_MAX = 2**64 - 1

settings.register_profile(
    "handoff-fuzz",
    max_examples=int(os.environ.get("HANDOFF_FUZZ_EXAMPLES", "300")),
    deadline=None,  # a full garbage collection can take a tenth of a second once PyTorch is loaded
    database=None,  # nothing written into the source tree; the printed blob replays a failure
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
FUZZ = settings.get_profile("handoff-fuzz")

# Every dtype handoff names, by DLPack (code, bits), lanes 1.
DTYPE_NAMES = {
    (6, 8): "bool", (0, 8): "int8", (0, 16): "int16", (0, 32): "int32", (0, 64): "int64",
    (1, 8): "uint8", (1, 16): "uint16", (1, 32): "uint32", (1, 64): "uint64",
    (2, 16): "float16", (2, 32): "float32", (2, 64): "float64", (4, 16): "bfloat16",
    (5, 32): "complex32", (5, 64): "complex64", (5, 128): "complex128",
    (7, 8): "float8_e3m4", (8, 8): "float8_e4m3", (9, 8): "float8_e4m3b11fnuz", (10, 8): "float8_e4m3fn",
    (11, 8): "float8_e4m3fnuz", (12, 8): "float8_e5m2", (13, 8): "float8_e5m2fnuz", (14, 8): "float8_e8m0fnu",
    (15, 6): "float6_e2m3fn", (16, 6): "float6_e3m2fn", (17, 4): "float4_e2m1fn",
}  # fmt: skip

# Host memory that forged tensors and interfaces may point into. Nothing here reads through a
# pointer unless the layout is known to lie inside its memory.
HOST = np.zeros(1 << 14, dtype=np.uint8)


class StreamFault(Exception):
    """Raised by stream objects' properties: user code's own errors propagate unchanged."""


# --- shared oracle ---------------------------------------------------------------------------


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements, an extent of 0 counting as 1 (as NumPy does)."""
    strides, step = [], 1
    for extent in reversed(shape):
        strides.append(step)
        step *= max(extent, 1)
    return tuple(reversed(strides))


def is_c_contiguous(shape, strides) -> bool:
    """Row-major, ignoring axes of extent 1 (they never move); empty arrays are contiguous."""
    if 0 in shape:
        return True
    return all(n == 1 or s == e for n, s, e in zip(shape, strides, contiguous_strides(shape)))


def byte_span(shape, strides, itemsize) -> tuple[int, int]:
    """[low, high): the bytes a non-empty layout touches, relative to its data pointer (exact)."""
    reaches = [(n - 1) * s for n, s in zip(shape, strides)]
    low = sum(r for r in reaches if r < 0)
    high = sum(r for r in reaches if r > 0)
    return low * itemsize, high * itemsize + itemsize


def layout_refusals(shape, strides, itemsize, data) -> tuple[set, set]:
    """What the checks every array gets imply: (errors that must be raised, errors that may be)."""
    if any(n < 0 for n in shape):
        return {ValueError}, set()
    elements = math.prod(shape)
    nonzero = math.prod(n for n in shape if n)
    if elements > INT64_MAX or elements * itemsize > INT64_MAX:
        return {ValueError}, set()
    # An element count that is 0 only thanks to a zero extent after an overflowing partial product
    # may be refused (NumPy refuses it as well).
    maybe = {ValueError} if elements == 0 and nonzero * itemsize > INT64_MAX else set()
    if elements == 0:
        return set(), maybe
    if not data:
        return {ValueError}, maybe
    low, high = byte_span(shape, strides, itemsize)
    if low < INT64_MIN or high > INT64_MAX:
        return {ValueError}, maybe
    return set(), maybe


def check_outcome(outcome, must: set, may: set) -> None:
    """`outcome` (an exception type, or None for success) agrees with what the input implies."""
    if must:
        assert outcome in must | may, f"expected one of {sorted(t.__name__ for t in must)}, got {outcome}"
    else:
        assert outcome is None or outcome in may, f"a valid input was refused with {outcome.__name__}"


def settle() -> None:
    """Lets deferred releases run: stream-ordered releases wait for their stream."""
    if SIM:
        settle_sim()
    else:
        gc.collect()


class Gauge:
    """The live producers (and sim allocations) when made; `assert_unchanged` after the example."""

    def __init__(self) -> None:
        self.views = handoff.stats()["live_views"]
        self.allocations = sim.live_allocations() if SIM else 0

    def assert_unchanged(self) -> None:
        if handoff.stats()["live_views"] != self.views or (SIM and sim.live_allocations() != self.allocations):
            settle()
        assert handoff.stats()["live_views"] == self.views, "a producer was leaked"
        if SIM:
            assert sim.live_allocations() == self.allocations, "a device allocation was leaked"


def attempt(call, *allowed):
    """(result, None) or (None, type of the allowed exception raised). Others propagate."""
    try:
        return call(), None
    except allowed as error:
        return None, type(error)


def device_error_name(call) -> str:
    """The backend's error name of the DeviceError that `call` raises."""
    with pytest.raises(handoff.DeviceError) as caught:
        call()
    return caught.value.error_name


# --- forged DLPack capsules ------------------------------------------------------------------

small_extent = st.integers(0, 4)
odd_extent = st.sampled_from([-1, -2, INT64_MIN, 2**31, 2**32 + 1, 2**40, 2**62, INT64_MAX]) | st.integers(
    INT64_MIN, INT64_MAX
)
small_stride = st.integers(-6, 8)
odd_stride = st.sampled_from([0, INT64_MIN, INT64_MAX, 2**62, -(2**62), 2**61 + 3]) | st.integers(INT64_MIN, INT64_MAX)


def mostly(draw, usual, unusual, odds=8):
    """Draws from `usual` `odds` times in ten; shrinks towards it."""
    return draw(usual) if draw(st.integers(0, 9)) < odds else draw(unusual)


@st.composite
def forged_tensors(draw) -> dict:
    legacy = draw(st.integers(0, 3)) == 0
    shape_kind = draw(st.sampled_from(["small", "small", "small", "large", "negative", "null"]))
    if shape_kind == "large":
        ndim = draw(st.integers(9, 300))
        shape = [mostly(draw, st.just(1), small_extent | odd_extent, 9) for _ in range(ndim)]
    elif shape_kind == "negative":
        ndim = draw(st.integers(INT64_MIN >> 32, -1))
        shape = []
    else:
        ndim = draw(st.integers(0 if shape_kind == "small" else 1, 8))
        shape = [mostly(draw, small_extent, odd_extent) for _ in range(ndim)]
    strides = None
    if ndim > 0 and draw(st.booleans()):
        strides = [mostly(draw, small_stride, odd_stride) for _ in range(ndim)]
    if draw(st.integers(0, 9)) < 8:
        code, bits = draw(st.sampled_from(sorted(DTYPE_NAMES)))
        lanes = 1
    else:
        code, bits = draw(st.integers(0, 255)), draw(st.integers(0, 255))
        lanes = draw(st.sampled_from([1, 1, 0, 2, 4, 65535]))
    flags = 0
    if draw(st.booleans()):
        flags = draw(st.sampled_from([FLAG_READ_ONLY, FLAG_IS_COPIED, FLAG_IS_SUBBYTE_TYPE_PADDED, 1 << 63]))
        flags |= draw(st.integers(0, 7))
    if bits < 8 and draw(st.booleans()):
        flags |= FLAG_IS_SUBBYTE_TYPE_PADDED
    major = mostly(draw, st.just(1), st.sampled_from([0, 2, 3, 2**32 - 1]))
    minor = mostly(draw, st.integers(0, 3), st.integers(0, 2**32 - 1))
    byte_offset = mostly(draw, st.just(0), st.integers(0, 64) | st.integers(0, UINT64_MAX), 7)
    device_kind = draw(st.sampled_from(["cpu", "cpu", "backend", "backend", "other", "unknown"]))
    if device_kind == "cpu":
        device = (CPU, 0)
    elif device_kind == "backend":
        device = (draw(st.sampled_from([DEVICE_MEMORY, DEVICE_MEMORY, HOST_MEMORY, CUDA_MANAGED])),
                  draw(st.integers(0, 2)))  # fmt: skip
    elif device_kind == "other":
        device = (draw(st.sampled_from([CPU, CUDA, CUDA_HOST, OPENCL, VULKAN, ROCM, ROCM_HOST, 13, 18])),
                  draw(st.integers(-1, 3)))  # fmt: skip
    else:
        device = (draw(st.sampled_from([0, 5, 6, 19, 99, -1, 2**31 - 1, -(2**31)])),
                  draw(st.sampled_from([0, -1, 2**31 - 1])))  # fmt: skip
    data_kinds = ["host", "host", "null", "garbage"] + (["sim", "sim", "sim"] if SIM else [])
    return {
        "legacy": legacy,
        "shape": tuple(shape),
        "ndim": ndim,
        "null_shape": shape_kind == "null",
        "strides": None if strides is None else tuple(strides),
        "code": code,
        "bits": bits,
        "lanes": lanes,
        "flags": flags,
        "major": major,
        "minor": minor,
        "byte_offset": byte_offset,
        "device": device,
        "data": draw(st.sampled_from(data_kinds)),
        "garbage": draw(st.integers(1, UINT64_MAX)),
        "sim_device": draw(st.integers(0, max(DEVICE_COUNT, 1) - 1)),
        "stream": draw(st.sampled_from([None, None, None, -1, DEFAULT_STREAM])),
        "entry": draw(st.sampled_from(["from_dlpack", "asarray"])),
        "copy": draw(st.sampled_from([None, None, True])),
        # Now and then an argument handoff refuses before it reads the capsule.
        "bad_argument": mostly(draw, st.none(), st.sampled_from(BAD_ARGUMENTS), 9),
    }


# (keyword, value, error): arguments refused before the capsule is read.
BAD_ARGUMENTS = [("stream", 1.5, TypeError), ("stream", True, TypeError), ("stream", 2**64, ValueError),
                 ("stream", object(), TypeError), ("copy", 1, TypeError), ("device", "gpu", ValueError),
                 ("device", (CPU, -1), ValueError)]  # fmt: skip


class Backing:
    """The memory a forged tensor points at: host memory, a sim allocation, null or garbage."""

    SIM_ELEMENTS = 256

    def __init__(self, kind: str, garbage: int, sim_device: int) -> None:
        self.kind = kind
        self.array = sim.zeros(self.SIM_ELEMENTS, "float32", sim_device) if kind == "sim" else None
        self.device = sim_device if kind == "sim" else None
        if kind == "host":
            self.address, self.size = HOST.ctypes.data, HOST.nbytes
        elif kind == "sim":
            self.address, self.size = self.array.data_ptr, self.array.nbytes
        else:
            self.address, self.size = (0 if kind == "null" else garbage), 0

    def holds(self, pointer: int) -> bool:
        return self.size > 0 and self.address <= pointer < self.address + self.size

    def holds_span(self, pointer: int, shape, strides, itemsize) -> bool:
        if math.prod(shape) == 0:
            return True
        low, high = byte_span(shape, strides, itemsize)
        return self.size > 0 and self.address <= pointer + low and pointer + high <= self.address + self.size


def stream_ordered_here(device_type: int) -> bool:
    """Whether the active backend orders memory of this device type (and looks its pointers up)."""
    return SIM and device_type in (ROCM_LIKE if SIM_ROCM else CUDA_LIKE)


# The device types DLPack defines (dlpack.h): 5 and 6 are not among them.
DLPACK_DEVICE_TYPES = frozenset({1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18})


def capsule_refusals(spec: dict, backing: Backing) -> tuple[set, set]:
    """The errors a forged tensor must (and may) be refused with, from the DLPack spec and the contract."""
    must, may = set(), set()
    if not spec["legacy"] and spec["major"] != 1:
        must.add(BufferError)  # another major version: nothing past the deleter may be read
        return must, may
    if spec["bits"] < 8 and (spec["legacy"] or not spec["flags"] & FLAG_IS_SUBBYTE_TYPE_PADDED):
        must.add(BufferError)
    if spec["ndim"] < 0 or (spec["ndim"] > 0 and spec["null_shape"]):
        must.add(ValueError)
        return must, may
    if spec["device"][0] not in DLPACK_DEVICE_TYPES or spec["device"][1] < 0:
        must.add(ValueError)  # a device type DLPack does not define, or a negative device id
        return must, may
    if spec["lanes"] != 1 or (spec["code"], spec["bits"]) not in DTYPE_NAMES:
        must.add(BufferError)
        return must, may
    shape = spec["shape"][: spec["ndim"]]
    strides = spec["strides"] or contiguous_strides(shape)
    pointer = effective_pointer(spec, backing)
    layout_must, layout_may = layout_refusals(shape, strides, itemsize_of(spec), pointer)
    must |= layout_must
    may |= layout_may
    device_type, device_id = spec["device"]
    family = device_type in (*CUDA_LIKE, *ROCM_LIKE)
    if family and table(spec["stream"], device_type) is ValueError:
        must.add(ValueError)  # a stream value that is invalid for the device of the data
        if SIM and not stream_ordered_here(device_type):
            may.add(handoff.DeviceError)
    elif SIM and family:
        # Every import of a device family's data is admitted, ordered or not: the family must be the
        # backend's; device memory must be the backend's, on the device claimed, and every byte the
        # view reaches inside one allocation; with no data, the claimed device must exist.
        if not stream_ordered_here(device_type):
            must.add(handoff.DeviceError)
        elif not pointer:
            if not 0 <= device_id < DEVICE_COUNT:
                must.add(ValueError)
        else:
            foreign = device_type in (CUDA, ROCM) and not (backing.holds(pointer) and backing.device == device_id)
            # The host reads memory claimed pinned or managed: device memory under that claim is refused.
            host_read = (
                device_type in (CUDA_HOST, CUDA_MANAGED, ROCM_HOST) and backing.kind == "sim" and backing.holds(pointer)
            )
            spans = backing.kind == "sim" and backing.holds_span(pointer, shape, strides, itemsize_of(spec))
            if foreign or host_read or (math.prod(shape) != 0 and not spans):
                must.add(ValueError)
    elif CUDA_ORDERING_REFUSED and device_type in CUDA_LIKE and spec["stream"] != -1 and not must:
        must.add(handoff.DeviceError)  # nothing can order it, and it is not exchanged unordered
    return must, may


def itemsize_of(spec: dict) -> int:
    return (spec["bits"] * spec["lanes"] + 7) // 8


def effective_pointer(spec: dict, backing: Backing) -> int:
    """data + byte_offset, as a 64-bit address (a null data pointer stays null)."""
    return 0 if backing.address == 0 else (backing.address + spec["byte_offset"]) % 2**64


# The parts of a forged tensor's description that HandMadeTensor takes as they are.
TENSOR_FIELDS = ("ndim", "null_shape", "strides", "code", "bits", "lanes", "flags", "major", "minor", "byte_offset",
                 "device", "legacy")  # fmt: skip


def build_tensor(spec: dict, backing: Backing) -> HandMadeTensor:
    return HandMadeTensor(backing.address or None, spec["shape"], **{field: spec[field] for field in TENSOR_FIELDS})


def assert_view_matches(view: handoff.Array, spec: dict, backing: Backing, copied: bool) -> None:
    shape = spec["shape"][: spec["ndim"]]
    item = itemsize_of(spec)
    assert view.shape == shape
    assert view.ndim == len(shape)
    assert view.dtype == DTYPE_NAMES[spec["code"], spec["bits"]]
    assert view.size == math.prod(shape)
    assert view.nbytes == math.prod(shape) * item
    # A copy of host data is plain CPU memory; a device copy stays on the device.
    assert view.device == ((CPU, 0) if spec["device"][0] == CPU else spec["device"])  # DLPack numbers the CPU 0
    assert view.__dlpack_device__() == view.device
    assert isinstance(repr(view), str)
    if copied:
        # A copy is compact; an empty array's strides, and those of axes of extent 1, are arbitrary.
        expected = contiguous_strides(shape)
        assert view.size == 0 or all(n == 1 or s == e * item for n, s, e in zip(shape, view.strides, expected))
        assert not view.readonly
        return
    if spec["strides"] is not None:
        assert view.strides == tuple(s * item for s in spec["strides"][: spec["ndim"]])
    elif view.size > 0:  # an empty array's implied strides are arbitrary
        assert view.strides == tuple(s * item for s in contiguous_strides(shape))
    assert view.data_ptr == effective_pointer(spec, backing)
    assert view.readonly == bool(not spec["legacy"] and spec["flags"] & FLAG_READ_ONLY)


def assert_reexport_matches(view: handoff.Array) -> None:
    """A view passes on through DLPack as itself (or is refused with a contract error)."""
    capsule, refused = attempt(lambda: view.__dlpack__(max_version=(1, 1)), BufferError, ValueError,
                               handoff.DeviceError)  # fmt: skip
    if refused is handoff.DeviceError:
        assert not stream_ordered_here(view.device[0]) and view.device[0] in (*CUDA_LIKE, *ROCM_LIKE)
        return
    assert refused is None or view.device[0] != CPU, f"a CPU view could not be exported ({refused})"
    if capsule is None:
        return
    again = handoff.from_dlpack(capsule)
    assert capsule_name(capsule) == "used_dltensor_versioned"
    assert (again.shape, again.strides, again.dtype, again.device, again.data_ptr) == (
        view.shape, view.strides, view.dtype, view.device, view.data_ptr)  # fmt: skip


def copy_allowed(spec: dict, backing: Backing, must: set) -> bool:
    """Whether the test may ask for a copy, which reads the data: only of a valid layout that lies
    inside the memory of its device, and not too large (a zero stride may broadcast to terabytes)."""
    shape = spec["shape"][: spec["ndim"]]
    strides = spec["strides"] or contiguous_strides(shape)
    on_its_device = (backing.kind == "host" and spec["device"][0] == CPU) or (
        backing.kind == "sim" and spec["device"] == (DEVICE_MEMORY, backing.device))  # fmt: skip
    return (on_its_device and not must and math.prod(shape) * itemsize_of(spec) <= 1 << 20
            and backing.holds_span(effective_pointer(spec, backing), shape, strides, itemsize_of(spec)))  # fmt: skip


@not_on_cuda
@FUZZ
@given(spec=forged_tensors())
def test_forged_capsules_are_imported_as_described_or_refused_cleanly(spec):
    gauge = Gauge()
    backing = Backing(spec["data"], spec["garbage"], spec["sim_device"])
    must, may = capsule_refusals(spec, backing)
    copy = spec["copy"] if copy_allowed(spec, backing, must) else None
    shape = spec["shape"][: max(spec["ndim"], 0)]
    if copy and spec["device"][0] != CPU and not is_c_contiguous(shape, spec["strides"] or contiguous_strides(shape)):
        must.add(BufferError)  # a device copy of strided data is made on the host only
    arguments = {"stream": spec["stream"], "copy": copy}
    if spec["bad_argument"] is not None:
        keyword, value, error = spec["bad_argument"]
        arguments[keyword] = value
        must, may = {error}, set()
    tensor = build_tensor(spec, backing)
    capsule = tensor.capsule(destructor=True)
    entry = handoff.from_dlpack if spec["entry"] == "from_dlpack" else handoff.asarray
    note(f"must={must} may={may} copy={copy} pointer={effective_pointer(spec, backing):#x}")
    view, refused = attempt(
        lambda: entry(capsule, **arguments), BufferError, ValueError, TypeError, handoff.DeviceError
    )
    check_outcome(refused, must, may)
    # handoff owns the tensor once it reads the capsule, which it does once its arguments are valid.
    consumed = capsule_name(capsule) == "used_" + tensor.name.decode()
    assert consumed == (spec["bad_argument"] is None)
    if view is not None:
        assert_view_matches(view, spec, backing, copied=copy is True)
        if copy is None:
            assert tensor.deleted == 0, "the producer was released while a view uses it"
            assert_reexport_matches(view)
        del view
    if not consumed:
        assert tensor.deleted == 0, "a capsule handoff did not take was deleted"
    del capsule  # its destructor deletes the tensor unless handoff took it
    if tensor.deleted != 1:
        settle()
    assert tensor.deleted == 1, f"the deleter ran {tensor.deleted} times"
    del backing
    gauge.assert_unchanged()


# --- __array_interface__ and __cuda_array_interface__ ----------------------------------------


class ArrayInterface:
    def __init__(self, interface: dict) -> None:
        self.__array_interface__ = interface


class BufferWithArrayInterface(bytearray):
    """Exports its own buffer, which an interface without 'data' describes."""


class CudaArrayInterface:
    def __init__(self, interface: dict) -> None:
        self.__cuda_array_interface__ = interface


MISSING = object()  # a key left out of the dict
EITHER = "either"  # a part of an input that handoff may take or refuse

# Typestrs handoff must take: (typestr, dtype name, itemsize).
VALID_TYPESTRS = [("|b1", "bool", 1), ("|i1", "int8", 1), ("<i2", "int16", 2), ("<i4", "int32", 4),
                  ("<i8", "int64", 8), ("|u1", "uint8", 1), ("<u8", "uint64", 8), ("<f2", "float16", 2),
                  ("<f4", "float32", 4), ("=f8", "float64", 8), ("<c8", "complex64", 8), (">u1", "uint8", 1),
                  ("<c16", "complex128", 16)]  # fmt: skip
UNEXCHANGEABLE_TYPESTRS = [">f4", ">i8", "|O8", "<U4", "|V8", "<M8", "<m8", "|S4", "<f3", "<i16"]
MALFORMED_TYPESTRS = ["f4", "<f", "", "<f-4", "xf4", "<f4x", "<f0", b"<f4", 4, None, MISSING]


@st.composite
def component(draw, valid, *wrong):
    """(value, verdict) of one part of an input: verdict None when valid, else the exception type the
    part must cause, or EITHER. `wrong` holds (strategy, verdict) pairs; draws shrink towards valid."""
    choice = draw(st.integers(0, 5 + len(wrong)))
    if choice < 6:
        return draw(valid), None
    strategy, verdict = wrong[choice - 6]
    return draw(strategy), verdict


def all_ints(value) -> bool:
    return isinstance(value, tuple) and all(type(n) is int for n in value)


@st.composite
def interface_dicts(draw, cuda: bool, pointers) -> tuple[dict, list, dict]:
    """An interface dict, the verdicts of its parts, and what it describes when they are valid.

    Extents and strides of any size are valid parts: whether their combination overflows or leaves
    the memory is for the layout oracle to say."""
    ndim = draw(st.integers(0, 4))
    verdicts = []

    def part(key, strategy):
        value, verdict = draw(strategy)
        verdicts.append((key, verdict))
        return value

    extent = mostly(draw, small_extent, odd_extent.filter(lambda n: n >= 0))
    shape = part("shape", component(
        st.tuples(*[small_extent | st.just(extent)] * ndim),
        (st.sampled_from([(-1,), (3, -2), (2, INT64_MIN)]), ValueError),
        (st.sampled_from([[2, 3], 2, "2", (2, "3"), (2.0,), (True,), None, (2**64,), MISSING]), ValueError),
    ))  # fmt: skip
    typestr, name, item = draw(st.sampled_from(VALID_TYPESTRS))
    typestr = part("typestr", component(
        st.just(typestr),
        (st.sampled_from(MALFORMED_TYPESTRS), ValueError),
        (st.sampled_from(UNEXCHANGEABLE_TYPESTRS), BufferError),
        (st.just("<f99999999999999999999"), EITHER),
    ))  # fmt: skip
    extents = shape if all_ints(shape) else ()
    strides = part("strides", component(
        st.just(MISSING) | st.just(None) | st.tuples(*[(small_stride | odd_stride).map(lambda s: s * item)
                                                       | small_stride | odd_stride] * len(extents)),
        (st.sampled_from([[item] * len(extents), (item,) * (len(extents) + 1), (1.5,) * len(extents), "8"]),
         ValueError),
    ))  # fmt: skip
    if isinstance(strides, tuple) and len(strides) == len(extents):
        in_range = all_ints(strides) and all(INT64_MIN <= s <= INT64_MAX for s in strides)
        verdicts[-1] = ("strides", None if in_range else ValueError)
    data, data_verdict, pointer = draw(pointers)
    verdicts.append(("data", data_verdict))
    version = part("version", component(
        st.sampled_from([0, 1, 2, 3]) if cuda else st.just(3) | st.just(MISSING),
        (st.sampled_from([4, -1, 2**70, "3", 3.0, None, True] + ([MISSING] if cuda else [0, 1, 2])), ValueError),
    ))  # fmt: skip
    interface = {"shape": shape, "typestr": typestr, "strides": strides, "data": data, "version": version}
    if draw(st.integers(0, 9)) == 0:
        interface["mask"] = draw(st.sampled_from([None, MISSING, HOST[:4]]))
        if interface["mask"] is not None and interface["mask"] is not MISSING:
            verdicts.append(("mask", NotImplementedError))
    if draw(st.booleans()):  # ignored by every consumer that knows the typestr
        interface["descr"] = draw(st.sampled_from([[("", typestr)], [], None, "garbage", [(1, 2, 3)]]))
    for key in [k for k, v in interface.items() if v is MISSING]:
        del interface[key]
    described = {"shape": extents, "item": item, "name": name, "pointer": pointer,
                 "strides": strides if all_ints(strides) and len(strides) == len(extents) else None}  # fmt: skip
    return interface, verdicts, described


def verdict_sets(verdicts) -> tuple[set, set]:
    """(errors some part requires, errors allowed because some part may go either way)."""
    must = {v for _, v in verdicts if isinstance(v, type)}
    either = any(v == EITHER for _, v in verdicts)
    return must, ({ValueError, BufferError, NotImplementedError} if either else set())


def layout_parts_valid(verdicts) -> bool:
    """Whether shape, typestr and strides are each valid, so that the layout oracle applies. Which of
    several refusals handoff reports first is its choice: the oracle accepts any of them."""
    return all(v is None for k, v in verdicts if k in ("shape", "typestr", "strides"))


def interface_layout_refusals(described: dict, buffer_size: int | None = None, offset: int = 0) -> tuple[set, set]:
    """The layout checks of an interface whose parts are all valid (strides in bytes)."""
    shape, item = described["shape"], described["item"]
    strides = contiguous_strides(shape)
    if described["strides"] is not None:
        # DLPack counts strides in elements: a stride that is no multiple of the item size is
        # representable only on an axis of extent 1, which never moves (it is made contiguous).
        if any(s % item and n != 1 for s, n in zip(described["strides"], shape)):
            return {BufferError}, set()
        strides = tuple(s // item if s % item == 0 else c for s, c in zip(described["strides"], strides))
    must, may = layout_refusals(shape, strides, item, 1 if described["pointer"] is None else described["pointer"])
    if buffer_size is not None and not must and math.prod(shape) > 0:
        low, high = byte_span(shape, strides, item)
        if offset + low < 0 or offset + high > buffer_size:
            must.add(ValueError)
    return must, may


def assert_interface_view(view: handoff.Array, described: dict, device: tuple[int, int]) -> None:
    shape, item = described["shape"], described["item"]
    assert view.shape == shape
    assert view.dtype == described["name"]
    assert view.device == device
    if described["pointer"] is not None:
        assert view.data_ptr == described["pointer"]
    expected = described["strides"] or tuple(s * item for s in contiguous_strides(shape))
    for axis, extent in enumerate(shape):
        if extent != 1:
            assert view.strides[axis] == expected[axis], f"strides {view.strides} != {expected}"


# 'data' values neither interface takes: no (pointer, readonly) pair of an int and a bool.
MALFORMED_DATA = [(HOST.ctypes.data,), (HOST.ctypes.data, 0), (-8, False), (2**64, False), [HOST.ctypes.data, False],
                  5, (float(HOST.ctypes.data), False)]  # fmt: skip


@st.composite
def host_pointers(draw):
    """(data, verdict, pointer described): '(pointer, readonly)' tuples, buffers, malformed values.
    The pointer of a buffer is filled in by the test (None: the holder's own buffer)."""
    kind = draw(st.sampled_from(["host", "host", "garbage", "null", "buffer", "own-buffer", "malformed"]))
    readonly = draw(st.booleans())
    if kind == "host":
        return (HOST.ctypes.data, readonly), None, HOST.ctypes.data
    if kind == "garbage":
        pointer = draw(st.integers(1, INT64_MAX))
        return (pointer, readonly), None, pointer
    if kind == "null":
        return (0, readonly), None, 0
    if kind == "buffer":
        return bytearray(draw(st.integers(0, 96))), None, None
    if kind == "own-buffer":
        return draw(st.sampled_from([MISSING, None])), None, None
    return draw(st.sampled_from([*MALFORMED_DATA, (HOST.ctypes.data, False, 0), "data"])), ValueError, 0


def buffer_address(buffer: bytearray) -> int | None:
    """Where a bytearray's buffer starts; None when empty (no element will be read through it)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer)) if len(buffer) else None


@FUZZ
@given(case=interface_dicts(cuda=False, pointers=host_pointers()), own_size=st.integers(0, 96),
       offset=st.sampled_from([MISSING, MISSING, 0, 4, 16, -4, 2**70, "4", None]))  # fmt: skip
def test_array_interface_dicts_are_imported_as_described_or_refused_cleanly(case, own_size, offset):
    interface, verdicts, described = case
    gauge = Gauge()
    if offset is not MISSING:
        interface["offset"] = offset  # read only when the data is a buffer
    data = interface.get("data")
    holder = ArrayInterface(interface)
    buffer = data if isinstance(data, bytearray) else None
    if data is None:  # no data: the holder's own buffer
        holder = buffer = BufferWithArrayInterface(own_size)
        holder.__array_interface__ = interface
    must, may = verdict_sets(verdicts)
    start = 0 if offset is MISSING else offset
    if buffer is not None:
        if type(start) is not int or not 0 <= start <= len(buffer):
            must.add(ValueError)
            buffer_size = None
        else:
            buffer_size = len(buffer)
            if len(buffer) > start:
                described["pointer"] = buffer_address(buffer) + start
    if layout_parts_valid(verdicts):
        layout_must, layout_may = interface_layout_refusals(described, buffer_size if buffer is not None else None,
                                                            start)  # fmt: skip
        must |= layout_must
        may |= layout_may
    note(f"must={must} may={may} described={described}")
    view, refused = attempt(lambda: handoff.asarray(holder), ValueError, BufferError, NotImplementedError)
    check_outcome(refused, must, may)
    if refused is ValueError:
        assert_value_error_names("__array_interface__", lambda: handoff.asarray(holder))
    if view is not None and not may:
        assert_interface_view(view, described, (CPU, 0))
        assert view.readonly == (False if buffer is not None else interface["data"][1])
    del view, holder, buffer, data
    gauge.assert_unchanged()


def assert_value_error_names(protocol: str, call) -> None:
    """The ValueError that `call` raises names the protocol whose field it is about."""
    with pytest.raises(ValueError) as caught:
        call()
    assert protocol in str(caught.value), f"{caught.value!r} does not name {protocol}"


@st.composite
def device_pointers(draw):
    """(data, verdict, pointer) for a CUDA Array Interface: on sim, pointers into live sim allocations
    (every memory kind, every device); everywhere, memory no device knows and malformed values."""
    readonly = draw(st.booleans())
    kinds = ["garbage", "host", "null", "malformed"]
    if SIM:
        kinds += ["device", "device", "device", "pinned", "managed"]
    kind = draw(st.sampled_from(kinds))
    if kind == "malformed":
        return draw(st.sampled_from([*MALFORMED_DATA, None, MISSING])), ValueError, 0
    if kind in ("device", "pinned", "managed"):
        if kind == "managed" and SIM_ROCM:
            kind = "pinned"  # ROCm has no DLPack device type for managed memory
        allocation = ALLOCATIONS[kind, draw(st.integers(0, DEVICE_COUNT - 1)) if kind == "device" else 0]
        pointer = allocation.data_ptr + draw(st.integers(0, allocation.nbytes - 1))
        return (pointer, readonly), None, pointer
    pointer = {"garbage": draw(st.integers(1, INT64_MAX)), "host": HOST.ctypes.data, "null": 0}[kind]
    return (pointer, readonly), None, pointer


# Allocations the CAI fuzzing points into, made once: a forged interface does not own its memory.
ALLOCATIONS = {}
if SIM:
    ALLOCATIONS = {("device", device): sim.zeros(1024, "uint8", device) for device in range(DEVICE_COUNT)}
    ALLOCATIONS["pinned", 0] = sim.zeros(1024, "uint8", memory="pinned")
    if not SIM_ROCM:
        ALLOCATIONS["managed", 0] = sim.zeros(1024, "uint8", memory="managed")


def sim_allocation_of(pointer: int) -> tuple[tuple[int, int], handoff.Array] | None:
    """(DLPack device type, device id) and the sim allocation holding `pointer`, else None."""
    for (kind, device), allocation in ALLOCATIONS.items():
        if allocation.data_ptr <= pointer < allocation.data_ptr + allocation.nbytes:
            return {"device": (DEVICE_MEMORY, device), "pinned": (HOST_MEMORY, 0),
                    "managed": (CUDA_MANAGED, 0)}[kind], allocation  # fmt: skip
    return None


@not_on_cuda
@FUZZ
@given(case=interface_dicts(cuda=True, pointers=device_pointers()),
       stream=st.sampled_from([MISSING, None, 1, 2, 0, -1, -2, -(2**63), True, "1", 1.0, 2**70]),
       consumer=st.sampled_from([None, -1, DEFAULT_STREAM]))  # fmt: skip
def test_cuda_array_interface_dicts_are_imported_as_described_or_refused_cleanly(case, stream, consumer):
    interface, verdicts, described = case
    gauge = Gauge()
    if stream is not MISSING:
        interface["stream"] = stream
        # The interface's own stream numbering (CUDA's, on every platform): 0 and negative values but
        # -1 (no ordering) name no stream.
        if stream is not None and (type(stream) is not int or stream == 0 or not -1 <= stream < 2**63):
            verdicts.append(("stream", ValueError))
    must, may = verdict_sets(verdicts)
    found = sim_allocation_of(described["pointer"]) if SIM and described["pointer"] is not None else None
    memory = found[0] if found else None
    if layout_parts_valid(verdicts):
        # Every byte the view reaches must lie in the allocation its data pointer is in.
        extent = {"buffer_size": found[1].nbytes, "offset": described["pointer"] - found[1].data_ptr} if found else {}
        layout_must, layout_may = interface_layout_refusals(described, **extent)
        must |= layout_must
        may |= layout_may
    empty_and_null = math.prod(described["shape"]) == 0 and not described["pointer"]
    if not must and not SIM:
        must = {handoff.DeviceError}  # well-formed, but reading it needs a device backend
    elif not must and memory is None and not empty_and_null:
        must = {BufferError}  # memory the device does not know
    note(f"must={must} may={may} described={described} memory={memory}")
    holder = CudaArrayInterface(interface)
    view, refused = attempt(lambda: handoff.asarray(holder, stream=consumer), ValueError, BufferError,
                            NotImplementedError, handoff.DeviceError)  # fmt: skip
    check_outcome(refused, must, may)
    if refused is ValueError:
        assert_value_error_names("__cuda_array_interface__", lambda: handoff.asarray(holder, stream=consumer))
    if view is not None and not may:
        assert_interface_view(view, described, memory or view.device)
        assert view.device[0] == (memory[0] if memory else DEVICE_MEMORY)
        assert view.readonly == interface["data"][1]
    del view, holder
    gauge.assert_unchanged()


# --- stream objects --------------------------------------------------------------------------


class CudaStreamMethod:
    def __init__(self, value):
        self.value = value

    def __cuda_stream__(self):
        if isinstance(self.value, type) and issubclass(self.value, Exception):
            raise self.value("no stream")  # a new instance: a raised one would keep its frames alive
        return self.value


class CudaStreamAttribute:
    """__cuda_stream__ as a plain attribute, not a method: as_stream reads it as the pair."""

    def __init__(self, value):
        self.__cuda_stream__ = value


class HandleAttribute:
    """`.cuda_stream` (PyTorch) or `.ptr` (CuPy), optionally with a `.device`."""

    def __init__(self, attribute, value, device=MISSING):
        setattr(self, attribute, value)
        if device is not MISSING:
            self.device = device


class RaisingProperty:
    """A stream-like object one of whose attributes raises."""

    def __init__(self, attribute, error):
        self.attribute, self.error = attribute, error

    def __getattr__(self, name):
        if name == self.attribute:
            raise self.error(name)
        raise AttributeError(name)


HANDLES = st.sampled_from([-1, 0, 1, 2, 3, 2**63 - 1, 2**63, 2**64, -(2**63), True, False]) | st.integers(
    -(2**65), 2**65
)
# What user code raises propagates unchanged (AttributeError from inside a __cuda_stream__() call too).
USER_ERRORS = (StreamFault, AttributeError)


@st.composite
def stream_likes(draw):
    """Anything passed as a stream: ints, Streams, and objects speaking a stream protocol, naming
    live sim streams or any handle at all."""
    handle = draw(HANDLES | st.sampled_from(LIVE_HANDLES) if LIVE_HANDLES else HANDLES)
    kind = draw(st.sampled_from(["int", "int", "Stream", "method", "attribute", "cuda_stream", "ptr", "raising",
                                 "not-a-stream"] + (["sim"] if SIM else [])))  # fmt: skip
    if kind == "int":
        return handle
    if kind == "Stream":
        return handoff.Stream(handle) if type(handle) is int and 0 <= handle < 2**63 else handle
    if kind == "sim":
        return draw(st.sampled_from(STREAMS))
    if kind in ("method", "attribute"):
        value = (draw(st.integers(-1, 3)), handle) if draw(st.booleans()) else draw(
            st.sampled_from([(), (0,), (0, 1, 2), [0, 3], None, (0, "3"), (0, 3.5), (0, None), (True, 3), 7,
                             StreamFault, AttributeError]))  # fmt: skip
        return CudaStreamMethod(value) if kind == "method" else CudaStreamAttribute(value)
    if kind in ("cuda_stream", "ptr"):
        device = draw(st.sampled_from([MISSING, None, 0, 1, -1, "cuda", 2**70]))
        return HandleAttribute(kind, draw(st.sampled_from([handle, handle, "7", 7.0, None])), device)
    if kind == "raising":
        attribute = draw(st.sampled_from(["__cuda_stream__", "cuda_stream", "ptr"]))
        error = draw(st.sampled_from([StreamFault, AttributeError]))
        return RaisingProperty(attribute, error)
    return draw(st.sampled_from([1.5, "1", b"1", [1], (1,), object(), 1j]))


# Streams that stream objects may name: both kinds, on every device. Made once, they outlive every
# view bound to them.
STREAMS = []
if SIM:
    STREAMS = [sim.Stream(device, non_blocking=flag) for device in range(DEVICE_COUNT) for flag in (False, True)]
LIVE_HANDLES = [s.handle for s in STREAMS]


def resolved_stream(obj):
    """What handoff.as_stream makes of `obj`: (Stream or None, the type of the error raised)."""
    return attempt(lambda: handoff.as_stream(obj), TypeError, ValueError, *USER_ERRORS)


@FUZZ
@given(obj=stream_likes())
def test_stream_objects_resolve_or_are_refused_with_contract_errors(obj):
    made, refused = resolved_stream(obj)
    if made is not None:
        assert isinstance(made, handoff.Stream)
        assert type(made.handle) is int and 0 <= made.handle < 2**63
        assert made.device is None or (type(made.device) is int and made.device >= 0)
    if isinstance(obj, bool):
        assert refused is TypeError
    elif type(obj) is int:
        assert refused is (None if 0 <= obj < 2**63 else ValueError)
    # A block resolves its stream the same way, and sets it only inside.
    outer = handoff.current_stream()
    block, block_refused = attempt(lambda: handoff.stream(obj), TypeError, ValueError, *USER_ERRORS)
    assert block_refused is refused
    if block is not None:
        with block as entered:
            assert entered == made and handoff.current_stream() == made
        assert handoff.current_stream() == outer
    # handoff.Stream takes a raw handle only.
    _, direct_refused = attempt(lambda: handoff.Stream(obj), TypeError, ValueError)
    if type(obj) is int:
        assert direct_refused is (None if 0 <= obj < 2**63 else ValueError)
    else:
        assert direct_refused is TypeError


def table(value: int | None, device_type: int):
    """The contract's stream table, consumer side: "ordered", "unordered" or ValueError."""
    if device_type in CUDA_LIKE:
        valid = value is None or value == -1 or value >= 1
    elif device_type in ROCM_LIKE:
        valid = value is None or value in (-1, 0) or value > 2
    else:
        return ValueError if value is not None else "unordered"
    return ValueError if not valid else ("unordered" if value == -1 else "ordered")


def consumer_value(obj, device_type: int, through_as_stream: bool = False):
    """(DLPack stream value handed on for data of `device_type`, or the error `obj` raises).
    An int is a DLPack value, unless it goes `through_as_stream` (a block's) as a native handle."""
    if obj is None:
        return None, None
    if type(obj) is int and not through_as_stream:
        return (obj, None) if INT64_MIN <= obj <= INT64_MAX else (None, ValueError)
    if isinstance(obj, bool):
        return None, TypeError
    made, refused = resolved_stream(obj)
    if refused is not None:
        return None, refused
    # CUDA's legacy default stream is handle 0, spelled 1 in DLPack.
    return (1 if made.handle == 0 and device_type in CUDA_LIKE else made.handle), None


def import_outcome(value, device_type: int, validated: bool):
    """The error importing data of `device_type` onto DLPack stream `value` must raise (None: none).
    `validated`: the producer hands the stream to the device (a sim array does; a capsule, already
    made, cannot)."""
    if device_type == CPU:
        return None  # host data needs no consumer stream: any stream value goes
    verdict = table(value, device_type)
    if verdict is ValueError:
        return ValueError
    if validated and verdict == "ordered" and value is not None and value > 2 and value not in LIVE_HANDLES:
        return handoff.DeviceError
    return None


def make_target(kind: str, keep: list):
    """A producer to import from, and the device type of its data."""
    if kind == "numpy":
        return np.arange(4.0), CPU
    if kind == "capsule-cpu":
        return np.arange(4.0).__dlpack__(max_version=(1, 1)), CPU
    source = sim.zeros(4)
    keep.append(source)
    if kind == "sim":
        return source, DEVICE_MEMORY
    if kind == "capsule-sim":
        return source.__dlpack__(stream=-1, max_version=(1, 1)), DEVICE_MEMORY
    # As a CuPy array on either platform describes itself (no stream: nothing pending).
    return CudaArrayInterface({"shape": (4,), "typestr": "<f4", "data": (source.data_ptr, False),
                               "version": 2}), DEVICE_MEMORY  # fmt: skip


ENTRIES = st.sampled_from(["from_dlpack", "asarray", "block"])


@needs_sim
@FUZZ
@given(obj=stream_likes(), kind=st.sampled_from(["sim", "sim", "capsule-sim", "cai-sim"]), entry=ENTRIES)
def test_consumer_streams_of_device_imports_follow_the_stream_table(obj, kind, entry):
    check_consumer_stream_of_import(obj, kind, entry)


@FUZZ
@given(obj=stream_likes(), kind=st.sampled_from(["numpy", "capsule-cpu"]), entry=ENTRIES)
def test_consumer_streams_of_host_imports_are_checked_on_every_backend(obj, kind, entry):
    check_consumer_stream_of_import(obj, kind, entry)


def check_consumer_stream_of_import(obj, kind, entry):
    if kind == "cai-sim" and entry == "from_dlpack":
        entry = "asarray"  # from_dlpack takes DLPack only; so does a block's import of it
    device_type = CPU if kind in ("numpy", "capsule-cpu") else DEVICE_MEMORY
    value, refused_value = consumer_value(obj, device_type, through_as_stream=entry == "block")
    garbage = refused_value is None and value is not None and value > 2 and value not in LIVE_HANDLES
    # A raw handle no device knows cannot be checked once a capsule or an interface is made: the
    # release then waits for a stream that never comes (its producer is kept, never released early).
    assume(not garbage or kind in ("sim", "numpy", "capsule-cpu"))
    gauge = Gauge()
    keep = []
    target, _ = make_target(kind, keep)
    expected = refused_value or import_outcome(value, device_type, validated=kind == "sim")
    allowed = (TypeError, ValueError, BufferError, handoff.DeviceError, *USER_ERRORS)
    call = handoff.asarray if entry == "asarray" or kind == "cai-sim" else handoff.from_dlpack

    def run():
        if entry != "block":
            return call(target, stream=obj)
        with handoff.stream(obj):
            return call(target)

    view, refused = attempt(run, *allowed)
    note(f"value={value} expected={expected} refused={refused}")
    assert refused is expected
    if refused is handoff.DeviceError:
        assert device_error_name(run) == INVALID_HANDLE
    if kind.startswith("capsule"):
        # The stream is resolved before the capsule is read: one it cannot resolve leaves the capsule
        # to its producer. One invalid for the data's device is found once handoff owns the tensor.
        assert capsule_name(target).startswith("used_") == (refused is None or refused_value is None)
    if view is not None:
        assert view.shape == (4,)
        assert view.device[0] == device_type
    del view, target, keep
    gauge.assert_unchanged()


@FUZZ
@given(obj=stream_likes(), on_sim=st.booleans() if SIM else st.just(False),
       max_version=st.sampled_from([None, (1, 1)]))  # fmt: skip
def test_stream_arguments_of_exports_follow_the_stream_table(obj, on_sim, max_version):
    gauge = Gauge()
    source = sim.zeros(8) if on_sim else handoff.from_dlpack(np.arange(8.0))
    device_type = source.device[0]
    capsule, refused = attempt(lambda: source.__dlpack__(stream=obj, max_version=max_version), TypeError,
                               ValueError, BufferError, handoff.DeviceError)  # fmt: skip
    # The producer side takes DLPack's integers only: stream objects are for consumers.
    if obj is None:
        expected = None
    elif type(obj) is not int:
        expected = TypeError
    elif not INT64_MIN <= obj <= INT64_MAX:
        expected = ValueError
    else:
        verdict = table(obj, device_type)
        expected = ValueError if verdict is ValueError else None
        if verdict == "ordered" and obj > 2 and obj not in LIVE_HANDLES:
            expected = handoff.DeviceError
    note(f"expected={expected} refused={refused}")
    assert refused is expected
    if refused is handoff.DeviceError:
        assert device_error_name(lambda: source.__dlpack__(stream=obj, max_version=max_version)) == INVALID_HANDLE
    if capsule is not None:
        again = handoff.from_dlpack(capsule, stream=-1 if device_type != CPU else None)
        assert again.data_ptr == source.data_ptr
        del again
    del capsule, source
    gauge.assert_unchanged()
