"""Exchanges between other libraries, made without handoff: traced (handoff-trace run, HANDOFF_TRACE,
handoff.trace(libraries=True)) and, in the ordering mode, ordered.

On the CPU, real libraries (NumPy, PyTorch, JAX) in programs that never import handoff; on the
simulator, small peer libraries written in the tests (peer_library.py) that behave as PyTorch's and
CuPy's CUDA paths do, with a negative control for each ordering: the same program without the
ordering mode reads stale data. Races are held with the simulator's gate (`sim.hold`), never timed.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.metadata
import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
import types
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import handoff
from handoff import _interposed
from handoff._adapters import Target, registry

from support import BACKEND, needs_sim, needs_two_devices, run_python, settle_sim

torch = pytest.importorskip("torch")

if BACKEND.startswith("sim"):
    from peer_library import _Capsule, make_library

    from handoff import sim

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


def show_saved(tmp_path: Path) -> subprocess.CompletedProcess:
    """`handoff-trace show` of the trace trace_run saved."""
    command = [sys.executable, "-m", "handoff._trace_cli", "show", str(tmp_path / "trace.json")]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


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


def test_a_hooked_producers_dlpack_binds_reads_and_fails_as_the_original_does():
    original = torch.Tensor.__dlpack__
    tensor = torch.arange(4.0)
    with handoff.trace(libraries=True) as t:
        hook = torch.Tensor.__dlpack__
        assert hook is not original and hook.__wrapped__ is original
        assert (hook.__name__, hook.__qualname__, hook.__doc__) == ("__dlpack__", "Tensor.__dlpack__", original.__doc__)
        bound = tensor.__dlpack__
        assert bound.__self__ is tensor and bound.__func__ is hook
        with pytest.raises(TypeError, match="stream must be"):  # PyTorch's own error, unchanged
            tensor.__dlpack__(stream="not a stream")
        with pytest.raises(TypeError):  # no tensor to export: the original says so
            hook()
        assert type(hook(tensor, stream=None)).__name__ == "PyCapsule"  # called through the class
        assert np.from_dlpack(tensor).tolist() == [0.0, 1.0, 2.0, 3.0]
    assert torch.Tensor.__dlpack__ is original
    assert [(e["producer"], e["consumer"]) for e in t.events if e["interposed"]] == [("torch", "numpy")]


def test_a_hooked_consumer_is_bound_where_its_original_is_and_weakly_referenced_as_a_function():
    with handoff.trace(libraries=True) as t:

        class Holder:
            python_function = torch.from_dlpack  # a Python function: bound on an instance
            builtin = np.from_dlpack  # a builtin: not bound

        holder = Holder()
        assert holder.python_function.__self__ is holder and holder.python_function.__func__ is torch.from_dlpack
        assert holder.builtin is np.from_dlpack
        assert holder.builtin(torch.arange(2.0)).tolist() == [0.0, 1.0]
        assert weakref.ref(torch.from_dlpack)() is torch.from_dlpack
        assert "from_dlpack" in repr(np.from_dlpack)
    assert [(e["producer"], e["consumer"]) for e in t.events if e["interposed"]] == [("torch", "numpy")]


def test_a_class_whose_dlpack_is_not_callable_is_not_hooked():
    class NotCallable:
        __dlpack__ = None

    module = types.ModuleType("not_callable_module")
    module.NotCallable = NotCallable
    handoff._interpose._hooks._install_producer(module, Target("not_callable_module", "NotCallable"))
    assert NotCallable.__dict__["__dlpack__"] is None
    with pytest.raises(TypeError, match="a producer hook wraps a callable, not NoneType"):
        handoff._handoff._interposed_producer_hook(None)


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
    assert event["action"] == "refused" and event["consumer"] == "numpy"
    assert event["detail"] == "BufferError: this producer cannot export"


@pytest.mark.parametrize(
    ("adapter", "error", "text"),
    [
        (lambda: handoff.LibraryAdapter(""), ValueError, "needs a name"),
        (lambda: handoff.LibraryAdapter("lib", consumers="lib:f"), TypeError, "not one string"),
        (lambda: handoff.LibraryAdapter("lib", consumers=("lib.f",)), ValueError, "'lib.f' is not 'module:attr'"),
        (lambda: handoff.register_library("lib"), TypeError, "takes a handoff.LibraryAdapter, not str"),
        (lambda: handoff.LibraryAdapter("lib", device=(2, 0)), TypeError, "device must be a function"),
        (lambda: handoff.LibraryAdapter("lib", host_only=1), TypeError, "host_only must be a bool, not int"),
    ],
)
def test_a_bad_adapter_is_refused_naming_what_is_wrong(adapter, error, text):
    with pytest.raises(error, match=text):
        adapter()


class Delegating:
    """An array type of its own whose exchanges are its tensor's."""

    def __init__(self, tensor) -> None:
        self.tensor = tensor

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


class FlatNumpySized(Delegating):
    """An array type that says its size in NumPy integers, as some libraries do, and its shape flat:
    what the trace reads of it is told apart from what the consumer's array says."""

    shape = property(lambda self: (np.int64(self.tensor.numel()),))
    dtype = property(lambda self: self.tensor.dtype)
    nbytes = property(lambda self: np.int64(self.tensor.nbytes))


def test_the_array_handed_over_is_described_by_its_own_attributes_numpy_integers_included():
    with handoff.trace(libraries=True) as t:
        np.from_dlpack(FlatNumpySized(torch.zeros(2, 3)))
    (event,) = [e for e in t.events if e["interposed"]]
    assert (event["shape"], event["dtype"], event["nbytes"]) == ([6], "float32", 24)


def test_a_program_that_makes_array_types_as_it_goes_is_traced_past_what_the_hooks_remember():
    # The hooks remember each array type's library and each dtype's name up to a bound, then forget
    # them all (releasing the types they held): past it, every exchange is still seen and described.
    made = [type(f"Made{i}", (Delegating,), {}) for i in range(1100)]
    with handoff.trace(libraries=True) as t:
        for kind in made:
            np.from_dlpack(kind(torch.arange(3.0)))
    described = [e for e in t.events if e["interposed"]]
    assert len(described) == len(made)
    assert {(e["dtype"], e["nbytes"]) for e in described} == {("float32", 12)}


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
    shown = show_saved(tmp_path)
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


