"""Exchanges between other libraries, made without handoff: traced (handoff-trace run, HANDOFF_TRACE,
handoff.trace(libraries=True)) and, in the ordering mode, ordered.

On the CPU, real libraries (NumPy, PyTorch, JAX) in programs that never import handoff; on the
simulator, small peer libraries written in the tests (peer_library.py) that behave as PyTorch's and
CuPy's CUDA paths do, with a negative control for each ordering: the same program without the
ordering mode reads stale data.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest

import handoff
from handoff import _interpose

from support import BACKEND, needs_sim, needs_two_devices, settle_sim

torch = pytest.importorskip("torch")

if BACKEND.startswith("sim"):
    from peer_library import make_library

    from handoff import sim

SLOW = 0.2  # seconds a producer's write takes: an unordered reader always wins
N = 4096


def trace_run(tmp_path: Path, script: str, *options: str, env: dict[str, str] | None = None) -> tuple:
    """Runs `script` under `handoff-trace run -o FILE`; (the result, the saved trace's section)."""
    program = tmp_path / "program.py"
    program.write_text(textwrap.dedent(script))
    output = tmp_path / "trace.json"
    command = [sys.executable, "-m", "handoff._trace_cli", "run", "-o", str(output), *options, "--"]
    result = subprocess.run(
        [*command, sys.executable, str(program)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, **(env or {})},
    )
    section = json.loads(output.read_text())["handoff"] if output.exists() else None
    return result, section


# --- programs that never import handoff, on the CPU ------------------------------------------------

NEVER_IMPORTS_HANDOFF = """
    import numpy as np
    import torch
    import jax.numpy as jnp


    tensor = torch.arange(6.0)
    array = np.from_dlpack(tensor)          # line 8: torch -> numpy
    back = torch.from_dlpack(np.ones(3))    # line 9: numpy -> torch
    on_jax = jnp.from_dlpack(tensor)        # line 10: torch -> jax
    from_jax = torch.from_dlpack(on_jax)    # line 11: jax -> torch
    print(float(array.sum()), float(back.sum()), float(on_jax.sum()), float(from_jax.sum()))
"""


def test_a_program_that_never_imports_handoff_has_each_exchange_traced_with_both_libraries_and_its_line(tmp_path):
    pytest.importorskip("jax")
    untraced = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(NEVER_IMPORTS_HANDOFF)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    result, section = trace_run(tmp_path, NEVER_IMPORTS_HANDOFF)
    assert result.returncode == 0, result.stderr
    assert result.stdout == untraced.stdout, "the program's output is unchanged"
    program = tmp_path / "program.py"
    seen = [(e["producer"], e["consumer"], e["where"]) for e in section["events"] if e["interposed"]]
    assert seen == [
        ("torch", "numpy", f"{program}:8"),
        ("numpy", "torch", f"{program}:9"),
        ("torch", "jax", f"{program}:10"),
        ("jax", "torch", f"{program}:11"),
    ]
    first = next(e for e in section["events"] if e["interposed"])
    assert (first["protocol"], first["shape"], first["dtype"], first["nbytes"]) == ("dlpack", [6], "float32", 24)
    assert first["device"] == [1, 0] and first["action"] == "none"
    assert "no hazards" in result.stderr and "torch     numpy" in result.stderr


def test_tracing_off_wraps_nothing_and_a_trace_block_puts_every_hook_back():
    originals = (np.from_dlpack, torch.from_dlpack, torch.utils.dlpack.from_dlpack, torch.Tensor.__dlpack__)
    with handoff.trace():  # not asked to trace other libraries
        assert (np.from_dlpack, torch.from_dlpack) == originals[:2]
    with handoff.trace(libraries=True) as t:
        assert np.from_dlpack is not originals[0] and np.from_dlpack.__handoff_original__ is originals[0]
        assert torch.from_dlpack is not originals[1]
        np.from_dlpack(torch.arange(2.0))
    assert (np.from_dlpack, torch.from_dlpack, torch.utils.dlpack.from_dlpack, torch.Tensor.__dlpack__) == originals
    assert [(e["producer"], e["consumer"]) for e in t.events] == [("torch", "numpy")]


def test_the_ordering_mode_alone_wraps_the_consumers_but_not_the_producers():
    original_export = torch.Tensor.__dlpack__
    handoff.order_libraries(True)
    try:
        assert np.from_dlpack.__handoff_original__ is not None
        assert torch.Tensor.__dlpack__ is original_export, "the stream a consumer passes matters to a trace only"
        with handoff.trace(libraries=True):
            assert torch.Tensor.__dlpack__ is not original_export
        assert torch.Tensor.__dlpack__ is original_export
    finally:
        handoff.order_libraries(False)
    assert not hasattr(np.from_dlpack, "__handoff_original__")


def test_a_library_imported_while_tracing_is_hooked_as_it_loads():
    code = """
        import sys, handoff
        with handoff.trace(libraries=True) as t:
            assert "torch" not in sys.modules
            import numpy as np, torch
            torch.from_dlpack(np.zeros(2))
        print([(e["producer"], e["consumer"]) for e in t.events])
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[('numpy', 'torch')]"


def test_exchanges_within_a_library_or_through_handoff_are_not_recorded_twice():
    with handoff.trace(libraries=True) as t:
        torch.from_dlpack(torch.arange(3.0))  # within one library: not between libraries
        np.from_dlpack(handoff.from_dlpack(np.arange(2.0)))  # handoff records its own
    assert [e for e in t.events if e["interposed"]] == []
    # handoff's own import of NumPy's array and its export to NumPy, each once
    assert [e["kind"] for e in t.events if e["producer"] == "numpy"][:2] == ["import", "export"]


class Refusing:
    """A producer whose export fails."""

    def __dlpack__(self, **kwargs):
        raise BufferError("this producer cannot export")

    def __dlpack_device__(self):
        return (1, 0)


def test_a_refused_exchange_is_recorded_and_its_error_reaches_the_program_unchanged():
    with handoff.trace(libraries=True) as t, pytest.raises(BufferError, match="this producer cannot export"):
        np.from_dlpack(Refusing())
    (event,) = [e for e in t.events if e["interposed"]]
    assert event["action"] == "refused" and event["consumer"] == "numpy" and "BufferError" in event["detail"]


@pytest.mark.parametrize(
    ("adapter", "error", "text"),
    [
        (lambda: handoff.LibraryAdapter(""), ValueError, "needs a name"),
        (lambda: handoff.LibraryAdapter("lib", consumers="lib:f"), TypeError, "not one string"),
        (lambda: handoff.LibraryAdapter("lib", consumers=("lib.f",)), ValueError, "'lib.f' is not 'module:attr'"),
        (lambda: handoff.register_library("lib"), TypeError, "takes a handoff.LibraryAdapter, not str"),
    ],
)
def test_a_bad_adapter_is_refused_naming_what_is_wrong(adapter, error, text):
    with pytest.raises(error, match=text):
        adapter()


def test_the_process_trace_is_bounded_and_says_what_it_dropped(tmp_path):
    script = """
        import numpy as np, torch
        for i in range(50):
            np.from_dlpack(torch.arange(3.0))
    """
    result, section = trace_run(tmp_path, script, env={"HANDOFF_TRACE_LIMIT": "10"})
    assert result.returncode == 0, result.stderr
    assert len(section["events"]) == 10 and section["dropped"] == 40
    assert "40 older events dropped" in result.stderr
    shown = subprocess.run(
        [sys.executable, "-m", "handoff._trace_cli", "show", str(tmp_path / "trace.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "40 older events dropped" in shown.stdout


def test_every_process_of_a_job_is_traced_to_its_own_file_and_merged(tmp_path):
    script = """
        import multiprocessing as mp
        import numpy as np, torch

        def work(n):
            np.from_dlpack(torch.arange(float(n)))  # line 6

        if __name__ == "__main__":
            torch.from_dlpack(np.zeros(2))  # line 9
            for method in ("fork", "spawn"):
                child = mp.get_context(method).Process(target=work, args=(3,))
                child.start()
                child.join()
    """
    result, section = trace_run(tmp_path, script)
    assert result.returncode == 0, result.stderr
    program = tmp_path / "program.py"
    by_where: dict[str, set[int]] = {}
    for event in section["events"]:
        if event["interposed"]:
            by_where.setdefault(event["where"], set()).add(event["pid"])
    assert set(by_where) == {f"{program}:9", f"{program}:6"}
    assert len(by_where[f"{program}:6"]) == 2, "the forked and the spawned child, each its own process"
    assert by_where[f"{program}:9"].isdisjoint(by_where[f"{program}:6"])
    assert len(section["processes"]) >= 3 and "processes" in result.stderr


# --- peer libraries on the simulator --------------------------------------------------------------


@pytest.fixture
def peers():
    """A producer that ignores `stream` (as cuda.core's and nanobind's do), one that honours it (as
    PyTorch's does), their streams, and the ordering mode off afterwards."""
    careless = make_library("simnano", honours_stream=False)
    torchlike = make_library("simtorch")
    producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    yield careless, torchlike, producer, consumer
    handoff.order_libraries(False)
    settle_sim()


def pending(library, stream):
    """An array of `library` whose write of 1.0 is still running on `stream`, its current stream."""
    with library.use(stream):
        array = library.zeros(N)
        library.fill(array, 1.0, delay=SLOW)
    return array


@needs_sim
def test_a_producer_that_ignores_stream_is_flagged_unordered_and_reads_stale_data(peers):
    careless, torchlike, producer, consumer = peers
    x = pending(careless, producer)
    with careless.use(producer), torchlike.use(consumer), handoff.trace(libraries=True) as t:
        seen = torchlike.to_numpy(torchlike.from_dlpack(x))
    assert (seen == 0).all(), "the negative control: unordered, the consumer reads before the write"
    (event,) = [e for e in t.events if e["interposed"]]
    assert (event["producer"], event["consumer"], event["action"]) == ("simnano", "simtorch", "unordered")
    assert event["hazard"] == "unordered" and event["interposed"] == "observed"
    assert event["stream_argument"] == consumer.handle, "the stream the consumer passed"
    assert (event["producer_stream"], event["consumer_stream"]) == (producer.handle, consumer.handle)
    assert "ignores DLPack's stream argument" in event["detail"]


@needs_sim
def test_the_ordering_mode_removes_the_race_and_marks_the_exchange_ordered(peers):
    careless, torchlike, producer, consumer = peers
    handoff.order_libraries(True)
    x = pending(careless, producer)
    with careless.use(producer), torchlike.use(consumer), handoff.trace(libraries=True) as t:
        seen = torchlike.to_numpy(torchlike.from_dlpack(x))
    assert (seen == 1).all(), "ordered: the consumer's stream waited for the producer's write"
    (event,) = [e for e in t.events if e["interposed"]]
    assert (event["action"], event["hazard"], event["interposed"]) == ("wait", None, "ordered")
    assert "1 ordered by handoff's hooks" in t.summary()


@needs_sim
def test_a_producer_that_honours_stream_is_ordered_by_itself_and_no_hazard(peers):
    _, torchlike, producer, consumer = peers
    other = make_library("simcupy")
    x = pending(other, producer)
    with other.use(producer), torchlike.use(consumer), handoff.trace(libraries=True) as t:
        seen = torchlike.to_numpy(torchlike.from_dlpack(x))
    assert (seen == 1).all()
    (event,) = [e for e in t.events if e["interposed"]]
    assert (event["action"], event["hazard"], event["stream_argument"]) == ("wait", None, consumer.handle)


@needs_sim
def test_the_ordering_mode_from_the_environment_fixes_an_unchanged_program(tmp_path):
    script = f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from handoff import sim
        from peer_library import make_library
        careless, torchlike = make_library("simnano", honours_stream=False), make_library("simtorch")
        producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
        with careless.use(producer), torchlike.use(consumer):
            x = careless.zeros({N})
            careless.fill(x, 1.0, delay={SLOW})
            print(torchlike.to_numpy(torchlike.from_dlpack(x)).min())
        sim.synchronize()
    """
    racy, section = trace_run(tmp_path, script)
    assert racy.returncode == 0, racy.stderr
    assert racy.stdout.strip() == "0.0" and "HAZARDS (1)" in racy.stderr and "unordered" in racy.stderr
    fixed, section = trace_run(tmp_path, script, "--order")
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.strip() == "1.0" and "no hazards" in fixed.stderr
    assert [e["interposed"] for e in section["events"] if e["interposed"]] == ["ordered"]


@needs_sim
def test_the_ordering_mode_keeps_the_producer_until_the_consumers_array_is_gone_and_its_stream_done(peers):
    _, _, _, consumer = peers

    class Owner:
        pass

    for keep in (True, False):  # the negative control: without the keep, the producer goes at once
        result, producer_object = Owner(), Owner()
        gone = weakref.ref(producer_object)
        busy = sim.zeros(N, "float32")
        sim.fill(busy, 2.0, stream=consumer, delay=SLOW)  # the consumer's stream still works
        if keep:
            _interpose._keep_until_done(result, producer_object, (sim_device_type(), 0), consumer.handle)
        del producer_object, result
        assert (gone() is not None) == keep
        settle_sim()
        assert gone() is None


@needs_sim
@pytest.mark.parametrize("settled_first", [False, True], ids=["busy", "negative-control-idle"])
def test_the_consumers_array_dropped_while_its_stream_works_with_the_last_producer_reference_is_released_early(
    peers, settled_first
):
    other, torchlike, producer, consumer = make_library("simcupy"), *peers[1:]
    x = pending(other, producer)
    sim.synchronize()
    with torchlike.use(consumer), handoff.trace(libraries=True) as t:
        y = torchlike.from_dlpack(x)
        torchlike.fill(y, 2.0, delay=SLOW)  # the consumer's kernel, still running on its stream
        del x  # the consumer's array holds the producer's last reference now
        if settled_first:
            sim.synchronize()
        del y
    releases = [e for e in t.events if e["interposed"] and e["kind"] == "release"]
    if settled_first:
        assert releases == [], "the consumer's work was done: nothing to flag"
    else:
        (event,) = releases
        assert (event["hazard"], event["producer"], event["consumer"]) == ("released early", "simcupy", "simtorch")
        assert "still had work queued" in event["detail"]


@needs_sim
def test_a_producer_still_held_elsewhere_is_not_released_early(peers):
    _, torchlike, producer, consumer = peers
    other = make_library("simcupy")
    x = pending(other, producer)
    sim.synchronize()
    with torchlike.use(consumer), handoff.trace(libraries=True) as t:
        y = torchlike.from_dlpack(x)
        torchlike.fill(y, 2.0, delay=SLOW)
        del y  # x is still the program's: its memory stays
    assert [e for e in t.events if e["interposed"] and e["kind"] == "release"] == []


@needs_sim
@needs_two_devices
def test_a_producer_called_while_another_device_is_current_is_a_cross_device_hazard(peers):
    _, torchlike, _, _ = peers
    other = make_library("simcupy")
    x = pending(other, sim.Stream(0, non_blocking=True))
    sim.synchronize()
    consumer = sim.Stream(0, non_blocking=True)
    hazards = []
    for current in (1, 0):  # the negative control: the data's own device current
        sim.set_device(current)
        try:
            with torchlike.use(consumer), handoff.trace(libraries=True) as t:
                torchlike.from_dlpack(x)
        finally:
            sim.set_device(0)
        (event,) = [e for e in t.events if e["interposed"]]
        hazards.append(event["hazard"])
        if event["hazard"]:
            assert "ran while device 1 was current" in event["detail"]
    assert hazards == ["cross-device", None]


def sim_device_type() -> int:
    return int(sim.zeros(1, "float32").__dlpack_device__()[0])


@needs_sim
@needs_two_devices
def test_a_consumer_stream_on_another_device_is_a_cross_device_hazard(peers):
    _, torchlike, _, _ = peers
    other = make_library("simcupy")
    data_stream, far = sim.Stream(0, non_blocking=True), sim.Stream(1, non_blocking=True)
    for consumer, hazard in ((far, "cross-device"), (sim.Stream(0, non_blocking=True), None)):  # negative control
        x = pending(other, data_stream)
        sim.synchronize()
        with torchlike.use(consumer), handoff.trace(libraries=True) as t:
            torchlike.from_dlpack(x)
        (event,) = [e for e in t.events if e["interposed"]]
        assert event["hazard"] == hazard


class InterfaceOnly:
    """A producer that offers only the CUDA Array Interface, as numba-cuda 0.30's device arrays do,
    with the stream its data is ready on or, as numba says of its default stream, `"stream": None`."""

    def __init__(self, data, with_stream: bool) -> None:
        interface = dict(data.__cuda_array_interface__)
        if not with_stream:
            interface["stream"] = None
        self.__cuda_array_interface__ = interface
        self._data = data


@needs_sim
@pytest.mark.skipif(BACKEND == "sim-rocm", reason="the CUDA Array Interface is CUDA's")
def test_an_interface_consumer_is_traced_as_such_and_an_interface_without_a_stream_is_unordered(peers):
    _, torchlike, producer, consumer = peers
    data = sim.zeros(N, "float32")
    sim.fill(data, 1.0, stream=producer)
    actions = []
    for with_stream in (True, False):
        with torchlike.use(consumer), handoff.trace(libraries=True) as t:
            torchlike.as_array(InterfaceOnly(data, with_stream))
        (event,) = [e for e in t.events if e["interposed"]]
        assert event["protocol"] == "cuda-array-interface" and event["device"] == (2, 0)
        actions.append(event["action"])
    assert actions == ["wait", "unordered"]


@needs_sim
def test_one_stream_block_sets_every_frameworks_current_stream_and_restores_each(peers):
    careless, torchlike, producer, consumer = peers
    with torchlike.use(producer):
        with handoff.stream(consumer, frameworks=True):
            assert handoff.current_stream() == handoff.as_stream(consumer)
            x = pending(careless, consumer)  # careless's own block nests inside
            with handoff.trace(libraries=True) as t:
                seen = torchlike.to_numpy(torchlike.from_dlpack(x))
        assert _interpose._registry["simtorch"].current_stream(0) == producer.handle, "restored"
    assert (seen == 1).all(), "one stream: nothing needed ordering"
    (event,) = [e for e in t.events if e["interposed"]]
    assert event["consumer_stream"] == consumer.handle and event["hazard"] is None


def test_a_framework_stream_block_needs_a_stream():
    with pytest.raises(ValueError, match="name the stream the frameworks should use"):
        handoff.stream(None, frameworks=True)
