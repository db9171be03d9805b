"""Ordering that must survive more than one hop: chains of imports through the default stream,
copies made for a consumer stream (and freed on their own device), device-to-host copies whose
synchronization fails, and a per-thread default stream that another thread passes on.

Run with HANDOFF_BACKEND=sim or sim-rocm; skipped otherwise. Each ordering test has a negative
control that shows the race when ordering is turned off, and holds its race with sim.hold.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import sys
import threading

import pytest
from peer_library import export_as_torch

import handoff

from dlpack_ctypes import HandMadeTensor
from support import (
    BACKEND,
    DEFAULT_STREAM,
    SIM_ROCM,
    behind,
    needs_sim,
    needs_two_devices,
    sim_leak_check,
    waiting_read,
)

pytestmark = needs_sim
if BACKEND.startswith("sim"):
    from handoff import sim

N = 4096
# Each write uses a value no earlier test wrote: a fresh allocation may reuse memory that still holds
# an old value, which would make a read of unwritten memory look right.
VALUES = itertools.count(start=10)


@pytest.fixture(autouse=True)
def no_leaks():
    yield from sim_leak_check()


@pytest.fixture
def new_stream():
    """Makes streams that outlive the test's views, as a consumer stream must."""
    made = []

    def make(non_blocking=True):
        made.append(sim.Stream(non_blocking=non_blocking))
        return made[-1]

    yield make
    sim.synchronize()


def pending_write(stream, device=0):
    """A device array and the value its producer write, enqueued on `stream`, puts everywhere: still
    pending while the caller holds `stream` (sim.hold)."""
    array = sim.zeros(N, "float32", device)
    value = float(next(VALUES))
    sim.fill(array, value, stream=stream)
    return array, value


@pytest.mark.parametrize("last_blocking", [False, True], ids=["non-blocking", "blocking"])
def test_a_hop_through_the_default_stream_keeps_the_order(last_blocking, new_stream):
    producer = new_stream(non_blocking=False)
    last = new_stream(non_blocking=not last_blocking)
    with sim.hold(producer):
        source, value = pending_write(producer)
        hop = handoff.from_dlpack(source, stream=DEFAULT_STREAM)  # nothing is enqueued on the default stream
        view = handoff.from_dlpack(hop, stream=last)
        read = waiting_read(view, last)
    assert read.result()[0] == value


def test_a_hop_from_the_default_stream_to_a_blocking_stream_keeps_the_order(new_stream):
    middle = new_stream(non_blocking=False)
    last = new_stream()
    with sim.hold(DEFAULT_STREAM):
        source, value = pending_write(DEFAULT_STREAM)
        hop = handoff.from_dlpack(source, stream=middle)  # nothing is enqueued on `middle`
        view = handoff.from_dlpack(hop, stream=last)
        read = waiting_read(view, last)
    assert read.result()[0] == value


def test_negative_control_a_hop_with_no_ordering_shows_the_race(new_stream):
    producer = new_stream()  # non-blocking: no implicit synchronization orders it either
    last = new_stream()
    with sim.hold(producer):
        source, value = pending_write(producer)
        hop = handoff.from_dlpack(source, stream=-1)
        view = handoff.from_dlpack(hop, stream=last)
        assert sim.to_numpy(view, stream=last)[0] != value, "expected stale data without ordering"


COPIES = {
    "from_dlpack": lambda source, stream: handoff.from_dlpack(source, stream=stream, copy=True),
    "asarray": lambda source, stream: handoff.asarray(source, stream=stream, copy=True),
    "__dlpack__": lambda source, stream: handoff.from_dlpack(
        source.__dlpack__(stream=stream.handle, copy=True, max_version=(1, 1)), stream=stream
    ),
}


@pytest.mark.parametrize("how", COPIES)
def test_a_copy_for_a_consumer_stream_is_written_before_the_consumer_reads_it(how, new_stream):
    producer = new_stream()
    consumer = new_stream()
    with contextlib.ExitStack() as copy_held:
        with sim.hold(producer):
            source, value = pending_write(producer)
            copy_held.enter_context(sim.hold(producer))  # a second hold, after the write: the copy waits for it
            copy = COPIES[how](source, consumer)
            assert copy.data_ptr != source.data_ptr
            read = waiting_read(copy, consumer)
        # The write may run now; the copy may not. The consumer's read must wait for the copy itself.
        assert sim.waits_for_hold(consumer), "the consumer reads the copy before it is written"
    assert read.result()[0] == value


def test_negative_control_a_copy_read_on_an_unordered_stream_shows_the_race(new_stream):
    producer = new_stream()
    consumer = new_stream()
    with sim.hold(producer):
        source, value = pending_write(producer)
        copy = handoff.from_dlpack(source, stream=-1, copy=True)
        assert sim.to_numpy(copy, stream=consumer)[0] != value, "expected stale data without ordering"
    sim.synchronize()


@pytest.mark.parametrize("device", [0, pytest.param(1, marks=needs_two_devices)])
def test_a_copy_is_freed_in_its_own_stream_order(device, new_stream):
    # The free of a copy named its stream by a default stream's handle, which resolved on the
    # device current where the copy was dropped: freed at once there, while the copy into it was
    # still queued on device 1 (a write into freed memory). On the current device it must wait too.
    source = sim.zeros(N, "float32", device)
    sim.synchronize()
    sim.set_device(device)
    with sim.hold(DEFAULT_STREAM):  # the default stream of the data's device
        sim.set_device(0)  # the copy is dropped where device 0 is current
        sim.fill(source, float(next(VALUES)), stream=DEFAULT_STREAM)  # the default stream of its device
        copy = handoff.from_dlpack(source, stream=-1, copy=True)  # queued behind the write
        allocations = sim.live_allocations()
        del copy
        sim.synchronize_unheld()  # a free that does not wait for the copy has run by now
        assert sim.live_allocations() == allocations, "the copy was freed while a copy into it was queued"
    sim.synchronize()


