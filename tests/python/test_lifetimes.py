"""Who keeps what alive: producers, capsules and their deleters, on every path, on many threads,
and at interpreter shutdown."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest

import handoff

from dlpack_ctypes import capsule_name
from support import SIM_ROCM, live_views, needs_sim, run_python, run_threads


class Owned(np.ndarray):
    """A NumPy array that can be weakly referenced and says so by name."""


def owned(n: int = 6) -> Owned:
    return np.arange(n, dtype=np.float64).view(Owned)


class Producer:
    """A tiny producer whose capsules come from a NumPy array it holds."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __dlpack__(self, **kwargs):
        return self.data.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.data.__dlpack_device__()


class FailingProducer:
    def __init__(self, error: type[BaseException]) -> None:
        self.error = error
        self.calls = 0

    def __dlpack__(self, **kwargs):
        self.calls += 1
        raise self.error("producer refused")

    def __dlpack_device__(self):
        return (1, 0)


class LegacyProducer:
    """A producer older than DLPack 1.0: no max_version keyword."""

    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __dlpack__(self, stream=None):
        return self.data.__dlpack__()

    def __dlpack_device__(self):
        return (1, 0)


def test_array_keeps_the_producer_alive(settled):
    data = owned()
    ref = weakref.ref(data)
    h = handoff.from_dlpack(Producer(data))
    del data
    assert ref() is not None
    assert live_views() == settled + 1
    np.testing.assert_array_equal(np.from_dlpack(h), np.arange(6.0))
    del h
    assert ref() is None  # by reference counting alone, no gc pass needed
    assert handoff.stats()["live_views"] == settled


def test_unconsumed_capsule_keeps_the_producer_alive(settled):
    data = owned()
    ref = weakref.ref(data)
    h = handoff.from_dlpack(data)
    del data
    capsule = h.__dlpack__(max_version=(1, 1))
    del h
    assert ref() is not None
    assert handoff.stats()["live_views"] == settled + 1
    del capsule  # its destructor runs the deleter
    assert ref() is None
    assert handoff.stats()["live_views"] == settled


@pytest.mark.parametrize("max_version", [None, (1, 0), (1, 1)])
def test_capsule_deleter_runs_on_gc(max_version, settled):
    data = owned()
    ref = weakref.ref(data)
    h = handoff.from_dlpack(data)
    del data

    class Cycle:
        pass

    holder = Cycle()
    holder.self = holder
    holder.capsule = h.__dlpack__(max_version=max_version)
    del h, holder
    assert ref() is not None  # held by a reference cycle until the collector runs
    assert live_views() == settled
    assert ref() is None


def test_views_of_views_share_one_producer(settled):
    data = owned()
    ref = weakref.ref(data)
    h1 = handoff.from_dlpack(data)
    h2 = handoff.from_dlpack(h1)
    h3 = handoff.from_dlpack(h2.__dlpack__())
    b = np.from_dlpack(h3)
    del data, h1, h2
    assert ref() is not None
    del h3
    assert ref() is not None  # b still uses it
    b[0] = 5.0
    del b
    assert ref() is None


def test_consumed_capsules_are_renamed(torch, settled):
    a = np.arange(4.0)
    for max_version, name in [((1, 1), "dltensor_versioned"), (None, "dltensor")]:
        capsule = a.__dlpack__(max_version=max_version)
        assert capsule_name(capsule) == name
        h = handoff.from_dlpack(capsule)
        assert capsule_name(capsule) == "used_" + name
        exported = h.__dlpack__(max_version=max_version)
        assert capsule_name(exported) == name
        t = torch.utils.dlpack.from_dlpack(exported)
        assert capsule_name(exported) == "used_" + name
        assert t.data_ptr() == a.ctypes.data
        del h, t, capsule, exported


def test_torch_keeps_the_producer_alive(torch, settled):
    data = owned()
    ref = weakref.ref(data)
    t = torch.from_dlpack(handoff.from_dlpack(data))
    del data
    assert ref() is not None
    assert live_views() == settled + 1
    del t
    assert ref() is None
    assert handoff.stats()["live_views"] == settled


def test_legacy_producer_falls_back_and_keeps_its_data_alive(settled):
    data = owned()
    ref = weakref.ref(data)
    h = handoff.from_dlpack(LegacyProducer(data))
    assert h.data_ptr == data.ctypes.data
    del data
    assert ref() is not None
    del h
    assert ref() is None


@pytest.mark.parametrize("error", [BufferError, ValueError, RuntimeError, TypeError])
def test_producer_raising_leaks_nothing(error, settled):
    producer = FailingProducer(error)
    with pytest.raises(error, match="producer refused"):
        handoff.from_dlpack(producer)
    assert producer.calls == (2 if error is TypeError else 1)  # TypeError: one legacy retry
    assert live_views() == settled
    with pytest.raises(error, match="producer refused"):
        handoff.asarray(producer)  # a BufferError tries the other protocols; with none, it is raised
    assert live_views() == settled


