"""Zero-copy exchange between NumPy, PyTorch, JAX and handoff, over every protocol handoff speaks."""

from __future__ import annotations

import array as pyarray
import ctypes
import gc
import re
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import handoff

from dlpack_ctypes import (
    CPU,
    FLAG_IS_COPIED,
    FLAG_IS_SUBBYTE_TYPE_PADDED,
    FLAG_READ_ONLY,
    HandMadeTensor,
    capsule_name,
    versioned_tensor,
)
from support import DlpackOnly, assert_dl_device_refused

NUMPY_DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]  # fmt: skip
TORCH_DTYPES = [
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
]  # fmt: skip


def sample(dtype: str, shape=(2, 3, 4)) -> np.ndarray:
    values = np.arange(int(np.prod(shape))).reshape(shape)
    if dtype == "bool":
        return (values % 3 == 0).astype(dtype)
    if dtype.startswith("complex"):
        return (values + 1j * (values % 5)).astype(dtype)
    return (values % 100).astype(dtype)


def assert_same_view(h: handoff.Array, a: np.ndarray) -> None:
    """`h` describes exactly the memory of `a`."""
    assert h.data_ptr == a.__array_interface__["data"][0]
    assert h.shape == a.shape
    assert h.strides == a.strides or a.size == 0  # strides of an empty array are arbitrary
    assert h.dtype == a.dtype.name
    assert h.device == (CPU, 0)
    assert h.ndim == a.ndim
    assert h.size == a.size
    assert h.nbytes == a.nbytes
    assert h.readonly == (not a.flags.writeable)


# --- NumPy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_numpy_round_trip_every_dtype(dtype):
    a = sample(dtype)
    h = handoff.from_dlpack(a)
    assert_same_view(h, a)
    b = np.from_dlpack(h)
    assert b.ctypes.data == a.ctypes.data
    assert b.dtype == a.dtype
    np.testing.assert_array_equal(b, a)
    c = np.asarray(h)  # through __array_interface__
    assert c.ctypes.data == a.ctypes.data
    assert c.dtype == a.dtype
    np.testing.assert_array_equal(c, a)


def test_writes_are_shared(live):
    a = np.zeros(4, dtype=np.int32)
    b = np.from_dlpack(handoff.from_dlpack(a))
    b[1] = 7
    assert a[1] == 7
    a[2] = 9
    assert b[2] == 9


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: np.array(2.5), id="0-d"),
        pytest.param(lambda: np.zeros((0,), np.float32), id="(0,)"),
        pytest.param(lambda: np.zeros((3, 0, 2), np.int16), id="(3,0,2)"),
        pytest.param(lambda: np.arange(24.0)[::-1], id="reversed"),
        pytest.param(lambda: np.arange(60, dtype=np.int32).reshape(6, 10)[:, ::-2], id="[:, ::-2]"),
        pytest.param(lambda: np.arange(60, dtype=np.int32).reshape(6, 10)[1:5:2, 3:9:3], id="strided slice"),
        pytest.param(lambda: np.arange(60.0).reshape(6, 10).T, id="transposed"),
        pytest.param(lambda: np.asfortranarray(np.arange(12.0).reshape(3, 4)), id="fortran"),
        pytest.param(lambda: np.arange(12, dtype=np.uint8).reshape(3, 4)[:, 1:2], id="column"),
        pytest.param(lambda: np.arange(2**5, dtype=np.int8).reshape((1, 2) * 5 + (1,) * 22), id="32 dims"),
    ],
)
def test_numpy_layouts_round_trip(make, live):
    a = make()
    h = handoff.from_dlpack(a)
    assert_same_view(h, a)
    for b in (np.from_dlpack(h), np.asarray(h)):
        assert b.__array_interface__["data"][0] == a.__array_interface__["data"][0]
        assert b.strides == a.strides or a.size <= 1
        np.testing.assert_array_equal(b, a)