@pytest.mark.parametrize("method", ["fork", "spawn"])
@pytest.mark.parametrize("joined", [False, True], ids=["terminated", "joined"])
def test_pool_workers_a_pool_terminates_are_reported_as_unfinished_and_joined_ones_traced(tmp_path, method, joined):
    # Leaving `with Pool()` terminates the workers (SIGTERM): their traces were lost without a word.
    script = f"""
        import multiprocessing as mp, os, threading
        import numpy as np, torch

        def work(n):
            np.from_dlpack(torch.arange(float(n)))  # line 6
            return os.getpid()

        def keep(started):
            global busy
            busy = started

        def stay():  # the worker is still busy when terminate() comes: it cannot leave on its own
            busy.set()
            threading.Event().wait()

        if __name__ == "__main__":
            context = mp.get_context("{method}")
            started = context.Event()
            with context.Pool(1, initializer=keep, initargs=(started,)) as pool:
                workers = set(pool.map(work, [2, 3]))
                if {joined}:
                    pool.close()
                    pool.join()
                else:
                    pool.apply_async(stay)
                    started.wait()
            print(*workers)
    """
    result, section = trace_run(tmp_path, script)
    assert result.returncode == 0, result.stderr
    (worker,) = map(int, result.stdout.split())
    traced = {event["pid"] for event in section["events"] if event["where"] == f"{tmp_path / 'program.py'}:6"}
    if joined:  # the control: a worker that leaves on its own saves its trace
        assert traced == {worker} and worker not in section["unfinished"], result.stderr
        assert "without saving" not in result.stderr
    else:
        assert not traced and worker in section["unfinished"]
        assert f"process {worker} ended without saving its trace" in result.stderr
        assert "pool.close() and pool.join()" in result.stderr
        shown = show_saved(tmp_path)
        assert shown.returncode == 0 and f"process {worker} ended without saving" in shown.stderr, shown.stderr


def test_run_waits_for_a_process_that_outlives_the_program_to_save_its_trace(tmp_path):
    # The child, traced from its start, exchanges once the program has ended (its stdin closes then):
    # its unfinished file was read as it stood, and the process reported as killed.
    script = """
        import subprocess, sys
        code = "import sys, numpy as np, torch; print(flush=True); sys.stdin.read(); np.from_dlpack(torch.arange(2.0))"
        child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        child.stdout.readline()  # it runs
        print(child.pid)
    """
    result, section = trace_run(tmp_path, script)
    assert result.returncode == 0, result.stderr
    child = int(result.stdout)
    assert [e["where"] for e in section["events"] if e["pid"] == child] == ["<string>:1"], result.stderr
    assert child in section["processes"] and not section["unfinished"]
    assert "without saving" not in result.stderr and "still ran" not in result.stderr


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


def write(library, array, stream, value: float = 1.0) -> None:
    """Enqueues `library`'s write of `value` to `array` on `stream`, its current stream (inside a
    `sim.hold(stream)` block, it waits there until the block ends)."""
    with library.use(stream):
        library.fill(array, value)


def written(library, stream):
    """An array of `library`'s whose write of 1.0 on `stream` is done."""
    array = library.zeros(N)
    write(library, array, stream)
    sim.synchronize()
    return array


def read_during_held_write(producer_library, consumer_library, producer, consumer, *, by_keyword: bool = False):
    """An array of the producer library's, written (1.0) on `producer` while that stream is held, and
    imported by the consumer library on `consumer` meanwhile (by position, or by keyword as
    `ext_tensor`): (whether the consumer's read was still waiting once everything not held had run,
    which an ordered read must be and an unordered one cannot be; the values it read). An unordered
    read runs inside the hold, so that it reads what was there before the write on any machine."""
    x = producer_library.zeros(N)
    with sim.hold(producer), producer_library.use(producer), consumer_library.use(consumer):
        producer_library.fill(x, 1.0)
        y = consumer_library.from_dlpack(ext_tensor=x) if by_keyword else consumer_library.from_dlpack(x)
        read = consumer_library.to_numpy(y, wait=False)
        sim.synchronize_unheld()  # a read that does not wait for the held write runs now
        waited = not read.done()
    return waited, read.result()


@needs_sim
def test_a_producer_that_ignores_stream_is_flagged_unordered_and_reads_stale_data(peers):
    careless, torchlike, producer, consumer = peers
    x = careless.zeros(N)
    with sim.hold(producer), careless.use(producer), torchlike.use(consumer), handoff.trace(libraries=True) as t:
        careless.fill(x, 1.0)
        seen = torchlike.to_numpy(torchlike.from_dlpack(x))  # not held: it does not wait for the write
    assert (seen == 0).all(), "the negative control: unordered, the consumer reads before the write"
    (event,) = [e for e in t.events if e["interposed"]]
    assert (event["producer"], event["consumer"], event["action"]) == ("simnano", "simtorch", "unordered")
    assert event["hazard"] == "unordered" and event["interposed"] == "observed"
    assert event["stream_argument"] == consumer.handle, "the stream the consumer passed"
    assert (event["producer_stream"], event["consumer_stream"]) == (producer.handle, consumer.handle)
    assert "ignores DLPack's stream argument" in event["detail"]


