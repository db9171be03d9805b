"""Consumer streams: handoff.Stream, as_stream, and ``with handoff.stream(...)`` blocks that are
context-local (per thread, per asyncio task)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import sys
import threading
import types

import numpy as np
import pytest

import handoff

from support import DEFAULT_STREAM, needs_sim


class CudaStreamProtocol:
    def __init__(self, handle: int, version: int = 0) -> None:
        self.handle = handle
        self.version = version

    def __cuda_stream__(self):
        return (self.version, self.handle)


class TorchStream:
    """What handoff reads of PyTorch 2.13's torch.cuda.Stream: `cuda_stream`, `device` (a torch.device,
    whose `index` is the device's) and `__cuda_stream__()`, which returns (0, cuda_stream)."""

    class device:
        type, index = "cuda", 3

    cuda_stream = 0x1234

    def __cuda_stream__(self):
        return (0, self.cuda_stream)


class CupyStream:
    """What handoff reads of CuPy 14's cupy.cuda.Stream: `ptr`, `device_id` (an int; -1 for a stream
    made for whichever device is current) and `__cuda_stream__()`, which returns (0, ptr)."""

    def __init__(self, device_id: int = 1) -> None:
        self.ptr, self.device_id = 0x5678, device_id

    def __cuda_stream__(self):
        return (0, self.ptr)


class CudaCoreStream:
    """What handoff reads of cuda.core's Stream: `device` (a cuda.core Device, whose `device_id` is
    the device's; no `index`) and `__cuda_stream__()`, which returns (0, its handle)."""

    class device:
        device_id = 2

    def __cuda_stream__(self):
        return (0, 0x9ABC)


class OlderTorchStream:
    """PyTorch's stream before its CUDA stream protocol (pytorch/pytorch#163614, 2025): `cuda_stream`
    and `device` alone."""

    class device:
        type, index = "cuda", 3

    cuda_stream = 0x1234


class OlderCupyStream:
    """CuPy 13's cupy.cuda.Stream, before `__cuda_stream__` (CuPy 14): `ptr` and `device_id` alone."""

    ptr, device_id = 0x5678, 1


# --- Stream ----------------------------------------------------------------------------------


def test_stream_holds_handle_and_device():
    s = handoff.Stream(0xABC, device=2)
    assert s.handle == 0xABC
    assert s.device == 2
    assert int(s) == 0xABC
    assert s.__cuda_stream__() == (0, 0xABC)
    assert handoff.Stream(5).device is None
    assert "0xabc" in repr(s) and "device=2" in repr(s)


def test_stream_equality_and_hash():
    assert handoff.Stream(7, device=1) == handoff.Stream(7, device=1)
    assert handoff.Stream(7, device=1) != handoff.Stream(7, device=0)
    assert handoff.Stream(7) != handoff.Stream(8)
    assert handoff.Stream(7) != 7
    assert len({handoff.Stream(7, device=1), handoff.Stream(7, device=1), handoff.Stream(7)}) == 2


@pytest.mark.parametrize("handle", [True, 1.0, "7", None, b"\x07"])
def test_stream_handle_must_be_an_int(handle):
    with pytest.raises(TypeError, match="Stream handle must be an int"):
        handoff.Stream(handle)


def test_stream_handle_and_device_ranges():
    for handle in (-1, 2**63, 2**64, 2**70):
        with pytest.raises(ValueError, match="native range"):
            handoff.Stream(handle)
    assert handoff.Stream(2**63 - 1).handle == 2**63 - 1
    for device in (-1, True, "0", 1.0):
        with pytest.raises(ValueError, match="device"):
            handoff.Stream(3, device=device)


# --- as_stream -------------------------------------------------------------------------------


def test_as_stream_accepts_every_spelling():
    s = handoff.Stream(9, device=0)
    assert handoff.as_stream(s) is s
    assert handoff.as_stream(9) == handoff.Stream(9)
    assert handoff.as_stream(0) == handoff.Stream(0)
    assert handoff.as_stream(CudaStreamProtocol(0x42)) == handoff.Stream(0x42)
    assert handoff.as_stream(TorchStream()) == handoff.Stream(0x1234, device=3)
    assert handoff.as_stream(CupyStream()) == handoff.Stream(0x5678, device=1)
    assert handoff.as_stream(CupyStream(device_id=-1)) == handoff.Stream(0x5678)
    assert handoff.as_stream(CudaCoreStream()) == handoff.Stream(0x9ABC, device=2)
    assert handoff.as_stream(OlderTorchStream()) == handoff.Stream(0x1234, device=3)
    assert handoff.as_stream(OlderCupyStream()) == handoff.Stream(0x5678, device=1)