def test_unsupported_dtype_through_the_buffer_protocol_leaks_nothing(settled):
    a = np.array(["ab", "cd"])
    view = memoryview(a)
    with pytest.raises(BufferError, match="buffer format"):
        handoff.asarray(view)
    assert live_views() == settled
    view.release()  # raises BufferError if handoff still held an export of it


def test_buffer_is_released_with_the_array(settled):
    raw = bytearray(16)
    h = handoff.asarray(raw)
    with pytest.raises(BufferError):
        raw.extend(b"x")  # exported: cannot resize
    del h
    raw.extend(b"x")
    view = memoryview(np.arange(3.0))
    h = handoff.asarray(view)
    with pytest.raises(BufferError):
        view.release()
    del h
    view.release()


def test_refused_readonly_legacy_export_leaks_nothing(settled):
    a = np.broadcast_to(np.arange(3.0), (2, 3))
    h = handoff.from_dlpack(a)
    for _ in range(3):
        with pytest.raises(BufferError):
            h.__dlpack__()
    del h
    assert live_views() == settled


def test_refused_stream_export_leaks_nothing(settled):
    h = handoff.from_dlpack(np.arange(3.0))
    for value in (0, 1, True, "x"):
        with pytest.raises((ValueError, TypeError)):
            h.__dlpack__(stream=value, max_version=(1, 1))
    del h
    assert live_views() == settled


def test_exceptions_keep_their_traceback_through_capsule_destructors(settled):
    # A capsule destroyed while an exception propagates must not clear or replace it.
    h = handoff.from_dlpack(np.arange(3.0))

    def fail():
        capsule = h.__dlpack__()  # noqa: F841 - destroyed during unwinding
        raise KeyError("kept")

    with pytest.raises(KeyError, match="kept"):
        fail()
    del h


def test_many_threads_exchanging_at_once(torch, settled):
    threads, rounds = 8, 500
    errors: list[BaseException] = []
    barrier = threading.Barrier(threads)

    def worker(seed: int) -> None:
        try:
            barrier.wait()
            for i in range(rounds):
                a = np.full(4 + (i % 3), seed * 1000 + i, dtype=np.int64)
                t = torch.from_dlpack(handoff.from_dlpack(a))
                assert t.data_ptr() == a.ctypes.data
                assert int(t[0]) == seed * 1000 + i
                b = np.from_dlpack(handoff.from_dlpack(t))
                assert b.ctypes.data == a.ctypes.data
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    run_threads(worker, threads)
    assert not errors, errors[0]
    assert live_views() == settled


def test_objects_released_on_another_thread(settled):
    # The last reference may die on a thread that did not import: releases take the GIL there.
    data = owned()
    ref = weakref.ref(data)
    box = [handoff.from_dlpack(data), handoff.from_dlpack(data).__dlpack__()]
    del data
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
    assert ref() is None
    assert live_views() == settled


SHUTDOWN = """
import numpy as np, handoff
{extra}
a = np.arange(10.0)
h = handoff.from_dlpack(a)
c1 = h.__dlpack__()
c2 = h.__dlpack__(max_version=(1, 1))
b = np.from_dlpack(handoff.from_dlpack(h))
m = handoff.asarray(memoryview(bytearray(8)))
i = handoff.asarray(type("I", (), {{"__array_interface__": a.__array_interface__, "keep": a}})())
class Cycle: pass
cycle = Cycle(); cycle.cycle = cycle; cycle.capsule = h.__dlpack__(); cycle.array = h
"""


@pytest.mark.parametrize("extra", ["", "import torch; t = torch.from_dlpack(handoff.from_dlpack(np.ones(3)))"])
def test_interpreter_shutdown_with_live_objects(extra):
    if extra and "torch" not in sys.modules:
        pytest.importorskip("torch")
    result = run_python(SHUTDOWN.format(extra=extra))
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout == ""


def test_shutdown_from_a_thread_holding_arrays():
    code = """
import threading, numpy as np, handoff
keep = []
def work():
    keep.append(handoff.from_dlpack(np.arange(4.0)))
    keep.append(keep[-1].__dlpack__())
t = threading.Thread(target=work); t.start(); t.join()
"""
    result = run_python(code)
    assert (result.returncode, result.stderr) == (0, "")


# --- long chains ---------------------------------------------------------------------------------

CHAINS = {
    # each array imports the previous one
    "re-import": "a = handoff.from_dlpack(a)",
    # each array's owner is the previous one (a library wrapping its own views)
    "owner": "a = handoff.view(a.data_ptr, a.shape, a.dtype, device='cpu', owner=a)",
    # each import goes through a capsule, which wraps the producer it holds
    "capsule": "a = handoff.from_dlpack(a.__dlpack__(max_version=(1, 1)))",
}


