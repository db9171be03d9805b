"""For library authors: handoff.view wraps memory a library describes, and handoff.Exporter gives a
class every protocol of handoff.Array.

Bad arguments get the contract's errors and leave nothing behind (the owner's reference count is
unchanged). On sim and sim-rocm, a view's `stream` orders exports after the producer's pending
write, with a negative control where the stream is left unknown.
"""

from __future__ import annotations

import gc
import sys
import weakref

import numpy as np
import pytest

import handoff

from support import CUDA_ORDERING_REFUSED, DEVICE_TYPE, SIM, needs_sim, pending_write, waiting_read

if SIM:
    from handoff import sim


class Buffer:
    """An owner that can be watched: its memory is a NumPy array."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values


class Tensor(handoff.Exporter):
    """A library's own array type: an Exporter over host memory it owns."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def __handoff_array__(self) -> handoff.Array:
        v = self.values
        return handoff.view(
            v.ctypes.data, v.shape, v.dtype, device="cpu", strides=v.strides, owner=self, readonly=not v.flags.writeable
        )


# ------------------------------------------------------------------------------------------------
# handoff.view


def test_a_view_wraps_memory_zero_copy_and_keeps_its_owner(settled):
    owner = Buffer(np.arange(12, dtype=np.int32).reshape(3, 4))
    watch = weakref.ref(owner)
    v = handoff.view(owner.values.ctypes.data, (3, 4), "int32", device=(1, 0), owner=owner)
    assert (v.shape, v.strides, v.dtype, v.device, v.readonly) == ((3, 4), (16, 4), "int32", (1, 0), False)
    assert v.data_ptr == owner.values.ctypes.data
    del owner
    gc.collect()
    assert watch() is not None, "the view holds its owner"
    assert np.from_dlpack(v).sum() == 66
    del v
    gc.collect()
    assert watch() is None, "the owner goes with the last view"


@pytest.mark.parametrize(
    "make",
    [
        lambda a: a.T,
        lambda a: a[::2, 1:],
        lambda a: a[0, 0, ...],
        lambda a: a[:0],
    ],
    ids=["transposed", "sliced", "0-d", "empty"],
)
def test_strides_are_in_bytes_as_numpy_reports_them(make):
    source = make(np.arange(24, dtype=np.float64).reshape(4, 6))
    v = handoff.view(
        source.ctypes.data if source.size else 0,
        source.shape,
        source.dtype,
        device="cpu",
        strides=source.strides,
        owner=source,
    )
    assert v.shape == source.shape
    assert np.array_equal(np.from_dlpack(v), source)


def test_dtypes_by_name_or_numpy_dtype():
    source = np.zeros(2, np.complex64)
    for dtype in ("complex64", np.dtype(np.complex64)):
        assert handoff.view(source.ctypes.data, 2, dtype, device="cpu", owner=source).dtype == "complex64"
    assert handoff.view(source.ctypes.data, (4,), "bfloat16", device="cpu", owner=source).dtype == "bfloat16"


def test_a_read_only_view_is_refused_to_legacy_consumers():
    source = np.arange(3.0)
    v = handoff.view(source.ctypes.data, 3, "float64", device="cpu", owner=source, readonly=True)
    assert v.readonly
    with pytest.raises(BufferError, match="read-only"):
        v.__dlpack__()
    assert np.from_dlpack(v).flags.writeable is False


ADDRESS = 0x10000


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"shape": (2, -3)}, ValueError, "shape[1] is negative"),
        ({"shape": (1 << 62, 1 << 3)}, ValueError, "overflows"),
        ({"shape": (1 << 64,)}, ValueError, "does not fit in 64 bits"),
        ({"shape": "ab"}, TypeError, "shape must be an int or a sequence of ints"),
        ({"shape": (2.0,)}, TypeError, "shape must hold ints"),
        ({"strides": (4, 4)}, ValueError, "strides"),
        ({"strides": (3,)}, BufferError, "strides"),
        ({"dtype": "float33"}, ValueError, "dtype 'float33' is not a dtype handoff knows"),
        ({"dtype": 5}, TypeError, "dtype must be a name"),
        ({"data_ptr": 0}, ValueError, "null pointer"),
        ({"data_ptr": -1}, ValueError, "data_ptr -1 is not an address"),
        ({"data_ptr": True}, TypeError, "data_ptr must be an int"),
        ({"device": None}, TypeError, "device is required"),
        ({"device": (99, 0)}, ValueError, "not a DLPack device type"),
        ({"device": (1, -1)}, ValueError, "not a valid DLPack device"),
        ({"device": "gpu"}, ValueError, "not a device handoff knows"),
        ({"stream": 5}, ValueError, ""),
        ({"stream": True}, TypeError, ""),
        ({"stream": object()}, TypeError, ""),
    ],
    ids=lambda value: str(value)[:40],
)
def test_bad_arguments_get_the_contracts_errors_and_leak_nothing(kwargs, error, text, settled):
    owner = Buffer(np.zeros(4, np.float32))
    arguments = {"data_ptr": ADDRESS, "shape": (4,), "dtype": "float32", "device": (1, 0), "owner": owner, **kwargs}
    references = sys.getrefcount(owner)
    with pytest.raises(error, match=None if not text else text.replace("[", r"\[").replace("(", r"\(")):
        handoff.view(arguments.pop("data_ptr"), arguments.pop("shape"), arguments.pop("dtype"), **arguments)
    assert sys.getrefcount(owner) == references, "a refused view keeps nothing"


