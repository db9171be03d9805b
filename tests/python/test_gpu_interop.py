"""Stream-ordered exchange with PyTorch, CuPy, JAX, numba-cuda and cuda.core on a real GPU.

Run with HANDOFF_BACKEND=cuda (or auto) on a machine with an NVIDIA GPU; skipped elsewhere. Each
exchange has a producer kernel still queued behind a long spin on the producer's stream, a
consumer that reads at once on its own non-blocking stream and must see the finished data, and a
negative control (`stream=-1`) that must see the stale data: the spin is long enough that an
unordered reader always wins.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import re
import sys
import textwrap
import threading
import time
import weakref
from pathlib import Path

import numpy as np
import pytest

import handoff

from dlpack_ctypes import CUDA, CUDA_MANAGED, DLManagedTensorVersioned, DLTensor, exchange_api_of
from support import DlpackOnly, cuda_core_module, live_views, run_python

INFO = handoff.runtime_info()
CUDA_USABLE = INFO["backend"] == "cuda" and not INFO.get("backend_error") and INFO["device_count"] > 0
BACKEND_STATE = INFO["backend"] + (f": {INFO['backend_error'].split(':')[0]}" if INFO.get("backend_error") else "")
pytestmark = pytest.mark.skipif(
    not CUDA_USABLE, reason=f"needs HANDOFF_BACKEND=cuda on a machine with a GPU (backend {BACKEND_STATE})"
)

N = 1 << 20
SPIN_SECONDS = 0.15  # the producer's head start: long against a kernel launch, short for a test
STALE, DONE = 0.0, 1.0
# A run with ordering turned off, which must see stale data (deselected under compute-sanitizer,
# which may serialize kernels: `-m "not negative_control"`).
NEGATIVE_CONTROL = pytest.param(False, marks=pytest.mark.negative_control)


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device here")
    return torch


@pytest.fixture(scope="module")
def spin_cycles(torch):
    """The torch.cuda._sleep cycles that keep a stream busy for SPIN_SECONDS on this GPU."""
    probe = 100_000_000  # about 50 ms: long enough for the clock to have ramped up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # warm up the kernel
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return int(probe * SPIN_SECONDS * 1000 / start.elapsed_time(end))


@pytest.fixture
def settled_views():
    """Waits, after the test, for the stream-ordered releases to run, and checks none leaked."""
    start = live_views()
    yield start
    wait_for_live_views(start)


def wait_for_live_views(expected: int, timeout: float = 10.0) -> None:
    """Releases run on handoff's service thread once their stream is done: poll until the deferred
    releases asked for have run (`live_views` drops when a release is asked for, not when it runs)."""
    deadline = time.monotonic() + timeout
    while live_views() > expected or handoff.stats()["pending_releases"] > 0:
        assert time.monotonic() < deadline, (
            f"live views stayed at {live_views()} (expected {expected}), "
            f"{handoff.stats()['pending_releases']} release(s) pending"
        )
        time.sleep(0.01)


_HOST_FUNCTION = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_host_functions: list = []  # handed to the driver, which may call one until the process ends


@contextlib.contextmanager
def held(handle: int, timeout: float = 60.0):
    """Nothing enqueued on the stream `handle` after this point runs until the block ends (what
    `sim.hold` does on the simulator): a host function enqueued there waits for the block's end. A
    test checks inside the block what must still be there while the stream's work is pending, at
    whatever speed it runs; the block must not wait for that stream itself, nor launch a kernel for
    the first time (loading one may wait for the device's work: conftest.py loads them eagerly)."""
    released = threading.Event()
    gate = _HOST_FUNCTION(lambda _: released.wait(timeout))
    _host_functions.append(gate)
    status = ctypes.CDLL("libcuda.so.1").cuLaunchHostFunc(ctypes.c_void_p(handle), gate, None)
    assert status == 0, f"cuLaunchHostFunc failed with CUresult {status}"
    try:
        yield
    finally:
        released.set()


def spin_on(torch, handle: int, cycles: int) -> None:
    """Keeps the stream `handle` (any library's) busy: what is enqueued after runs late."""
    with torch.cuda.stream(torch.cuda.ExternalStream(handle)):
        torch.cuda._sleep(cycles)


@pytest.fixture
def torch_out(torch):
    """Where a consumer copies what it reads, allocated before any producer work is queued: CUDA
    lists a device allocation among the operations that may order two streams, which would hide
    the race a negative control must show."""
    out = torch.empty(N, device="cuda")
    torch.cuda.synchronize()
    return out


def read_with_torch(torch, out, obj, handle: int):
    """Imports `obj` into PyTorch on stream `handle` (PyTorch names it to `__dlpack__`), copies it
    into `out` on that stream at once, and returns the copy's first and last values once it is done."""
    stream = torch.cuda.ExternalStream(handle)
    with torch.cuda.stream(stream):
        out.copy_(torch.from_dlpack(obj) if hasattr(obj, "__dlpack__") else torch.as_tensor(obj, device="cuda"))
    stream.synchronize()
    return out[0].item(), out[-1].item()


class Unordered:
    """Passes a view on to a consumer with `stream=-1` whatever stream the consumer names: the
    negative control of an export."""

    def __init__(self, view: handoff.Array) -> None:
        self.view = view

    def __dlpack__(self, *, stream=None, **kwargs):
        return self.view.__dlpack__(stream=-1, **kwargs)

    def __dlpack_device__(self):
        return self.view.__dlpack_device__()


# --- PyTorch ---------------------------------------------------------------------------------


def torch_pending(torch, spin_cycles, producer):
    """A tensor whose fill (DONE) is queued behind a spin on `producer`, which stays current:
    PyTorch names its current stream as the one the data is ready on (its DLPack C exchange API,
    through which handoff orders), or orders that stream before the consumer's (`__dlpack__`)."""
    x = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(spin_cycles)
        x.fill_(DONE)
    return x


def torch_view_pending_on_another_stream(torch, spin_cycles, producer):
    """A view of a pending tensor, imported onto a stream of its own that waits for `producer`."""
    x = torch_pending(torch, spin_cycles, producer)
    with torch.cuda.stream(producer):
        return handoff.from_dlpack(x, stream=torch.cuda.Stream())


@pytest.fixture
def torch_streams(torch):
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()  # non-blocking, from the pool
    yield producer, consumer
    torch.cuda.synchronize()


@pytest.mark.parametrize("spelling", ["object", "int", "handoff.Stream", "block"])
def test_torch_to_handoff_is_ordered_onto_the_consumer_stream(
    torch, spin_cycles, torch_streams, spelling, settled_views, torch_out
):
    producer, consumer = torch_streams
    x = torch_pending(torch, spin_cycles, producer)
    stream = {"object": consumer, "int": consumer.cuda_stream, "handoff.Stream": handoff.Stream(consumer.cuda_stream),
              "block": None}[spelling]  # fmt: skip
    with torch.cuda.stream(producer):
        if spelling == "block":
            with handoff.stream(consumer):
                view = handoff.from_dlpack(x)
        else:
            view = handoff.from_dlpack(x, stream=stream)
    assert view.device == (CUDA, x.device.index) and view.data_ptr == x.data_ptr()
    assert read_with_torch(torch, torch_out, view, consumer.cuda_stream) == (DONE, DONE)


@pytest.mark.negative_control
def test_torch_to_handoff_negative_control_shows_the_race(torch, spin_cycles, torch_streams, settled_views, torch_out):
    producer, consumer = torch_streams
    x = torch_pending(torch, spin_cycles, producer)
    with torch.cuda.stream(producer):
        view = handoff.from_dlpack(x, stream=-1)
    assert read_with_torch(torch, torch_out, Unordered(view), consumer.cuda_stream) == (STALE, STALE), (
        "expected stale data"
    )


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_handoff_to_torch_is_ordered_by_the_export(
    torch, spin_cycles, torch_streams, ordered, settled_views, torch_out
):
    # The view is ready on another stream, which waits for the producer; PyTorch names `consumer`.
    producer, consumer = torch_streams
    view = torch_view_pending_on_another_stream(torch, spin_cycles, producer)
    waits = handoff.stats()["waits_inserted"]
    expected = DONE if ordered else STALE
    assert read_with_torch(torch, torch_out, view if ordered else Unordered(view), consumer.cuda_stream) == (
        expected,
        expected,
    )
    assert (handoff.stats()["waits_inserted"] > waits) == ordered


def test_torch_empty_tensors(torch, torch_streams, settled_views):
    _, consumer = torch_streams
    for shape in ((0,), (3, 0, 2)):
        x = torch.empty(shape, device="cuda")
        view = handoff.from_dlpack(x, stream=consumer)
        assert view.shape == shape and view.size == 0 and view.nbytes == 0
        with torch.cuda.stream(consumer):
            back = torch.from_dlpack(view)
        assert tuple(back.shape) == shape and back.device == x.device


def test_capture_with_an_import_an_export_and_a_release_inside(torch, settled_views):
    # Inside the capture every call names the capturing stream, so nothing is ordered across the
    # capture's edge; the release must not be recorded into the graph, and must keep the producer
    # (which nothing else holds then) until the graph is destroyed: its replays read its memory.
    # The data is ready on the stream that captures: ordering it after any other (the legacy stream,
    # say) would be an operation across the capture's edge, which handoff refuses.
    capturing = torch.cuda.Stream()
    view, gone = owned_view(torch, stream=capturing.cuda_stream)
    out = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capturing):
        imported = handoff.from_dlpack(view, stream=capturing)
        tensor = torch.from_dlpack(imported)  # an export inside the capture
        tensor.add_(1.0)
        out.copy_(tensor * 2.0)
        del tensor, imported, view  # the releases, inside the capture
    gc.collect()
    torch.cuda.synchronize()
    assert out[0].item() == 0.0, "captured work must not run before the graph is launched"
    assert gone() is not None, "the producer was released while its graph could still be launched"
    for launch in (1, 2):
        graph.replay()
        torch.cuda.synchronize()
        assert out[-1].item() == 2.0 * launch
    gc.collect()
    assert gone() is not None, "the producer was released while its graph could still be launched"
    del graph
    torch.cuda.synchronize()
    wait_for_live_views(settled_views)
    gc.collect()
    assert gone() is None, "the producer was kept after its graph was destroyed"