def _with_record_field(length: int) -> np.ndarray:
    """The int32 field of `length` packed records: a stride of 5 bytes, no multiple of its item."""
    records = np.zeros(length, dtype=[("tag", "u1"), ("value", "<i4")])
    records["value"] = np.arange(length)
    return records["value"]


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: np.arange(24, dtype=np.float32).reshape(2, 3, 4), id="contiguous"),
        pytest.param(lambda: np.arange(24.0).reshape(4, 6)[::2, ::-3], id="strided"),
        pytest.param(lambda: np.array(2.5), id="0-d"),
        pytest.param(lambda: np.zeros((3, 0, 2), np.int16), id="empty"),
        pytest.param(lambda: np.arange(6) % 2 == 0, id="bool"),
        pytest.param(lambda: np.zeros(4, np.dtype("f4", metadata={"unit": "m"})), id="dtype with metadata"),
        pytest.param(lambda: np.lib.stride_tricks.as_strided(np.arange(3.0), (4, 3), (0, 8)), id="zero strides"),
        pytest.param(lambda: np.broadcast_to(np.arange(3.0), (4, 3)), id="read-only"),
        pytest.param(lambda: _with_record_field(1), id="one item, odd stride"),
        pytest.param(lambda: _with_record_field(4), id="odd strides"),
        pytest.param(lambda: np.arange(4, dtype=">i4"), id="swapped bytes"),
        pytest.param(lambda: np.zeros(3, np.longdouble), id="longdouble"),
        pytest.param(lambda: np.zeros(3, "U2"), id="strings"),
    ],
)
def test_a_numpy_array_is_imported_as_its_own_dlpack_export_describes_it(make, live):
    # A NumPy array's view is read from its fields (no capsule is made): the same view, or the same
    # refusal, as the capsule NumPy's __dlpack__ makes of it.
    a = make()
    try:
        exported = a.__dlpack__(max_version=(1, 1))
    except BufferError as refusal:
        with pytest.raises(BufferError, match=re.escape(str(refusal))):
            handoff.from_dlpack(a)
        return
    through_capsule = handoff.from_dlpack(exported)
    view = handoff.from_dlpack(a)
    for field in ("data_ptr", "shape", "strides", "dtype", "device", "readonly"):
        assert getattr(view, field) == getattr(through_capsule, field), field
    np.testing.assert_array_equal(np.from_dlpack(view), a)


def test_an_imported_numpy_array_lives_as_long_as_its_view(live):
    a = np.arange(5.0)
    ref = weakref.ref(a)
    view = handoff.from_dlpack(a)
    del a
    assert ref() is not None, "the view must keep the array it reads alive"
    assert gc.collect() >= 0 and ref() is not None
    # An array the collector cannot see into closes no cycle: the view is left out of collections.
    assert not gc.is_tracked(view)
    np.testing.assert_array_equal(np.from_dlpack(view), np.arange(5.0))
    del view
    assert ref() is None


def test_32_dimensions_of_extent_two(live):
    a = np.zeros((2,) * 32, dtype=np.bool_)[(slice(None, 1),) * 28]  # 16 elements, 32 dims
    h = handoff.from_dlpack(a)
    assert h.ndim == 32
    assert h.shape == a.shape and h.strides == a.strides
    np.testing.assert_array_equal(np.from_dlpack(h), a)


def test_zero_strides_from_broadcast(live):
    base = np.arange(5, dtype=np.float32)
    a = np.broadcast_to(base, (4, 5))  # NumPy exports it read-only
    h = handoff.from_dlpack(a)
    assert h.strides == (0, 4)
    assert h.readonly
    b = np.from_dlpack(h)
    assert b.strides == (0, 4)
    assert not b.flags.writeable
    assert b.ctypes.data == base.ctypes.data
    np.testing.assert_array_equal(b, a)


def test_readonly_survives_a_versioned_round_trip(live):
    a = np.arange(6.0)
    a.flags.writeable = False
    h = handoff.from_dlpack(a)
    assert h.readonly
    capsule = h.__dlpack__(max_version=(1, 1))
    assert versioned_tensor(capsule).flags & FLAG_READ_ONLY
    b = np.from_dlpack(handoff.from_dlpack(capsule))
    assert not b.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        b[0] = 1.0
    assert np.asarray(h).flags.writeable is False  # __array_interface__ says read-only too


