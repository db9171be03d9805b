"""The CUDA rules the simulator enforces where lifetime and teardown go wrong, seen from Python:
captured work runs per graph launch (and a view dropped during a capture is released once, not at
every launch), a sticky error halts a device (and exit does not wait for what it will never run),
a destroyed stream used later is refused and recorded; and the hold (sim.hold) that ordering tests
hold their races with."""

from __future__ import annotations

import gc
import os
import textwrap
import threading
import time

import numpy as np
import pytest

import handoff

from support import BACKEND, DEFAULT_STREAM, HOLD_DEADLOCK, live_views, needs_sim, run_python, sim_leak_check

pytestmark = needs_sim
if BACKEND.startswith("sim"):
    from handoff import sim

STICKY = "hipErrorIllegalAddress" if BACKEND == "sim-rocm" else "cudaErrorIllegalAddress"
INVALID_HANDLE = "hipErrorInvalidHandle" if BACKEND == "sim-rocm" else "cudaErrorInvalidResourceHandle"


def test_captured_work_runs_once_per_launch_and_not_before():
    stream = sim.Stream(non_blocking=True)
    array = sim.zeros(64)
    sim.begin_capture(stream)
    sim.fill(array, 3.0, stream=stream)
    graph = sim.end_capture(stream)
    assert len(graph) == 1
    sim.synchronize()
    assert sim.to_numpy(array, stream=stream)[0] == 0.0, "captured work ran without a launch"
    graph.launch(stream)
    assert np.all(sim.to_numpy(array, stream=stream) == 3.0)


def test_a_view_dropped_during_a_capture_is_released_once_whatever_the_launches(settled):
    consumer = sim.Stream(non_blocking=False)
    source = sim.zeros(64)
    sim.fill(source, 2.0, stream=consumer)
    sim.synchronize()
    sim.begin_capture(consumer)
    view = handoff.from_dlpack(source, stream=consumer)
    sim.fill(source, 4.0, stream=consumer)  # captured work that reads nothing of the release
    del view  # its release must not become a node of the graph
    graph = sim.end_capture(consumer)
    for _ in range(3):
        graph.launch(consumer)
    sim.synchronize()
    sim.drain()  # does not wait for the graph the program holds
    del graph  # the release waited for the graph
    sim.synchronize()
    sim.drain()
    del source
    sim.synchronize()
    sim.drain()
    assert live_views() == settled, "the producer was not released exactly once"


def test_using_a_destroyed_stream_is_recorded_as_a_violation():
    stream = sim.Stream(non_blocking=True)
    handle = stream.handle
    del stream  # destroyed with its object
    with pytest.raises(handoff.DeviceError):
        sim.fill(sim.zeros(4), 1.0, stream=handle)
    found = sim.violations()
    sim.clear_violations()  # the fixture would fail this test otherwise
    assert len(found) == 1 and "after it was destroyed" in found[0], found


@pytest.mark.parametrize(
    "call",
    [
        lambda handle: sim.fill(sim.zeros(4), 1.0, stream=handle),
        lambda handle: sim.to_numpy(sim.zeros(4), stream=handle),
        lambda handle: sim.to_numpy(sim.zeros(4), stream=handle, wait=False),
        lambda handle: sim.hold(handle).__enter__(),
        lambda handle: sim.pending(handle),  # noqa: PLW0108 (sim is imported on sim backends only)
        lambda handle: sim.held(handle),  # noqa: PLW0108
        lambda handle: sim.waits_for_hold(handle),  # noqa: PLW0108
        lambda handle: sim.begin_capture(handle),  # noqa: PLW0108
        lambda handle: handoff.from_dlpack(sim.zeros(4), stream=handle),
    ],
    ids=[
        "fill",
        "to_numpy",
        "to_numpy-no-wait",
        "hold",
        "pending",
        "held",
        "waits_for_hold",
        "begin_capture",
        "from_dlpack",
    ],
)
def test_a_call_on_a_destroyed_stream_fails_as_cuda_reports_it(call):
    stream = sim.Stream(non_blocking=True)
    handle = stream.handle
    del stream
    with pytest.raises(handoff.DeviceError) as failure:
        call(handle)
    found = sim.violations()
    sim.clear_violations()
    assert failure.value.error_name == INVALID_HANDLE, failure.value
    assert found and all("after it was destroyed" in v for v in found), found
    sim.synchronize()


def test_a_sticky_error_fails_every_later_call_on_its_device():
    stream = sim.Stream(non_blocking=True)
    array = sim.zeros(16)
    sim.inject_sticky_fault(0, STICKY)
    try:
        with pytest.raises(handoff.DeviceError) as failure:
            sim.fill(array, 1.0, stream=stream)
        assert failure.value.error_name == STICKY
        with pytest.raises(handoff.DeviceError):
            handoff.from_dlpack(array, stream=stream)
    finally:
        sim.clear_sticky_fault(0)