# A process that makes a tensor whose fill is queued behind `cycles` of spin on `producer`, and
# imports it onto `consumer`.
PENDING_IMPORT_SCRIPT = """
import torch, handoff
producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
x = torch.zeros(1 << 22, device="cuda")
torch.cuda.synchronize()
with torch.cuda.stream(producer):
    torch.cuda._sleep({cycles})
    x.fill_(1.0)
    view = handoff.from_dlpack(x, stream=consumer)
"""


def test_exit_with_a_pending_release_is_clean(torch):
    # The view's release waits for a stream still busy for about a second when the process ends.
    code = PENDING_IMPORT_SCRIPT.format(cycles=2_000_000_000) + textwrap.dedent(
        """
        del view
        print("pending", flush=True)
        """
    )
    result = run_python(code, HANDOFF_LOG_LEVEL="warn")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["pending"]
    assert [line for line in result.stderr.splitlines() if "error" in line.lower()] == []


def test_expandable_segments(torch):
    code = PENDING_IMPORT_SCRIPT.format(cycles=200_000_000) + textwrap.dedent(
        """
        assert view.data_ptr == x.data_ptr()
        with torch.cuda.stream(consumer):
            copy = torch.from_dlpack(view).clone()
        consumer.synchronize()
        print(copy[0].item(), copy[-1].item())
        """
    )
    result = run_python(code, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1.0", "1.0"]


# --- CuPy ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cupy():
    cupy = pytest.importorskip("cupy")
    # CuPy compiles and loads its kernels on first use, and loading may wait for the kernels running
    # on the device: the ones the tests run behind a spin, or inside a stream held by `held`, are
    # made now.
    warm = cupy.zeros(8, dtype=cupy.float32)
    warm.fill(1.0)
    warm += 1.0
    cupy.copyto(warm, warm.copy())
    cupy.cuda.Device().synchronize()
    return cupy


@pytest.fixture
def cupy_out(cupy):
    """Where a CuPy consumer copies what it reads, allocated before any producer work (see torch_out)."""
    out = cupy.empty(N, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    return out


@pytest.fixture
def cupy_streams(cupy, torch):
    producer, consumer = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    yield producer, consumer
    cupy.cuda.Device().synchronize()


def cupy_pending(cupy, torch, spin_cycles, producer, x=None):
    """A CuPy array whose fill (DONE) is queued on `producer` behind a spin."""
    x = cupy.zeros(N, dtype=cupy.float32) if x is None else x
    x.fill(STALE)
    cupy.cuda.Device().synchronize()
    spin_on(torch, producer.ptr, spin_cycles)
    with producer:
        x.fill(DONE)
    return x


def test_cupy_to_handoff_is_ordered_onto_the_consumer_stream(
    cupy, torch, spin_cycles, cupy_streams, settled_views, torch_out
):
    producer, consumer = cupy_streams
    x = cupy_pending(cupy, torch, spin_cycles, producer)
    with producer:  # CuPy orders the work of its current stream before the consumer's
        view = handoff.from_dlpack(x, stream=consumer)
    assert view.data_ptr == x.data.ptr
    assert read_with_torch(torch, torch_out, view, consumer.ptr) == (DONE, DONE)


@pytest.mark.negative_control
def test_cupy_to_handoff_negative_control_shows_the_race(
    cupy, torch, spin_cycles, cupy_streams, settled_views, torch_out
):
    producer, consumer = cupy_streams
    x = cupy_pending(cupy, torch, spin_cycles, producer)
    with producer:
        view = handoff.from_dlpack(x, stream=-1)
    assert read_with_torch(torch, torch_out, Unordered(view), consumer.ptr) == (STALE, STALE), "expected stale data"


def read_with_cupy(cupy, out, obj, stream):
    with stream:
        cupy.copyto(out, cupy.from_dlpack(obj))  # CuPy names its current stream to __dlpack__
    stream.synchronize()
    return float(out[0].get()), float(out[-1].get())


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_handoff_to_cupy_is_ordered_by_the_export(
    cupy, torch, spin_cycles, cupy_streams, ordered, settled_views, cupy_out
):
    producer, consumer = cupy_streams
    x = cupy_pending(cupy, torch, spin_cycles, producer)
    with producer:
        view = handoff.from_dlpack(x, stream=cupy.cuda.Stream(non_blocking=True))
    expected = DONE if ordered else STALE
    assert read_with_cupy(cupy, cupy_out, view if ordered else Unordered(view), consumer) == (expected, expected)


def test_cupy_managed_memory_is_ordered(cupy, torch, spin_cycles, cupy_streams, settled_views, cupy_out):
    producer, consumer = cupy_streams
    memory = cupy.cuda.MemoryPointer(cupy.cuda.ManagedMemory(N * 4), 0)
    x = cupy_pending(cupy, torch, spin_cycles, producer, cupy.ndarray((N,), cupy.float32, memory))
    with producer:
        view = handoff.from_dlpack(x, stream=consumer)
    assert view.device[0] in (CUDA, CUDA_MANAGED)
    assert read_with_cupy(cupy, cupy_out, view, consumer) == (DONE, DONE)


def test_cupy_empty_arrays(cupy, cupy_streams, settled_views):
    _, consumer = cupy_streams
    x = cupy.empty((0, 3), dtype=cupy.float32)
    view = handoff.from_dlpack(x, stream=consumer)
    assert view.shape == (0, 3) and view.size == 0
    with consumer:
        assert cupy.from_dlpack(view).shape == (0, 3)


def test_two_threads_hand_views_across_their_per_thread_default_streams(cupy, torch, spin_cycles, settled_views):
    # DLPack's stream 2 names the calling thread's own default stream. Each thread imports onto its
    # own, then the other thread reads the view on *its* own and drops it: the binding must name a
    # stream every thread can wait for, and the release one every thread can record on.
    import queue

    handed = {3.0: queue.Queue(), 5.0: queue.Queue()}
    results, errors = {}, []

    def run(value: float, other: float) -> None:
        try:
            producer = cupy.cuda.Stream(non_blocking=True)
            x, out = cupy.zeros(N, dtype=cupy.float32), cupy.empty(N, dtype=cupy.float32)
            cupy.cuda.Device().synchronize()
            spin_on(torch, producer.ptr, spin_cycles)
            with producer:
                x.fill(value)
                handed[other].put(handoff.from_dlpack(x, stream=2))
            view = handed[value].get(timeout=30)  # the other thread's
            results[value] = read_with_cupy(cupy, out, view, cupy.cuda.Stream.ptds)  # stream 2
            del view  # dropped on this thread, bound on the other's stream
            producer.synchronize()
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=pair) for pair in ((3.0, 5.0), (5.0, 3.0))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == {3.0: (5.0, 5.0), 5.0: (3.0, 3.0)}


def test_consumer_stream_destroyed_early_is_kept_until_the_release(cupy, torch, spin_cycles, settled_views, torch_out):
    # CuPy destroys its stream with the object; the view keeps it until its release has run.
    producer = cupy.cuda.Stream(non_blocking=True)
    consumer = cupy.cuda.Stream(non_blocking=True)
    x = cupy_pending(cupy, torch, spin_cycles, producer)
    with producer:
        view = handoff.from_dlpack(x, stream=consumer)
    handle = consumer.ptr
    consumer_alive = weakref.ref(consumer)
    del consumer
    gc.collect()
    assert consumer_alive() is not None, "the view must keep its consumer stream alive"
    assert read_with_torch(torch, torch_out, view, handle) == (DONE, DONE)
    del view
    wait_for_live_views(settled_views)
    gc.collect()
    assert consumer_alive() is None, "the stream must go once its release has run"
    producer.synchronize()


# --- JAX -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jax_gpu():
    jax = pytest.importorskip("jax")
    try:
        return jax, jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")


def test_jax_to_handoff_is_ordered_onto_the_consumer_stream(jax_gpu, torch, torch_streams, settled_views, torch_out):
    # JAX makes the consumer stream wait for the buffer's ready event. (Asked for no ordering,
    # JAX blocks the host until the buffer is ready, so there is no race to show.)
    jax, gpu = jax_gpu
    _, consumer = torch_streams
    big = jax.device_put(jax.numpy.ones((2048, 2048), jax.numpy.float32), gpu)

    @jax.jit
    def slow_fill(m):
        m = jax.lax.fori_loop(0, 4000, lambda _, a: jax.numpy.tanh(a @ a), m)  # well over 100 ms
        return jax.numpy.full(N, DONE, jax.numpy.float32) + 0.0 * m[0, 0]

    slow_fill(big).block_until_ready()  # compiled before timing matters
    y = slow_fill(big)
    view = handoff.from_dlpack(y, stream=consumer)
    assert view.device == (CUDA, gpu.id)
    assert read_with_torch(torch, torch_out, view, consumer.cuda_stream) == (DONE, DONE)


def test_handoff_to_jax_is_ordered_by_the_export(jax_gpu, torch, spin_cycles, torch_streams, settled_views):
    jax, _ = jax_gpu
    producer, _ = torch_streams
    view = torch_view_pending_on_another_stream(torch, spin_cycles, producer)
    y = jax.numpy.from_dlpack(view)  # JAX names its own stream to __dlpack__
    values = np.asarray(y)
    assert (values[0], values[-1]) == (DONE, DONE)


# --- numba-cuda ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def numba_cuda():
    cuda = pytest.importorskip("numba.cuda")
    if not cuda.is_available():
        pytest.skip("numba-cuda sees no GPU here")

    @cuda.jit
    def fill(out, value):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = value

    try:
        fill[(N + 255) // 256, 256](cuda.device_array(N, np.float32), 0.0)  # compiled now, not behind a spin
    except AttributeError as error:  # numba-cuda's own modules reach for what this NumPy removed
        pytest.skip(f"this numba-cuda cannot compile a kernel with NumPy {np.__version__}: {error}")
    cuda.synchronize()
    return cuda, fill


def numba_pending(numba_cuda, torch, spin_cycles, producer):
    """A Numba array bound to `producer` (its CUDA Array Interface names it) whose fill kernel is
    queued there behind a spin."""
    cuda, fill = numba_cuda
    x = cuda.to_device(np.zeros(N, np.float32), stream=producer)
    producer.synchronize()
    spin_on(torch, int(producer), spin_cycles)
    fill[(N + 255) // 256, 256, producer](x, DONE)
    return x


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_numba_to_handoff_honours_the_interface_stream(
    numba_cuda, torch, spin_cycles, torch_streams, ordered, settled_views, torch_out
):
    # The negative control imports with no ordering (stream=-1): the read shows the race.
    cuda, _ = numba_cuda
    producer = cuda.stream()
    _, consumer = torch_streams
    x = numba_pending(numba_cuda, torch, spin_cycles, producer)
    view = handoff.asarray(x, stream=consumer if ordered else -1)
    if ordered:
        assert x.__cuda_array_interface__["stream"] == int(producer)
        assert view.data_ptr == x.__cuda_array_interface__["data"][0]
    expected = DONE if ordered else STALE
    assert read_with_torch(torch, torch_out, view if ordered else Unordered(view), consumer.cuda_stream) == (
        expected,
        expected,
    ), "expected the producer's data" if ordered else "expected stale data"
    producer.synchronize()


@pytest.mark.parametrize("sync", [True, NEGATIVE_CONTROL])
def test_handoff_to_numba_through_the_interface_stream(
    numba_cuda, torch, spin_cycles, torch_streams, sync, settled_views
):
    # handoff's interface names the stream the view is ready on; Numba synchronizes it when asked
    # (sync=True), and without that it reads at once on its own stream: the negative control.
    cuda, _ = numba_cuda
    producer, consumer = torch_streams
    x = torch_pending(torch, spin_cycles, producer)
    with torch.cuda.stream(producer):
        view = handoff.from_dlpack(x, stream=consumer)
    assert view.__cuda_array_interface__["stream"] == consumer.cuda_stream
    reader = cuda.external_stream(torch.cuda.Stream().cuda_stream)
    d = cuda.as_cuda_array(view, sync=sync)
    host = d.copy_to_host(stream=reader)
    reader.synchronize()
    expected = DONE if sync else STALE
    assert (host[0], host[-1]) == (expected, expected)


# --- cuda.core -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_core():
    """(Device, StridedMemoryView) from cuda.core, whichever of its layouts is installed."""
    core = cuda_core_module()
    device = core.Device()
    device.set_current()
    strided_memory_view = importlib.import_module(f"{core.__name__}.utils").StridedMemoryView
    # Newer cuda.core deprecates the constructor for StridedMemoryView.from_dlpack (same arguments).
    return device, getattr(strided_memory_view, "from_dlpack", strided_memory_view)


class RawDeviceMemory:
    """A CUDA Array Interface over a bare pointer, with no stream: PyTorch then orders nothing."""

    def __init__(self, pointer: int, owner: object) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (N,), "typestr": "<f4", "data": (pointer, False), "version": 3}


def test_cuda_core_stream_as_the_consumer_stream(
    cuda_core, torch, spin_cycles, torch_streams, settled_views, torch_out
):
    device, _ = cuda_core
    producer, _ = torch_streams
    consumer = device.create_stream()  # handoff takes it by its __cuda_stream__ protocol
    x = torch_pending(torch, spin_cycles, producer)
    with torch.cuda.stream(producer):
        view = handoff.from_dlpack(x, stream=consumer)
    handle = handoff.as_stream(consumer).handle
    assert read_with_torch(torch, torch_out, view, handle) == (DONE, DONE)


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_handoff_to_cuda_core_strided_memory_view(
    cuda_core, torch, spin_cycles, torch_streams, ordered, settled_views, torch_out
):
    # cuda.core passes its consumer stream to __dlpack__ (-1: no ordering, the negative control).
    device, strided_memory_view = cuda_core
    producer, _ = torch_streams
    consumer = device.create_stream()
    handle = handoff.as_stream(consumer).handle
    view = torch_view_pending_on_another_stream(torch, spin_cycles, producer)
    memory = strided_memory_view(view, stream_ptr=handle if ordered else -1)
    assert memory.ptr == view.data_ptr and memory.shape == (N,)
    expected = DONE if ordered else STALE
    assert read_with_torch(torch, torch_out, RawDeviceMemory(memory.ptr, memory), handle) == (expected, expected)
    del memory, view


# --- releases, host waits and devices: what only a GPU shows --------------------------------------


class Owner:
    """What a library's array keeps alive; a weak reference to it says when handoff let go."""


def assert_kept_while_the_stream_works(kept: bool, ordered: bool, what: str) -> None:
    """Inside `held`: `what` (the producer, say) must still be there when ordered, and gone at once in
    the negative control, which nothing orders."""
    assert kept == ordered, (
        f"{what} was let go while the consumer's stream still used it"
        if ordered
        else f"the negative control: nothing orders the hand-over, so {what} goes at once"
    )


def assert_let_go_once_done(stream, gone, settled_views) -> None:
    """After `held`: once `stream` is done and the releases have run, `gone()` is None."""
    stream.synchronize()
    wait_for_live_views(settled_views)
    gc.collect()
    assert gone() is None


def owned_view(torch, stream=None):
    """A handoff.view of a fresh CUDA tensor's memory, owned by an Owner that only the view holds."""
    memory = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()
    owner = Owner()
    owner.memory = memory
    view = handoff.view(
        memory.data_ptr(), (N,), "float32", device=(CUDA, memory.device.index), owner=owner, stream=stream
    )
    return view, weakref.ref(owner)


def assert_producer_kept_until_done(torch, consumer, ordered, settled_views, consume) -> None:
    """`consume(view)` hands an owned_view over to work on `consumer`, held back, and drops every
    reference it took: the producer must outlive that work when `ordered`, and go at once in the
    negative control."""
    view, gone = owned_view(torch)
    with held(consumer.cuda_stream):
        consume(view)
        del view
        gc.collect()
        assert_kept_while_the_stream_works(gone() is not None, ordered, "the producer")
    assert_let_go_once_done(consumer, gone, settled_views)


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_an_export_keeps_its_producer_until_the_consumers_stream_is_done(torch, torch_streams, ordered, settled_views):
    # PyTorch calls the capsule's deleter when its tensor goes, whatever its stream still has queued:
    # the caching allocator would hand the block out again while the consumer's kernel reads it. The
    # negative control exports with no ordering (stream=-1): nothing then says when to release.
    _, consumer = torch_streams

    def consume(view):
        with handoff.stream(consumer), torch.cuda.stream(consumer):
            t = torch.from_dlpack(view if ordered else Unordered(view))  # PyTorch names `consumer`
            t.add_(1.0)  # the consumer's later work on the data, held back

    assert_producer_kept_until_done(torch, consumer, ordered, settled_views, consume)


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_a_view_released_while_its_consumer_stream_is_busy_keeps_the_producer(
    torch, torch_streams, ordered, settled_views
):
    _, consumer = torch_streams

    def consume(view):
        imported = handoff.from_dlpack(view, stream=consumer if ordered else -1)
        with torch.cuda.stream(consumer):
            torch.from_dlpack(imported if ordered else Unordered(imported)).add_(1.0)

    assert_producer_kept_until_done(torch, consumer, ordered, settled_views, consume)


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_a_host_read_of_data_ready_on_a_per_thread_stream_waits_for_its_work(
    torch, spin_cycles, ordered, settled_views
):
    # Data bound to stream 2 is bound to the legacy stream, which any thread can name; a host wait
    # must go through an event recorded there: cudaStreamSynchronize(legacy) is not one of its
    # operations, so it need not wait for the per-thread stream's later work.
    pinned = torch.zeros(N).pin_memory()
    done = torch.full((N,), DONE, device="cuda")
    torch.cuda.synchronize()
    view = handoff.view(pinned.data_ptr(), (N,), "float32", device=(3, 0), owner=pinned, stream=2)
    with torch.cuda.stream(torch.cuda.ExternalStream(2)):  # this thread's per-thread default stream
        torch.cuda._sleep(spin_cycles)
        pinned.copy_(done, non_blocking=True)
    values = np.asarray(handoff.from_dlpack(view, device="cpu")) if ordered else pinned.numpy()
    expected = DONE if ordered else STALE
    assert (values[0], values[-1]) == (expected, expected)
    torch.cuda.synchronize()


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_a_producer_on_another_device_than_the_current_one_orders_its_own_streams(
    torch, spin_cycles, ordered, settled_views
):
    # PyTorch's __dlpack__ orders the *current* device's current stream: handoff makes the data's
    # device current around the call, as CuPy's consumer does.
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    with torch.cuda.device(1):
        producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
        out = torch.empty(N, device="cuda:1")
        x = torch_pending(torch, spin_cycles, producer)
        torch.cuda.set_stream(producer)  # device 1's current stream: the one PyTorch orders
    try:
        assert torch.cuda.current_device() == 0
        if ordered:
            view = handoff.from_dlpack(DlpackOnly(x), stream=consumer)
        else:
            view = handoff.from_dlpack(DlpackOnly(x), stream=-1)
        assert torch.cuda.current_device() == 0, "the consumer's current device was not restored"
        with torch.cuda.device(1):
            expected = DONE if ordered else STALE
            assert read_with_torch(torch, out, view if ordered else Unordered(view), consumer.cuda_stream) == (
                expected,
                expected,
            )
    finally:
        with torch.cuda.device(1):
            torch.cuda.set_stream(torch.cuda.default_stream())
            torch.cuda.synchronize()


@pytest.mark.parametrize(
    "through, arguments",
    [
        (lambda t: t, {}),
        (DlpackOnly, {}),
        (DlpackOnly, {"stream": "consumer"}),
        (lambda t: t, {"device": "cpu"}),
        (lambda t: t, {"copy": False}),
    ],
    ids=["table", "__dlpack__", "consumer stream", "device", "copy=False"],
)
def test_a_pinned_tensor_is_accepted_as_host_memory_on_every_path(
    torch, torch_streams, through, arguments, settled_views
):
    # PyTorch says kDLCUDAHost in __dlpack_device__ and kDLCPU in the capsule, and its __dlpack__
    # takes only stream None or -1 for a pinned tensor: handoff passes None.
    _, consumer = torch_streams
    t = torch.arange(6.0).pin_memory()
    if arguments.get("stream") == "consumer":
        arguments = {"stream": consumer}
    view = handoff.from_dlpack(through(t), **arguments)
    assert view.device == (1, 0)
    assert view.data_ptr == t.data_ptr()
    assert np.from_dlpack(view).tolist() == t.tolist()


def test_torch_from_dlpack_of_pinned_memory_says_how_to_import_it_without_a_copy(torch, settled_views):
    # PyTorch imports no kDLCUDAHost capsule ("Unsupported device_type: 3") and never asks for the
    # data on the CPU: handoff's export says what to do instead, and that way shares the memory.
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) > (2, 13):
        pytest.skip(f"PyTorch {torch.__version__} is newer than the releases known to refuse pinned memory")
    pinned = torch.arange(float(N)).pin_memory()
    view = handoff.view(pinned.data_ptr(), (N,), "float32", device=(3, 0), owner=pinned)
    with pytest.raises(BufferError, match=r"torch\.from_dlpack\(handoff\.from_dlpack\(x, device='cpu'\)\)"):
        torch.from_dlpack(view)
    tensor = torch.from_dlpack(handoff.from_dlpack(view, device="cpu"))
    assert tensor.data_ptr() == pinned.data_ptr()
    assert tensor[-1].item() == N - 1


PER_THREAD_IMPORTS = {
    "copy=False": (lambda t: t, {"copy": False}),
    "device": (lambda t: t, {"device": "its own"}),
    "__dlpack__": (DlpackOnly, {}),
}


@pytest.mark.parametrize("through, arguments", PER_THREAD_IMPORTS.values(), ids=PER_THREAD_IMPORTS)
@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_a_pytorch_tensor_is_imported_onto_the_per_thread_stream_through_the_legacy_one(
    torch, spin_cycles, torch_streams, through, arguments, ordered, settled_views, torch_out
):
    # PyTorch's __dlpack__ refuses stream=2, and a torch.Tensor reaches it with `device` or `copy`
    # (its DLPack C exchange API takes neither): handoff asks it for the legacy stream (1), which
    # then waits for PyTorch's current stream, and orders the per-thread stream after the legacy
    # one. The negative control imports with stream=-1.
    producer, _ = torch_streams
    x = torch_pending(torch, spin_cycles, producer)
    if arguments.get("device") == "its own":
        arguments = {"device": (CUDA, x.device.index)}
    with torch.cuda.stream(producer):  # the stream PyTorch orders: its current one
        view = handoff.from_dlpack(through(x), stream=2 if ordered else -1, **arguments)
    expected = DONE if ordered else STALE
    assert read_with_torch(torch, torch_out, view if ordered else Unordered(view), 2) == (expected, expected)


def test_exchanges_after_numba_resets_the_context_use_fresh_events(numba_cuda):
    # numba-cuda's cuda.close() resets the primary context, destroying every event made in it: the
    # pool must not hand out the old context's events.
    code = textwrap.dedent(
        """
        import gc, time
        import numpy as np
        import handoff
        from numba import cuda

        def exchange(value):
            producer, consumer = cuda.stream(), cuda.stream()
            x = cuda.to_device(np.full(1 << 20, value, np.float32), stream=producer)
            view = handoff.asarray(x, stream=int(consumer))
            host = np.asarray(handoff.from_dlpack(view, device="cpu"))
            del view
            gc.collect()
            cuda.synchronize()
            deadline = time.monotonic() + 10
            while handoff.stats()["pending_releases"] and time.monotonic() < deadline:
                time.sleep(0.01)
            return host[0], host[-1]

        assert exchange(1.0) == (1.0, 1.0)
        cuda.close()
        assert exchange(2.0) == (2.0, 2.0)
        print("ok")
        """
    )
    result = run_python(code, HANDOFF_LOG_LEVEL="warn")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]
    assert "error" not in result.stderr.lower(), result.stderr


