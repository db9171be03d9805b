"""Memory kinds peers really export: managed memory labelled as device memory (kDLCUDA, as PyTorch
with a managed allocator and RMM's managed resource export it), and pinned or managed memory
handed to the CPU, which reuses the memory. Run with HANDOFF_BACKEND=sim or sim-rocm."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import handoff

from dlpack_ctypes import CPU, DLDevice, HandMadeTensor
from support import BACKEND, HOLD_DEADLOCK, SIM_ROCM, DlpackOnly, needs_sim, waiting_read

pytestmark = needs_sim
if BACKEND.startswith("sim"):
    from handoff import sim

DEVICE = 10 if SIM_ROCM else 2
N = 1024


@pytest.fixture(autouse=True)
def settle():
    yield
    sim.synchronize()
    gc.collect()
    sim.drain()


@pytest.mark.skipif(SIM_ROCM, reason="managed memory has no DLPack device type on ROCm")
def test_managed_memory_exported_as_device_memory_is_accepted_and_ordered():
    managed = sim.zeros(N, memory="managed")
    producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    with sim.hold(producer):
        sim.fill(managed, 6.0, stream=producer)
        as_device = handoff.from_dlpack(managed, stream=producer)  # ready on the producer's stream
        tensor = HandMadeTensor(managed.data_ptr, (N,), code=2, bits=32)  # float32
        tensor.managed.dl_tensor.device = DLDevice(DEVICE, 0)  # as PyTorch labels managed memory
        view = handoff.from_dlpack(tensor.capsule(), stream=consumer)
        assert view.device == (DEVICE, 0)
        assert view.data_ptr == managed.data_ptr
        ordered = handoff.from_dlpack(as_device, stream=consumer)  # orders the consumer after the fill
        read = waiting_read(ordered, consumer)
    assert read.result()[0] == 6.0
    del view, ordered, as_device
    gc.collect()
    sim.synchronize()
    sim.drain()
    assert tensor.deleted == 1


def _exported_to_the_cpu(source, copy):
    return handoff.from_dlpack(source.__dlpack__(dl_device=(CPU, 0), copy=copy, max_version=(1, 1)))


def _imported_to_the_cpu(source, copy):
    # A capsule: no producer is left to honour `device`, so the consumer moves the data.
    return handoff.from_dlpack(source.__dlpack__(max_version=(1, 1)), device="cpu", copy=copy)


@pytest.mark.parametrize("to_cpu", [_exported_to_the_cpu, _imported_to_the_cpu], ids=["export", "import"])
@pytest.mark.parametrize("memory", ["pinned", "managed"])
def test_host_accessible_memory_goes_to_the_cpu_without_a_copy(memory, to_cpu):
    if SIM_ROCM and memory == "managed":
        pytest.skip("managed memory has no DLPack device type on ROCm")
    source = sim.zeros(N, memory=memory)
    producer = sim.Stream(non_blocking=True)
    with sim.hold(producer):
        sim.fill(source, 8.0, stream=producer)
        for copy in (None, False, True):  # each waits on the host for the held write: here, for ever
            with pytest.raises(handoff.DeviceError, match=HOLD_DEADLOCK):
                to_cpu(source, copy)
    for copy in (None, False):
        view = to_cpu(source, copy)
        assert view.device == (CPU, 0)
        assert view.data_ptr == source.data_ptr, "host-accessible memory must be reused, not copied"
        assert np.from_dlpack(view)[0] == 8.0, "the CPU consumer must see the producer's finished write"
    copied = to_cpu(source, True)
    assert copied.data_ptr != source.data_ptr
    assert np.from_dlpack(copied)[-1] == 8.0


@pytest.mark.parametrize("memory", ["pinned", "managed"])
def test_a_copy_of_host_accessible_memory_comes_back_on_the_same_device(memory):
    if SIM_ROCM and memory == "managed":
        pytest.skip("managed memory has no DLPack device type on ROCm")
    source = sim.zeros(N, memory=memory)
    producer = sim.Stream(non_blocking=True)
    with sim.hold(producer):
        sim.fill(source, 5.0, stream=producer)
        # handoff's exporter and importer agree: the copy is of the device the source says it is on
        copied = handoff.from_dlpack(source, device=source.__dlpack_device__(), copy=True)
        assert copied.device == source.__dlpack_device__()
        assert copied.data_ptr != source.data_ptr
        with pytest.raises(handoff.DeviceError, match=HOLD_DEADLOCK):  # the host waits for the copy
            handoff.from_dlpack(copied, device="cpu")
    assert np.from_dlpack(handoff.from_dlpack(copied, device="cpu"))[-1] == 5.0


def test_device_memory_to_the_cpu_with_copy_false_is_still_refused():
    source = sim.zeros(N)
    with pytest.raises(BufferError, match="copy=False"):
        source.__dlpack__(dl_device=(CPU, 0), copy=False, max_version=(1, 1))


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "negative-control"])
def test_pinned_memory_is_asked_for_with_none_and_the_consumer_ordered_after_the_default_stream(ordered, sim_streams):
    # Pinned memory is CPU memory to PyTorch, whose pinned tensors take only stream None or -1: the
    # producer is asked with None, which DLPack's stream table reads as the default stream, and the
    # consumer's non-blocking stream is then ordered after that stream.
    producer, consumer = sim_streams
    source = sim.zeros(N, memory="pinned")
    sim.synchronize()
    forwarded = DlpackOnly(source)
    with sim.hold(producer):
        sim.fill(source, 7.0, stream=producer)
        view = handoff.from_dlpack(forwarded, stream=consumer if ordered else -1)
        read = sim.to_numpy(view, stream=consumer, wait=False)
        if ordered:
            assert not read.done() and sim.pending(consumer) > 0, "the consumer must wait for the held producer"
        else:
            assert sim.to_numpy(view, stream=consumer)[0] == 0.0, "the negative control reads before the write"
    assert [call.get("stream") for call in forwarded.calls] == [None if ordered else -1]
    assert view.device == source.device
    if ordered:
        seen = read.result()
        assert (seen[0], seen[-1]) == (7.0, 7.0)
    else:
        read.result()