@pytest.mark.parametrize("obj", [True, False, 1.5, "3", None, object(), [3], (0, 3)])
def test_as_stream_refuses_non_streams(obj):
    with pytest.raises(TypeError, match="stream"):
        handoff.as_stream(obj)


@pytest.mark.parametrize("value", [(0,), [0, 3], 3, (0, 3, 1), (0, "3"), (0, 3.5), (0, True), (0, None)])
def test_as_stream_refuses_a_bad_cuda_stream_protocol(value):
    class Bad:
        def __cuda_stream__(self):
            return value

    with pytest.raises(TypeError, match="__cuda_stream__"):
        handoff.as_stream(Bad())


@pytest.mark.parametrize("attribute", ["cuda_stream", "ptr"])
@pytest.mark.parametrize("value", [True, "7", 7.0, None])
def test_as_stream_refuses_ill_typed_attributes(attribute, value):
    obj = type("S", (), {attribute: value})()
    with pytest.raises(TypeError, match="is not a stream"):
        handoff.as_stream(obj)


def test_as_stream_with_torch_cpu_has_no_cuda_stream(torch):
    with pytest.raises(TypeError):
        handoff.as_stream(torch.device("cpu"))


# --- with handoff.stream(...) ----------------------------------------------------------------


def test_block_sets_and_restores_the_current_stream():
    assert handoff.current_stream() is None
    with handoff.stream(7) as s:
        assert s == handoff.Stream(7)
        assert handoff.current_stream() == handoff.Stream(7)
    assert handoff.current_stream() is None


def test_blocks_nest():
    with handoff.stream(handoff.Stream(3, device=0)):
        with handoff.stream(CudaStreamProtocol(4)):
            assert handoff.current_stream() == handoff.Stream(4)
            with handoff.stream(None):
                assert handoff.current_stream() is None
            assert handoff.current_stream() == handoff.Stream(4)
        assert handoff.current_stream() == handoff.Stream(3, device=0)
    assert handoff.current_stream() is None


def test_block_restores_on_exception():
    with pytest.raises(KeyError), handoff.stream(5):
        raise KeyError
    assert handoff.current_stream() is None


def test_block_object_is_reentrant():
    block = handoff.stream(6)
    with block:
        with block:
            assert handoff.current_stream() == handoff.Stream(6)
        assert handoff.current_stream() == handoff.Stream(6)
    assert handoff.current_stream() is None


def test_interleaved_blocks_each_restore_what_they_found():
    def loader():
        with handoff.stream(8):  # entered inside the caller's block, then suspended
            yield

    def body():
        with handoff.stream(7):
            suspended = loader()
            next(suspended)
            assert handoff.current_stream() == handoff.Stream(8)
        assert handoff.current_stream() is None, "leaving the block restored another block's stream"
        with pytest.raises(StopIteration):
            next(suspended)
        assert handoff.current_stream() is None, "the generator's block ended with the block it was entered in"

    contextvars.copy_context().run(body)  # its leftovers stay in its own context
    assert handoff.current_stream() is None


def test_a_block_still_open_keeps_its_stream_when_a_block_entered_before_it_ends():
    def reader(handle: int):
        with handoff.stream(handle):
            yield
            yield handoff.current_stream()

    def other(handle: int):
        with handoff.stream(handle):
            yield

    def body() -> None:
        first, second = other(3), reader(4)
        next(first)
        next(second)  # entered after the first's block, beside it: the first's generator is suspended
        for _ in first:  # the first's block ends first
            pass
        assert handoff.current_stream() == handoff.Stream(4), "the second block is still open"
        assert next(second) == handoff.Stream(4)
        for _ in second:
            pass
        assert handoff.current_stream() is None

    contextvars.copy_context().run(body)
    assert handoff.current_stream() is None