STICKY_AT_EXIT = textwrap.dedent(
    """
    import atexit, time
    import handoff
    from handoff import sim
    stream = sim.Stream(non_blocking=True)
    source = sim.zeros(1024)
    hold = sim.hold(stream)
    hold.__enter__()
    sim.fill(source, 1.0, stream=stream)
    view = handoff.from_dlpack(source, stream=stream)
    del view  # its release is queued on the stream, behind the held write
    sim.inject_sticky_fault(0, "{error}")  # the stream will never get there
    atexit.register(hold.__exit__, None, None, None)  # after handoff's: runs before its exit drain
    print("exiting", time.monotonic(), flush=True)  # the clock is the machine's: the parent reads it too
    """
)


def test_exit_after_a_sticky_error_abandons_what_will_never_run_at_once_and_says_so():
    result = run_python(STICKY_AT_EXIT.format(error=STICKY), HANDOFF_LOG_LEVEL="warn")
    ended = time.monotonic()
    assert result.returncode == 0, result.stderr
    said, exiting_at = result.stdout.split()
    assert said == "exiting"
    took = ended - float(exiting_at)  # the exit alone, not the interpreter's start on a busy machine
    # Said once, by whichever looked first: the release's poller (kept) or the exit drain (abandoned).
    assert STICKY in result.stderr and ("kept" in result.stderr or "abandoned" in result.stderr), result.stderr
    # Bounded by the device error, not by the 10 s exit limit.
    assert took < 5.0, f"the exit took {took:.1f} s"


FOREIGN_DELETER_AT_EXIT = textwrap.dedent(
    """
    import ctypes, sys
    sys.path.insert(0, {tests!r})
    import handoff
    from handoff import sim
    from dlpack_ctypes import HandMadeTensor, CUDA

    source = sim.zeros(1024)
    # A producer whose deleter takes the GIL, as CuPy 14's does (`with gil`; a ctypes callback does).
    tensor = HandMadeTensor(source.__cuda_array_interface__["data"][0], (1024,), device=(CUDA, 0))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(tensor))  # its deleter's code outlives the interpreter

    class Producer:
        def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
            return tensor.capsule()

        def __dlpack_device__(self):
            return (CUDA, 0)

    stream = sim.Stream(non_blocking=True)
    sim.fill(source, 1.0, stream=stream, delay={delay})
    view = handoff.from_dlpack(Producer(), stream=stream)  # dropped with the module's globals
    print("exiting", flush=True)
    """
)


@pytest.mark.skipif(BACKEND != "sim", reason="the producer exports through the CUDA Array Interface's pointer")
@pytest.mark.parametrize("delay", [0.0, 0.02, 0.2])
def test_a_foreign_deleter_that_takes_the_gil_never_runs_once_python_is_finalizing(delay):
    code = FOREIGN_DELETER_AT_EXIT.format(tests=os.path.dirname(os.path.abspath(__file__)), delay=delay)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "exiting\n"
    assert "terminate" not in result.stderr and "Fatal" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("call", "error", "text"),
    [
        (lambda s: sim.fill(sim.zeros(4), 1.0, stream=s, delay=1e10), OverflowError, "delay=10000000000 s is longer"),
        (lambda s: sim.fill(sim.zeros(4), 1.0, stream=s, delay=-1.0), ValueError, "delay must be a non-negative"),
        (lambda s: sim.fill(sim.zeros(4), 1.0, stream=s, delay=float("nan")), ValueError, "delay must be"),
        (lambda s: sim.set_copy_delay(1e300), OverflowError, "delay=1e+300 s is longer"),
        (lambda s: sim.fill(sim.zeros(2, "int8"), 1e300, stream=s), OverflowError, "does not fit in int8"),
        (lambda s: sim.fill(sim.zeros(2, "int8"), 128, stream=s), OverflowError, "does not fit in int8"),
        (lambda s: sim.fill(sim.zeros(2, "uint8"), -1, stream=s), OverflowError, "does not fit in uint8"),
        (lambda s: sim.fill(sim.zeros(2, "uint64"), 2**64, stream=s), OverflowError, "does not fit in uint64"),
        (lambda s: sim.fill(sim.zeros(2, "int32"), 1.5, stream=s), ValueError, "not an integer"),
        (lambda s: sim.fill(sim.zeros(2, "float32"), 1e300, stream=s), OverflowError, "does not fit in float32"),
        (lambda s: sim.fill(sim.zeros(2, "float32"), "1", stream=s), TypeError, "must be a number"),
        (
            lambda s: sim.inject_fault("record_event", 1, "notAnError"),
            ValueError,
            "not the name of a CUDA or HIP error",
        ),
        (lambda s: sim.inject_sticky_fault(0, "cudaError"), ValueError, "not the name of a CUDA or HIP error"),
    ],
    ids=[
        "long delay",
        "negative delay",
        "nan delay",
        "long copy delay",
        "int8 1e300",
        "int8 128",
        "uint8 -1",
        "uint64 2**64",
        "int32 1.5",
        "float32 1e300",
        "str value",
        "fault name",
        "sticky fault name",
    ],
)
def test_arguments_the_simulator_cannot_meet_are_refused_naming_them(call, error, text):
    stream = sim.Stream(non_blocking=True)
    with pytest.raises(error, match=text.replace("+", r"\+")):
        call(stream)
    sim.synchronize()


