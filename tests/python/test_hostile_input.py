"""Hostile input: producers that lie or return the wrong types, out-of-range stream handles, device
arguments the runtime cannot serve, calls that once crashed or leaked (several found by
test_fuzz_hypothesis.py), and exit with threads inside handoff."""

from __future__ import annotations

import ctypes
import gc
import textwrap

import numpy as np
import pytest

import handoff

from dlpack_ctypes import CPU, CUDA, ROCM, HandMadeTensor, capsule_name, exchange_api_of
from support import (
    BACKEND,
    DEVICE_COUNT,
    assert_dl_device_refused,
    needs_sim,
    needs_two_devices,
    run_python,
    waiting_read,
)

# A stream value every backend accepts for the arrays of the test: a CPU array takes None only, so
# a stream is asked for through a producer that claims a device.
CONSUMER_STREAM = 0 if BACKEND == "sim-rocm" else 1
DEVICE_MEMORY = ROCM if BACKEND == "sim-rocm" else CUDA


# --- stream handles outside the native range ------------------------------------------------


class CudaStreamProtocol:
    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


class CudaStreamAttribute:
    """Names any handle as PyTorch's streams name theirs (`.cuda_stream`): no peer's stream."""

    def __init__(self, handle):
        self.cuda_stream = handle


class PtrAttribute:
    """Names any handle as CuPy's streams name theirs (`.ptr`): no peer's stream."""

    def __init__(self, handle):
        self.ptr = handle


@pytest.mark.parametrize("kind", [CudaStreamProtocol, CudaStreamAttribute, PtrAttribute, int])
@pytest.mark.parametrize("handle", [2**63, 2**64, 2**80])
def test_stream_objects_with_handles_outside_the_native_range_are_value_errors(kind, handle, live):
    with pytest.raises(ValueError, match=r"native range|out of range"):
        handoff.as_stream(kind(handle))
    with pytest.raises(ValueError, match=r"native range|out of range"):
        handoff.stream(kind(handle))
    with pytest.raises(ValueError, match=r"native range|out of range"):
        handoff.from_dlpack(np.arange(3.0), stream=kind(handle))


# --- __dlpack_device__ returning the wrong things ------------------------------------------


class ClaimsDevice:
    """A CPU producer whose __dlpack_device__ says whatever the test wants."""

    def __init__(self, claim):
        self.claim = claim
        self.data = np.arange(4.0)

    def __dlpack_device__(self):
        return self.claim

    def __dlpack__(self, **kwargs):
        kwargs.pop("stream", None)  # a CPU producer ignores it
        return self.data.__dlpack__(**kwargs)


@pytest.mark.parametrize(
    ("claim", "error"),
    [
        ((1.5, 0), TypeError),
        (("1", 0), TypeError),
        ((1, "0"), TypeError),
        ((True, 0), TypeError),
        ((2**70, 0), ValueError),
        ((1, 2**40), ValueError),
        ((1, -1), ValueError),
        ((99, 0), ValueError),
        ([1, 0], TypeError),
        ((1, 0, 0), TypeError),
        (None, TypeError),
    ],
)
def test_dlpack_device_returning_non_devices(claim, error, live):
    with pytest.raises(error, match="__dlpack_device__"):
        handoff.from_dlpack(ClaimsDevice(claim), stream=CONSUMER_STREAM)


@needs_sim
def test_a_producer_claiming_device_memory_for_host_data_is_refused(live):
    from handoff import sim

    device_type = 10 if BACKEND == "sim-rocm" else 2
    consumer = sim.Stream()
    with pytest.raises(ValueError, match=r"__dlpack_device__.*refused"):
        handoff.from_dlpack(ClaimsDevice((device_type, 0)), stream=consumer)


@needs_sim
def test_a_producer_claiming_host_memory_for_device_data_is_refused(live):
    from handoff import sim

    class HidesItsDevice:
        def __init__(self):
            self.array = sim.zeros(8)

        def __dlpack_device__(self):
            return (CPU, 0)

        def __dlpack__(self, stream=None, **kwargs):
            return self.array.__dlpack__(stream=None if stream is None else -1, **kwargs)

    consumer = sim.Stream()
    with pytest.raises(ValueError, match=r"__dlpack_device__.*refused"):
        handoff.from_dlpack(HidesItsDevice(), stream=consumer)
    sim.synchronize()