@pytest.mark.parametrize("link", CHAINS.values(), ids=CHAINS.keys())
def test_dropping_a_long_chain_of_arrays_releases_it_iteratively(link):
    # Each array releases the next inside its own deallocation: recursively, 200,000 deep, that
    # overflows the C stack.
    code = f"""
import numpy as np, handoff
a = handoff.from_dlpack(np.zeros(4, np.float32))
for _ in range(200_000):
    {link}
del a
print(handoff.stats()["live_views"])
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["0"]


def test_re_imports_share_their_root_producer(settled):
    source = owned()
    a = handoff.from_dlpack(source)
    for _ in range(1000):
        a = handoff.from_dlpack(a)
    assert live_views() == settled + 2, "a chain of re-imports keeps one producer and the last view's"
    assert np.from_dlpack(a).tolist() == source.tolist()
    del a


def test_round_trips_through_pytorch_drop_without_recursion(torch):
    code = """
import numpy as np, torch, handoff
a = handoff.from_dlpack(np.zeros(4, np.float32))
for _ in range(100_000):
    a = handoff.from_dlpack(torch.from_dlpack(a))
del a
print("dropped")
"""
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["dropped"]


# --- deferred releases on the simulator ------------------------------------------------------


class Held:
    """What keeps simulated memory: a producer handoff must release once its consumer is done."""


@needs_sim
def test_a_transient_failure_of_a_deferred_release_is_asked_again(sim_streams):
    # The device could not be made current three times in a row: the fallback from a failed event
    # record to waiting for the stream tried once and kept the producer for the life of the process,
    # saying pending_releases 0.
    from handoff import sim

    _, consumer = sim_streams
    data = sim.zeros((16,), "float32")
    held = Held()
    alive = weakref.ref(held)
    view = handoff.view(data.data_ptr, (16,), "float32", device=data.device, owner=held)
    imported = handoff.from_dlpack(view, stream=consumer)
    del view, held
    before = handoff.stats()["pending_releases"]
    sim.inject_fault("push_current_device", 3, "hipErrorLaunchFailure" if SIM_ROCM else "cudaErrorLaunchFailure")
    # Dropped on a thread with no device current, as a consumer's thread may be.
    dropper = threading.Thread(target=list.clear, args=([imported],))
    del imported
    dropper.start()
    dropper.join()
    sim.drain()  # asks the device nothing: the injected faults are the release's alone
    sim.clear_faults()
    gc.collect()
    assert alive() is None, "a transient failure abandoned the release and kept its producer"
    assert handoff.stats()["pending_releases"] == before


@needs_sim
def test_a_view_imported_during_a_capture_is_kept_for_the_graphs_launches():
    # torch.cuda.graph: the graph reads the data at every launch, however soon after the capture
    # the imported view is dropped. It was released after the stream's own work.
    from handoff import sim

    consumer = sim.Stream(non_blocking=False)
    data = sim.zeros((16,), "float32")
    held = Held()
    alive = weakref.ref(held)
    view = handoff.view(data.data_ptr, (16,), "float32", device=data.device, owner=held, stream=consumer)
    del held
    sim.begin_capture(consumer)
    imported = handoff.from_dlpack(view, stream=consumer)  # ready on the capturing stream itself
    sim.fill(imported, 2.0, stream=consumer)  # a node of the graph: it writes the data at each launch
    graph = sim.end_capture(consumer)
    del view, imported  # after the capture
    graph.launch(consumer)
    consumer.synchronize()
    sim.drain()
    gc.collect()
    assert alive() is not None, "released while the graph that writes the data can still be launched"
    graph.launch(consumer)
    del graph  # the launch still holds it
    consumer.synchronize()
    sim.drain()
    gc.collect()
    assert alive() is None


# A batch of releases: a Python producer's, then a copy in pinned memory, whose free waits for the
# device. The batch held the GIL through the free, which waits for work this thread holds back
# until it gets the GIL: a deadlock (and every Python thread stalled by any such free).
RELEASE_BATCH = """
import threading, weakref
import handoff
from handoff import sim

consumer, busy = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
pinned = sim.zeros((1024,), "float32", memory="pinned")
copy = handoff.from_dlpack(pinned, copy=True)  # pinned too: its free waits for the device
imported_copy = handoff.from_dlpack(copy, stream=consumer)
del copy


class Owner:
    pass


owner = Owner()
finalized = threading.Event()
weakref.finalize(owner, finalized.set)
data = sim.zeros((16,), "float32")
imported_view = handoff.from_dlpack(
    handoff.view(data.data_ptr, (16,), "float32", device=data.device, owner=owner), stream=consumer
)
del owner
with sim.hold(busy):
    sim.fill(data, 1.0, stream=busy)  # work the free waits for
    with sim.hold(consumer):  # both released in one batch once the consumer's work is done
        del imported_view  # its Python part first
        del imported_copy
    finalized.wait()  # the batch runs: the free waits for `busy`, which this thread must let go
print("let go", flush=True)
sim.synchronize()
sim.drain()
print("released", flush=True)
"""


@needs_sim
def test_a_release_batch_holds_the_gil_only_for_its_python_parts():
    try:
        result = subprocess.run(
            [sys.executable, "-c", RELEASE_BATCH],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HANDOFF_BACKEND": handoff.runtime_info()["backend"]},
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"deadlock: the batch held the GIL through a free that waits for the device ({e.stdout!r})")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:2] == ["let go", "released"]