def test_readonly_to_a_legacy_consumer_is_a_buffer_error(live):
    a = np.arange(6.0)
    a.flags.writeable = False
    h = handoff.from_dlpack(a)
    exports = handoff.stats()["exports"]
    with pytest.raises(BufferError, match="read-only"):
        h.__dlpack__(max_version=None)
    with pytest.raises(BufferError, match="read-only"):
        h.__dlpack__()
    assert handoff.stats()["exports"] == exports
    # A copy is writable, so a legacy consumer may have one.
    capsule = h.__dlpack__(copy=True)
    assert capsule_name(capsule) == "dltensor"


@pytest.mark.parametrize(
    ("max_version", "name", "version"),
    [
        (None, "dltensor", None),
        ((0, 8), "dltensor", None),
        ((1, 0), "dltensor_versioned", (1, 0)),
        ((1, 1), "dltensor_versioned", (1, 1)),
        ((1, 7), "dltensor_versioned", (1, 1)),
        ((2, 0), "dltensor_versioned", (1, 1)),
    ],
)
def test_max_version_selects_the_capsule(max_version, name, version, live):
    a = np.arange(12, dtype=np.int64).reshape(3, 4)
    h = handoff.from_dlpack(a)
    capsule = h.__dlpack__(max_version=max_version)
    assert capsule_name(capsule) == name
    if version is not None:
        managed = versioned_tensor(capsule)
        assert (managed.version.major, managed.version.minor) == version
        assert managed.flags & (FLAG_READ_ONLY | FLAG_IS_COPIED) == 0
        assert managed.dl_tensor.data == a.ctypes.data
        assert managed.dl_tensor.ndim == 2
        assert list(managed.dl_tensor.shape[:2]) == [3, 4]
        assert list(managed.dl_tensor.strides[:2]) == [4, 1]  # elements, not bytes
    b = handoff.from_dlpack(capsule)
    assert b.data_ptr == a.ctypes.data
    assert capsule_name(capsule) == "used_" + name


@pytest.mark.parametrize(
    ("max_version", "exported"), [(None, None), ((1, 0), None), ((1, 1), (1, 1))], ids=["legacy", "1.0", "1.1"]
)
def test_a_padded_sub_byte_dtype_is_exported_only_to_a_consumer_that_reads_its_flag(max_version, exported, live):
    buffer = np.zeros(8, np.uint8)
    padded = HandMadeTensor(buffer.ctypes.data, (4,), code=17, bits=4, flags=FLAG_IS_SUBBYTE_TYPE_PADDED)
    values = handoff.from_dlpack(padded.capsule())  # float4_e2m1fn, a byte each
    if exported is None:  # DLPack 1.1 added the padding flag: an older consumer would read packed data
        with pytest.raises(BufferError, match=r"max_version=\(1, 1\)"):
            values.__dlpack__(max_version=max_version)
        return
    managed = versioned_tensor(values.__dlpack__(max_version=max_version))
    assert (managed.version.major, managed.version.minor) == exported
    assert managed.flags & FLAG_IS_SUBBYTE_TYPE_PADDED and managed.dl_tensor.dtype.bits == 4


def test_max_version_must_be_a_pair(live):
    h = handoff.from_dlpack(np.arange(3))
    for bad in [(1,), [1, 0], "1.0", (1, 0, 0), (1.0, 0)]:
        with pytest.raises(TypeError, match="max_version"):
            h.__dlpack__(max_version=bad)


@pytest.mark.parametrize("max_version", [None, (1, 0), (1, 1)])
def test_copy_true_gives_a_copy(max_version, live):
    a = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    h = handoff.from_dlpack(a)
    capsule = h.__dlpack__(copy=True, max_version=max_version)
    if max_version is not None:
        assert versioned_tensor(capsule).flags & FLAG_IS_COPIED
    b = np.from_dlpack(handoff.from_dlpack(capsule))
    assert b.ctypes.data != a.ctypes.data
    np.testing.assert_array_equal(b, a)
    assert b.flags.c_contiguous
    b[...] = -1  # IS_COPIED: the consumer owns the copy; the original is untouched
    assert (a >= 0).all()


