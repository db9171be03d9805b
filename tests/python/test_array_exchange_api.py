"""handoff.Array's own DLPack C exchange API (`__dlpack_c_exchange_api__`), called through ctypes as a
C consumer would call it.

The table's functions that take Python objects are called holding the GIL (PYFUNCTYPE: a -1 return
raises the Python error the function set); the allocator is called without it (CFUNCTYPE) and
reports failures through its SetError callback. On sim and sim-rocm a handed-out array is ordered
onto the current work stream, with negative controls that show the race without it.
"""

from __future__ import annotations

import ctypes
import gc
import textwrap
from pathlib import Path

import numpy as np
import pytest

import handoff

from dlpack_ctypes import (
    CPU,
    FLAG_READ_ONLY,
    SET_ERROR,
    DLDataType,
    DLDevice,
    DLManagedTensorVersioned,
    DLPackExchangeAPI,
    DLTensor,
    HandMadeTensor,
    capsule_name,
    exchange_api_of,
)
from support import CUDA_ORDERING_REFUSED, DEVICE_TYPE, SIM, needs_sim, pending_write, run_python, waiting_read

if SIM:
    from handoff import sim

_dec_ref = ctypes.pythonapi["Py_DecRef"]
_dec_ref.argtypes = [ctypes.c_void_p]

CAPSULE = handoff.Array.__dlpack_c_exchange_api__
API = exchange_api_of(handoff.Array)


def export(x: object) -> ctypes._Pointer:
    """managed_tensor_from_py_object_no_sync(x): the tensor, whose deleter the test must run."""
    out = ctypes.POINTER(DLManagedTensorVersioned)()
    assert API.managed_tensor_from_py_object_no_sync(x, ctypes.byref(out)) == 0
    return out


def delete(tensor: ctypes._Pointer) -> None:
    tensor.contents.deleter(tensor)


def to_array(tensor: ctypes._Pointer) -> handoff.Array:
    """managed_tensor_to_py_object_no_sync(tensor), which takes the tensor."""
    out = ctypes.c_void_p()
    assert API.managed_tensor_to_py_object_no_sync(tensor, ctypes.byref(out)) == 0
    wrapped = ctypes.cast(out, ctypes.py_object).value
    _dec_ref(out)  # the call's new reference; `wrapped` holds its own
    return wrapped


class Allocation:
    """One managed_tensor_allocator call and what its SetError was told."""

    def __init__(
        self,
        shape: tuple[int, ...],
        *,
        device: tuple[int, int] = (CPU, 0),
        code: int = 2,
        bits: int = 32,
        ndim: int | None = None,
    ) -> None:
        self.errors: list[tuple[str, str]] = []
        self._set_error = SET_ERROR(lambda _ctx, kind, message: self.errors.append((kind.decode(), message.decode())))
        self._shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        prototype = DLTensor()
        prototype.device = DLDevice(*device)
        prototype.ndim = len(shape) if ndim is None else ndim
        prototype.dtype = DLDataType(code, bits, 1)
        prototype.shape = self._shape
        self.tensor = ctypes.POINTER(DLManagedTensorVersioned)()
        self.status = API.managed_tensor_allocator(
            ctypes.byref(prototype), ctypes.byref(self.tensor), None, self._set_error
        )


def dltensor(x: object) -> DLTensor:
    out = DLTensor()
    assert API.dltensor_from_py_object_no_sync(x, ctypes.byref(out)) == 0
    return out


def work_stream(device_type: int, device_id: int = 0) -> int | None:
    out = ctypes.c_void_p()
    assert API.current_work_stream(device_type, device_id, ctypes.byref(out)) == 0
    return out.value


# ------------------------------------------------------------------------------------------------
# The table


def test_the_type_publishes_a_complete_versioned_table():
    assert capsule_name(CAPSULE) == "dlpack_exchange_api"
    assert (API.version.major, API.version.minor) == (1, 2)
    assert API.prev_api is None
    for name, _ in DLPackExchangeAPI._fields_[2:]:
        assert ctypes.cast(getattr(API, name), ctypes.c_void_p).value, f"{name} is NULL"
    # One table for the life of the process, found on the type as the API asks.
    assert handoff.from_dlpack(np.zeros(1)).__dlpack_c_exchange_api__ is CAPSULE