@needs_sim
@pytest.mark.parametrize("ordered", [True, pytest.param(False, marks=pytest.mark.negative_control)])
def test_imports_in_a_block_still_open_are_ordered_onto_its_stream_when_a_block_entered_before_it_ends(ordered):
    from handoff import sim

    producer, first_stream, second_stream = (sim.Stream(non_blocking=True) for _ in range(3))
    source = sim.zeros(4)

    def reader():
        with handoff.stream(second_stream):
            yield
            with sim.hold(producer):
                sim.fill(source, 7.0, stream=producer)
                if ordered:
                    read = sim.to_numpy(handoff.from_dlpack(source), stream=second_stream, wait=False)
                    assert not read.done() and sim.pending(second_stream) > 0, "the block's stream waits"
                else:  # the negative control: not held, the read returns before the write
                    stale = sim.to_numpy(handoff.from_dlpack(source, stream=-1), stream=second_stream)
            yield read.result() if ordered else stale

    def other():
        with handoff.stream(first_stream):
            yield

    def body():
        first, second = other(), reader()
        next(first)
        next(second)  # entered after the first's block, beside it
        for _ in first:  # the first's block ends first
            pass
        seen = next(second)
        for _ in second:
            pass
        return seen

    seen = contextvars.copy_context().run(body)
    sim.synchronize()
    assert (seen == (7.0 if ordered else 0.0)).all()


def _batches(handle: int, seen: list[object]):
    with handoff.stream(handle):
        for i in range(3):
            seen.append(handoff.current_stream())
            yield i


def _drain_in_an_asyncio_task(rest) -> list[int]:
    async def drain() -> list[int]:
        return list(rest)

    return asyncio.run(drain())


def _drain_in_asyncio_to_thread(rest) -> list[int]:
    async def drain() -> list[int]:
        return await asyncio.to_thread(list, rest)

    return asyncio.run(drain())


def _drain_in_a_copied_context(rest) -> list[int]:
    return contextvars.copy_context().run(list, rest)


@pytest.mark.parametrize(
    "drain",
    [_drain_in_an_asyncio_task, _drain_in_asyncio_to_thread, _drain_in_a_copied_context],
    ids=lambda f: f.__name__,
)
def test_a_block_left_in_a_copy_of_its_context_ends_here_too(drain):
    # A generator primed here (its block entered in this context) and finished in a copy of it.
    seen: list[object] = []
    batches = _batches(13, seen)
    assert next(batches) == 0
    assert handoff.current_stream() == handoff.Stream(13), "a generator's block is seen by the code driving it"
    assert drain(batches) == [1, 2]
    assert seen == [handoff.Stream(13)] * 3
    assert handoff.current_stream() is None, "the block ended: its stream is no longer current here"
    with handoff.stream(14):  # and this context's blocks work as before
        assert handoff.current_stream() == handoff.Stream(14)
    assert handoff.current_stream() is None


@pytest.mark.parametrize("inner", ["inside", pytest.param("beside", marks=pytest.mark.negative_control)])
@pytest.mark.parametrize(
    "drain",
    [_drain_in_an_asyncio_task, _drain_in_asyncio_to_thread, _drain_in_a_copied_context],
    ids=lambda f: f.__name__,
)
def test_a_block_left_in_another_context_ends_the_blocks_entered_inside_it_here_too(drain, inner):
    # A block ended in its own context ends the generators' blocks entered inside it; ended in a copy
    # of that context, it left them open here: their stream stayed current with it gone.
    def blocks_of(stream: int):
        with handoff.stream(stream):
            yield

    suspended = blocks_of(22)  # kept suspended (its block open) until the test ends

    def outer():
        with handoff.stream(21):
            if inner == "inside":
                next(suspended)  # entered while this block's code runs: inside it
            yield
            yield

    def body() -> object:
        rest = outer()
        next(rest)
        if inner == "beside":
            next(suspended)  # entered while the outer generator is suspended: beside its block
        assert handoff.current_stream() == handoff.Stream(22)
        drain(rest)
        return handoff.current_stream()

    left = contextvars.copy_context().run(body)
    assert left == (None if inner == "inside" else handoff.Stream(22))