def test_fill_values_at_the_edges_of_a_dtype_are_written():
    stream = sim.Stream(non_blocking=True)
    for dtype, value in [
        ("int8", -128),
        ("uint8", 255),
        ("int64", 2**63 - 1),
        ("uint64", 2**64 - 1),
        ("int16", 3.0),
        ("float32", float("inf")),
        ("bool", 7),
    ]:
        array = sim.zeros(2, dtype)
        sim.fill(array, value, stream=stream)
        assert sim.to_numpy(array, stream=stream).tolist() == [value if dtype != "bool" else True] * 2, dtype


# --- the hold: a test holds a stream's work exactly as long as its assertion needs ----------------


@pytest.fixture
def no_leaks():
    yield from sim_leak_check()


def test_a_hold_keeps_what_is_enqueued_on_its_stream_until_the_block_ends(no_leaks):
    stream = sim.Stream(non_blocking=True)
    array = sim.zeros(64)
    assert not sim.held(stream)
    with sim.hold(stream) as hold:
        assert hold.active and hold.stream is stream and sim.held(stream)
        assert sim.pending(stream) == 0, "the hold itself is not counted"
        sim.fill(array, 3.0, stream=stream)
        assert sim.pending(stream) == 1 and sim.waits_for_hold(stream)
        read = sim.to_numpy(array, stream=stream, wait=False)
        assert sim.pending(stream) > 1  # the copy too, and the events recorded after it
        assert not read.done()
    assert not hold.active and not sim.held(stream) and not sim.waits_for_hold(stream)
    assert read.result().tolist() == [3.0] * 64
    assert read.done() and sim.pending(stream) == 0


def test_work_enqueued_before_the_hold_is_not_held(no_leaks):
    stream = sim.Stream(non_blocking=True)
    array = sim.zeros(64)
    sim.fill(array, 2.0, stream=stream)
    before = sim.to_numpy(array, stream=stream, wait=False)
    with sim.hold(stream):
        assert before.result()[0] == 2.0  # ahead of the hold: this thread may wait for it


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "negative-control"])
def test_an_ordered_consumer_waits_while_the_producer_is_held(no_leaks, ordered):
    producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    source = sim.zeros(64)
    with sim.hold(producer):
        sim.fill(source, 1.0, stream=producer)
        view = handoff.from_dlpack(source, stream=consumer if ordered else -1)
        read = sim.to_numpy(view, stream=consumer, wait=False)
        assert sim.waits_for_hold(consumer) == ordered, "the consumer must wait for the producer, if ordered"
        if ordered:
            assert not read.done() and sim.pending(consumer) > 0
        else:
            assert read.result()[0] == 0.0, "expected stale data without ordering"
    assert read.result()[0] == (1.0 if ordered else 0.0)
    producer.synchronize()  # the held write runs once the block ends, not before it ends
    assert sim.to_numpy(view, stream=consumer)[0] == 1.0


def test_holds_nest_and_work_runs_once_every_hold_it_is_behind_has_ended(no_leaks):
    stream = sim.Stream(non_blocking=True)
    first, second = sim.zeros(8), sim.zeros(8)
    with sim.hold(stream):
        sim.fill(first, 1.0, stream=stream)
        with sim.hold(stream):
            sim.fill(second, 2.0, stream=stream)
        assert sim.held(stream)
        read = sim.to_numpy(second, stream=stream, wait=False)
        assert not read.done()
    assert read.result()[0] == 2.0
    assert sim.to_numpy(first, stream=stream)[0] == 1.0