def test_the_table_is_also_offered_as_dlpack_1_2_did():
    # DLPack 1.2's attribute: the same table's address, as an int (cuda.core and Paddle read it).
    assert handoff.Array.__c_dlpack_exchange_api__ == ctypes.addressof(API)
    assert handoff.from_dlpack(np.zeros(1)).__c_dlpack_exchange_api__ == ctypes.addressof(API)


# ------------------------------------------------------------------------------------------------
# Host arrays


def test_a_managed_tensor_describes_the_array_and_keeps_its_producer(settled):
    source = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    view = handoff.from_dlpack(source)
    exports = handoff.stats()["exports"]
    tensor = export(view)
    assert handoff.stats()["exports"] == exports + 1
    t = tensor.contents
    assert (t.version.major, t.version.minor) == (1, 1)
    assert t.flags & FLAG_READ_ONLY == 0
    d = t.dl_tensor
    assert (d.data, d.ndim, d.device.device_type) == (view.data_ptr, 2, CPU)
    assert (d.dtype.code, d.dtype.bits, d.dtype.lanes) == (2, 32, 1)
    assert (d.shape[0], d.shape[1], d.strides[0], d.strides[1]) == (4, 3, 6, 2)
    del view, source
    assert handoff.stats()["live_views"] == settled + 1, "the tensor holds the producer"
    delete(tensor)
    assert handoff.stats()["live_views"] == settled


def test_a_read_only_array_is_flagged_and_refused_as_a_bare_dltensor(settled):
    source = np.arange(3.0)
    source.flags.writeable = False
    view = handoff.asarray(source)
    tensor = export(view)
    assert tensor.contents.flags & FLAG_READ_ONLY
    delete(tensor)
    with pytest.raises(BufferError, match="read-only"):
        dltensor(view)


def test_a_dltensor_views_the_array_while_it_lives():
    source = np.arange(12, dtype=np.int16).reshape(3, 4).T
    view = handoff.from_dlpack(source)
    exports = handoff.stats()["exports"]
    d = dltensor(view)
    assert handoff.stats()["exports"] == exports + 1
    assert (d.data, d.ndim, d.byte_offset) == (view.data_ptr, 2, 0)
    assert (d.dtype.code, d.dtype.bits) == (0, 16)
    assert [d.shape[i] for i in range(2)] == [4, 3]
    assert [d.strides[i] * 2 for i in range(2)] == list(view.strides)


@pytest.mark.parametrize("call", [export, dltensor], ids=["managed", "dltensor"])
def test_only_handoff_arrays_are_taken(call):
    with pytest.raises(TypeError, match=r"expected a handoff\.Array or an instance of a def_dlpack class, got ndarray"):
        call(np.zeros(3))


def test_to_py_object_wraps_a_tensor_zero_copy_and_deletes_it_once(settled):
    source = np.arange(6, dtype=np.float32)
    made = HandMadeTensor(source.ctypes.data, (2, 3))
    imports = handoff.stats()["imports"]
    array = to_array(ctypes.pointer(made.managed))
    assert handoff.stats()["imports"] == imports + 1
    assert isinstance(array, handoff.Array)
    assert (array.shape, array.data_ptr) == ((2, 3), source.ctypes.data)
    assert np.from_dlpack(array).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert made.deleted == 0
    del array
    gc.collect()
    assert made.deleted == 1


def test_to_py_object_takes_a_tensor_it_refuses():
    made = HandMadeTensor(0x1000, (-2,))
    out = ctypes.c_void_p()
    with pytest.raises(ValueError, match="negative"):
        API.managed_tensor_to_py_object_no_sync(ctypes.pointer(made.managed), ctypes.byref(out))
    assert (made.deleted, out.value) == (1, None), "the refused tensor is deleted exactly once"


def test_to_py_object_refuses_a_device_type_dlpack_does_not_define():
    made = HandMadeTensor(np.zeros(4, np.float32).ctypes.data, (4,), device=(999, 0))
    out = ctypes.c_void_p()
    with pytest.raises(ValueError, match="999 is not a DLPack device type"):
        API.managed_tensor_to_py_object_no_sync(ctypes.pointer(made.managed), ctypes.byref(out))
    assert (made.deleted, out.value) == (1, None)
    with pytest.raises(ValueError, match="999 is not a DLPack device type"):
        handoff.from_dlpack(HandMadeTensor(0x1000, (4,), device=(999, 0)).capsule())  # as every import