@needs_sim
def test_a_block_ended_elsewhere_no_longer_orders_imports_here(sim_streams):
    from handoff import sim

    _, consumer = sim_streams
    data = sim.zeros((4,), "float32")

    def consumer_stream_of_an_import() -> int:
        with handoff.trace() as t:
            handoff.from_dlpack(data)
        return t.events[0]["consumer_stream"]

    batches = _batches(consumer.handle, [])
    next(batches)
    assert consumer_stream_of_an_import() == consumer.handle
    assert _drain_in_an_asyncio_task(batches) == [1, 2]
    assert consumer_stream_of_an_import() == DEFAULT_STREAM, "onto the default stream, as outside every block"


def test_leaving_a_block_entered_in_another_context_changes_nothing_here():
    block = handoff.stream(9)
    contextvars.copy_context().run(block.__enter__)
    block.__exit__(None, None, None)
    assert handoff.current_stream() is None


def test_block_refuses_non_streams():
    with pytest.raises(TypeError):
        handoff.stream(1.5)
    assert handoff.current_stream() is None


def test_blocks_are_per_thread():
    seen: dict[str, object] = {}
    inside = threading.Event()
    done = threading.Event()

    def other() -> None:
        inside.wait()
        seen["before"] = handoff.current_stream()
        with handoff.stream(11):
            seen["inside"] = handoff.current_stream()
        seen["after"] = handoff.current_stream()
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with handoff.stream(10):
        inside.set()
        done.wait(10)
        assert handoff.current_stream() == handoff.Stream(10)  # the thread's block did not leak here
    thread.join()
    assert seen == {"before": None, "inside": handoff.Stream(11), "after": None}


def test_one_block_object_shared_by_threads():
    # A module-level `block = handoff.stream(s)` used by several threads at once: each thread's
    # exit restores that thread's own state.
    block = handoff.stream(12)
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(50):
                with block:
                    barrier.wait()
                    assert handoff.current_stream() == handoff.Stream(12)
                assert handoff.current_stream() is None
                barrier.wait()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, repr(errors[0])


def test_blocks_are_per_asyncio_task():
    async def task(handle: int, ready: asyncio.Event, go: asyncio.Event) -> tuple:
        with handoff.stream(handle):
            ready.set()
            await go.wait()
            inside = handoff.current_stream()
        return inside, handoff.current_stream()

    async def main() -> list:
        events = [(asyncio.Event(), asyncio.Event()) for _ in range(3)]
        tasks = [asyncio.create_task(task(20 + i, *events[i])) for i in range(3)]
        for ready, _ in events:
            await ready.wait()
        assert handoff.current_stream() is None
        for _, go in reversed(events):  # leave the blocks in another order than they were entered
            go.set()
            await asyncio.sleep(0)
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert results == [(handoff.Stream(20 + i), None) for i in range(3)]


def test_one_block_object_shared_by_tasks():
    block = handoff.stream(30)

    async def task(ready: asyncio.Event, go: asyncio.Event):
        with block:
            ready.set()
            await go.wait()
            return handoff.current_stream()

    async def main():
        a, b = (asyncio.Event(), asyncio.Event()), (asyncio.Event(), asyncio.Event())
        ta, tb = asyncio.create_task(task(*a)), asyncio.create_task(task(*b))
        await a[0].wait()
        await b[0].wait()
        a[1].set()  # the first to enter leaves first
        first = await ta
        b[1].set()
        return first, await tb

    assert asyncio.run(main()) == (handoff.Stream(30), handoff.Stream(30))


# --- one block object, entries matched to the code that leaves them --------------------------


def _held_import(producer, consumer) -> tuple[bool, float]:
    """Imports data whose write `producer` holds, naming no stream (the enclosing block's, else the
    default stream), and reads it on `consumer`: whether the read waited for the write, and what it
    read (what the write left, or, where the read did not wait, what was there before it)."""
    from handoff import sim

    data = sim.zeros(4)
    with sim.hold(producer):
        sim.fill(data, 5.0, stream=producer)
        read = sim.to_numpy(handoff.from_dlpack(data), stream=consumer, wait=False)
        waited = sim.waits_for_hold(consumer)
        if not waited:  # the race: the read is done while the write is still held
            return waited, float(read.result()[0])
    return waited, float(read.result()[0])