class DeviceAsList:
    """A producer whose __dlpack_device__ answers a list rather than the tuple DLPack names."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return list(self.array.__dlpack_device__())


@needs_sim
def test_a_device_said_as_a_list_is_device_data_as_one_said_as_a_tuple(peers):
    _, torchlike, producer, consumer = peers
    x = written(torchlike, producer)
    with torchlike.use(consumer), handoff.trace(libraries=True) as t, pytest.raises(TypeError):
        torchlike.from_dlpack(DeviceAsList(x))  # which handoff's own import, beneath, refuses
    (event,) = [e for e in t.events if e["interposed"]]
    assert event["device"] == tuple(x.__dlpack_device__()), "not taken for host data"
    assert event["action"] == "refused" and event["detail"].startswith("TypeError: ")
    assert event["consumer_stream"] == consumer.handle, "its streams asked, as device data's are"


def register_asking_device(name: str, **options) -> list:
    """Registers an adapter for library `name` whose `device` answers as the array does and lists
    each array it is asked about; returns that list."""
    asked: list = []

    def device(array):
        asked.append(array)
        return array.__dlpack_device__()

    handoff.register_library(handoff.LibraryAdapter(name, device=device, **options))
    return asked


@needs_sim
def test_an_adapters_device_is_asked_once_an_exchange(peers):
    _, torchlike, _, consumer = peers
    library = make_library("simdevice", register=False)
    asked = register_asking_device("simdevice")
    x = library.zeros(N)
    with torchlike.use(consumer), handoff.trace(libraries=True) as t:
        torchlike.from_dlpack(x)
    assert asked == [x]
    (event,) = [e for e in t.events if e["interposed"]]
    assert event["producer"] == "simdevice" and event["device"] == tuple(x.__dlpack_device__())


@needs_sim
def test_a_host_only_librarys_exchanges_pass_the_ordering_mode_unasked_and_a_trace_records_them(peers):
    _, torchlike, _, consumer = peers
    library = make_library("simhostonly", register=False)
    asked = register_asking_device("simhostonly", host_only=True)
    x = library.zeros(N)
    handoff.order_libraries(True)
    with torchlike.use(consumer):
        torchlike.from_dlpack(x)
    assert asked == [], "the ordering mode alone asks nothing of a host-only library's arrays"
    with torchlike.use(consumer), handoff.trace(libraries=True) as t:
        torchlike.from_dlpack(x)
    assert asked == [x], "a trace records the exchange, and asks its device"
    assert [e["producer"] for e in t.events if e["interposed"]] == ["simhostonly"]


@pytest.mark.parametrize(
    "tensor",
    [
        pytest.param(lambda: torch.arange(6.0), id="plain"),
        pytest.param(lambda: torch.arange(6.0).reshape(2, 3).T, id="view"),
        pytest.param(lambda: torch.tensor(True), id="bool-0d"),
        pytest.param(lambda: torch.nn.Parameter(torch.ones(2)), id="parameter"),
        pytest.param(
            lambda: torch.ones(3).pin_memory(),
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs PyTorch's CUDA"),
            id="pinned",
        ),
    ],
)
def test_pytorchs_adapter_answers_the_device_as_pytorch_does(tensor):
    made = tensor()
    adapter = registry.get("torch")
    assert adapter is not None and adapter.device is not None
    assert adapter.device(made) == tuple(int(part) for part in made.__dlpack_device__())


@needs_sim
def test_the_ordering_mode_removes_the_race_and_marks_the_exchange_ordered(peers):
    careless, torchlike, producer, consumer = peers
    handoff.order_libraries(True)
    with handoff.trace(libraries=True) as t:
        waited, seen = read_during_held_write(careless, torchlike, producer, consumer)
    assert waited and (seen == 1).all(), "ordered: the consumer's stream waited for the producer's write"
    (event,) = [e for e in t.events if e["interposed"]]
    assert (event["action"], event["hazard"], event["interposed"]) == ("wait", None, "ordered")
    assert "1 ordered by handoff's hooks" in t.summary()


class DLPackOnly(Delegating):
    """A producer that offers DLPack alone, as cuda.core's `Buffer` does (its library's module is set
    by the test that uses it)."""


@needs_sim
@pytest.mark.parametrize("ordering", [False, True], ids=["negative-control-unhooked", "ordering"])
def test_the_ordering_mode_leaves_the_consumer_what_the_producer_answers_and_offers(peers, ordering):
    careless, torchlike, producer, consumer = peers
    module = types.ModuleType("simbuffers")
    DLPackOnly.__module__ = module.__name__
    sys.modules[module.__name__] = module
    handoff.register_library(handoff.LibraryAdapter(module.__name__, current_stream=lambda device: producer))
    handoff.order_libraries(ordering)
    try:
        with torchlike.use(consumer):
            # copy=True, which the producer refuses (cuda.core's own BufferError) and a handoff.Array would make
            with pytest.raises(BufferError, match="Sorry, not supported: copy=True"):
                torchlike.from_dlpack(careless.zeros(N), copy=True)
            assert np.array_equal(torchlike.to_numpy(torchlike.from_dlpack(careless.zeros(N), copy=False)), np.zeros(N))
            # An interface reader handed DLPack alone, where a handoff.Array has the interface too
            with pytest.raises(AttributeError, match="__cuda_array_interface__"):
                torchlike.as_array(DLPackOnly(sim.zeros(N, "float32")))
    finally:
        del sys.modules[module.__name__]


@needs_sim
def test_a_producer_that_honours_stream_is_ordered_by_itself_and_no_hazard(peers):
    _, torchlike, producer, consumer = peers
    other = make_library("simcupy")
    with handoff.trace(libraries=True) as t:
        waited, seen = read_during_held_write(other, torchlike, producer, consumer)
    assert waited and (seen == 1).all()
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
        x = careless.zeros({N})
        with sim.hold(producer), careless.use(producer), torchlike.use(consumer):
            careless.fill(x, 1.0)
            read = torchlike.to_numpy(torchlike.from_dlpack(x), wait=False)
            sim.synchronize_unheld()  # a read that does not wait for the held write runs now
            waited = not read.done()
        print(waited, read.result().min())
        sim.synchronize()
    """
    racy, section = trace_run(tmp_path, script)
    assert racy.returncode == 0, racy.stderr
    # Unordered, the read does not wait for the held write (it may not have run yet, but reads before it).
    assert racy.stdout.split()[1] == "0.0" and "HAZARDS (1)" in racy.stderr and "unordered" in racy.stderr
    fixed, section = trace_run(tmp_path, script, "--order")
    assert fixed.returncode == 0, fixed.stderr
    assert fixed.stdout.split() == ["True", "1.0"] and "no hazards" in fixed.stderr
    assert [e["interposed"] for e in section["events"] if e["interposed"]] == ["ordered"]


# The ordering mode on (handoff.order_libraries), and off: the negative control.
ordering_on_and_off = pytest.mark.parametrize("ordering", [True, False], ids=["ordered", "negative-control-unordered"])


def imported_by_torchlike(peers, ordering: bool) -> tuple:
    """An array of the careless library's, imported by the PyTorch-like one with the ordering mode on
    or off: (the import, a weak reference to the producer's array, the producer's memory). The caller
    keeps the memory until its test ends: a release tests that the producer (its Python object) goes,
    and freeing the memory meanwhile would wait for the held work."""
    careless, torchlike, producer, consumer = peers
    handoff.order_libraries(ordering)
    x = written(careless, producer)
    gone = weakref.ref(x)
    with careless.use(producer), torchlike.use(consumer):
        return torchlike.from_dlpack(x), gone, x._data


def released_while_held(gone, held: bool) -> None:
    """Inside a hold of the consumer's stream, after its array went: asserts that the producer is kept
    (`held`: its release waits for the held work) or released while the work is still held (a release
    that waits for no held work runs on the service thread once the streams it waits for are seen
    done: polled for, as sim.drain inside a hold would wait for the held work too). The producer's
    memory must outlive the hold (see imported_by_torchlike)."""
    gc.collect()
    if held:
        assert gone() is not None, "kept until the work the consumer's stream had is done"
        return
    deadline = time.monotonic() + 30
    while gone() is not None and time.monotonic() < deadline:
        time.sleep(0.001)
        gc.collect()
    assert gone() is None, "released with the consumer's array, whatever its stream still does"


@contextlib.contextmanager
def consumer_work_held(consumer, gone, kept: bool) -> Iterator[None]:
    """A hold of the consumer's stream around its work on an import and the drop of its arrays: at the
    block's end, released_while_held(gone, kept) while the work is still held; after the hold, once
    that work is done, the producer must be gone."""
    with sim.hold(consumer):
        yield
        released_while_held(gone, held=kept)
    settle_sim()
    assert gone() is None