@pytest.mark.skipif(not SIM, reason="needs a simulated backend of one device family")
def test_to_py_object_refuses_device_memory_of_the_other_family():
    other = 10 if DEVICE_TYPE == 2 else 2
    made = HandMadeTensor(np.zeros(4, np.float32).ctypes.data, (4,), device=(other, 0))
    out = ctypes.c_void_p()
    with pytest.raises(handoff.DeviceError, match="cannot be ordered"):
        API.managed_tensor_to_py_object_no_sync(ctypes.pointer(made.managed), ctypes.byref(out))
    assert (made.deleted, out.value) == (1, None)


def test_the_allocator_fails_without_calling_set_error_once_python_exits():
    # Daemon threads may still allocate while the interpreter exits; SetError may take the GIL, which
    # would then end the thread mid-call (pthread_exit through handoff's frames). Made deterministic
    # here: an atexit handler that runs after handoff's makes an allocation fail.
    code = textwrap.dedent(
        """
        import atexit, ctypes, sys
        calls = []

        def at_exit():
            sys.path.insert(0, {here!r})
            from test_array_exchange_api import Allocation, DEVICE_TYPE
            made = Allocation((-4,), device=(DEVICE_TYPE, 0))
            print(made.status, made.errors, flush=True)

        atexit.register(at_exit)  # before handoff's own: it runs after
        import handoff
        """
    ).format(here=str(Path(__file__).parent))
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "-1 []", result.stdout


def test_the_allocator_makes_host_tensors_that_round_trip(settled):
    made = Allocation((2, 3))
    assert (made.status, made.errors) == (0, [])
    d = made.tensor.contents.dl_tensor
    assert (d.device.device_type, [d.shape[0], d.shape[1]], [d.strides[0], d.strides[1]]) == (CPU, [2, 3], [3, 1])
    array = to_array(made.tensor)
    np.from_dlpack(array)[...] = 7.0  # writable memory of the whole size
    assert np.from_dlpack(array).sum() == 42.0
    del array


@pytest.mark.parametrize(
    ("kwargs", "kind", "text"),
    [
        ({"shape": (2, -1)}, "ValueError", "shape[1] is negative"),
        ({"shape": (1 << 62, 8)}, "ValueError", "overflows"),
        ({"shape": (2,), "code": 99}, "BufferError", "dtype"),
        ({"shape": (2,), "ndim": -1}, "ValueError", "ndim"),
        ({"shape": (2,), "device": (7, 0)}, "BufferError", "cannot allocate on device (7, 0)"),
    ],
    ids=["negative", "overflow", "dtype", "ndim", "device"],
)
def test_the_allocator_reports_bad_prototypes_through_set_error(kwargs, kind, text, settled):
    made = Allocation(**kwargs)
    assert made.status == -1
    assert not made.tensor, "no tensor on failure"
    assert len(made.errors) == 1, "SetError is called exactly once"
    assert made.errors[0][0] == kind
    assert text in made.errors[0][1]


def test_current_work_stream_is_null_for_the_host():
    assert work_stream(CPU) is None


# ------------------------------------------------------------------------------------------------
# Device arrays on the simulator

N = 4096


@needs_sim
def test_current_work_stream_is_the_stream_block_on_its_device(sim_streams):
    _, consumer = sim_streams
    assert work_stream(DEVICE_TYPE) is None, "outside a block: the default stream"
    with handoff.stream(consumer):
        assert work_stream(DEVICE_TYPE) == consumer.handle
    with handoff.stream(handoff.Stream(consumer.handle, device=1)):
        assert work_stream(DEVICE_TYPE, 0) is None, "the block's stream is another device's"


@needs_sim
@pytest.mark.parametrize("call", [export, dltensor], ids=["managed", "dltensor"])
def test_handing_out_orders_the_work_stream_after_the_producer(sim_streams, call):
    producer, consumer = sim_streams
    with sim.hold(producer):
        array = pending_write(producer)
        with handoff.stream(consumer):
            handed = call(array)
        read = waiting_read(array, consumer)
    assert read.result()[[0, -1]].tolist() == [1.0, 1.0]
    if call is export:
        delete(handed)