# ------------------------------------------------------------------------------------------------
# handoff.Exporter


def test_an_exporter_speaks_every_host_protocol(torch, settled):
    t = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert np.from_dlpack(t).tolist() == t.values.tolist()
    assert torch.from_dlpack(t).sum().item() == 15.0
    assert handoff.from_dlpack(t).data_ptr == t.values.ctypes.data
    assert t.__dlpack_device__() == (1, 0)
    assert np.asarray(t).tolist() == t.values.tolist()  # through __array_interface__
    assert not hasattr(t, "__cuda_array_interface__"), "host memory has no CUDA Array Interface"


def test_an_exporter_honours_the_dlpack_arguments_as_an_array_does():
    t = Tensor(np.arange(4.0))
    assert np.from_dlpack(handoff.from_dlpack(t.__dlpack__(max_version=(1, 0), copy=True))).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        t.__dlpack__(stream=5)  # host data takes no stream
    with pytest.raises(BufferError, match="unreachable"):
        t.__dlpack__(dl_device=(2, 0))
    with pytest.raises(TypeError):
        t.__dlpack__(max_version="1.0")


def test_the_capsule_keeps_the_instance_alive(settled):
    t = Tensor(np.arange(4.0))
    watch = weakref.ref(t)
    capsule = t.__dlpack__(max_version=(1, 0))
    del t
    gc.collect()
    assert watch() is not None, "the capsule holds the instance"
    imported = handoff.from_dlpack(capsule)
    del capsule
    gc.collect()
    assert watch() is not None, "so does the array imported from it"
    assert np.from_dlpack(imported).tolist() == [0, 1, 2, 3]
    del imported
    gc.collect()
    assert watch() is None


def test_an_exporter_must_describe_its_data():
    class Missing(handoff.Exporter):
        pass

    class Wrong(handoff.Exporter):
        def __handoff_array__(self) -> object:
            return np.zeros(3)

    with pytest.raises(NotImplementedError, match="Missing must define __handoff_array__"):
        Missing().__dlpack__()
    with pytest.raises(TypeError, match=r"Wrong.__handoff_array__\(\) must return a handoff.Array, not ndarray"):
        Wrong().__dlpack__()
    with pytest.raises(TypeError, match=r"must return a handoff\.Array"):
        Wrong().__dlpack_device__()


# ------------------------------------------------------------------------------------------------
# Device memory on the simulator


class DeviceTensor(handoff.Exporter):
    """A device array library: memory from the simulator, ready on `stream` (None: unknown)."""

    def __init__(self, memory: handoff.Array, stream: object) -> None:
        self.memory = memory
        self.stream = stream

    def __handoff_array__(self) -> handoff.Array:
        return handoff.view(
            self.memory.data_ptr,
            self.memory.shape,
            "float32",
            device=self.memory.device,
            owner=self,
            stream=self.stream,
        )


@needs_sim
@pytest.mark.parametrize("as_object", [False, True], ids=["int", "stream object"])
def test_exports_are_ordered_after_the_stream_the_view_is_ready_on(sim_streams, as_object):
    producer, consumer = sim_streams
    with sim.hold(producer):
        t = DeviceTensor(pending_write(producer), producer if as_object else producer.handle)
        imported = handoff.from_dlpack(t, stream=consumer)
        read = waiting_read(imported, consumer)
    assert read.result()[[0, -1]].tolist() == [1.0, 1.0]


