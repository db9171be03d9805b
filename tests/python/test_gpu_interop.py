"""Stream-ordered exchange with PyTorch, CuPy, JAX, numba-cuda and cuda.core on a real GPU.

Run with HANDOFF_BACKEND=cuda (or auto) on a machine with an NVIDIA GPU; skipped elsewhere. Each
exchange has a producer kernel still queued behind a long spin on the producer's stream, a
consumer that reads at once on its own non-blocking stream and must see the finished data, and a
negative control (`stream=-1`) that must see the stale data: the spin is long enough that an
unordered reader always wins.
"""

from __future__ import annotations

import gc
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest

import handoff

from dlpack_ctypes import CUDA, CUDA_MANAGED
from support import live_views, run_python

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
    # capture's edge; the release must not be recorded into the graph, and runs after the capture.
    x = torch.zeros(N, device="cuda")
    out = torch.zeros(N, device="cuda")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capturing = torch.cuda.current_stream()
        x.add_(1.0)
        view = handoff.from_dlpack(x, stream=capturing)
        out.copy_(torch.from_dlpack(view) * 2.0)
        del view
    torch.cuda.synchronize()
    assert out[0].item() == 0.0, "captured work must not run before the graph is launched"
    for launch in (1, 2):
        graph.replay()
        torch.cuda.synchronize()
        assert (x[0].item(), out[-1].item()) == (float(launch), 2.0 * launch)
    del graph


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
    # CuPy compiles its kernels on first use: compiled now, a fill is queued at once behind a spin.
    warm = cupy.zeros(8, dtype=cupy.float32)
    warm.fill(1.0)
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
            results[value] = read_with_cupy(cupy, out, view, cupy.cuda.ExternalStream(2))
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

    fill[1, 32](cuda.device_array(32, np.float32), 0.0)  # compiled now, not behind a spin
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


def test_numba_to_handoff_honours_the_interface_stream(
    numba_cuda, torch, spin_cycles, torch_streams, settled_views, torch_out
):
    cuda, _ = numba_cuda
    producer = cuda.stream()
    _, consumer = torch_streams
    x = numba_pending(numba_cuda, torch, spin_cycles, producer)
    assert x.__cuda_array_interface__["stream"] == int(producer)
    view = handoff.asarray(x, stream=consumer)
    assert view.data_ptr == x.__cuda_array_interface__["data"][0]
    assert read_with_torch(torch, torch_out, view, consumer.cuda_stream) == (DONE, DONE)
    producer.synchronize()


@pytest.mark.negative_control
def test_numba_to_handoff_negative_control_shows_the_race(
    numba_cuda, torch, spin_cycles, torch_streams, settled_views, torch_out
):
    cuda, _ = numba_cuda
    producer = cuda.stream()
    _, consumer = torch_streams
    x = numba_pending(numba_cuda, torch, spin_cycles, producer)
    view = handoff.asarray(x, stream=-1)
    assert read_with_torch(torch, torch_out, Unordered(view), consumer.cuda_stream) == (STALE, STALE), (
        "expected stale data"
    )
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
    pytest.importorskip("cuda.core")
    try:
        from cuda.core import Device
        from cuda.core.utils import StridedMemoryView
    except ImportError:
        from cuda.core.experimental import Device
        from cuda.core.experimental.utils import StridedMemoryView
    device = Device()
    device.set_current()
    # Newer cuda.core deprecates the constructor for StridedMemoryView.from_dlpack (same arguments).
    return device, getattr(StridedMemoryView, "from_dlpack", StridedMemoryView)


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


def test_an_export_keeps_its_producer_until_the_consumers_stream_is_done(
    torch, spin_cycles, torch_streams, settled_views
):
    # PyTorch calls the capsule's deleter when its tensor goes, whatever its stream still has queued:
    # the caching allocator would hand the block out again while the consumer's kernel reads it.
    _, consumer = torch_streams
    view, gone = owned_view(torch)
    with handoff.stream(consumer), torch.cuda.stream(consumer):
        t = torch.from_dlpack(view)  # PyTorch names `consumer`, which the block holds
        torch.cuda._sleep(spin_cycles)
        t.add_(1.0)  # the consumer's later work on the data
    del t, view
    gc.collect()
    assert gone() is not None, "the producer was released while the consumer's stream still used it"
    consumer.synchronize()
    wait_for_live_views(settled_views)
    gc.collect()
    assert gone() is None


def test_a_view_released_while_its_consumer_stream_is_busy_keeps_the_producer(
    torch, spin_cycles, torch_streams, settled_views
):
    _, consumer = torch_streams
    view, gone = owned_view(torch)
    imported = handoff.from_dlpack(view, stream=consumer)
    with torch.cuda.stream(consumer):
        torch.cuda._sleep(spin_cycles)
        torch.from_dlpack(imported).add_(1.0)
    del imported, view
    gc.collect()
    assert gone() is not None, "the producer was released while the consumer's stream still used it"
    consumer.synchronize()
    wait_for_live_views(settled_views)
    gc.collect()
    assert gone() is None


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


class DlpackOnly:
    """Forwards the DLPack protocol only: the consumer goes through `__dlpack__`, not a C table."""

    def __init__(self, array) -> None:
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


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


@pytest.mark.parametrize("through", [lambda t: t, DlpackOnly], ids=["table", "__dlpack__"])
def test_a_pinned_tensor_is_accepted_as_host_memory(torch, through, settled_views):
    # PyTorch says kDLCUDAHost in __dlpack_device__ and kDLCPU in the capsule: the same memory.
    t = torch.arange(6.0).pin_memory()
    view = handoff.from_dlpack(through(t))
    assert view.device == (1, 0)
    assert view.data_ptr == t.data_ptr()
    assert np.from_dlpack(view).tolist() == t.tolist()


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
    assert "can never get there" in result.stderr or "cannot be waited for" in result.stderr, result.stderr


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


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_a_careless_hand_off_between_two_libraries_is_flagged_and_the_ordering_mode_fixes_it(
    torch, cupy, spin_cycles, ordered, settled_views
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
    handoff.register_library(
        handoff.LibraryAdapter(
            "carelesslib",
            ignores_stream=True,
            current_stream=lambda device: producer.cuda_stream,
        )
    )
    handoff.order_libraries(ordered)
    try:
        consumer = cupy.cuda.Stream(non_blocking=True)
        with torch.cuda.stream(producer):
            x = torch_pending(torch, spin_cycles, producer)
            with consumer, handoff.trace(libraries=True) as t:
                seen = cupy.from_dlpack(Careless(x)).copy()
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