@needs_sim
@ordering_on_and_off
def test_the_ordering_mode_keeps_the_producer_until_the_consumers_array_is_gone_and_its_stream_done(peers, ordering):
    _, torchlike, _, consumer = peers
    y, gone, _memory = imported_by_torchlike(peers, ordering)
    # Ordered, the producer is kept until the work the consumer's stream had when its array went is
    # done; unordered, it goes with the array, while that work still reads its memory.
    with consumer_work_held(consumer, gone, kept=ordering):
        write(torchlike, y, consumer, 2.0)  # the consumer's kernel, still running on its stream
        del y


@needs_sim
@pytest.mark.parametrize("busy", [True, False], ids=["busy", "negative-control-idle"])
def test_the_consumers_array_dropped_while_its_stream_works_with_the_last_producer_reference_is_released_early(
    peers, busy
):
    other, torchlike, producer, consumer = make_library("simcupy"), *peers[1:]
    x = written(other, producer)
    _memory = x._data  # freed only after the hold: freeing it would wait for the held work
    held = sim.hold(consumer) if busy else contextlib.nullcontext()
    with held, torchlike.use(consumer), handoff.trace(libraries=True) as t:
        y = torchlike.from_dlpack(x)
        if busy:
            torchlike.fill(y, 2.0)  # the consumer's kernel, still running on its stream
        else:
            sim.synchronize()  # the consumer's stream is done
        del x  # the consumer's array holds the producer's last reference now
        del y
    releases = [e for e in t.events if e["interposed"] and e["kind"] == "release"]
    if not busy:
        assert releases == [], "the consumer's work was done: nothing to flag"
    else:
        (event,) = releases
        assert (event["hazard"], event["producer"], event["consumer"]) == ("released early", "simcupy", "simtorch")
        assert "still had work queued" in event["detail"]


@needs_sim
def test_a_producer_still_held_elsewhere_is_not_released_early(peers):
    _, torchlike, producer, consumer = peers
    other = make_library("simcupy")
    x = written(other, producer)
    with sim.hold(consumer), torchlike.use(consumer), handoff.trace(libraries=True) as t:
        y = torchlike.from_dlpack(x)
        torchlike.fill(y, 2.0)
        del y  # x is still the program's: its memory stays
    assert [e for e in t.events if e["interposed"] and e["kind"] == "release"] == []


@needs_sim
@needs_two_devices
def test_a_producer_called_while_another_device_is_current_is_a_cross_device_hazard(peers):
    _, torchlike, _, _ = peers
    other = make_library("simcupy")
    x = written(other, sim.Stream(0, non_blocking=True))
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
    # PyTorch passes the current stream of the data's device (torch.cuda.current_stream(f"cuda:{i}")),
    # never another device's: the consumer here is a library with one current stream for every
    # device, which it passes whatever device the data is on.
    from handoff._adapters import registry

    other = make_library("simcupy")
    data_stream, far = sim.Stream(0, non_blocking=True), sim.Stream(1, non_blocking=True)
    current: list = [None]
    module = types.ModuleType("simonestream")

    def from_dlpack(x):
        capsule = x.__dlpack__(stream=current[0].handle, max_version=(1, 0))
        return handoff.from_dlpack(_Capsule(capsule, x.__dlpack_device__()), stream=-1)

    module.from_dlpack = from_dlpack
    sys.modules[module.__name__] = module
    handoff.register_library(
        handoff.LibraryAdapter(
            module.__name__, consumers=(f"{module.__name__}:from_dlpack",), current_stream=lambda device: current[0]
        )
    )
    try:
        for consumer, hazard in ((far, "cross-device"), (sim.Stream(0, non_blocking=True), None)):  # negative control
            x = written(other, data_stream)
            current[0] = consumer
            with handoff.trace(libraries=True) as t:
                module.from_dlpack(x)
            (event,) = [e for e in t.events if e["interposed"]]
            assert event["hazard"] == hazard
    finally:
        registry.remove(module.__name__)
        del sys.modules[module.__name__]


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
            x = careless.zeros(N)
            write(careless, x, consumer)  # careless's own block nests inside
            with handoff.trace(libraries=True) as t:
                seen = torchlike.to_numpy(torchlike.from_dlpack(x))
        assert registry.get("simtorch").current_stream(0) is producer, "restored"
    assert (seen == 1).all(), "one stream: nothing needed ordering"
    (event,) = [e for e in t.events if e["interposed"]]
    assert event["consumer_stream"] == consumer.handle and event["hazard"] is None


def test_a_framework_stream_block_needs_a_stream():
    with pytest.raises(ValueError, match="name the stream the frameworks should use"):
        handoff.stream(None, frameworks=True)


# --- the hooks as the program sees them: pickling, reloads, keywords, adapters ------------------------


@pytest.mark.parametrize("mode", ["traced", "ordering"])
def test_a_hooked_consumer_pickles_as_what_it_wraps_and_its_aliases_stay_one_function(mode):
    jax_dlpack = pytest.importorskip("jax.dlpack")
    originals = (torch.from_dlpack, jax_dlpack.from_dlpack)
    with contextlib.ExitStack() as hooks:
        if mode == "traced":
            hooks.enter_context(handoff.trace(libraries=True))
        else:
            handoff.order_libraries(True)
            hooks.callback(handoff.order_libraries, False)
        assert torch.from_dlpack is not originals[0], "hooked"
        assert torch.from_dlpack is torch.utils.dlpack.from_dlpack, "the aliases are one function, as before"
        for hooked in (torch.from_dlpack, jax_dlpack.from_dlpack):
            assert pickle.loads(pickle.dumps(hooked)) is hooked
        pickled = pickle.dumps((torch.from_dlpack, jax_dlpack.from_dlpack))
    # Where no hooks are in place (a worker process of a pool), it is what it wraps.
    assert pickle.loads(pickled) == originals


@pytest.mark.parametrize("mode", ["HANDOFF_ORDER", "order_libraries"])
def test_a_library_imported_while_hooked_gets_its_own_functions_back_when_the_hooks_go(mode):
    # torch/__init__ copies torch.utils.dlpack's from_dlpack, already hooked: that copy is put back too.
    result = run_python(
        textwrap.dedent(
            f"""
            import pickle, handoff
            if {mode == "order_libraries"}:
                handoff.order_libraries(True)
            import torch, torch.utils.dlpack
            hooked = torch.from_dlpack
            handoff.order_libraries(False)
            original = torch.utils.dlpack.from_dlpack
            print(hooked is not original, torch.from_dlpack is original, pickle.loads(pickle.dumps(torch.from_dlpack)) is original)
            handoff.order_libraries(True)
            print(torch.from_dlpack.__handoff_original__ is original)
            """
        ),
        **({"HANDOFF_ORDER": "1"} if mode == "HANDOFF_ORDER" else {}),
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "True", "True"], "put back, pickled as itself, wrapped once again"