@needs_sim
@pytest.mark.parametrize("own_block", [True, pytest.param(False, marks=pytest.mark.negative_control)])
def test_a_generator_finished_on_a_thread_inside_the_same_block_object_leaves_that_threads_block_open(own_block):
    from handoff import sim

    producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    block = handoff.stream(consumer)  # one block object, entered by a generator and by a thread
    seen: dict[str, object] = {}

    def batches():
        with block:
            yield

    def worker(primed) -> None:
        with block if own_block else contextlib.nullcontext():
            list(primed)  # the generator's block ends here, on this thread, in this thread's context
            seen["worker, the generator finished"] = handoff.current_stream()
            seen["import"] = _held_import(producer, consumer)
        seen["worker, its block ended"] = handoff.current_stream()

    def body() -> None:
        primed = batches()
        next(primed)
        seen["primed"] = handoff.current_stream()
        thread = threading.Thread(target=worker, args=(primed,))
        thread.start()
        thread.join()
        seen["the generator finished"] = handoff.current_stream()

    contextvars.copy_context().run(body)
    assert seen.pop("primed") == handoff.as_stream(consumer)
    assert seen.pop("the generator finished") is None, "the generator's block ended where it was entered too"
    assert seen.pop("worker, its block ended") is None
    if own_block:
        assert seen == {
            "worker, the generator finished": handoff.as_stream(consumer),  # its own block is still open
            "import": (True, 5.0),  # onto the block's stream, which waits for the write
        }
    else:  # without its block, the thread's import is not ordered onto `consumer`: the read races
        assert seen == {"worker, the generator finished": None, "import": (False, 0.0)}


@needs_sim
@pytest.mark.parametrize("own_block", [True, pytest.param(False, marks=pytest.mark.negative_control)])
def test_a_generator_finished_in_a_task_leaves_the_block_another_task_entered_with_the_same_object_open(own_block):
    from handoff import sim

    producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    block = handoff.stream(consumer)
    seen: dict[str, object] = {}

    def batches():
        with block:
            yield

    async def main() -> None:
        primed_event, inside, go, drain = (asyncio.Event() for _ in range(4))
        primed: list = []

        async def drainer() -> None:  # a task whose context does not list the generator's block
            await drain.wait()
            list(primed[0])

        async def reader() -> None:
            await primed_event.wait()
            with block if own_block else contextlib.nullcontext():  # entered after the generator's
                inside.set()
                await go.wait()
                seen["reader"] = handoff.current_stream()
                seen["import"] = _held_import(producer, consumer)

        drained, read = asyncio.create_task(drainer()), asyncio.create_task(reader())
        primed.append(batches())
        next(primed[0])  # its block entered in this task's context
        primed_event.set()
        await inside.wait()
        drain.set()
        await drained  # the generator's block ends in the drainer's context
        seen["main, the generator finished"] = handoff.current_stream()
        go.set()
        await read
        seen["main, at the end"] = handoff.current_stream()

    asyncio.run(main())
    assert seen.pop("main, the generator finished") is None, "the generator's block ended here too"
    assert seen.pop("main, at the end") is None
    if own_block:
        assert seen == {"reader": handoff.as_stream(consumer), "import": (True, 5.0)}
    else:
        assert seen == {"reader": None, "import": (False, 0.0)}


class _WrappedBlock:
    """A class that wraps a block, delegating its with-statement to it."""

    def __init__(self, obj: object) -> None:
        self._block = handoff.stream(obj)

    def __enter__(self):
        return self._block.__enter__()

    def __exit__(self, *exc_info):
        return self._block.__exit__(*exc_info)


@contextlib.contextmanager
def _on_stream(obj: object):
    with handoff.stream(obj):
        yield


@contextlib.contextmanager
def _on_stream_nested(obj: object):
    with _on_stream(obj):
        yield


@contextlib.contextmanager
def _on_stream_by_exit_stack(obj: object):
    with contextlib.ExitStack() as stack:
        stack.enter_context(handoff.stream(obj))
        yield


def _by_exit_stack(obj: object) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(handoff.stream(obj))  # entered now, by this helper, which returns at once
    return stack


# However a block is entered, the code inside it is that of the with-statement that names it.
_ENTRIES = {
    "with": handoff.stream,
    "ExitStack": _by_exit_stack,
    "contextmanager": _on_stream,
    "nested contextmanagers": _on_stream_nested,
    "contextmanager with an ExitStack": _on_stream_by_exit_stack,
    "class": _WrappedBlock,
}


