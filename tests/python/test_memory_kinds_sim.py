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


@pytest.fixture(params=["pinned", "managed"])
def host_accessible(request):
    """Simulator memory of N zeros that the host can reach: pinned, or managed (not on ROCm, where
    managed memory has no DLPack device type)."""
    if SIM_ROCM and request.param == "managed":
        pytest.skip("managed memory has no DLPack device type on ROCm")
    return sim.zeros(N, memory=request.param)


@pytest.mark.parametrize("to_cpu", [_exported_to_the_cpu, _imported_to_the_cpu], ids=["export", "import"])
def test_host_accessible_memory_goes_to_the_cpu_without_a_copy(host_accessible, to_cpu):
    source = host_accessible
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


def test_numpy_over_host_accessible_memory_is_imported_on_its_device_through_subclass_views(host_accessible):
    # NumPy's __dlpack_device__ walks an array's bases, subclasses' included, to the capsule
    # numpy.from_dlpack kept: the import's device comes from there, not from the array's fields.
    class Tagged(np.ndarray):
        pass

    on_numpy = np.from_dlpack(host_accessible)
    through_subclass = on_numpy.view(Tagged)[1:].view(np.ndarray)
    assert isinstance(through_subclass.base, Tagged)
    for a in (on_numpy, through_subclass):
        assert a.__dlpack_device__() == host_accessible.__dlpack_device__()
        view = handoff.from_dlpack(a)
        assert view.device == host_accessible.__dlpack_device__()
        assert view.data_ptr == a.__array_interface__["data"][0]


def test_a_copy_of_host_accessible_memory_comes_back_on_the_same_device(host_accessible):
    source = host_accessible
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


@pytest.mark.parametrize("claim", ["pinned", "managed"])
def test_device_memory_claimed_host_accessible_is_refused_and_its_producer_released_once(claim):
    # The host reads what is claimed pinned or managed (a view or a copy to the CPU): device memory
    # under that claim faulted there.
    if SIM_ROCM and claim == "managed":
        pytest.skip("managed memory has no DLPack device type on ROCm")
    claimed = {"pinned": 11 if SIM_ROCM else 3, "managed": 13}[claim]
    device_memory, host_accessible = sim.zeros(N), sim.zeros(N, memory=claim)  # the second: the control
    for memory, refused in ((device_memory, True), (host_accessible, False)):
        tensor = HandMadeTensor(memory.data_ptr, (N,), code=2, bits=32)
        tensor.managed.dl_tensor.device = DLDevice(claimed, 0)
        if refused:
            with pytest.raises(ValueError, match=f"claims .* memory, but {memory.data_ptr:#x} is device memory"):
                handoff.from_dlpack(tensor.capsule())
        else:
            view = handoff.from_dlpack(tensor.capsule(), device="cpu")
            assert view.data_ptr == memory.data_ptr, "host-accessible memory is reused"
            del view
        gc.collect()
        sim.drain()
        assert tensor.deleted == 1, memory


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


class PinnedExporter(handoff.Exporter):
    """A library's array over pinned memory, exporting through handoff.Exporter."""

    def __init__(self, memory):
        self.memory = memory

    def __handoff_array__(self):
        return self.memory


PINNED_PRODUCERS = {"handoff.Array": lambda memory: memory, "Exporter": PinnedExporter}
TORCH_IMPORTS = {
    "from_dlpack": lambda torch, x: torch.from_dlpack(x),
    "device='cpu'": lambda torch, x: torch.from_dlpack(x, device="cpu"),
    "copy=True": lambda torch, x: torch.from_dlpack(x, copy=True),
}


@pytest.mark.parametrize("producer", PINNED_PRODUCERS.values(), ids=PINNED_PRODUCERS)
@pytest.mark.parametrize("torch_import", TORCH_IMPORTS.values(), ids=TORCH_IMPORTS)
def test_torch_from_dlpack_of_pinned_memory_is_refused_saying_how_to_import_it_without_a_copy(
    torch, producer, torch_import
):
    # PyTorch 2.13's from_dlpack asks for the data where __dlpack_device__ says it is (never on the
    # CPU: dl_device only for the device its caller names, and pinned memory is none of PyTorch's),
    # and its import refuses a kDLCUDAHost capsule ("Unsupported device_type: 3"). Its `copy=True`
    # copies after that import, and `device='cpu'` moves after it.
    source = sim.zeros(N, memory="pinned")
    sim.fill(source, 3.0, stream=sim.Stream(non_blocking=True))
    sim.synchronize()
    pinned = source.device[0]
    refusal = rf"PyTorch 2\.\d+\S* imports no .* capsule \(DLPack device type {pinned}\)"
    with pytest.raises(BufferError, match=refusal) as refused:
        torch_import(torch, producer(source))
    assert "torch.from_dlpack(handoff.from_dlpack(x, device='cpu'))" in str(refused.value)
    # What the error says to do: a CPU tensor of the same memory.
    tensor = torch.from_dlpack(handoff.from_dlpack(producer(source), device="cpu"))
    assert tensor.data_ptr() == source.data_ptr, "the pinned memory must be reused, not copied"
    assert tensor[0].item() == 3.0 and tensor[-1].item() == 3.0
    tensor[0] = 4.0
    assert np.from_dlpack(handoff.from_dlpack(source, device="cpu"))[0] == 4.0


def test_pinned_memory_asked_for_on_the_cpu_reaches_torch_without_a_copy(torch):
    # The array API's way, which PyTorch's from_dlpack never takes but a capsule carries to it.
    source = sim.zeros(N, memory="pinned")
    sim.synchronize()
    tensor = torch.from_dlpack(source.__dlpack__(dl_device=(CPU, 0), max_version=(1, 1)))
    assert tensor.data_ptr() == source.data_ptr


def test_a_pytorch_that_may_import_pinned_memory_gets_it_as_it_is(torch, monkeypatch):
    # Only the PyTorch releases known to refuse it (through 2.13) are told what to do instead; a
    # later one gets the capsule DLPack describes, kDLCUDAHost (this 2.13 then refuses it itself).
    source = sim.zeros(N, memory="pinned")
    sim.synchronize()
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    with pytest.raises(BufferError, match=rf"^Unsupported device_type: {source.device[0]}$"):
        torch.from_dlpack(source)
