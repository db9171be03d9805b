"""The CUDA rules the simulator enforces where lifetime and teardown go wrong, seen from Python:
captured work runs per graph launch (and a view dropped during a capture is released once, not at
every launch), a sticky error halts a device (and exit does not wait for what it will never run),
a destroyed stream used later is a violation."""

from __future__ import annotations

import os
import textwrap
import time

import numpy as np
import pytest

import handoff

from support import BACKEND, live_views, needs_sim, run_python

pytestmark = needs_sim
if BACKEND.startswith("sim"):
    from handoff import sim

STICKY = "hipErrorIllegalAddress" if BACKEND == "sim-rocm" else "cudaErrorIllegalAddress"


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
    import handoff
    from handoff import sim
    stream = sim.Stream(non_blocking=True)
    source = sim.zeros(1024)
    sim.fill(source, 1.0, stream=stream, delay=0.3)
    view = handoff.from_dlpack(source, stream=stream)
    del view  # its release is queued on the stream, behind the slow write
    sim.inject_sticky_fault(0, "{error}")  # the stream will never get there
    print("exiting", flush=True)
    """
)


def test_exit_after_a_sticky_error_abandons_what_will_never_run_at_once_and_says_so():
    start = time.monotonic()
    result = run_python(STICKY_AT_EXIT.format(error=STICKY), HANDOFF_LOG_LEVEL="warn")
    took = time.monotonic() - start
    assert result.returncode == 0, result.stderr
    assert result.stdout == "exiting\n"
    # Said once, by whichever looked first: the release's poller (kept) or the exit drain (abandoned).
    assert STICKY in result.stderr and ("kept" in result.stderr or "abandoned" in result.stderr), result.stderr
    # Bounded by the device error, not by the 10 s exit limit.
    assert took < 5.0, f"exit took {took:.1f} s"


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