@pytest.fixture
def three_streams() -> tuple:
    """A producer's stream and two streams for blocks, non-blocking streams of the simulator."""
    from handoff import sim

    return tuple(sim.Stream(non_blocking=True) for _ in range(3))


@needs_sim
@pytest.mark.parametrize(
    "entered",
    [*_ENTRIES, pytest.param("no first block", marks=pytest.mark.negative_control)],
)
def test_a_generators_block_entered_beside_another_stays_open_however_the_other_was_entered(entered, three_streams):
    producer, first_stream, second_stream = three_streams
    seen: dict[str, object] = {}

    def first():
        if entered == "no first block":
            yield
            return
        with _ENTRIES[entered](first_stream):
            yield

    def second():
        with handoff.stream(second_stream):
            yield
            seen["second, resumed"] = handoff.current_stream()
            seen["import"] = _held_import(producer, second_stream)
            yield

    def body() -> None:
        one, two = first(), second()
        next(one)
        next(two)  # entered while the first generator is suspended: beside the first's block
        for _ in one:  # the first's block ends first
            pass
        seen["the first finished"] = handoff.current_stream()
        next(two)
        for _ in two:
            pass
        seen["both finished"] = handoff.current_stream()

    contextvars.copy_context().run(body)
    assert seen == {
        "the first finished": handoff.as_stream(second_stream),  # the second block is still open
        "second, resumed": handoff.as_stream(second_stream),
        "import": (True, 5.0),
        "both finished": None,
    }


@needs_sim
@pytest.mark.parametrize(
    "entered",
    [*_ENTRIES, pytest.param("no outer block", marks=pytest.mark.negative_control)],
)
def test_a_block_ends_the_generators_blocks_entered_inside_it_however_it_was_entered(entered, three_streams):
    producer, outer_stream, inner_stream = three_streams
    default = handoff.Stream(DEFAULT_STREAM)
    seen: dict[str, object] = {}

    def inner():
        with handoff.stream(inner_stream):
            yield

    def body() -> None:
        outer = contextlib.nullcontext() if entered == "no outer block" else _ENTRIES[entered](outer_stream)
        with outer:
            suspended = inner()
            next(suspended)  # entered inside the outer block, then suspended
            seen["inside"] = handoff.current_stream()
        seen["after the outer block"] = handoff.current_stream()
        # no block of this code is open: onto the default stream, ordered after the write
        seen["import"] = _held_import(producer, default)
        suspended.close()
        seen["at the end"] = handoff.current_stream()

    contextvars.copy_context().run(body)
    assert seen.pop("inside") == handoff.as_stream(inner_stream)
    assert seen.pop("at the end") is None
    if entered == "no outer block":  # the generator's block stays open: imports go to its stream
        assert seen == {"after the outer block": handoff.as_stream(inner_stream), "import": (False, 0.0)}
    else:
        assert seen == {"after the outer block": None, "import": (True, 5.0)}


def test_block_applies_to_imports_of_cpu_data(live):
    a = np.arange(4.0)
    with handoff.stream(handoff.Stream(0x77)):
        h = handoff.from_dlpack(a)  # CPU data needs no ordering: the block does not get in the way
        assert h.data_ptr == a.ctypes.data
        assert handoff.asarray(memoryview(a)).data_ptr == a.ctypes.data


# --- frameworks=True: frameworks' current streams are per thread ------------------------------


class PerThreadLibrary:
    """A library whose current stream is per thread, as PyTorch's (torch.cuda.current_stream) and
    CuPy's are, registered with handoff as its adapter would be."""

    name = "perthreadlib"

    def __init__(self) -> None:
        self._state = threading.local()

    def current(self, device: int = 0) -> int | None:
        return getattr(self._state, "stream", None)

    @contextlib.contextmanager
    def use(self, handle: int, device: int):
        previous, self._state.stream = self.current(), handle
        try:
            yield
        finally:
            self._state.stream = previous