def test_exit_after_a_sticky_error_with_a_release_pending_is_bounded_and_says_why(cupy):
    # A kernel's illegal access poisons the context: the stream the release waits for never gets
    # there. The exit gives up on it at once (not after the full exit wait) and logs why.
    code = textwrap.dedent(
        """
        import cupy, handoff
        consumer = cupy.cuda.Stream(non_blocking=True)
        x = cupy.zeros(1 << 20, dtype=cupy.float32)
        view = handoff.from_dlpack(x, stream=consumer)
        bad = cupy.RawKernel(
            'extern "C" __global__ void bad(unsigned long long a) { *(volatile float*)a = 1.0f; }', "bad")
        with consumer:
            bad((1,), (1,), (cupy.uint64(16),))
        del view  # its release waits for a stream that never gets there
        print("exiting", flush=True)
        """
    )
    start = time.monotonic()
    result = run_python(code, HANDOFF_LOG_LEVEL="warn")
    assert time.monotonic() - start < 30, "the exit waited for a stream that can never get there"
    assert "exiting" in result.stdout
    # Said once, by whichever looked first: the exit drain (abandoned) or the release's poller (kept),
    # each naming the stream's error.
    abandoned = re.search(r"abandoned: the stream can never get there \(.*cudaErrorIllegalAddress", result.stderr)
    kept = re.search(r"cannot be waited for \(.*cudaErrorIllegalAddress.*polls\); 1 producer\(s\) kept", result.stderr)
    assert abandoned or kept, result.stderr