@needs_sim
def test_negative_control_the_work_stream_races_without_the_table(sim_streams):
    producer, consumer = sim_streams
    with sim.hold(producer):
        array = pending_write(producer)
        assert sim.to_numpy(array, stream=consumer)[0] == 0.0, "expected stale data without ordering"


@needs_sim
@pytest.mark.parametrize(
    "table", [True, False], ids=["through the table", "negative control without the table the release is immediate"]
)
def test_the_producer_outlives_the_work_stream(sim_streams, table):
    _, consumer = sim_streams
    array = sim.zeros(N, "float32")
    sim.synchronize()
    if table:
        with handoff.stream(consumer):
            tensor = export(array)
    with sim.hold(consumer):
        sim.fill(array, 2.0, stream=consumer)  # the C consumer's kernel on the work stream
        deferred = handoff.stats()["deferred_releases"]
        del array
        if table:
            delete(tensor)
        gc.collect()
        if table:
            assert handoff.stats()["deferred_releases"] == deferred + 1, "released before the work stream was done"
        else:
            assert handoff.stats()["deferred_releases"] == deferred, "nothing bound the producer to the stream"
    sim.synchronize()
    sim.drain()


@needs_sim
def test_device_allocations_are_made_on_the_work_stream(sim_streams):
    _, consumer = sim_streams
    with handoff.stream(consumer):
        made = Allocation((N,), device=(DEVICE_TYPE, 0))
        assert (made.status, made.errors) == (0, [])
        array = to_array(made.tensor)
    assert array.device == (DEVICE_TYPE, 0)
    if DEVICE_TYPE == 2:
        assert array.__cuda_array_interface__["stream"] == consumer.handle, "ready on the work stream"
    sim.fill(array, 3.0, stream=consumer)
    assert sim.to_numpy(array, stream=consumer)[[0, -1]].tolist() == [3.0, 3.0]
    del array
    sim.synchronize()
    gc.collect()
    sim.drain()


@needs_sim
def test_the_allocator_refuses_a_device_the_backend_does_not_have():
    made = Allocation((4,), device=(DEVICE_TYPE, 99))
    assert (made.status, made.errors[0][0]) == (-1, "ValueError")
    assert "device 99" in made.errors[0][1]


@pytest.mark.skipif(not CUDA_ORDERING_REFUSED, reason="HANDOFF_BACKEND=auto without a usable CUDA device")
def test_device_tensors_need_a_backend():
    made = HandMadeTensor(0x10000, (4,), device=(2, 0))
    out = ctypes.c_void_p()
    with pytest.raises(handoff.DeviceError):
        API.managed_tensor_to_py_object_no_sync(ctypes.pointer(made.managed), ctypes.byref(out))
    assert made.deleted == 1


# ------------------------------------------------------------------------------------------------
# Several producers in one call, as tvm-ffi makes it


def launch_as_tvm_ffi_does(first_arguments_stream, array: handoff.Array):
    """A call of a tvm-ffi function with another framework's tensor first and a handoff array second:
    tvm-ffi launches on the first argument's current work stream (here that framework's current
    stream), converts every argument through its own type's table without synchronizing, and its
    kernel reads them there. Returns the kernel's read of the handoff array, enqueued (a PendingCopy)."""
    dltensor(array)  # handoff's no-sync export: ordered onto handoff's current work stream
    return sim.to_numpy(array, stream=first_arguments_stream, wait=False)


@needs_sim
def test_a_call_mixing_frameworks_races_unless_handoffs_work_stream_is_the_launch_stream(sim_streams):
    """handoff orders a handed-out array onto its own current work stream; a consumer that launches on
    another producer's stream must wait for handoff's, or the program makes them one stream with
    handoff.stream(s, frameworks=True) (docs/c-exchange-api.md)."""
    producer, launch = sim_streams
    with sim.hold(producer):
        array = pending_write(producer)
        read = launch_as_tvm_ffi_does(launch, array)
        assert read.result()[[0, -1]].tolist() == [0.0, 0.0], "negative control: handoff's stream is not the launch's"
    sim.synchronize()
    with sim.hold(producer):
        array = pending_write(producer)
        with handoff.stream(launch, frameworks=True):  # the launch stream is every framework's, handoff's too
            assert work_stream(DEVICE_TYPE) == launch.handle
            read = launch_as_tvm_ffi_does(launch, array)
        assert sim.waits_for_hold(launch)
    assert read.result()[[0, -1]].tolist() == [1.0, 1.0]