# --- dl_device the runtime does not know ----------------------------------------------------


@pytest.mark.parametrize("device", [(99, 0), (5, 0), (6, 0), (2**31 - 1, 0), (2**40, 0)])
def test_dl_device_of_an_unknown_type_is_a_buffer_error(device, live):
    assert_dl_device_refused(device, BufferError)


def test_dl_device_out_of_range_is_still_a_value_error(live):
    for device in ((2**70, 0), (1, -1), (1, 2**31)):
        assert_dl_device_refused(device, ValueError)


def test_dl_device_naming_a_cpu_other_than_0_is_a_buffer_error_not_a_copy_labelled_cpu_0(live):
    array = handoff.from_dlpack(np.arange(3.0))
    with pytest.raises(BufferError, match="the CPU is device 0"):
        array.__dlpack__(dl_device=(CPU, 1), max_version=(1, 1))
    with pytest.raises(BufferError, match="the CPU is device 0"):
        handoff.from_dlpack(array, device=(CPU, 1))
    assert array.__dlpack__(dl_device=(CPU, 0), copy=False, max_version=(1, 1)) is not None  # the control


def test_a_capsule_numbering_the_cpu_otherwise_is_on_the_cpu_and_a_negative_id_is_refused(live):
    data = np.arange(4, dtype=np.float32)
    negative = HandMadeTensor(data.ctypes.data, (4,), device=(CPU, -1))
    with pytest.raises(ValueError, match="device id -1 is negative"):
        handoff.from_dlpack(negative.capsule())
    assert negative.deleted == 1
    # A CPU numbered 3 is the host: asked for on (kDLCPU, 0) without a copy, it was refused as a move.
    numbered = HandMadeTensor(data.ctypes.data, (4,), device=(CPU, 3))
    view = handoff.from_dlpack(numbered.capsule())
    assert view.device == (CPU, 0)
    assert handoff.from_dlpack(view, device=(CPU, 0), copy=False).data_ptr == data.ctypes.data
    with pytest.raises(ValueError, match=r"device \(1, 3\) is not a DLPack device: the CPU is device 0"):
        handoff.view(data.ctypes.data, 4, "float32", device=(CPU, 3), owner=data)  # a library's own: its error


class NumberedCpu:
    """A producer that numbers the CPU 3, in its __dlpack_device__ and in its capsules."""

    def __init__(self) -> None:
        self.data = np.arange(4, dtype=np.float32)
        self.tensors: list[HandMadeTensor] = []  # each capsule's, alive as long as the producer

    def __dlpack_device__(self) -> tuple[int, int]:
        return (CPU, 3)

    def __dlpack__(self, **kwargs: object) -> object:
        self.tensors.append(HandMadeTensor(self.data.ctypes.data, (4,), device=(CPU, 3)))
        return self.tensors[-1].capsule()


def test_a_producer_numbering_the_cpu_otherwise_is_imported_and_a_cpu_other_than_0_is_never_asked_of_it(live):
    # Its answer and its capsule said (1, 3); the capsule read as (1, 0) no longer matched the answer.
    producer = NumberedCpu()
    view = handoff.from_dlpack(producer)
    assert view.device == (CPU, 0) and view.data_ptr == producer.data.ctypes.data
    with pytest.raises(BufferError, match=r"device=\(1, 1\): the CPU is device 0"):
        handoff.from_dlpack(producer, device=(CPU, 1))
    assert len(producer.tensors) == 1, "refused before the producer was asked"
    del view


# --- calls that once crashed ------------------------------------------------------------------


@needs_sim
@pytest.mark.parametrize("device", [0, pytest.param(1, marks=needs_two_devices)])
def test_sim_synchronize_of_one_device(device):
    from handoff import sim

    sim.synchronize(device)
    sim.synchronize(device=device)


@needs_sim
def test_sim_synchronize_of_a_device_that_does_not_exist():
    from handoff import sim

    with pytest.raises(ValueError, match="device 7 does not exist"):
        sim.synchronize(7)
    for device in ("0", 1.0, True):
        with pytest.raises(TypeError, match="device"):
            sim.synchronize(device)