def test_data_ready_on_an_ended_threads_per_thread_stream_is_read_finished(
    torch, spin_cycles, torch_streams, settled_views, torch_out
):
    # Whichever way the driver treats an ended thread's per-thread stream, handoff makes the legacy
    # stream (which the binding names) wait for its work when the thread ends.
    _, consumer = torch_streams
    memory = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()
    made = []

    def producer_thread() -> None:
        per_thread = torch.cuda.ExternalStream(2)
        with torch.cuda.stream(per_thread):
            torch.cuda._sleep(spin_cycles)
            memory.fill_(DONE)
        made.append(
            handoff.view(memory.data_ptr(), (N,), "float32", device=(CUDA, memory.device.index), owner=memory, stream=2)
        )

    thread = threading.Thread(target=producer_thread)
    thread.start()
    thread.join()  # ended while its per-thread stream still spins
    assert read_with_torch(torch, torch_out, made.pop(), consumer.cuda_stream) == (DONE, DONE)


# --- exchanges between other libraries, made without handoff -----------------------------------


@pytest.fixture
def registered():
    """Registers library adapters for a test (call it with a handoff.LibraryAdapter) and, after the
    test, gives handoff's registry back what it held before: what a test teaches handoff's hooks
    must not change how later tests' libraries are hooked. (handoff has no public way to forget a
    library, so the registry is restored through its module.)"""
    from handoff._adapters import registry

    before = {adapter.name: adapter for adapter in registry.adapters()}
    yield handoff.register_library
    for adapter in registry.adapters():
        if adapter.name not in before:
            handoff.register_library(handoff.LibraryAdapter(adapter.name))  # unhooks what it hooked
            registry.remove(adapter.name)
    for name, adapter in before.items():
        if registry.get(name) is not adapter:
            handoff.register_library(adapter)


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_a_careless_hand_off_between_two_libraries_is_flagged_and_the_ordering_mode_fixes_it(
    torch, cupy, spin_cycles, ordered, registered, settled_views
):
    """PyTorch's pending tensor, handed to CuPy by a producer wrapper that ignores `stream` (as
    cuda.core's and nanobind's arrays do): traced, it is an unordered hazard and CuPy reads stale data;
    in the ordering mode, CuPy's current stream waits for PyTorch's and reads the finished data."""

    class Careless:  # registered as a library that ignores `stream`
        def __init__(self, tensor):
            self.tensor = tensor

        def __dlpack__(self, *, stream=None, **kwargs):
            return self.tensor.__dlpack__(stream=-1, **kwargs) if stream is not None else self.tensor.__dlpack__()

        def __dlpack_device__(self):
            return self.tensor.__dlpack_device__()

    Careless.__module__ = "carelesslib"
    producer = torch.cuda.Stream()
    registered(
        handoff.LibraryAdapter("carelesslib", ignores_stream=True, current_stream=lambda device: producer.cuda_stream)
    )
    handoff.order_libraries(ordered)
    try:
        consumer = cupy.cuda.Stream(non_blocking=True)
        seen = cupy.empty(N, dtype=cupy.float32)  # before the race: an allocation may order streams
        cupy.cuda.Device().synchronize()
        with torch.cuda.stream(producer):
            x = torch_pending(torch, spin_cycles, producer)
            with consumer, handoff.trace(libraries=True) as t:
                cupy.copyto(seen, cupy.from_dlpack(Careless(x)))
                consumer.synchronize()
        (event,) = [e for e in t.events if e["interposed"]]
        assert (event["producer"], event["consumer"]) == ("carelesslib", "cupy")
        if ordered:
            assert float(seen[0]) == DONE and float(seen[-1]) == DONE
            assert (event["interposed"], event["hazard"]) == ("ordered", None)
        else:
            assert float(seen[0]) == STALE, "the negative control reads before the write"
            assert event["hazard"] == "unordered"
    finally:
        handoff.order_libraries(False)
        torch.cuda.synchronize()