def test_copy_of_a_readonly_array_is_writable(live):
    a = np.broadcast_to(np.arange(3.0), (2, 3))
    capsule = handoff.from_dlpack(a).__dlpack__(copy=True, max_version=(1, 1))
    flags = versioned_tensor(capsule).flags
    assert flags & FLAG_IS_COPIED and not flags & FLAG_READ_ONLY
    b = np.from_dlpack(handoff.from_dlpack(capsule))
    b[0, 0] = 9.0
    assert a[0, 0] == 0.0


@pytest.mark.parametrize("make", [lambda: np.array(3.0, np.float32), lambda: np.zeros((3, 0, 2))])
def test_copy_of_degenerate_shapes(make, live):
    a = make()
    b = np.from_dlpack(handoff.from_dlpack(handoff.from_dlpack(a).__dlpack__(copy=True, max_version=(1, 1))))
    assert b.shape == a.shape
    np.testing.assert_array_equal(b, a)


def test_copy_false_and_none_share_memory(live):
    a = np.arange(4.0)
    h = handoff.from_dlpack(a)
    for copy in (False, None):
        assert handoff.from_dlpack(h.__dlpack__(copy=copy, max_version=(1, 1))).data_ptr == a.ctypes.data


def test_from_dlpack_copy_true_copies_once(live):
    a = np.arange(6.0)
    h = handoff.from_dlpack(a, copy=True)
    assert h.data_ptr != a.ctypes.data
    np.asarray(h)[0] = 42.0
    assert a[0] == 0.0
    h2 = handoff.asarray(a, copy=True)
    assert h2.data_ptr != a.ctypes.data
    np.testing.assert_array_equal(np.asarray(h2), a)


@pytest.mark.parametrize("device", [(1, 0), "cpu"])
def test_from_dlpack_device_cpu_is_zero_copy(device, live):
    a = np.arange(6.0)
    assert handoff.from_dlpack(a, device=device).data_ptr == a.ctypes.data
    ro = np.broadcast_to(a, (2, 6))  # needs the versioned protocol to say read-only
    h = handoff.from_dlpack(ro, device=device)
    assert h.readonly and h.data_ptr == a.ctypes.data


def test_dl_device_cpu_is_accepted(live):
    a = np.arange(6.0)
    h = handoff.from_dlpack(a)
    b = handoff.from_dlpack(h.__dlpack__(dl_device=(CPU, 0), max_version=(1, 1)))
    assert b.data_ptr == a.ctypes.data
    c = np.from_dlpack(h, device="cpu")
    assert c.ctypes.data == a.ctypes.data


def test_dl_device_cuda_is_a_buffer_error(live):
    h = handoff.from_dlpack(np.arange(6.0))
    for copy in (None, True, False):
        with pytest.raises(BufferError, match=r"\(2, 0\)"):
            h.__dlpack__(dl_device=(2, 0), copy=copy, max_version=(1, 1))


def test_copy_false_to_a_foreign_device_is_a_buffer_error(live):
    h = handoff.from_dlpack(np.arange(6.0))
    with pytest.raises(BufferError, match="unreachable"):
        h.__dlpack__(dl_device=(2, 0), copy=False, max_version=(1, 1))
    with pytest.raises(BufferError):
        handoff.from_dlpack(np.arange(3.0), device=(2, 0))
    with pytest.raises(BufferError):
        handoff.from_dlpack(np.arange(3.0), device=(2, 0), copy=False)


@pytest.mark.parametrize("bad", [(1,), (1, 0, 0), ("1", 0), [1, 0], 1.0])
def test_dl_device_must_be_a_pair_of_ints(bad, live):
    assert_dl_device_refused(bad, TypeError)


def test_dlpack_device(live):
    h = handoff.from_dlpack(np.arange(3.0))
    assert h.__dlpack_device__() == (CPU, 0)