def test_byte_strides_beyond_64_bits_are_reported_exactly(live):
    # A stride in elements that fits may not fit in bytes where it never moves (extent 1, or empty).
    data = np.zeros(8, dtype=np.float32)
    tensor = HandMadeTensor(data.ctypes.data, (1, 2), strides=(2**62, 1))
    view = handoff.from_dlpack(tensor.capsule())
    assert view.strides == (2**64, 4)
    empty = HandMadeTensor(data.ctypes.data, (0, 2), strides=(-(2**62), 2**62))
    assert handoff.from_dlpack(empty.capsule()).strides == (-(2**64), 2**64)


# A stream value that is invalid for the device of a capsule's data, on a backend that does not
# order that device's memory (there: sim-rocm or none for CUDA data, sim or none for ROCm data).
FOREIGN_DEVICE, INVALID_STREAM = (CUDA, 0) if BACKEND == "sim-rocm" else (ROCM, 1)


def test_stream_invalid_for_the_data_is_refused_on_every_backend(live):
    tensor = HandMadeTensor(None, (0,), device=(FOREIGN_DEVICE, 0))
    capsule = tensor.capsule(destructor=True)
    with pytest.raises(ValueError, match=rf"stream={INVALID_STREAM}\b"):
        handoff.from_dlpack(capsule, stream=INVALID_STREAM)
    assert capsule_name(capsule).startswith("used_")  # handoff read it, so it deleted it
    assert tensor.deleted == 1


@needs_sim
@pytest.mark.parametrize("device_id", [-1, DEVICE_COUNT, 9])
def test_an_empty_capsule_on_a_device_the_backend_lacks_is_refused(device_id, live):
    # It used to be bound to that device's default stream, whose release could never be enqueued:
    # the producer was kept for ever.
    from handoff import sim

    tensor = HandMadeTensor(None, (0,), device=(DEVICE_MEMORY, device_id))
    capsule = tensor.capsule(destructor=True)
    lacks = "device id -1 is negative" if device_id < 0 else rf"device {device_id}\b.*has {DEVICE_COUNT} device"
    with pytest.raises(ValueError, match=lacks):
        handoff.from_dlpack(capsule)
    del capsule
    gc.collect()
    sim.drain()
    assert tensor.deleted == 1


# --- every import passes one door ------------------------------------------------------------
# A tensor claiming 16M floats over a 6-float allocation was accepted by every import but
# handoff.view, and reading it crashed the process; data of the device family the backend does not
# order was accepted by from_dlpack and refused by the C exchange API's to_py.


# Each import path, ordered onto the default stream or not at all (the C exchange API's to_py has no
# consumer stream: the data is ready on its work stream).
IMPORT_PATHS = [("capsule", None), ("capsule", -1), ("producer", None), ("producer", -1), ("to_py", None)]


def to_py_object(tensor: HandMadeTensor) -> object:
    """handoff.Array's C exchange API table asked to import `tensor` (managed_tensor_to_py_object_no_sync)."""
    out = ctypes.c_void_p()
    status = exchange_api_of(handoff.Array).managed_tensor_to_py_object_no_sync(
        ctypes.pointer(tensor.managed), ctypes.byref(out)
    )
    assert status == 0, "a failed call raises"
    return ctypes.cast(out, ctypes.py_object).value


@needs_sim
@pytest.mark.parametrize(("path", "consumer"), IMPORT_PATHS)
@pytest.mark.parametrize("refused", ["past its allocation", "of the other device family"])
def test_an_import_is_checked_at_one_door_on_every_path(refused, path, consumer, live):
    from handoff import sim

    small = sim.zeros((6,), "float32")
    if refused == "past its allocation":
        device, error, match = (DEVICE_MEMORY, 0), ValueError, "run past the end of their allocation"
        tensor = HandMadeTensor(small.data_ptr, (1 << 24,), device=device)
    else:
        device, error, match = (FOREIGN_DEVICE, 0), handoff.DeviceError, "cannot be ordered by the"
        tensor = HandMadeTensor(small.data_ptr, (6,), device=device)
    with pytest.raises(error, match=match):
        if path == "capsule":
            handoff.from_dlpack(tensor.capsule(), stream=consumer)
        elif path == "producer":
            handoff.from_dlpack(Produces(tensor, device), stream=consumer)
        else:
            to_py_object(tensor)
    gc.collect()
    assert tensor.deleted == 1


@needs_sim
def test_a_cuda_array_interface_past_its_allocation_is_refused(live):
    from handoff import sim

    small = sim.zeros((6,), "float32")
    interface = {"shape": (1 << 24,), "typestr": "<f4", "data": (small.data_ptr, False), "version": 3}
    with pytest.raises(ValueError, match="run past the end of their allocation"):
        handoff.asarray(CudaArrayInterface(interface))