per_thread_only = pytest.mark.skipif(SIM_ROCM, reason="ROCm's per-thread default stream has no DLPack stream value")
PER_THREAD = 2  # CUDA's per-thread default stream: its handle names the calling thread's stream


def in_thread_kept_alive(work):
    """Runs `work` in a thread that stays alive (so that its per-thread stream is its own) until
    the returned function is called; returns `work`'s result and that function."""
    result, done, leave = {}, threading.Event(), threading.Event()

    def run():
        result["value"] = work()
        done.set()
        leave.wait()

    thread = threading.Thread(target=run)
    thread.start()
    done.wait()

    def finish():
        leave.set()
        thread.join()

    return result.pop("value"), finish


@per_thread_only
def test_data_ready_on_a_per_thread_stream_is_ordered_for_another_thread(new_stream):
    producer = new_stream()
    consumer = new_stream()
    with sim.hold(producer):
        source, value = pending_write(producer)
        view, finish = in_thread_kept_alive(lambda: handoff.from_dlpack(source, stream=PER_THREAD))
        again = handoff.from_dlpack(view, stream=consumer)  # another thread: another per-thread stream
        read = waiting_read(again, consumer)
    assert read.result()[0] == value
    finish()


@per_thread_only
def test_a_release_after_a_per_thread_stream_waits_for_it_from_another_thread():
    target = sim.zeros(N)
    sim.synchronize()
    gate = sim.Stream(non_blocking=True)

    def import_and_write():
        behind(gate, PER_THREAD)  # the thread's stream now waits for the held gate
        tensor = HandMadeTensor(target.data_ptr, (N,), device=(2, 0))
        view = handoff.from_dlpack(tensor.capsule(), stream=PER_THREAD)
        sim.fill(view, 1.0, stream=PER_THREAD)  # the consumer's work on its stream
        return tensor, view

    with sim.hold(gate):
        (tensor, view), finish = in_thread_kept_alive(import_and_write)
        assert sys.getrefcount(view) == 2  # this frame's reference is the last: the release happens here
        del view
        sim.synchronize_unheld()
        assert tensor.deleted == 0, "released while the consumer's stream still used the data"
    finish()
    sim.synchronize()
    sim.drain()
    assert tensor.deleted == 1


HOST_COPIES = {
    "from_dlpack(device='cpu')": lambda source: handoff.from_dlpack(source, device="cpu"),
    "__dlpack__(dl_device=CPU)": lambda source: handoff.from_dlpack(
        source.__dlpack__(dl_device=(1, 0), max_version=(1, 1))
    ),
    "sim.to_numpy": lambda source: sim.to_numpy(source, stream=DEFAULT_STREAM),
}


@pytest.mark.parametrize("how", HOST_COPIES)
def test_a_failing_synchronization_during_a_host_copy_frees_nothing_early(how, new_stream):
    producer = new_stream()
    with sim.hold(producer):  # the copy is still queued when its synchronization fails
        source, _ = pending_write(producer)
        sim.inject_fault("synchronize_stream", 1, "cudaErrorLaunchFailure")
        with pytest.raises(handoff.DeviceError, match="cudaErrorLaunchFailure"):
            HOST_COPIES[how](source)
        sim.clear_faults()
    sim.synchronize()  # the copy still lands in its staging memory, which must still be there
    gc.collect()
    sim.drain()
    sim.synchronize()


class TorchTensor:
    """A CUDA (ROCm) tensor of PyTorch 2.13 on the simulator: `__dlpack__` exports as PyTorch's does
    (peer_library.export_as_torch: an omitted `stream` is -1, no synchronization), ordering PyTorch's
    current stream, `current`, which the program wrote the data on."""

    __slots__ = ("array", "current")  # no instance dict: handoff's fastest import path calls it

    def __init__(self, array, current):
        self.array, self.current = array, current

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, *, stream=-1, max_version=None, dl_device=None, copy=None):
        return export_as_torch(
            self.array, self, self.current, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy
        )


class TorchTensorWithDict(TorchTensor):
    """The same with an instance dict (a subclass's), which takes the general import path."""

    __slots__ = ("__dict__",)


@pytest.mark.parametrize("kind", [TorchTensor, TorchTensorWithDict])
@pytest.mark.parametrize("entry", [handoff.from_dlpack, handoff.asarray])
def test_a_producer_reading_an_omitted_stream_as_no_sync_is_asked_for_the_default_stream(kind, entry, new_stream):
    producer = new_stream()  # non-blocking: only an explicit wait orders the default stream after it
    with sim.hold(producer):
        source, value = pending_write(producer)
        view = entry(kind(source, producer.handle))  # no consumer stream: the device's default stream
        read = waiting_read(view, DEFAULT_STREAM)
    assert read.result()[0] == value


def test_negative_control_a_producer_asked_for_no_sync_shows_the_race(new_stream):
    producer = new_stream()
    with sim.hold(producer):
        source, value = pending_write(producer)
        view = handoff.from_dlpack(source, stream=-1)
        assert sim.to_numpy(view, stream=DEFAULT_STREAM)[0] != value, "expected stale data without ordering"