# --- __array_interface__ and the buffer protocol ---------------------------------------------


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
def test_array_interface_round_trip(dtype, live):
    a = sample(dtype)[:, ::2]
    h = handoff.from_dlpack(a)
    interface = h.__array_interface__
    assert interface["version"] == 3
    assert interface["typestr"] == a.dtype.str
    assert interface["shape"] == a.shape
    assert interface["data"] == (a.ctypes.data, False)
    assert interface["strides"] == a.strides
    b = np.asarray(h)
    assert b.ctypes.data == a.ctypes.data
    np.testing.assert_array_equal(b, a)
    assert handoff.asarray(b).data_ptr == a.ctypes.data


def test_array_interface_of_contiguous_array_has_no_strides(live):
    h = handoff.from_dlpack(np.zeros((2, 3)))
    assert h.__array_interface__["strides"] is None


def test_array_interface_keeps_the_array_alive(live):
    # np.asarray(handoff.Array) holds the Array as its base, so the producer outlives the Array name.
    a = np.arange(5.0)
    b = np.asarray(handoff.from_dlpack(a))
    del a
    np.testing.assert_array_equal(b, np.arange(5.0))


def test_producer_may_answer_max_version_with_a_legacy_capsule(live):
    # DLPack allows a producer to return a legacy capsule even when max_version was passed.
    class OldCapsules:
        def __init__(self, a):
            self.a = a

        def __dlpack__(self, **kwargs):
            return self.a.__dlpack__()

        def __dlpack_device__(self):
            return (CPU, 0)

    a = np.arange(5.0)
    h = handoff.from_dlpack(OldCapsules(a))
    assert h.data_ptr == a.ctypes.data
    assert not h.readonly


def test_asarray_prefers_dlpack(live):
    a = np.arange(6.0)
    imports = handoff.stats()["imports"]
    h = handoff.asarray(a)
    assert h.data_ptr == a.ctypes.data
    assert handoff.stats()["imports"] == imports + 1


@pytest.mark.parametrize(
    ("make", "dtype", "readonly"),
    [
        (lambda: bytes(range(10)), "uint8", True),
        (lambda: bytearray(range(10)), "uint8", False),
        (lambda: memoryview(bytearray(range(10))), "uint8", False),
        (lambda: memoryview(bytes(range(10))), "uint8", True),
        (lambda: pyarray.array("d", [1.0, 2.0, 3.0]), "float64", False),
        (lambda: pyarray.array("i", [1, 2, 3]), "int32", False),
        (lambda: pyarray.array("H", [1, 2, 3]), "uint16", False),
        (lambda: pyarray.array("Q", [1, 2, 3]), "uint64", False),
        (lambda: memoryview(np.arange(12, dtype=np.float32).reshape(3, 4)[::2, ::-1]), "float32", False),
        (lambda: memoryview(np.array(7, dtype=np.int64)), "int64", False),
        (lambda: memoryview(np.arange(4, dtype=np.complex64)), "complex64", False),
        (lambda: memoryview(np.array([True, False])), "bool", False),
        (lambda: memoryview(np.arange(4, dtype=np.float16)), "float16", False),
        (lambda: (ctypes.c_int16 * 4)(1, 2, 3, 4), "int16", False),
    ],
)
def test_asarray_from_the_buffer_protocol(make, dtype, readonly, live):
    obj = make()
    view = memoryview(obj)
    h = handoff.asarray(obj)
    assert h.dtype == dtype
    assert h.readonly == readonly
    assert h.shape == view.shape
    assert h.strides == view.strides
    expected = np.asarray(view)
    assert h.data_ptr == expected.__array_interface__["data"][0]
    np.testing.assert_array_equal(np.from_dlpack(h) if not readonly else np.asarray(h), expected)
    del view, expected


def test_bytearray_writes_are_shared(live):
    data = bytearray(4)
    b = np.from_dlpack(handoff.asarray(data))
    b[2] = 200
    assert data[2] == 200


