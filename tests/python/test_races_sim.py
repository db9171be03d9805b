"""Races after the exchange, on the simulator: a launch trace (``handoff.trace(launches=True)``)
records each launch, copy, stream operation and host wait, and its detector flags what CUDA's rules
leave unordered. Each race has its negative control, the same program with the ordering it lacked;
the producers are held with the simulator's gate where the race is real, never with a timed delay."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import handoff
from handoff import _trace_cli

from support import (
    BACKEND,
    DEFAULT_STREAM,
    DEVICE_COUNT,
    attached_client,
    cuda_is_usable,
    go_on,
    needs_sim,
    run_python,
    serving_child,
)

HERE = Path(__file__).resolve()
EXAMPLES = HERE.parents[2] / "examples"
N = 1024


@pytest.fixture(autouse=True)
def no_earlier_garbage():
    """Frees earlier tests' unreachable arrays now, so that a collection inside a traced block
    neither adds memory events nor hands their addresses out again."""
    gc.collect()


def line_of(marker: str) -> str:
    """`file:line` of the line of this file that ends with the comment `# marker`."""
    for number, text in enumerate(HERE.read_text().splitlines(), start=1):
        if text.rstrip().endswith(f"# {marker}"):
            return f"{HERE}:{number}"
    raise AssertionError(f"no line marked {marker}")


def eventually(condition, what: str) -> None:
    """Polls until `condition()` holds (work that handoff's threads or the device do on their own),
    failing after a minute instead of hanging; it waits for nothing the program could order by."""
    deadline = time.monotonic() + 60.0
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.001)


def races(t: handoff.trace) -> list[dict[str, Any]]:
    return [e for e in t.hazards() if e["hazard"] in ("race", "reuse")]


def frees_of(t: handoff.trace, address: int, op: str) -> list[dict[str, Any]]:
    """The `op` ("free" or "free-sync") memory events that freed `address`: by address, as a
    collection of an earlier test's garbage inside a traced block frees memory too."""
    return [e for e in t.events if e["kind"] == "memory" and e["op"] == op and e["buffers"][0]["address"] == address]


def ordered_after(producer_ready: handoff.Array, consumer: Any) -> handoff.Array:
    """Makes `consumer` wait for the stream `producer_ready` is ready on (an event recorded there and
    waited for: what handoff.from_dlpack does); the view keeps the data until `consumer` is done."""
    return handoff.from_dlpack(producer_ready, stream=consumer)


# --- the legacy default stream after an ordered exchange -------------------------------------------


@needs_sim
def test_a_launch_on_the_legacy_stream_after_an_ordered_exchange_is_a_race(sim_streams):
    from handoff import sim

    producer, consumer = sim_streams
    data, out = sim.zeros(N), sim.zeros(N)
    with handoff.trace(launches=True) as t, sim.hold(producer):
        sim.fill(data, 1.0, stream=producer)  # producer-write
        imported = handoff.from_dlpack(data, stream=consumer)  # ordered onto `consumer`
        sim.launch("scale", reads=[imported], writes=[out], stream=DEFAULT_STREAM)  # legacy-launch
        # The race is real: the legacy stream does not wait for the held producer (and the copy that
        # shows it is one more race).
        assert sim.to_numpy(imported, stream=DEFAULT_STREAM)[0] == 0.0  # stale-read
    assert t.launch_problem is None
    race, stale_read = races(t)
    assert race["kind"] == "launch" and race["kernel"] == "scale" and race["hazard"] == "race"
    assert stale_read["kind"] == "copy" and stale_read["where"] == line_of("stale-read")
    assert race["stream"] == DEFAULT_STREAM and race["other_stream"] == producer.handle
    assert race["where"] == line_of("legacy-launch") and race["other_where"] == line_of("producer-write")
    assert race["other_kind"] == "copy" and race["buffers"][0]["access"] == "read"
    assert "legacy default stream" in race["detail"] and "does not wait for non-blocking streams" in race["fix"]
    assert "HAZARDS (2)" in t.summary() and "'scale' on" in t.summary() and "fix: " in t.summary()


@needs_sim
def test_the_same_launch_on_the_stream_the_exchange_ordered_is_clean(sim_streams):
    from handoff import sim

    producer, consumer = sim_streams
    data, out = sim.zeros(N), sim.zeros(N)
    with handoff.trace(launches=True) as t:
        with sim.hold(producer):
            sim.fill(data, 1.0, stream=producer)
            imported = handoff.from_dlpack(data, stream=consumer)
            sim.launch("scale", reads=[imported], writes=[out], stream=consumer)
        assert sim.to_numpy(imported, stream=consumer)[0] == 1.0
    assert races(t) == [] and t.hazards() == []
    launches = [e for e in t.events if e["kind"] == "launch"]
    assert [e["kernel"] for e in launches] == ["scale"] and launches[0]["stream"] == consumer.handle
    assert {b["access"] for b in launches[0]["buffers"]} == {"read", "write"}


# --- a library's default stream -------------------------------------------------------------------

LIBRARY = '''
"""A library that launches on the default stream unless told otherwise (as many do)."""
from handoff import sim


def normalize(x, out, stream=None):
    sim.launch("mylib_normalize", reads=[x], writes=[out], stream={default} if stream is None else stream)
'''

CALLER = """
import json, handoff, mylib
from handoff import sim

compute = sim.Stream(non_blocking=True)
x, out = sim.zeros(1024), sim.zeros(1024)
with handoff.trace(launches=True) as t:
    sim.fill(x, 1.0, stream=compute)
    mylib.normalize(x, out{argument})
sim.synchronize()
print(json.dumps([e for e in t.hazards()]))
"""


@needs_sim
@pytest.mark.parametrize("passes_its_stream", [False, True], ids=["default-stream", "caller-stream"])
def test_a_library_launching_on_the_default_stream_while_its_caller_uses_a_non_blocking_one(
    tmp_path: Path, passes_its_stream: bool
):
    # The library is installed where libraries are (a site directory), so that the trace names it.
    site = Path(
        subprocess.run(
            [sys.executable, "-c", "import site; print(site.getusersitepackages())"],
            env={**os.environ, "PYTHONUSERBASE": str(tmp_path)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "mylib").mkdir(parents=True)
    (site / "mylib" / "__init__.py").write_text(LIBRARY.format(default=DEFAULT_STREAM))
    program = tmp_path / "caller.py"
    program.write_text(CALLER.format(argument=", stream=compute" if passes_its_stream else ""))
    result = subprocess.run(
        [sys.executable, str(program)],
        env={**os.environ, "PYTHONUSERBASE": str(tmp_path), "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    hazards = json.loads(result.stdout)
    if passes_its_stream:
        assert hazards == []
        return
    [race] = hazards
    assert race["hazard"] == "race" and race["kernel"] == "mylib_normalize"
    assert race["library"] == "mylib" and race["where"] == f"{program}:9"  # the caller's line, and the library
    assert race["other_where"] == f"{program}:8" and race["other_library"] is None


# --- frees and reuse ------------------------------------------------------------------------------


@needs_sim
@pytest.mark.parametrize("waits", [False, True], ids=["no-wait", "with-wait"])
def test_memory_freed_on_one_stream_and_used_on_another(sim_streams, waits: bool):
    from handoff import sim

    first, second = sim_streams
    memory = sim.zeros(N, stream=first)  # allocated on `first`, freed on it when released
    address = memory.data_ptr
    # What a caching allocator hands out again: the same memory, seen through another array.
    alias = handoff.view(memory.data_ptr, (N,), "float32", device=memory.device)
    marker = sim.zeros(1)
    with handoff.trace(launches=True) as t, sim.hold(first):
        sim.launch("produce", writes=[memory], stream=first)
        del memory  # freed on `first` (cudaFreeAsync), after its work
        if waits:
            sim.fill(marker, 1.0, stream=first)
            kept = ordered_after(marker, second)  # `second` waits for `first`, the free included
        sim.launch("reuse", writes=[alias], stream=second)  # reuse
    if not waits:
        [reuse] = races(t)
        assert reuse["hazard"] == "reuse" and reuse["kernel"] == "reuse" and reuse["where"] == line_of("reuse")
        assert reuse["other_kind"] == "memory" and reuse["other_stream"] == first.handle
        assert "after the free" in reuse["fix"]
    else:
        assert races(t) == []
        del kept
    [free] = frees_of(t, address, "free")
    assert free["stream"] == first.handle


@needs_sim
@pytest.mark.parametrize("free", ["cudaFree", "cudaFreeAsync"])
def test_ordering_that_relied_on_a_synchronizing_free(sim_streams, free: str):
    from handoff import sim

    producer, consumer = sim_streams
    data = sim.zeros(N)
    scratch = sim.zeros(16) if free == "cudaFree" else sim.zeros(16, stream=producer)
    scratch_address = scratch.data_ptr
    with handoff.trace(launches=True) as t:
        sim.launch("produce", writes=[data], stream=producer)
        del scratch  # cudaFree waits for the whole device first; cudaFreeAsync orders nothing
        sim.launch("consume", reads=[data], stream=consumer)  # consume
    if free == "cudaFree":
        assert races(t) == []
        [wait] = frees_of(t, scratch_address, "free-sync")
        assert wait["blocked_ns"] >= 0
    else:
        [race] = races(t)
        assert race["kernel"] == "consume" and race["where"] == line_of("consume")
        assert race["other_kernel"] == "produce"


@needs_sim
@pytest.mark.parametrize("between", ["allocation", "legacy-operation"])
def test_an_allocation_orders_no_other_streams_work_as_an_operation_of_the_legacy_stream_does(between: str):
    from handoff import sim

    first, second = sim.Stream(), sim.Stream()  # blocking: ordered by the legacy stream's operations
    data, scratch = sim.zeros(N), sim.zeros(16)
    with handoff.trace(launches=True) as t:
        with sim.hold(first):
            sim.fill(data, 1.0, stream=first)
            if between == "allocation":
                more = sim.zeros(16)  # no work on the legacy stream: `second` does not wait for `first`
            else:
                sim.fill(scratch, 0.0, stream=DEFAULT_STREAM)  # waits for `first`, and `second` for it
            read = sim.to_numpy(data, stream=second, wait=False)  # second-read
            assert sim.waits_for_hold(second) == (between == "legacy-operation")
        assert read.result()[0] == (0.0 if between == "allocation" else 1.0)
    if between == "allocation":
        [race] = races(t)
        assert race["kind"] == "copy" and race["where"] == line_of("second-read")
        del more
    else:
        assert races(t) == []
    sim.synchronize()


@needs_sim
@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "after-the-allocation"])
def test_memory_handed_out_again_is_usable_on_another_stream_once_ordered_after_the_allocation(
    sim_streams, ordered: bool
):
    from handoff import sim

    first, allocating = sim_streams
    third = sim.Stream(non_blocking=True)
    marker = sim.zeros(1)
    with handoff.trace(launches=True) as t:
        freed = sim.zeros(N, stream=first)
        address = freed.data_ptr
        sim.launch("read_freed", reads=[freed], stream=first)
        del freed  # cudaFreeAsync on `first`
        sim.synchronize()  # the free has run: the pool hands the memory out again
        again = sim.zeros(N, stream=allocating)  # cudaMallocAsync: `allocating` is after the free
        assert again.data_ptr == address
        if ordered:
            sim.fill(marker, 1.0, stream=allocating)
            kept = ordered_after(marker, third)  # `third` waits for `allocating`, the allocation included
        sim.launch("write_again", writes=[again], stream=third)  # write-again
    if ordered:
        assert races(t) == []
        del kept
    else:
        [reuse] = races(t)
        assert reuse["hazard"] == "reuse" and reuse["kernel"] == "write_again"
        assert reuse["where"] == line_of("write-again") and reuse["other_stream"] == allocating.handle
        assert "after the allocation" in reuse["fix"]
    del again


@needs_sim
@pytest.mark.parametrize("query", ["release-poll", "unordered-probe"])
@pytest.mark.parametrize("synchronized", [False, True], ids=["not-synchronized", "synchronized"])
def test_handoffs_own_device_queries_are_not_the_programs_host_waits(sim_streams, query: str, synchronized: bool):
    from handoff import sim

    producer, consumer = sim_streams
    data = sim.zeros(N)
    with handoff.trace(launches=True) as t:
        if query == "release-poll":
            imported = handoff.from_dlpack(data, stream=producer)
            sim.launch("produce", writes=[data], stream=producer)
            del imported  # released after `producer`'s work: handoff's service thread queries its event
            eventually(lambda: handoff.stats()["pending_releases"] == 0, "the release was seen done")
        else:
            sim.fill(data, 1.0, stream=producer)  # the array's stream: the one the trace asks about
            eventually(lambda: sim.pending(producer) == 0, "the producer's work ran")
            unordered = handoff.from_dlpack(data, stream=-1)  # the trace asks whether `producer` still works
        if synchronized:
            producer.synchronize()
        sim.launch("consume", reads=[data], stream=consumer)  # consume-after-query
    if synchronized:
        assert races(t) == []
    else:
        [race] = races(t)
        assert race["kernel"] == "consume" and race["other_stream"] == producer.handle
        assert race["where"] == line_of("consume-after-query")
    if query == "unordered-probe":
        del unordered


@needs_sim
@pytest.mark.parametrize("between", ["graph", "nothing"])
def test_a_graph_launched_on_the_legacy_stream_orders_the_blocking_streams(between: str):
    from handoff import sim

    first, second, capturing = sim.Stream(), sim.Stream(), sim.Stream(non_blocking=True)
    data, scratch = sim.zeros(N), sim.zeros(16)
    sim.begin_capture(capturing)
    sim.fill(scratch, 2.0, stream=capturing)
    graph = sim.end_capture(capturing)
    with handoff.trace(launches=True) as t:
        with sim.hold(first):
            sim.fill(data, 1.0, stream=first)
            if between == "graph":
                graph.launch(DEFAULT_STREAM)  # one operation of the legacy stream: it waits for `first`
            read = sim.to_numpy(data, stream=second, wait=False)  # graph-read
            assert sim.waits_for_hold(second) == (between == "graph")
        read.result()
    if between == "graph":
        assert races(t) == []
        [launch] = [e for e in t.events if e["kind"] == "launch"]
        assert launch["kernel"] in ("cudaGraphLaunch", "hipGraphLaunch") and launch["stream"] == DEFAULT_STREAM
    else:
        [race] = races(t)
        assert race["where"] == line_of("graph-read")
    sim.synchronize()


@needs_sim
@pytest.mark.parametrize("synchronized", [False, True], ids=["not-synchronized", "device-synchronized"])
def test_a_destroyed_streams_work_is_ordered_by_a_device_synchronization(sim_streams, synchronized: bool):
    from handoff import sim

    _, consumer = sim_streams
    outputs = [sim.zeros(N) for _ in range(3)]
    with handoff.trace(launches=True) as t:
        for out in outputs:  # a stream per step, as some pipelines make them
            step = sim.Stream(non_blocking=True)
            sim.launch("produce", writes=[out], stream=step)
            del step  # destroyed, its work still to run
        if synchronized:
            sim.synchronize()
        sim.launch("consume", reads=outputs, stream=consumer)  # after-destroyed
    if synchronized:
        assert races(t) == []
    else:
        [race] = races(t)
        assert race["kernel"] == "consume" and race["where"] == line_of("after-destroyed")


@needs_sim
@pytest.mark.parametrize("kept_for_the_copy", [False, True], ids=["freed-while-copying", "kept-for-the-copy"])
def test_a_side_stream_copy_whose_source_is_freed_while_it_runs(sim_streams, kept_for_the_copy: bool):
    from handoff import sim

    main, side = sim_streams
    source, target = sim.zeros(N, stream=main), sim.zeros(N)
    ready, copied = sim.zeros(1), sim.zeros(1)
    with handoff.trace(launches=True) as t:
        sim.fill(source, 1.0, stream=main)
        sim.fill(ready, 1.0, stream=main)
        side_view = ordered_after(ready, side)  # `side` waits for `main`: the copy reads written data
        with sim.hold(side):
            sim.launch("copy", reads=[source], writes=[target], stream=side)  # side-copy
            if kept_for_the_copy:  # `main` waits for the copy before the free (record_stream's effect)
                sim.fill(copied, 1.0, stream=side)
                main_view = ordered_after(copied, main)
            del source  # free-source
    if kept_for_the_copy:
        assert races(t) == []
        del main_view
    else:
        [reuse] = races(t)
        assert reuse["hazard"] == "reuse" and reuse["kind"] == "memory" and reuse["where"] == line_of("free-source")
        assert reuse["other_kernel"] == "copy" and reuse["other_where"] == line_of("side-copy")
        assert "record_stream" in reuse["fix"]
    del side_view


# --- host waits -----------------------------------------------------------------------------------


@needs_sim
def test_host_waits_are_attributed_to_their_lines_with_the_time_they_blocked(sim_streams):
    from handoff import sim

    producer, _ = sim_streams
    data = sim.zeros(N)
    with handoff.trace(launches=True) as t:
        # A delay here is the work the host waits for (no race depends on it).
        sim.fill(data, 1.0, stream=producer, delay=0.05)
        producer.synchronize()  # long-wait
        sim.fill(data, 2.0, stream=producer, delay=0.01)
        sim.synchronize(0)  # device-wait
        host = sim.to_numpy(data, stream=producer)  # copy-wait
    assert host[0] == 2.0
    waits = {e["where"]: e for e in t.events if e["kind"] == "sync"}
    long_wait, device_wait, copy_wait = (waits[line_of(m)] for m in ("long-wait", "device-wait", "copy-wait"))
    assert long_wait["op"] == "stream" and long_wait["stream"] == producer.handle
    assert long_wait["blocked_ns"] >= 40_000_000
    assert device_wait["op"] == "device" and device_wait["blocked_ns"] >= 5_000_000
    assert copy_wait["op"] == "stream" and copy_wait["blocked_ns"] >= 0
    summary = t.summary()
    section = summary[summary.index("HOST WAITS") :]
    assert section.index(line_of("long-wait")) < section.index(line_of("device-wait"))
    assert "device activity:" in summary and "3 host waits" in summary


@needs_sim
@pytest.mark.parametrize("consumer_on_device", [True, False], ids=["device-consumer", "host-consumer"])
def test_a_host_wait_that_only_guards_an_exchange_is_marked(sim_streams, consumer_on_device: bool):
    from handoff import sim

    producer, consumer = sim_streams
    data = sim.zeros(N)
    with handoff.trace(launches=True) as t:
        sim.fill(data, 1.0, stream=producer)
        producer.synchronize()  # guard
        # To a device consumer an event wait would have done; the host reading it needs the wait.
        kept = handoff.from_dlpack(data, stream=consumer) if consumer_on_device else sim.to_numpy(data, stream=producer)
    summary = t.summary()
    assert line_of("guard") in summary
    assert ("guards 1 exchange to a device consumer" in summary) == consumer_on_device
    del kept


# --- a clean program ------------------------------------------------------------------------------


@needs_sim
def test_a_program_with_no_race_shows_no_hazard(sim_streams):
    from handoff import sim

    producer, consumer = sim_streams
    weights, activations, out = sim.zeros(N), sim.zeros(N, stream=producer), sim.zeros(N)
    with handoff.trace(launches=True) as t:
        with sim.hold(producer):
            sim.fill(weights, 0.5, stream=producer)
            sim.launch("matmul", reads=[weights], writes=[activations], stream=producer)
            w, a = handoff.from_dlpack(weights, stream=consumer), handoff.from_dlpack(activations, stream=consumer)
            sim.launch("relu", reads=[w, a], writes=[out], stream=consumer)
        result = sim.to_numpy(out, stream=consumer)
        del w, a, activations  # released after `consumer`'s work; freed on `producer` after that
        sim.launch("next", writes=[weights], stream=producer)  # ordered: the host waited for `consumer`
        sim.synchronize()
    assert result.shape == (N,)
    assert t.hazards() == []
    assert "no hazards" in t.summary()
    assert {e["kind"] for e in t.events} >= {"launch", "copy", "sync", "stream", "import"}


@needs_sim
def test_a_trace_without_launches_records_no_device_activity(sim_streams):
    from handoff import sim

    producer, _ = sim_streams
    data = sim.zeros(N)
    with handoff.trace() as t:
        sim.launch("k", writes=[data], stream=producer)
        producer.synchronize()
    assert t.events == [] and t.launch_problem is None


@needs_sim
def test_launch_checks_its_arguments(sim_streams):
    import numpy as np

    from handoff import sim

    producer, _ = sim_streams
    with pytest.raises(TypeError, match="reads must be a sequence of arrays"):
        sim.launch("k", reads=3, stream=producer)
    with pytest.raises(TypeError, match=r"writes holds ndarray, not a handoff\.Array"):
        sim.launch("k", writes=[np.zeros(3)], stream=producer)
    with pytest.raises(ValueError, match="a kernel needs a name"):
        sim.launch("", stream=producer)
    with pytest.raises(ValueError, match="no NUL character"):
        sim.launch("gemm\0tail", stream=producer)
    for memory in ("pinned", "managed") if BACKEND == "sim" else ("pinned",):  # memory a kernel reaches
        sim.launch("k", writes=[sim.zeros(4, memory=memory)], stream=producer)
    if DEVICE_COUNT > 1:
        with pytest.raises(ValueError, match="the arrays are on device 1 and the stream on device 0"):
            sim.launch("k", writes=[sim.zeros(4, device=1)], stream=producer)
    for value in ("false", 0, None):
        with pytest.raises(TypeError, match=r"handoff.trace\(launches=...\) takes True or False"):
            handoff.trace(launches=value)
    with pytest.raises(TypeError, match=r"handoff.trace\(libraries=...\) takes True or False"):
        handoff.trace(libraries="no")
    with pytest.raises(ValueError, match="delay must be a non-negative"):
        sim.launch("k", stream=producer, delay=-1.0)
    with pytest.raises(TypeError, match="a stream is required"):
        sim.launch("k", stream=None)
    with pytest.raises(ValueError, match="stream= allocates device memory"):
        sim.zeros(4, memory="pinned", stream=producer)


# --- where launches cannot be recorded --------------------------------------------------------------


def test_a_launch_trace_without_a_device_says_why_and_records_the_exchanges():
    code = """
import json, numpy as np, handoff
with handoff.trace(launches=True) as t:
    handoff.from_dlpack(np.zeros(3))
print(json.dumps([t.launch_problem, [e["kind"] for e in t.events], t.summary()]))
"""
    result = run_python(code, HANDOFF_BACKEND="auto")
    assert result.returncode == 0, result.stderr
    problem, kinds, summary = json.loads(result.stdout)
    assert kinds == ["import", "release"]
    if cuda_is_usable():
        assert problem is None  # CUPTI records them on a GPU
        return
    assert problem.startswith("a launch trace needs a device backend, and none is active (HANDOFF_BACKEND=auto")
    assert f"launches not recorded: {problem}" in summary


def test_a_launch_trace_on_a_cuda_backend_that_cannot_start_says_why():
    if cuda_is_usable():
        pytest.skip("a CUDA device is usable here: CUPTI records the launches (test_races_gpu.py)")
    result = run_python(
        "import handoff\nwith handoff.trace(launches=True) as t: pass\nprint(t.launch_problem)", HANDOFF_BACKEND="cuda"
    )
    assert result.returncode == 0, result.stderr
    assert "cuda backend cannot be used" in result.stdout and "cudaError" in result.stdout


# --- the trace file, show, graph, Perfetto and attach -----------------------------------------------


@needs_sim
def test_a_saved_launch_trace_shows_its_races_as_arrows_and_in_show_and_graph(sim_streams, tmp_path, capsys):
    from handoff import sim

    producer, _ = sim_streams
    data = sim.zeros(N)
    path = tmp_path / "races.json"
    with handoff.trace(path, launches=True), sim.hold(producer):
        sim.fill(data, 1.0, stream=producer)
        sim.launch("late", reads=[data], stream=DEFAULT_STREAM)
    saved = json.loads(path.read_text())
    trace_events = saved["traceEvents"]
    tracks = {e["args"]["name"] for e in trace_events if e.get("name") == "thread_name"}
    assert any(f"stream {hex(producer.handle)}" in name for name in tracks)
    race_slice = next(e for e in trace_events if e.get("ph") == "X" and e["name"].startswith("\u26a0 race: late"))
    fill_slice = next(e for e in trace_events if e.get("ph") == "X" and e.get("cat") == "handoff.copy")
    start, finish = (next(e for e in trace_events if e.get("ph") == p and e.get("cat") == "handoff.race") for p in "sf")
    assert start["id"] == finish["id"]
    assert (start["tid"], finish["tid"]) == (fill_slice["tid"], race_slice["tid"])

    assert _trace_cli.main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "race" in out and "fix:" in out and "device activity: 1 launch" in out
    assert _trace_cli.main(["show", str(path), "--json"]) == 0
    events = json.loads(capsys.readouterr().out)
    assert any(e["kind"] == "launch" and e["buffers"][0]["access"] == "read" for e in events)
    assert _trace_cli.main(["graph", str(path), "--format", "json"]) == 0
    graph = json.loads(capsys.readouterr().out)
    [edge] = [e for e in graph["edges"] if e["kind"] == "race"]
    assert edge["src"].endswith(hex(producer.handle))
    assert _trace_cli.main(["graph", str(path)]) == 0
    assert 'label="race' in capsys.readouterr().out


@needs_sim
def test_a_race_whose_earlier_side_a_bounded_trace_dropped_is_drawn_from_a_slice_of_its_own(sim_streams, tmp_path):
    from handoff import sim

    producer, consumer = sim_streams
    data, other = sim.zeros(N), sim.zeros(N)
    path = tmp_path / "bounded.json"
    with handoff.trace(path, launches=True, limit=3) as t:
        sim.launch("write", writes=[data], stream=producer)
        for _ in range(5):
            sim.launch("filler", writes=[other], stream=producer)  # the write's event is dropped
        sim.launch("read", reads=[data], stream=consumer)
    assert t.dropped > 0
    [race] = races(t)
    assert race["other_kernel"] == "write" and all(e["seq"] != race["other_seq"] for e in t.events)
    trace_events = json.loads(path.read_text())["traceEvents"]
    assert all(e["ts"] >= 0 for e in trace_events if "ts" in e)
    start = next(e for e in trace_events if e.get("ph") == "s" and e.get("cat") == "handoff.race")
    # The arrow starts in a slice: the dropped side's own, on its stream's track, where it ran.
    [dropped_side] = [e for e in trace_events if e.get("ph") == "X" and e["name"] == "write"]
    assert (dropped_side["tid"], dropped_side["ts"]) == (start["tid"], start["ts"])


ATTACHED = """
import sys, handoff
from handoff import sim
print(handoff.serve_trace(), flush=True)
sys.stdin.readline()  # the client is attached
stream = sim.Stream(non_blocking=True)
data = sim.zeros(16)
with handoff.trace(launches=True):
    sim.launch("watched", writes=[data], stream=stream)
    stream.synchronize()
sys.stdin.readline()
"""


@needs_sim
def test_attach_carries_the_device_activity_of_a_launch_trace(tmp_path):
    with serving_child(ATTACHED, tmp_path) as (child, path):
        with attached_client(path) as (_, reader):
            go_on(child)
            events = [json.loads(reader.readline()) for _ in range(2)]
        assert [(e["kind"], e["op"]) for e in events] == [("launch", "kernel"), ("sync", "stream")]
        launch = next(e for e in events if e["kind"] == "launch")
        assert launch["kernel"] == "watched" and "launch" in _trace_cli.format_event(launch)
        go_on(child)
        assert child.wait(timeout=60) == 0


# --- handoff-trace run --launches on the examples ---------------------------------------------------


def run_launches(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "handoff._trace_cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **(env or {})},
    )


@needs_sim
@pytest.mark.parametrize(
    ("example", "hazards"),
    [
        (["races.py"], {"race", "reuse"}),  # after correct exchanges
        (["cross_library.py"], {"unordered", "race"}),  # the unordered hand-off, and the read it races
        (["pipeline.py"], {"unordered", "race"}),
        (["demo.py"], {"unordered", "race"}),
    ],
    ids=["races", "cross-library", "pipeline", "demo"],
)
def test_run_launches_flags_the_races_of_the_examples(example: list[str], hazards: set[str], tmp_path: Path):
    output = tmp_path / "trace.json"
    result = run_launches("--launches", "-o", str(output), "--", sys.executable, *map(str, [EXAMPLES / example[0]]))
    assert result.returncode == 0, result.stderr
    assert "fix:" in result.stderr and "device activity:" in result.stderr, result.stderr
    events = json.loads(output.read_text())["handoff"]["events"]
    assert {e["hazard"] for e in events if e.get("hazard")} == hazards
    for event in events:
        if event.get("hazard") in ("race", "reuse"):  # both sides named, with their lines
            assert event["where"] and event["other_where"] and event["fix"]


@needs_sim
@pytest.mark.parametrize(
    ("example", "options"),
    [("races.py", ["--fixed"]), ("cross_library.py", [])],
    ids=["races-fixed", "cross-library-ordered"],
)
def test_run_launches_finds_no_race_in_the_clean_examples(example: str, options: list[str]):
    order = ["--order"] if example == "cross_library.py" else []
    result = run_launches("--launches", *order, "--", sys.executable, str(EXAMPLES / example), *options)
    assert result.returncode == 0, result.stderr
    assert "no hazards" in result.stderr, result.stderr
    assert "device activity:" in result.stderr


def test_run_launches_sets_the_environment(tmp_path, capsys):
    report = tmp_path / "env.txt"
    code = textwrap.dedent(f"""
        import os
        open({str(report)!r}, "w").write(os.environ.get("HANDOFF_TRACE_LAUNCHES", ""))
    """)
    assert _trace_cli.main(["run", "--launches", "--", sys.executable, "-c", code]) == 0
    assert report.read_text() == "1"
    capsys.readouterr()