@pytest.mark.parametrize("mode", ["trace", "ordering"])
def test_the_array_types_the_hooks_remember_are_let_go_of_when_the_hooks_go(mode):
    def exchanged() -> weakref.ref:
        big = np.zeros(1000)  # what the type keeps alive
        kind = type(
            "Kept",
            (),
            {"__dlpack__": lambda self, **kw: big.__dlpack__(**kw), "__dlpack_device__": lambda self: (1, 0)},
        )
        torch.from_dlpack(kind())
        np.from_dlpack(kind())
        return weakref.ref(kind)

    if mode == "trace":
        with handoff.trace(libraries=True):
            kept = exchanged()
    else:
        handoff.order_libraries(True)
        kept = exchanged()
        handoff.order_libraries(False)
    gc.collect()
    assert kept() is None


def test_a_hooked_call_whose_arrays_device_fills_the_hooks_cache_names_its_producer_all_the_same():
    # The array's __dlpack_device__ makes a hooked call on a new type with the per-type cache full,
    # which empties it: the call in progress holds its library's entry itself (PYTHONMALLOC=debug
    # fills what is freed, so a freed entry would be read as garbage).
    result = run_python(
        textwrap.dedent(
            """
            import numpy as np, torch, handoff
            with handoff.trace(libraries=True) as t:
                for i in range(1100):  # past the cache's bound, each type a library of its own
                    try:
                        torch.from_dlpack(type(f"T{i}", (), {"__module__": f"lib{i}"})())
                    except Exception:
                        pass
                base = np.arange(4.0)
                class Outer:
                    def __dlpack__(self, **kw):
                        return base.__dlpack__(**kw)
                    def __dlpack_device__(self):
                        for j in range(1100):
                            try:
                                torch.from_dlpack(type(f"F{j}", (), {"__module__": f"fresh{j}"})())
                            except Exception:
                                pass
                        return (1, 0)
                Outer.__module__ = "outerlib.sub"
                print(torch.from_dlpack(Outer()).tolist())
            print([e["producer"] for e in t.events if e.get("consumer") == "torch" and e.get("producer") == "outerlib"])
            """
        ),
        PYTHONMALLOC="debug",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[0.0, 1.0, 2.0, 3.0]", "['outerlib']"]


def test_a_module_reloaded_while_hooked_is_hooked_again_and_only_what_is_still_ours_is_put_back(tmp_path, monkeypatch):
    module = tmp_path / "reloaded_library.py"
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(version: int) -> None:
        module.write_text(f"def from_dlpack(x):\n    return 'v{version}'\n")
        stamp = module.stat().st_mtime + version  # a newer time: reload reads the new source
        os.utime(module, (stamp, stamp))

    write(1)
    library = importlib.import_module("reloaded_library")
    monkeypatch.setitem(sys.modules, "reloaded_library", library)  # removed again at the end
    handoff.register_library(handoff.LibraryAdapter("reloaded_library", consumers=("reloaded_library:from_dlpack",)))
    with handoff.trace(libraries=True) as t:
        library.from_dlpack(np.arange(3.0))
        write(2)
        importlib.invalidate_caches()
        importlib.reload(library)
        assert library.from_dlpack(np.arange(3.0)) == "v2"
    assert [e["consumer"] for e in t.events if e["interposed"]] == ["reloaded_library"] * 2, "both calls seen"
    assert library.from_dlpack(np.arange(3.0)) == "v2", "the reloaded function is put back, not the old one"
    assert not hasattr(library.from_dlpack, "__handoff_original__")

    def mine(x):
        return "mine"

    with handoff.trace(libraries=True):
        library.from_dlpack = mine  # the program's own patch, made while hooked
    assert library.from_dlpack is mine, "what is no longer the hooks' own stays"


def test_an_array_given_by_keyword_is_an_exchange_as_one_given_by_position():
    with handoff.trace(libraries=True) as t:
        by_position = torch.from_dlpack(np.arange(3.0))
        by_keyword = torch.from_dlpack(ext_tensor=np.arange(3.0))  # PyTorch 2.13's parameter
    assert torch.equal(by_position, by_keyword)
    assert [(e["producer"], e["consumer"]) for e in t.events if e["interposed"]] == [("numpy", "torch")] * 2


class NoSignature:
    """A consumer function whose signature Python cannot read (a C or Cython function: CuPy builds with
    binding=False), which takes the array as `array`."""

    @property
    def __signature__(self):
        raise ValueError("no signature found for builtin")

    def __call__(self, array=None, *, copy=None):
        return np.from_dlpack(array)


def test_a_consumer_without_a_signature_takes_the_array_by_the_keyword_its_adapter_names(monkeypatch):
    library = types.ModuleType("unsigned_library")
    library.from_dlpack = NoSignature()
    monkeypatch.setitem(sys.modules, "unsigned_library", library)
    handoff.register_library(
        handoff.LibraryAdapter("unsigned_library", consumers=("unsigned_library:from_dlpack(array)",))
    )
    with handoff.trace(libraries=True) as t:
        library.from_dlpack(torch.arange(2.0))
        library.from_dlpack(array=torch.arange(2.0))
    assert [e["producer"] for e in t.events if e["interposed"]] == ["torch", "torch"]
    with pytest.raises(ValueError, match="'arr ay' is not a parameter name"):
        handoff.LibraryAdapter("bad", consumers=("bad:f(arr ay)",))


def test_an_adapters_consumers_given_as_a_generator_are_kept():
    adapter = handoff.LibraryAdapter(
        "generated", consumers=(f"generated:{name}" for name in ("from_dlpack", "asarray"))
    )
    assert adapter.consumers == ("generated:from_dlpack", "generated:asarray")


def test_the_release_check_counts_references_as_this_python_does():
    # `sys.getrefcount(...) > 3` was a constant of one CPython version: the check measures its own.
    held = Refusing()
    assert _interposed._references(weakref.ref(held)) - _interposed._OWN_REFERENCES == 1


# --- programs that never import handoff: the environment, the trace file, its graph ---------------


PLAIN_PROGRAM = """
import numpy as np, torch, sys
np.from_dlpack(torch.arange(3.0))
print("handoff" in sys.modules)
"""


def installed_pth() -> Path | None:
    """handoff.pth as the installed distribution lists it (None for a package on PYTHONPATH)."""
    try:
        files = importlib.metadata.files("handoff") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = [f for f in files if f.name == "handoff.pth"]
    return Path(found[0].locate()) if found else None


needs_pth = pytest.mark.skipif(
    installed_pth() is None or not Path(handoff.__file__).is_relative_to(Path(str(installed_pth())).parent),
    reason="handoff is not installed as a distribution here (its handoff.pth is installed with it)",
)


@needs_pth
def test_the_environment_traces_a_program_that_never_imports_handoff(tmp_path):
    # The handoff.pth installed beside the package imports handoff at start-up only where asked.
    plain = run_python(PLAIN_PROGRAM)
    assert plain.returncode == 0 and plain.stdout.strip() == "False", "unset, nothing is imported"
    traced = run_python(PLAIN_PROGRAM, HANDOFF_TRACE=str(tmp_path / "trace-%p.json"))
    assert traced.returncode == 0, traced.stderr
    (saved,) = tmp_path.glob("trace-*.json")
    events = json.loads(saved.read_text())["handoff"]["events"]
    assert [(e["producer"], e["consumer"], e["where"]) for e in events] == [("torch", "numpy", "<string>:3")]
    hooked = "import sys, torch; print('handoff' in sys.modules, hasattr(torch.from_dlpack, '__handoff_original__'))"
    assert run_python(hooked).stdout.split() == ["False", "False"]
    assert run_python(hooked, HANDOFF_ORDER="1").stdout.split() == ["True", "True"], "the ordering mode's hooks"


def test_a_trace_file_keeps_each_event_once(tmp_path):
    with handoff.trace(tmp_path / "trace.json", libraries=True):
        np.from_dlpack(torch.arange(3.0))
    text = (tmp_path / "trace.json").read_text()
    assert text.count('"time_ns"') == 1, "under 'handoff', not again in the Perfetto slice"
    (exchange,) = [e["args"]["exchange"] for e in json.loads(text)["traceEvents"] if e["ph"] == "X"]
    assert "torch -> numpy" in exchange


def test_the_graph_of_a_program_that_never_calls_handoff_draws_its_exchanges_and_says_so(tmp_path):
    with handoff.trace(tmp_path / "trace.json", libraries=True):
        np.from_dlpack(torch.arange(3.0))
        torch.from_dlpack(np.ones(2))
    command = [sys.executable, "-m", "handoff._trace_cli", "graph", str(tmp_path / "trace.json"), "--format"]
    dot = subprocess.run([*command, "dot"], capture_output=True, text=True, timeout=120, check=True)
    assert '"library:torch" -> "library:numpy" [label="1 import (dlpack)"]' in dot.stdout
    assert '"library:numpy" -> "library:torch"' in dot.stdout
    assert "the trace saw 2 exchanges between other libraries" in dot.stderr
    shown = json.loads(
        subprocess.run([*command, "json"], capture_output=True, text=True, timeout=120, check=True).stdout
    )
    assert [(p["producer"], p["consumer"], p["imports"]) for p in shown["exchanges"]] == [
        ("torch", "numpy", 1),
        ("numpy", "torch", 1),
    ]


def test_a_consumer_that_copies_what_it_was_handed_is_recorded_with_the_data_handed_and_a_note():
    jnp = pytest.importorskip("jax.numpy")
    with handoff.trace(libraries=True) as t:
        jnp.from_dlpack(torch.arange(6))  # JAX without x64 makes an int32 copy of int64 data
        jnp.from_dlpack(torch.arange(6.0))  # negative control: a float32 view, no copy to note
    copied, viewed = [e for e in t.events if e["interposed"]]
    assert (copied["dtype"], copied["nbytes"]) == ("int64", 48)
    assert copied["detail"] == "jax made a copy: int32[6] of the int64[6] it was handed"
    assert viewed["dtype"] == "float32" and not viewed["detail"]


def test_a_copy_of_the_same_layout_is_told_by_its_data_pointer():
    with handoff.trace(libraries=True) as t:
        for _ in range(2):  # the second finds each type's pointer read remembered
            np.from_dlpack(torch.ones(4), copy=True)
            np.from_dlpack(torch.ones(4))  # negative control: a view, no copy to note
    notes = [e["detail"] for e in t.events if e["interposed"]]
    copied = "numpy made a copy of the float32[4] it was handed"
    assert notes == [copied, None, copied, None]


@pytest.mark.parametrize(
    "array",
    [np.arange(6.0).reshape(2, 3).T, np.array([True, False, True]), np.zeros((0, 4), np.int16)],
    ids=["transposed-view", "bool", "empty"],
)
def test_a_numpy_array_handed_over_is_described_as_numpy_describes_it(array):
    with handoff.trace(libraries=True) as t:
        torch.from_dlpack(array)
    (event,) = [e for e in t.events if e["interposed"]]
    assert (event["shape"], event["dtype"], event["nbytes"]) == (list(array.shape), str(array.dtype), array.nbytes)
    assert event["detail"] is None, "a view of the same data: no copy to note"


@pytest.mark.parametrize(
    "tensor",
    [torch.arange(6.0).reshape(2, 3).T, torch.tensor([True, False, True]), torch.zeros((0, 4), dtype=torch.int16)],
    ids=["transposed-view", "bool", "empty"],
)
def test_a_tensor_handed_to_numpy_is_described_as_the_tensor_says_it_is(tensor):
    # The view's NumPy side is read in full and the tensor's data pointer only: the event still says
    # what the tensor is, and an empty tensor (whose pointer tells nothing) is read in full.
    with handoff.trace(libraries=True) as t:
        np.from_dlpack(tensor)
    (event,) = [e for e in t.events if e["interposed"]]
    expected = (list(tensor.shape), str(tensor.dtype).removeprefix("torch."), tensor.nbytes)
    assert (event["shape"], event["dtype"], event["nbytes"]) == expected
    assert event["detail"] is None, "a view of the same data: no copy to note"


# --- the ordering mode's streams and keep-alive, on the simulator ----------------------------------


@needs_sim
@ordering_on_and_off
def test_an_array_given_by_keyword_is_ordered_as_one_given_by_position(peers, ordering):
    careless, torchlike, producer, consumer = peers
    handoff.order_libraries(ordering)
    waited, seen = read_during_held_write(careless, torchlike, producer, consumer, by_keyword=True)
    if ordering:
        assert waited and (seen == 1).all()
    else:
        assert (seen == 0).all(), "the negative control: it read before the held write"


class Answer:
    """A library whose adapter answers `current_stream` with whatever a test gives it."""

    def __init__(self, name: str, answer: object) -> None:
        self.answer = answer
        self.module = types.ModuleType(name)
        self.module.from_dlpack = lambda x: handoff.from_dlpack(x, stream=-1)
        sys.modules[name] = self.module
        handoff.register_library(
            handoff.LibraryAdapter(name, consumers=(f"{name}:from_dlpack",), current_stream=lambda device: self.answer)
        )


@needs_sim
@pytest.mark.parametrize(
    ("answer", "named"),
    [("stream 7", "str"), (2**70, "int"), (object(), "object")],
    ids=["a string", "an int over 64 bits", "an object that is no stream"],
)
def test_an_adapters_current_stream_that_names_no_stream_is_said_once_and_the_call_goes_on(peers, capfd, answer, named):
    library = Answer(f"answers_{named}", answer).module
    x = peers[0].zeros(N)
    capfd.readouterr()
    with handoff.trace(libraries=True) as t:
        for _ in range(2):
            assert library.from_dlpack(x).shape == (N,)
    handoff.order_libraries(True)
    assert library.from_dlpack(x).shape == (N,), "ordered or not, the program runs as without hooks"
    handoff.order_libraries(False)
    events = [e for e in t.events if e["interposed"]]
    assert len(events) == 2 and all(e["consumer_stream"] is None for e in events), "each seen, without it"
    said = capfd.readouterr().err
    assert said.count(f"the library adapter 'answers_{named}': current_stream(0) returned") == 1, said


@needs_sim
def test_an_adapters_current_stream_may_be_the_stream_object_which_is_held(peers):
    careless, _, producer, _ = peers
    stream = sim.Stream(non_blocking=True)
    library = Answer("answers_object", stream).module
    x = careless.zeros(N)
    handoff.order_libraries(True)
    with sim.hold(producer), careless.use(producer), handoff.trace(libraries=True) as t:
        careless.fill(x, 1.0)
        read = sim.to_numpy(library.from_dlpack(x), stream=stream, wait=False)
        assert not read.done(), "the adapter's stream waits for the producer's"
    (event,) = [e for e in t.events if e["interposed"]]
    assert (event["consumer_stream"], event["interposed"]) == (stream.handle, "ordered")
    assert (read.result() == 1).all()


def make_short_lived(name: str, *, objects: bool):
    """A consumer library whose current stream is a stream object it drops (CuPy's `with
    cupy.cuda.Stream(): y = cupy.asarray(x)`), its adapter giving the object or, as older adapters
    did, its bare handle."""
    library = make_library(name, register=False)
    current: list = [None]
    library.use_short_lived = lambda stream: current.__setitem__(0, stream)
    handoff.register_library(
        handoff.LibraryAdapter(
            name,
            consumers=(f"{name}:from_dlpack",),
            current_stream=lambda device: current[0] if objects or current[0] is None else current[0].handle,
        )
    )
    return library, current


@needs_sim
@pytest.mark.parametrize("mode", ["ordering", "tracing"])
@pytest.mark.parametrize("objects", [True, False], ids=["stream-object", "bare-handle"])
def test_a_consumer_stream_destroyed_before_its_array_is_never_used_after_it_is_gone(peers, mode, objects):
    careless, _, producer, _ = peers
    consumer, current = make_short_lived(f"short_lived_{mode}_{objects}", objects=objects)
    sim.clear_violations()
    x = written(careless, producer)
    gone = weakref.ref(x)
    with contextlib.ExitStack() as block:
        if mode == "ordering":
            handoff.order_libraries(True)
        else:
            block.enter_context(handoff.trace(libraries=True))
        stream = sim.Stream(non_blocking=True)
        current[0] = stream
        with careless.use(producer):
            y = consumer.from_dlpack(x)
        current[0] = None
        del x, stream  # the library's stream object goes first: destroyed, unless handoff holds it
        gc.collect()
        del y
        settle_sim()
    assert sim.violations() == [], "no work was put on a destroyed stream"
    assert gone() is None, "the producer was released"


@needs_sim
@ordering_on_and_off
def test_the_ordering_mode_releases_the_producer_after_the_consumers_storage_not_its_first_wrapper(peers, ordering):
    _, torchlike, _, consumer = peers
    y, gone, _memory = imported_by_torchlike(peers, ordering)
    view = torchlike.view(y)  # shares y's storage, as a PyTorch view does
    del y
    settle_sim()
    assert gone() is not None, "the view still holds the data"
    # Ordered, the release waits for the work the consumer's stream had when its storage went.
    with consumer_work_held(consumer, gone, kept=ordering):
        write(torchlike, view, consumer, 3.0)  # later work of the consumer's, through the view
        del view


@needs_sim
@pytest.mark.parametrize("policy", ["known-streams", "every-stream"])
def test_the_ordering_mode_keeps_the_producer_behind_a_bare_handle_only_where_the_policy_vouches_for_it(peers, policy):
    careless, _, producer, _ = peers
    consumer, current = make_short_lived(f"bare_{policy.replace('-', '_')}", objects=False)
    stream = sim.Stream(non_blocking=True)
    handoff.order_libraries(True)
    handoff.set_export_release(policy)
    try:
        x = written(careless, producer)
        gone, _memory = weakref.ref(x), x._data  # the memory outlives the hold (see imported_by_torchlike)
        current[0] = stream
        with careless.use(producer), handoff.trace(libraries=True) as t:
            y = consumer.from_dlpack(x)
        current[0] = None
        with sim.hold(stream):
            sim.fill(y._data, 2.0, stream=stream)
            del x, y
            # Only where the policy vouches for bare handles does a release wait for one.
            released_while_held(gone, held=policy == "every-stream")
    finally:
        handoff.set_export_release("known-streams")
    (event,) = [e for e in t.events if e["interposed"]]
    assert (event["action"], event["interposed"]) == ("wait", "ordered"), "ordered either way"
    assert ("is a bare handle that may be destroyed first" in event["detail"]) == (policy == "known-streams")
    settle_sim()


@needs_sim
@pytest.mark.parametrize("knows", [True, False], ids=["negative-control-known", "no-current-stream"])
def test_an_exchange_the_ordering_mode_cannot_order_is_flagged_saying_why_and_how(peers, knows):
    careless, _, producer, consumer = peers
    name = "streamless_consumer"
    library = make_library(name, register=False)
    handoff.register_library(
        handoff.LibraryAdapter(
            name,
            consumers=(f"{name}:from_dlpack",),
            current_stream=(lambda device: consumer) if knows else None,  # cuda.core, MLX, tvm-ffi have none
        )
    )
    sim.synchronize()
    x = careless.zeros(N)  # nothing pending: flagged all the same, as the mode promised an order
    handoff.order_libraries(True)
    with careless.use(producer), library.use(consumer), handoff.trace(libraries=True) as t:
        library.from_dlpack(x)
    (event,) = [e for e in t.events if e["interposed"]]
    if knows:
        assert (event["interposed"], event["hazard"]) == ("ordered", None)
    else:
        assert (event["interposed"], event["hazard"], event["action"]) == ("observed", "unordered", "unordered")
        assert f"handoff knows no current stream of {name}" in event["detail"]
        assert "current_stream" in event["detail"] and "frameworks=True" in event["detail"]


@needs_sim
@pytest.mark.parametrize("current", [True, False], ids=["the-librarys-current-stream", "negative-control-another"])
def test_an_export_to_a_bare_handle_holds_the_stream_object_of_the_library_whose_current_stream_it_is(current):
    library = make_library("holds_its_streams")
    stream = library.Stream()
    handle = stream.handle
    data = sim.zeros(N, "float32")
    sim.synchronize()

    class Owner:
        pass

    owner = Owner()
    gone = weakref.ref(owner)
    view = handoff.view(data.data_ptr, (N,), "float32", device=data.device, owner=owner)
    del owner
    with library.use(stream) if current else contextlib.nullcontext():
        capsule = view.__dlpack__(stream=handle, max_version=(1, 0))  # a CuPy consumer passes its stream
    imported = handoff.from_dlpack(capsule, stream=-1)
    sim.clear_violations()
    with sim.hold(stream):
        sim.fill(imported, 2.0, stream=stream)  # the consumer's work on the data
        del view, capsule, imported
        # Held, the stream outlives the release that waits for its work; unheld, nothing waits.
        released_while_held(gone, held=current)
    del stream  # the library drops its stream object too
    settle_sim()
    assert gone() is None and sim.violations() == []


@needs_sim
@needs_two_devices
def test_a_framework_stream_block_and_pinned_data_ask_for_the_device_that_works_on_them(peers):
    asked: list = []
    library = make_library("device_spy", register=False)
    handoff.register_library(
        handoff.LibraryAdapter(
            "device_spy",
            consumers=("device_spy:from_dlpack",),
            current_stream=lambda device: asked.append(("current_stream", device)),
            use_stream=lambda handle, device: asked.append(("use_stream", device)),
        )
    )
    far = sim.Stream(1, non_blocking=True)
    with handoff.stream(handoff.Stream(far.handle), frameworks=True):  # no device said: the stream's own
        pass
    pinned = peers[0].Array(sim.zeros(N, "float32", memory="pinned"))  # DLPack says device 0 of pinned memory
    sim.set_device(1)
    try:
        with handoff.trace(libraries=True):
            library.from_dlpack(pinned)
    finally:
        sim.set_device(0)
    assert asked == [("use_stream", 1), ("current_stream", 1)]


# --- on a GPU: PyTorch and CuPy as they are ------------------------------------------------------

CUDA_USABLE = (
    BACKEND == "cuda" and not handoff.runtime_info().get("backend_error") and handoff.runtime_info()["device_count"] > 0
)
needs_gpu = pytest.mark.skipif(not CUDA_USABLE, reason=f"needs HANDOFF_BACKEND=cuda and a GPU (backend {BACKEND!r})")
GPU_N = 1 << 20


@pytest.fixture(scope="module")
def cuda_libraries():
    """PyTorch and CuPy on the GPU, and the torch.cuda._sleep cycles that keep a stream busy for about
    0.15 s (a consumer that is not ordered always reads first)."""
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device here")
    cupy = pytest.importorskip("cupy")
    cupy.zeros(8, dtype=cupy.float32).fill(1.0)  # CuPy compiles its kernels now, not behind a spin
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(100_000_000)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return torch, cupy, int(100_000_000 * 0.15 * 1000 / start.elapsed_time(end))


class CarelessTensor:
    """A PyTorch tensor handed on by a wrapper that ignores `stream` (as cuda.core's and nanobind's
    arrays do), registered as the library `careless_gpu`."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __dlpack__(self, *, stream=None, **kwargs):
        return self.tensor.__dlpack__(stream=-1, **kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


CarelessTensor.__module__ = "careless_gpu"


@pytest.fixture
def careless_gpu(cuda_libraries):
    """Makes a tensor whose fill of 1.0 is queued behind a spin on a PyTorch stream, handed on
    carelessly: (the careless wrapper, a weak reference to the tensor). The ordering mode is off, and
    everything settled, afterwards."""
    torch, cupy, cycles = cuda_libraries
    producer = torch.cuda.Stream()
    handoff.register_library(
        handoff.LibraryAdapter("careless_gpu", ignores_stream=True, current_stream=lambda device: producer)
    )

    def make() -> tuple:
        x = torch.zeros(GPU_N, device="cuda")
        torch.cuda.synchronize()
        with torch.cuda.stream(producer):
            torch.cuda._sleep(cycles)
            x.fill_(1.0)
        return CarelessTensor(x), weakref.ref(x)

    yield make, cupy, cycles
    handoff.order_libraries(False)
    torch.cuda.synchronize()
    deadline = time.monotonic() + 10
    while handoff.stats()["pending_releases"] and time.monotonic() < deadline:
        time.sleep(0.01)


def spin_cupy_stream(cycles: int, stream) -> None:
    with torch.cuda.stream(torch.cuda.ExternalStream(stream.ptr)):
        torch.cuda._sleep(cycles)


@needs_gpu
@pytest.mark.parametrize("ordering", [True, pytest.param(False, marks=pytest.mark.negative_control)])
def test_gpu_the_ordering_mode_holds_a_cupy_stream_the_program_drops_until_the_release_is_done(careless_gpu, ordering):
    make, cupy, cycles = careless_gpu
    handoff.order_libraries(ordering)
    careless, _ = make()
    stream = cupy.cuda.Stream(non_blocking=True)
    held = weakref.ref(stream)
    with stream:
        y = cupy.from_dlpack(careless)
        first = float(y[0].get())  # on the stream: ordered, after the producer's fill
        spin_cupy_stream(cycles, stream)  # the consumer's work, still queued when the program lets go
    assert first == (1.0 if ordering else 0.0)
    del stream
    gc.collect()
    # Held, the stream outlives the release that waits for it; unheld, CuPy destroys it at once.
    assert (held() is not None) == ordering
    del y


@needs_gpu
@pytest.mark.parametrize("ordering", [True, pytest.param(False, marks=pytest.mark.negative_control)])
def test_gpu_the_ordering_mode_keeps_the_producer_while_a_cupy_view_of_the_import_is_used(careless_gpu, ordering):
    make, cupy, cycles = careless_gpu
    handoff.order_libraries(ordering)
    careless, gone = make()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        y = cupy.from_dlpack(careless)
        view = y[::2]  # shares y's memory
        del y, careless
        stream.synchronize()
        spin_cupy_stream(cycles, stream)  # later work through the view, still queued
        view *= 2
    del view
    gc.collect()
    # Ordered, the tensor is kept until that work is done; unordered, it goes with CuPy's memory.
    assert (gone() is not None) == ordering


@needs_gpu
@pytest.mark.parametrize("current", [True, pytest.param(False, marks=pytest.mark.negative_control)])
def test_gpu_an_export_to_cupys_current_stream_holds_it_until_its_release(cuda_libraries, current):
    torch, cupy, cycles = cuda_libraries
    view = handoff.from_dlpack(torch.ones(GPU_N, device="cuda"))
    stream = cupy.cuda.Stream(non_blocking=True)
    held = weakref.ref(stream)
    with stream if current else contextlib.nullcontext():
        capsule = view.__dlpack__(stream=stream.ptr, max_version=(1, 0))  # what CuPy passes: its current stream
    with stream:
        y = cupy.from_dlpack(capsule)
        spin_cupy_stream(cycles, stream)
        y *= 2
    del view, capsule, y, stream
    gc.collect()
    # Its release waits for the stream's work: held, the stream stays until then; unheld, nothing waits.
    assert (held() is not None) == current
    torch.cuda.synchronize()