class ArrayInterfaceOnly:
    """Exposes a NumPy array's memory through __array_interface__ alone."""

    def __init__(self, a: np.ndarray, **overrides: object) -> None:
        self._a = a
        self._overrides = overrides

    @property
    def __array_interface__(self) -> dict:
        interface = dict(self._a.__array_interface__)
        interface.update(self._overrides)
        return interface


class BufferAndOffset:
    """__array_interface__ whose data is the object's own buffer, from an offset."""

    def __init__(self, raw: bytearray, offset: int, shape: tuple[int, ...], typestr: str) -> None:
        self._raw = raw
        self.__array_interface__ = {"shape": shape, "typestr": typestr, "data": raw, "offset": offset, "version": 3}


@pytest.mark.parametrize(
    "make",
    [
        lambda: np.arange(6.0),
        lambda: np.arange(24, dtype=np.int16).reshape(4, 6)[::-1, 1::2],
        lambda: np.zeros((0, 3)),
        lambda: np.array(5, dtype=np.uint32),
        lambda: np.broadcast_to(np.arange(3.0), (4, 3)),
    ],
)
def test_asarray_from_array_interface_only(make, live):
    a = make()
    obj = ArrayInterfaceOnly(a)
    h = handoff.asarray(obj)
    assert_same_view(h, a)
    np.testing.assert_array_equal(np.asarray(h), a)


def test_array_interface_only_keeps_its_object_alive(live):
    import weakref

    obj = ArrayInterfaceOnly(np.arange(4.0))
    ref = weakref.ref(obj)
    h = handoff.asarray(obj)
    del obj
    assert ref() is not None
    np.testing.assert_array_equal(np.asarray(h), np.arange(4.0))
    del h
    assert ref() is None


def test_a_view_in_a_cycle_through_the_object_it_keeps_is_collected(live):
    obj = ArrayInterfaceOnly(np.arange(4.0))
    obj.view = handoff.asarray(obj)  # the view keeps obj alive, and obj the view
    ref = weakref.ref(obj)
    assert gc.is_tracked(obj.view), "only the collector can free the cycle"
    del obj
    gc.collect()
    assert ref() is None


def test_array_interface_with_a_buffer_and_offset(live):
    raw = bytearray(np.arange(8, dtype=np.int32).tobytes())
    h = handoff.asarray(BufferAndOffset(raw, 8, (3,), "<i4"))
    assert h.dtype == "int32" and h.shape == (3,)
    np.testing.assert_array_equal(np.asarray(h), [2, 3, 4])


def test_array_interface_readonly_flag(live):
    a = np.arange(4.0)
    h = handoff.asarray(ArrayInterfaceOnly(a, data=(a.ctypes.data, True)))
    assert h.readonly


# --- PyTorch ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_torch_round_trip_every_dtype(torch, dtype, live):
    t = torch.arange(24).reshape(2, 3, 4).to(getattr(torch, dtype))
    h = handoff.from_dlpack(t)
    assert h.data_ptr == t.data_ptr()
    assert h.dtype == dtype
    assert h.shape == tuple(t.shape)
    assert h.strides == tuple(s * t.element_size() for s in t.stride())
    back = torch.from_dlpack(h)
    assert back.data_ptr() == t.data_ptr()
    assert back.dtype == t.dtype
    assert back.view(torch.uint8).equal(t.view(torch.uint8))


def test_torch_numpy_both_ways(torch, live):
    # Not negative strides: PyTorch 2.13 aborts the process on them (NumPy -> torch directly, too).
    a = np.arange(24, dtype=np.float32).reshape(3, 8)[:, ::2]
    t = torch.from_dlpack(handoff.from_dlpack(a))
    assert t.data_ptr() == a.ctypes.data
    assert t.stride() == (8, 2)
    assert torch.equal(t, torch.tensor(a.copy()))
    t[0, 0] = -5.0
    assert a[0, 0] == -5.0
    b = np.from_dlpack(handoff.from_dlpack(t))
    assert b.ctypes.data == a.ctypes.data