@pytest.fixture
def per_thread_library(monkeypatch: pytest.MonkeyPatch):
    from handoff import _streams
    from handoff._adapters import registry

    library = PerThreadLibrary()
    monkeypatch.setitem(sys.modules, library.name, types.ModuleType(library.name))
    monkeypatch.setattr(_streams, "_overlap_warned", False, raising=False)
    handoff.register_library(
        handoff.LibraryAdapter(library.name, current_stream=library.current, use_stream=library.use)
    )
    yield library
    registry.remove(library.name)


def test_frameworks_blocks_of_interleaved_tasks_restore_the_frameworks_stream(
    per_thread_library: PerThreadLibrary, capfd: pytest.CaptureFixture[str]
):
    library = per_thread_library
    seen: dict[str, object] = {}

    async def work(handle: int, entered: asyncio.Event, leave: asyncio.Event) -> None:
        with handoff.stream(handle, frameworks=True):
            entered.set()
            await leave.wait()
            seen[f"{handle:#x} leaving"] = (handoff.current_stream(), library.current())

    async def main() -> None:
        first, second = (asyncio.Event(), asyncio.Event()), (asyncio.Event(), asyncio.Event())
        one = asyncio.create_task(work(0x51, *first))
        await first[0].wait()
        two = asyncio.create_task(work(0x52, *second))
        await second[0].wait()
        first[1].set()  # the block entered first ends first
        await one
        seen["between"] = library.current()
        second[1].set()
        await two

    asyncio.run(main())
    assert seen["0x51 leaving"] == (handoff.Stream(0x51), 0x52), (
        "per thread: the library follows the block entered last"
    )
    assert seen["between"] == 0x52, "the block still open keeps the library's stream"
    assert seen["0x52 leaving"] == (handoff.Stream(0x52), 0x52)
    assert library.current() is None, "every block ended: the library's own stream is back"
    assert "frameworks' current streams are per thread" in capfd.readouterr().err


def test_frameworks_blocks_nested_in_one_task_restore_in_order(per_thread_library: PerThreadLibrary):
    library = per_thread_library
    with handoff.stream(0x61, frameworks=True):
        with handoff.stream(0x62, frameworks=True):
            assert library.current() == 0x62
        assert library.current() == 0x61
    assert library.current() is None


def test_a_frameworks_block_left_on_another_thread_is_restored_on_its_own(per_thread_library: PerThreadLibrary):
    library = per_thread_library

    def batches():
        with handoff.stream(0x71, frameworks=True):
            yield 0
            yield 1

    primed = batches()
    next(primed)
    assert library.current() == 0x71
    left = threading.Thread(target=list, args=(primed,))
    left.start()
    left.join()
    # That thread cannot set this thread's stream; this thread's next frameworks block does.
    assert handoff.current_stream() is None
    with handoff.stream(0x72, frameworks=True):
        assert library.current() == 0x72
    assert library.current() is None


@needs_sim
def test_a_generator_finished_on_a_thread_inside_the_same_frameworks_block_object_keeps_that_threads_streams(
    per_thread_library: PerThreadLibrary,
):
    from handoff import sim

    library = per_thread_library
    producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    block = handoff.stream(consumer, frameworks=True)  # one block object, entered by a generator and a thread
    seen: dict[str, object] = {}

    def batches():
        with block:
            yield

    def worker(primed) -> None:
        with block:
            seen["worker, before"] = (handoff.current_stream(), library.current())
            list(primed)  # the generator's block ends on this thread
            seen["worker, the generator finished"] = (handoff.current_stream(), library.current())
            seen["import"] = _held_import(producer, consumer)
        seen["worker, its block ended"] = (handoff.current_stream(), library.current())

    def body() -> None:
        primed = batches()
        next(primed)
        thread = threading.Thread(target=worker, args=(primed,))
        thread.start()
        thread.join()
        seen["the generator finished"] = handoff.current_stream()

    contextvars.copy_context().run(body)
    on_block = (handoff.as_stream(consumer), consumer.handle)
    assert seen == {
        "worker, before": on_block,
        "worker, the generator finished": on_block,  # the thread's own block is still open
        "import": (True, 5.0),
        "worker, its block ended": (None, None),
        "the generator finished": None,
    }
    # This thread's frameworks block ended on the worker: restored when this thread next uses one.
    with handoff.stream(0x73, frameworks=True):
        assert library.current() == 0x73
    assert library.current() is None