def test_pytorch_to_cupy_is_traced_with_the_stream_cupy_passed(torch, cupy, settled_views):
    x = torch.ones(N, device="cuda")
    consumer = cupy.cuda.Stream(non_blocking=True)
    with consumer, handoff.trace(libraries=True) as t:
        y = cupy.from_dlpack(x)
    consumer.synchronize()
    (event,) = [e for e in t.events if e["interposed"]]
    assert (event["producer"], event["consumer"], event["action"]) == ("torch", "cupy", "wait")
    assert event["stream_argument"] == consumer.ptr and event["consumer_stream"] == consumer.ptr
    assert float(y[-1]) == 1.0


def test_one_stream_block_makes_pytorch_and_cupy_launch_on_the_same_stream(torch, cupy):
    stream = torch.cuda.Stream()
    with handoff.stream(stream, frameworks=True):
        assert torch.cuda.current_stream().cuda_stream == stream.cuda_stream
        assert cupy.cuda.get_current_stream().ptr == stream.cuda_stream
    assert torch.cuda.current_stream().cuda_stream != stream.cuda_stream
    assert cupy.cuda.get_current_stream().ptr != stream.cuda_stream


# --- several producers in one call, as tvm-ffi makes it (docs/c-exchange-api.md) --------------------


@pytest.mark.parametrize("one_stream", [True, NEGATIVE_CONTROL])
def test_a_tvm_ffi_like_call_with_a_pytorch_tensor_first_and_a_handoff_array_second(
    torch, spin_cycles, torch_streams, one_stream, settled_views, torch_out
):
    # tvm-ffi launches on the first argument's current_work_stream (PyTorch's current stream) and
    # converts every argument through its type's table without synchronizing: handoff's array is
    # ordered for handoff's own work stream, which is the launch stream only inside
    # handoff.stream(s, frameworks=True). The negative control calls outside it.
    if not hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        pytest.skip(f"PyTorch {torch.__version__} offers no DLPack C exchange API")
    producer, launch = torch_streams
    first = torch.zeros(4, device="cuda")
    torch.cuda.synchronize()  # before the producer's work is queued: a synchronization would end it
    view = torch_view_pending_on_another_stream(torch, spin_cycles, producer)
    torch_api, handoff_api = exchange_api_of(torch.Tensor), exchange_api_of(handoff.Array)

    def call():
        stream = ctypes.c_void_p()
        assert torch_api.current_work_stream(CUDA, first.device.index, ctypes.byref(stream)) == 0
        tensor = DLTensor()
        assert handoff_api.dltensor_from_py_object_no_sync(view, ctypes.byref(tensor)) == 0
        return read_with_torch(torch, torch_out, RawDeviceMemory(tensor.data, view), stream.value or 1)

    with torch.cuda.stream(launch):
        if one_stream:
            with handoff.stream(launch, frameworks=True):
                seen = call()
        else:
            seen = call()
    expected = DONE if one_stream else STALE
    assert seen == (expected, expected)