@pytest.mark.parametrize(
    "make",
    [
        lambda torch: torch.tensor(3.5),
        lambda torch: torch.zeros(0),
        lambda torch: torch.zeros(3, 0, 2),
        lambda torch: torch.arange(60.0).reshape(6, 10)[:, 1::3],
        lambda torch: torch.arange(10.0).expand(4, 10),
        lambda torch: torch.arange(60).reshape(3, 4, 5).permute(2, 0, 1),
    ],
)
def test_torch_layouts(torch, make, live):
    t = make(torch)
    h = handoff.from_dlpack(t)
    assert h.data_ptr == t.data_ptr()
    assert h.shape == tuple(t.shape)
    back = torch.from_dlpack(h)
    assert back.data_ptr() == t.data_ptr()
    assert back.stride() == t.stride() or t.numel() <= 1
    assert torch.equal(back, t)


def test_torch_from_handoff_copy(torch, live):
    a = np.arange(6.0)
    t = torch.from_dlpack(handoff.from_dlpack(a), copy=True)
    assert t.data_ptr() != a.ctypes.data
    t[0] = 9.0
    assert a[0] == 0.0


def test_torch_from_legacy_capsule(torch, live):
    a = np.arange(6.0)
    t = torch.utils.dlpack.from_dlpack(handoff.from_dlpack(a).__dlpack__())
    assert t.data_ptr() == a.ctypes.data


# --- JAX -------------------------------------------------------------------------------------


@pytest.fixture
def jax():
    """JAX with its CPU device as the default: these tests exchange host memory, and a GPU JAX
    would otherwise put its arrays on the GPU."""
    jax = pytest.importorskip("jax")
    with jax.default_device(jax.devices("cpu")[0]):
        yield jax


