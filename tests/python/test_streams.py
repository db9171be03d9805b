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