@needs_sim
def test_negative_control_an_unknown_stream_cannot_be_ordered(sim_streams):
    producer, consumer = sim_streams
    with sim.hold(producer):
        t = DeviceTensor(pending_write(producer), None)
        imported = handoff.from_dlpack(t, stream=consumer)
        assert sim.to_numpy(imported, stream=consumer)[0] == 0.0, "expected stale data: nothing said where it is ready"


@needs_sim
def test_a_device_exporter_has_the_cuda_array_interface_only_on_cuda(sim_streams):
    producer, _ = sim_streams
    t = DeviceTensor(pending_write(producer), producer)
    assert not hasattr(t, "__array_interface__")
    if DEVICE_TYPE == 2:
        assert t.__cuda_array_interface__["stream"] == producer.handle
    else:
        assert not hasattr(t, "__cuda_array_interface__")
    sim.synchronize()


@needs_sim
def test_a_view_must_claim_the_device_its_memory_is_on():
    memory = sim.zeros(4, "float32")
    with pytest.raises(ValueError, match="belongs to device 0"):
        handoff.view(memory.data_ptr, 4, "float32", device=(DEVICE_TYPE, 1), owner=memory)
    host = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="not device memory"):
        handoff.view(host.ctypes.data, 4, "float32", device=(DEVICE_TYPE, 0), owner=host)


@needs_sim
def test_a_device_view_must_lie_within_its_allocation():
    memory = sim.zeros(4, "float32")  # a 16-byte allocation
    for shape, strides in [((1 << 24,), None), ((5,), None), ((2, 2), (16, 4)), ((2,), (-8,))]:
        with pytest.raises(ValueError, match="allocation"):
            handoff.view(memory.data_ptr, shape, "float32", device=(DEVICE_TYPE, 0), strides=strides, owner=memory)
    inside = [
        handoff.view(memory.data_ptr, 4, "float32", device=(DEVICE_TYPE, 0), owner=memory),
        handoff.view(memory.data_ptr + 12, 1, "float32", device=(DEVICE_TYPE, 0), owner=memory),
        handoff.view(memory.data_ptr + 12, 4, "float32", device=(DEVICE_TYPE, 0), strides=(-4,), owner=memory),
        handoff.view(memory.data_ptr + 4, (0, 9), "float32", device=(DEVICE_TYPE, 0), owner=memory),
    ]
    assert [v.shape for v in inside] == [(4,), (1,), (4,), (0, 9)]


@needs_sim
def test_an_empty_device_view_publishes_a_null_pointer_in_the_cuda_array_interface():
    if DEVICE_TYPE != 2:
        pytest.skip("the CUDA Array Interface is for CUDA memory")
    memory = sim.zeros(4, "float32")
    empty = handoff.view(memory.data_ptr, (0, 3), "float32", device=(2, 0), owner=memory)
    assert empty.data_ptr == memory.data_ptr
    assert empty.__cuda_array_interface__["data"] == (0, False)  # "For zero-size arrays, use 0 here"
    assert memory.__cuda_array_interface__["data"][0] == memory.data_ptr


def test_a_non_native_byte_order_is_refused(settled):
    values = np.arange(4, dtype=(">" if sys.byteorder == "little" else "<") + "f4")
    with pytest.raises(BufferError, match="not in native byte order"):
        handoff.view(values.ctypes.data, values.shape, values.dtype, device="cpu", owner=values)
    native = values.astype(values.dtype.newbyteorder("="))
    assert np.asarray(handoff.view(native.ctypes.data, 4, native.dtype, device="cpu", owner=native)).tolist() == [
        0.0,
        1.0,
        2.0,
        3.0,
    ]


@needs_sim
def test_a_view_of_the_other_device_family_is_refused():
    memory = sim.zeros(4, "float32")
    other = 2 if DEVICE_TYPE == 10 else 10
    with pytest.raises(handoff.DeviceError, match="cannot be ordered"):
        handoff.view(memory.data_ptr, 4, "float32", device=(other, 0), owner=memory)


@pytest.mark.skipif(not CUDA_ORDERING_REFUSED, reason="HANDOFF_BACKEND=auto without a usable CUDA device")
def test_a_ready_stream_for_cuda_memory_needs_a_backend():
    with pytest.raises(handoff.DeviceError):
        handoff.view(ADDRESS, 4, "float32", device=(2, 0), stream=7)
    assert handoff.view(ADDRESS, 4, "float32", device=(2, 0)).device == (2, 0), "unknown: exchanged as it comes"