def aligned(n, dtype, alignment=64):
    """A NumPy array whose data is `alignment`-aligned: JAX's CPU client imports such buffers
    without a copy and copies any other."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(n * itemsize + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + n * itemsize].view(dtype)


def test_jax_to_handoff_is_zero_copy_and_keeps_jax_alive(jax, live):
    x = jax.numpy.arange(12, dtype=jax.numpy.float32).reshape(3, 4)
    pointer = x.unsafe_buffer_pointer()
    h = handoff.from_dlpack(x)
    assert h.data_ptr == pointer
    assert h.shape == (3, 4) and h.dtype == "float32" and h.__dlpack_device__() == (CPU, 0)
    del x
    gc.collect()
    np.testing.assert_array_equal(np.from_dlpack(h), np.arange(12, dtype=np.float32).reshape(3, 4))
    assert handoff.asarray(jax.numpy.ones(3)).shape == (3,)


def test_handoff_to_jax_is_zero_copy_for_aligned_data(jax, live):
    a = aligned(16, np.float32)
    a[:] = np.arange(16)
    y = jax.numpy.from_dlpack(handoff.from_dlpack(a))
    assert y.unsafe_buffer_pointer() == a.ctypes.data
    np.testing.assert_array_equal(np.asarray(y), a)
    del a
    gc.collect()
    np.testing.assert_array_equal(np.asarray(y), np.arange(16, dtype=np.float32))  # the capsule kept it


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.float16, np.float32, np.complex64, np.bool_])
@pytest.mark.parametrize("shape", [(), (0, 3), (2, 3)])
def test_jax_round_trips_through_handoff(jax, dtype, shape, live):
    a = np.arange(int(np.prod(shape))).astype(dtype).reshape(shape)
    y = jax.numpy.from_dlpack(handoff.from_dlpack(a))
    assert y.shape == shape
    np.testing.assert_array_equal(np.asarray(y), a)
    back = np.from_dlpack(handoff.from_dlpack(y))
    np.testing.assert_array_equal(back, a)


def test_jax_refuses_broadcast_strides_that_handoff_passes_on(jax, live):
    # handoff exports the layout as it is; JAX takes only compact ones and says so.
    b = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    with pytest.raises(Exception, match="striding"):
        jax.numpy.from_dlpack(handoff.from_dlpack(b))
    y = jax.numpy.from_dlpack(handoff.from_dlpack(b, copy=True))  # a compact copy goes
    np.testing.assert_array_equal(np.asarray(y), b)


# --- properties ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    a=hnp.arrays(
        dtype=st.sampled_from([np.int8, np.uint16, np.int32, np.float32, np.float64, np.complex64, np.bool_]),
        shape=hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=5),
    ),
    data=st.data(),
)
def test_random_slices_round_trip(a, data):
    if a.ndim:
        index = data.draw(hnp.basic_indices(a.shape, allow_newaxis=True, allow_ellipsis=True))
        view = a[index]
    else:
        view = a
    if not isinstance(view, np.ndarray):
        view = np.asarray(view)
    h = handoff.from_dlpack(view)
    assert h.data_ptr == view.__array_interface__["data"][0]
    assert h.shape == view.shape
    for b in (np.from_dlpack(h), np.asarray(h), np.from_dlpack(handoff.asarray(memoryview(view)))):
        assert b.__array_interface__["data"][0] == view.__array_interface__["data"][0]
        assert b.shape == view.shape
        np.testing.assert_array_equal(b, view)
    copied = np.from_dlpack(handoff.from_dlpack(h.__dlpack__(copy=True, max_version=(1, 1))))
    np.testing.assert_array_equal(copied, view)


@pytest.fixture
def pinned_tensor(torch):
    """Makes a pinned host tensor of the installed PyTorch (2.13 here) from values. The CPU build
    cannot pin memory, so the tensor's class answers is_pinned() as a pinned tensor's does; all the
    rest is PyTorch's own code: __dlpack_device__ says kDLCUDAHost, __dlpack__ takes only stream
    None or -1 (AssertionError "stream should be None on cpu." otherwise) and exports a kDLCPU capsule,
    and the DLPack C exchange API exports it as CPU memory."""

    class PinnedTensor(torch.Tensor):
        def is_pinned(self, device=None) -> bool:
            return True

    return lambda values: torch.as_tensor(values).as_subclass(PinnedTensor)


@pytest.mark.parametrize(
    "through, arguments",
    [
        (lambda t: t, {}),
        (DlpackOnly, {}),
        (DlpackOnly, {"stream": 2}),
        (DlpackOnly, {"stream": handoff.Stream(0x5100)}),
        (DlpackOnly, {"stream": -1}),
        (lambda t: t, {"device": "cpu"}),
        (lambda t: t, {"copy": False}),
        (lambda t: t, {"device": (CPU, 0), "copy": False}),
    ],
    ids=["table", "__dlpack__", "stream=2", "stream object", "stream=-1", "device", "copy=False", "both"],
)
def test_a_pinned_tensor_is_imported_as_host_memory_whatever_the_consumer_stream(pinned_tensor, through, arguments):
    # PyTorch's pinned tensors take only stream None or -1: the consumer's stream is not passed.
    values = np.arange(6, dtype=np.float32)
    tensor = pinned_tensor(values)
    producer = through(tensor)
    view = handoff.from_dlpack(producer, **arguments)
    assert view.device == (CPU, 0)
    assert view.data_ptr == tensor.data_ptr()
    assert np.from_dlpack(view).tolist() == values.tolist()
    if isinstance(producer, DlpackOnly):
        (call,) = producer.calls
        assert call.get("stream") == (-1 if arguments.get("stream") == -1 else None)


def test_a_pinned_tensor_copied_on_import_is_a_copy(pinned_tensor):
    tensor = pinned_tensor(np.arange(4, dtype=np.float32))
    view = handoff.from_dlpack(tensor, copy=True)
    assert view.device == (CPU, 0)
    assert view.data_ptr != tensor.data_ptr()
    assert np.from_dlpack(view).tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("stream", [0, -2])
def test_a_stream_pinned_memory_cannot_take_is_refused_before_the_producer_is_asked(pinned_tensor, stream):
    producer = DlpackOnly(pinned_tensor(np.arange(4, dtype=np.float32)))
    with pytest.raises(ValueError, match=f"stream={stream} is invalid for a CUDA host array"):
        handoff.from_dlpack(producer, stream=stream)
    assert producer.calls == []