# --- issue 40: the ordering mode's stream and storage, C++ results, exports to bare handles ------
# Written against the contract; what they test is implemented beside them (see each test).


@pytest.fixture
def ordering_mode():
    """Turns handoff's ordering mode on or off for a test (`ordering_mode(True)`), and off after it."""
    yield handoff.order_libraries
    handoff.order_libraries(False)


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_the_ordering_mode_holds_the_consumers_stream_object_until_the_release_has_run(
    torch, cupy, spin_cycles, ordering_mode, ordered, settled_views
):
    # Issue 40, item 2: PyTorch -> CuPy in the ordering mode; CuPy destroys its stream with the
    # object, and the release deferred behind that stream must not record on a destroyed (or
    # recycled) handle: the mode holds the stream object until the release has run. The negative
    # control, without the mode, holds nothing.
    ordering_mode(ordered)
    producer = torch.cuda.Stream()
    x = torch_pending(torch, spin_cycles, producer)
    consumer = cupy.cuda.Stream(non_blocking=True)
    stream_gone = weakref.ref(consumer)
    with held(consumer.ptr):
        with torch.cuda.stream(producer), consumer:
            y = cupy.from_dlpack(x)
            y += 1.0  # the consumer's work on the data, held back
        del consumer, y, x
        gc.collect()
        assert_kept_while_the_stream_works(stream_gone() is not None, ordered, "the consumer's stream object")
    assert_let_go_once_done(torch.cuda, stream_gone, settled_views)


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_the_ordering_mode_keeps_the_producer_while_a_view_of_the_consumers_tensor_lives(
    torch, cupy, ordering_mode, ordered, settled_views
):
    # Issue 40, item 3: CuPy -> PyTorch in the ordering mode; a PyTorch view outlives the tensor
    # from_dlpack made, and its last reference calls the DLPack deleter while PyTorch's stream still
    # reads the data: CuPy's pool must not get the block back until that work is done. The negative
    # control, without the mode, gives it back at once.
    ordering_mode(ordered)
    pool = cupy.get_default_memory_pool()
    producer = cupy.cuda.Stream(non_blocking=True)
    with producer:
        x = cupy.full(N, DONE, dtype=cupy.float32)
    producer.synchronize()
    used = pool.used_bytes()
    consumer = torch.cuda.Stream()
    out = torch.empty(N // 2, device="cuda")
    torch.cuda.synchronize()
    with held(consumer.cuda_stream):
        with torch.cuda.stream(consumer):
            t = torch.from_dlpack(x)
            v = t[::2]  # holds the same storage
            out.copy_(v)  # the consumer's work on it, held back
        del t, x, v  # the view's end calls the deleter
        gc.collect()
        assert_kept_while_the_stream_works(pool.used_bytes() >= used, ordered, "CuPy's block")
    consumer.synchronize()
    assert out[0].item() == DONE
    wait_for_live_views(settled_views)


@pytest.fixture(scope="module")
def example():
    """examples/pybind11 (tensor_example), built where HANDOFF_PYBIND11_EXAMPLE or build/example-pybind11
    says (the test command and tools/gpu-check build it), or a skip."""
    folder = Path(os.environ.get("HANDOFF_PYBIND11_EXAMPLE", Path(__file__).parents[2] / "build" / "example-pybind11"))
    if not any(folder.glob("tensor_example*.so")):
        pytest.skip(f"examples/pybind11 is not built in {folder}")
    sys.path.insert(0, str(folder))
    import tensor_example

    return tensor_example


def device_result_of(example, name: str):
    """A function of the example that returns C++-owned device memory, or a skip."""
    if not hasattr(example, name):
        pytest.skip(f"examples/pybind11 has no {name} (issue 40, items 5 and 6)")
    return getattr(example, name)


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_a_cpp_device_result_is_ordered_after_the_stream_it_names(
    example, torch, spin_cycles, torch_streams, ordered, settled_views, torch_out
):
    # Issue 40, item 5: C++ returns device memory that a kernel is still writing on the library's
    # own stream, and names that stream; a consumer reading at once elsewhere sees finished data.
    # The negative control names the stream as unknown (0): exports then order after the legacy
    # default stream only, which the producer's non-blocking stream is not.
    device_result = device_result_of(example, "device_result")
    producer, consumer = torch_streams
    memory = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(producer):
        torch.cuda._sleep(spin_cycles)
        memory.fill_(DONE)
    result = device_result(
        memory.data_ptr(), N, (CUDA, memory.device.index), stream=producer.cuda_stream if ordered else 0, owner=memory
    )
    expected = DONE if ordered else STALE
    assert read_with_torch(torch, torch_out, result, consumer.cuda_stream) == (expected, expected)


@pytest.mark.parametrize("framework", ["torch", "cupy"])
@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_a_framework_tagged_cpp_result_keeps_its_owner_until_the_frameworks_stream_is_done(
    example, torch, cupy, framework, ordered, settled_views
):
    # Issue 40, item 6: a result returned as the framework's array is exported to that framework's
    # own stream; the C++ owner must outlive the work queued there. The negative control hands the
    # untagged result to the framework with no ordering (stream=-1): released at once.
    tagged = device_result_of(example, f"device_result_{framework}")
    untagged = device_result_of(example, "device_result")
    memory = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()
    owner = Owner()
    owner.memory = memory
    pointer, device, gone = memory.data_ptr(), (CUDA, memory.device.index), weakref.ref(owner)
    del memory
    if framework == "torch":
        stream = torch.cuda.Stream()
        handle, current = stream.cuda_stream, torch.cuda.stream(stream)
    else:
        stream = cupy.cuda.Stream(non_blocking=True)
        handle, current = stream.ptr, stream
    with held(handle):
        with current:
            if ordered:
                result = tagged(pointer, N, device, stream=0, owner=owner)
            else:
                plain = untagged(pointer, N, device, stream=0, owner=owner)
                result = (torch.from_dlpack if framework == "torch" else cupy.from_dlpack)(Unordered(plain))
                del plain
            result += 1.0  # the framework's work on the data, held back
        del owner, result
        gc.collect()
        assert_kept_while_the_stream_works(gone() is not None, ordered, "the C++ owner")
    assert_let_go_once_done(stream, gone, settled_views)


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_a_def_dlpack_object_reaches_a_consumer_that_prefers_the_tables_dltensor_slot(
    example, torch, spin_cycles, torch_streams, ordered, settled_views, torch_out
):
    # Issue 40, item 7: a consumer that uses dltensor_from_py_object_no_sync where the table has it
    # (and managed_tensor_from_py_object_no_sync otherwise) gets a def_dlpack object's device data,
    # ordered for handoff's current work stream. The negative control reads on another stream.
    producer, consumer = torch_streams
    held_array = example.Held(torch_view_pending_on_another_stream(torch, spin_cycles, producer))
    api = exchange_api_of(type(held_array))
    with handoff.stream(consumer):
        if api.dltensor_from_py_object_no_sync:
            tensor = DLTensor()
            assert api.dltensor_from_py_object_no_sync(held_array, ctypes.byref(tensor)) == 0, (
                "a slot the table publishes must work (DLPack lets it be NULL instead)"
            )
            pointer, managed = tensor.data, None
        else:
            managed = ctypes.POINTER(DLManagedTensorVersioned)()
            assert api.managed_tensor_from_py_object_no_sync(held_array, ctypes.byref(managed)) == 0
            pointer = managed.contents.dl_tensor.data
    reader = consumer if ordered else torch.cuda.Stream()
    expected = DONE if ordered else STALE
    assert read_with_torch(torch, torch_out, RawDeviceMemory(pointer, held_array), reader.cuda_stream) == (
        expected,
        expected,
    )
    if managed:
        managed.contents.deleter(managed)


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_an_export_to_cupys_bare_stream_handle_keeps_the_producer_until_that_stream_is_done(
    cupy, torch, ordered, settled_views
):
    # Issue 40, item 9: CuPy names its current stream to __dlpack__ by its bare handle (> 2); handoff
    # knows CuPy, resolves the handle to CuPy's stream object and holds it, so the export's release
    # waits for that stream by default. The negative control exports with no ordering.
    view, gone = owned_view(torch)
    consumer = cupy.cuda.Stream(non_blocking=True)
    with held(consumer.ptr):
        with consumer:
            y = cupy.from_dlpack(view if ordered else Unordered(view))
            y += 1.0  # the consumer's work on the data, held back
        del y, view
        gc.collect()
        assert_kept_while_the_stream_works(gone() is not None, ordered, "the producer")
    assert_let_go_once_done(consumer, gone, settled_views)