def test_a_held_legacy_stream_holds_the_later_work_of_blocking_streams(no_leaks):
    blocking, non_blocking = sim.Stream(non_blocking=False), sim.Stream(non_blocking=True)
    held_back, free = sim.zeros(8), sim.zeros(8)
    with sim.hold(DEFAULT_STREAM):
        sim.fill(held_back, 1.0, stream=blocking)
        sim.fill(free, 2.0, stream=non_blocking)
        assert sim.to_numpy(free, stream=non_blocking)[0] == 2.0
        assert sim.pending(blocking) == 1 and sim.waits_for_hold(blocking) and not sim.held(blocking)
        assert not sim.waits_for_hold(non_blocking)
    assert sim.to_numpy(held_back, stream=blocking)[0] == 1.0


@pytest.mark.parametrize(
    "wait",
    [
        lambda stream, array, read: sim.to_numpy(array, stream=stream),
        lambda stream, array, read: read.result(),
        lambda stream, array, read: stream.synchronize(),
        lambda stream, array, read: sim.synchronize(),
        lambda stream, array, read: sim.drain(),
    ],
    ids=["to_numpy", "PendingCopy.result", "Stream.synchronize", "synchronize", "drain"],
)
def test_a_wait_for_held_work_on_the_holding_thread_fails_instead_of_hanging(no_leaks, wait):
    stream = sim.Stream(non_blocking=True)
    array = sim.zeros(8)
    with sim.hold(stream):
        sim.fill(array, 4.0, stream=stream)
        read = sim.to_numpy(array, stream=stream, wait=False)
        with pytest.raises(handoff.DeviceError, match="hold") as failure:
            wait(stream, array, read)
        assert failure.value.error_name == HOLD_DEADLOCK
    assert read.result()[0] == 4.0


def test_synchronize_unheld_waits_for_what_can_run_and_not_for_what_is_held(no_leaks, sim_streams):
    held, free = sim_streams
    held_array, free_array = sim.zeros(8), sim.zeros(8)
    with sim.hold(held):
        sim.fill(held_array, 1.0, stream=held)
        sim.fill(free_array, 2.0, stream=free)
        sim.synchronize_unheld()
        assert sim.pending(free) == 0 and sim.pending(held) == 1
    assert sim.to_numpy(held_array, stream=held)[0] == 1.0


def test_a_wait_on_another_thread_waits_for_the_end_of_the_hold(no_leaks):
    stream = sim.Stream(non_blocking=True)
    array = sim.zeros(8)
    seen = []
    with sim.hold(stream):
        sim.fill(array, 5.0, stream=stream)
        reader = threading.Thread(target=lambda: seen.append(sim.to_numpy(array, stream=stream)[0]))
        reader.start()
        assert seen == [] and reader.is_alive()  # it cannot return before the write has run
    reader.join()
    assert seen == [5.0]


def test_an_array_dropped_inside_a_hold_is_freed_once_the_held_work_is_done(no_leaks):
    stream = sim.Stream(non_blocking=True)
    before = sim.live_allocations()
    with sim.hold(stream):
        array = sim.zeros(8)
        sim.fill(array, 1.0, stream=stream)
        del array  # cudaFree would wait for the held write: freed after it instead
        gc.collect()
        assert sim.live_allocations() == before + 1
    sim.synchronize()
    assert sim.live_allocations() == before


def test_a_hold_is_entered_once_and_its_arguments_are_checked():
    stream = sim.Stream(non_blocking=True)
    hold = sim.hold(stream)
    with hold, pytest.raises(ValueError, match="active already"):
        hold.__enter__()
    with pytest.raises(TypeError, match="stream"):
        sim.hold(None)
    capturing = sim.Stream(non_blocking=True)
    sim.begin_capture(capturing)
    try:
        with pytest.raises(handoff.DeviceError, match="StreamCaptureUnsupported"), sim.hold(capturing):
            pass
    finally:
        sim.end_capture(capturing)


def test_calls_are_counted_on_the_counting_thread_one_count_at_a_time():
    with sim.count_calls() as one_stream:
        first = sim.Stream(non_blocking=True)  # kept: its destruction is not counted
    assert one_stream["create_stream"] == 1
    other_thread_streams = []
    with sim.count_calls() as counted:
        stream = sim.Stream(non_blocking=True)
        worker = threading.Thread(target=lambda: other_thread_streams.append(sim.Stream(non_blocking=True)))
        worker.start()
        worker.join()
        with pytest.raises(ValueError, match="one count at a time"), sim.count_calls():
            pass
    assert counted == one_stream, "another thread's calls were counted"
    with sim.count_calls() as again:  # the count ended with its block
        stream.synchronize()
    assert again == {"synchronize_stream": 1}
    del first, stream, other_thread_streams