class Produces:
    """A producer whose __dlpack__ hands out `tensor` (whatever it is asked), claiming `device`."""

    def __init__(self, tensor: HandMadeTensor, device: tuple[int, int]) -> None:
        self.tensor = tensor
        self.device = device

    def __dlpack__(self, **_kwargs: object) -> object:
        return self.tensor.capsule()

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


class CudaArrayInterface:
    def __init__(self, interface):
        self.__cuda_array_interface__ = interface


@needs_sim
def test_an_empty_cuda_array_interface_with_a_null_pointer_is_on_the_current_device(live):
    # The interface asks for pointer 0 for empty arrays; there is no allocation to ask about.
    view = handoff.asarray(CudaArrayInterface({"shape": (0,), "typestr": "<f4", "data": (0, False), "version": 3}))
    assert view.device == (DEVICE_MEMORY, 0)
    assert view.shape == (0,) and view.data_ptr == 0


@needs_sim
@pytest.mark.parametrize("how", ["argument", "block"])
def test_a_cuda_array_interface_onto_a_stream_object_for_the_default_stream(how):
    # handoff.Stream(0) is the default stream's handle: DLPack spells it 1 for CUDA, 0 for ROCm.
    from handoff import sim

    source = sim.zeros(1024)
    producer = sim.Stream(non_blocking=True)
    with sim.hold(producer):
        sim.fill(source, 5.0, stream=producer)
        cai = {"shape": (1024,), "typestr": "<f4", "data": (source.data_ptr, False), "version": 3,
               "stream": int(producer.handle)}  # fmt: skip
        if how == "argument":
            view = handoff.asarray(CudaArrayInterface(cai), stream=handoff.Stream(0))
        else:
            with handoff.stream(handoff.Stream(0)):
                view = handoff.asarray(CudaArrayInterface(cai))
        read = waiting_read(view, CONSUMER_STREAM)
    assert read.result()[0] == 5.0
    del view
    sim.synchronize()


@needs_sim
def test_cuda_array_interface_stream_values_are_cuda_numbered_on_every_platform():
    # 1 is the legacy default stream in the interface, also from a HIP build of a CUDA library.
    from handoff import sim

    source = sim.zeros(1024)
    consumer = sim.Stream(non_blocking=True)  # no implicit synchronization with the default stream
    with sim.hold(CONSUMER_STREAM):
        sim.fill(source, 3.0, stream=CONSUMER_STREAM)  # the platform's default stream
        cai = {"shape": (1024,), "typestr": "<f4", "data": (source.data_ptr, False), "version": 3, "stream": 1}
        view = handoff.asarray(CudaArrayInterface(cai), stream=consumer)
        read = waiting_read(view, consumer)
    assert read.result()[0] == 3.0
    del view
    sim.synchronize()


EXIT_WITH_DAEMON_THREADS = textwrap.dedent(
    """
    import sys, threading, time
    import numpy as np
    import handoff
    from handoff import sim

    producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    source = sim.zeros(1 << 14)
    host = np.arange(16.0)

    class StreamObject:  # resolved through handoff.as_stream, Python code inside the import
        def __cuda_stream__(self):
            return (0, consumer.handle)

    def forever(step):
        def run():
            while True:
                step()
        return run

    steps = [
        lambda: source.__dlpack__(stream=consumer.handle),                  # ordered export
        lambda: handoff.from_dlpack(source, stream=consumer),               # ordered import
        lambda: handoff.from_dlpack(source, stream=StreamObject()),
        lambda: sim.to_numpy(source, stream=producer),                      # blocks: GIL released
        lambda: handoff.from_dlpack(source, device="cpu"),                  # blocks: GIL released
        lambda: handoff.from_dlpack(host),
    ]
    for step in steps:
        threading.Thread(target=forever(step), daemon=True).start()
    time.sleep(0.3)
    sys.stdout.write("exiting\\n")
    """
)


@needs_sim
@pytest.mark.parametrize("attempt", range(3))
def test_exit_while_daemon_threads_are_inside_handoff_calls(attempt):
    result = run_python(EXIT_WITH_DAEMON_THREADS)
    assert "terminate called" not in result.stderr
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout == "exiting\n"
