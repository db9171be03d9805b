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
from conftest import CUDA, CUDA_MANAGED, live_views, run_python

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
    """Releases run on handoff's service thread once their stream is done: poll for them."""
    deadline = time.monotonic() + timeout
    while live_views() > expected:
        assert time.monotonic() < deadline, f"live views stayed at {live_views()}, expected {expected}"
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
def test_torch_to_handoff_is_ordered_onto_the_consumer_stream(torch, spin_cycles, torch_streams, spelling,
                                                              settled_views, torch_out):
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
    assert read_with_torch(torch, torch_out, Unordered(view), consumer.cuda_stream) == (STALE, STALE), "expected stale data"


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_handoff_to_torch_is_ordered_by_the_export(torch, spin_cycles, torch_streams, ordered, settled_views, torch_out):
    # The view is ready on another stream, which waits for the producer; PyTorch names `consumer`.
    producer, consumer = torch_streams
    view = torch_view_pending_on_another_stream(torch, spin_cycles, producer)
    waits = handoff.stats()["waits_inserted"]
    expected = DONE if ordered else STALE
    assert read_with_torch(torch, torch_out, view if ordered else Unordered(view), consumer.cuda_stream) == (expected, expected)
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


def test_cupy_to_handoff_is_ordered_onto_the_consumer_stream(cupy, torch, spin_cycles, cupy_streams, settled_views, torch_out):
    producer, consumer = cupy_streams
    x = cupy_pending(cupy, torch, spin_cycles, producer)
    with producer:  # CuPy orders the work of its current stream before the consumer's
        view = handoff.from_dlpack(x, stream=consumer)
    assert view.data_ptr == x.data.ptr
    assert read_with_torch(torch, torch_out, view, consumer.ptr) == (DONE, DONE)


@pytest.mark.negative_control
def test_cupy_to_handoff_negative_control_shows_the_race(cupy, torch, spin_cycles, cupy_streams, settled_views, torch_out):
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
def test_handoff_to_cupy_is_ordered_by_the_export(cupy, torch, spin_cycles, cupy_streams, ordered, settled_views, cupy_out):
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


def test_two_threads_on_their_per_thread_default_streams(cupy, torch, spin_cycles, settled_views):
    # DLPack's stream 2 names the calling thread's own default stream; each thread reads its own.
    results, errors = {}, []

    def run(value: float) -> None:
        try:
            producer = cupy.cuda.Stream(non_blocking=True)
            x, out = cupy.zeros(N, dtype=cupy.float32), cupy.empty(N, dtype=cupy.float32)
            cupy.cuda.Device().synchronize()
            spin_on(torch, producer.ptr, spin_cycles)
            with producer:
                x.fill(value)
                view = handoff.from_dlpack(x, stream=2)
            results[value] = read_with_cupy(cupy, out, view, cupy.cuda.ExternalStream(2))
            producer.synchronize()
        except Exception as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(value,)) for value in (3.0, 5.0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == {3.0: (3.0, 3.0), 5.0: (5.0, 5.0)}


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


def test_numba_to_handoff_honours_the_interface_stream(numba_cuda, torch, spin_cycles, torch_streams, settled_views, torch_out):
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
def test_numba_to_handoff_negative_control_shows_the_race(numba_cuda, torch, spin_cycles, torch_streams,
                                                          settled_views, torch_out):
    cuda, _ = numba_cuda
    producer = cuda.stream()
    _, consumer = torch_streams
    x = numba_pending(numba_cuda, torch, spin_cycles, producer)
    view = handoff.asarray(x, stream=-1)
    assert read_with_torch(torch, torch_out, Unordered(view), consumer.cuda_stream) == (STALE, STALE), "expected stale data"
    producer.synchronize()


@pytest.mark.parametrize("sync", [True, NEGATIVE_CONTROL])
def test_handoff_to_numba_through_the_interface_stream(numba_cuda, torch, spin_cycles, torch_streams, sync,
                                                       settled_views):
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


def test_cuda_core_stream_as_the_consumer_stream(cuda_core, torch, spin_cycles, torch_streams, settled_views, torch_out):
    device, _ = cuda_core
    producer, _ = torch_streams
    consumer = device.create_stream()  # handoff takes it by its __cuda_stream__ protocol
    x = torch_pending(torch, spin_cycles, producer)
    with torch.cuda.stream(producer):
        view = handoff.from_dlpack(x, stream=consumer)
    handle = handoff.as_stream(consumer).handle
    assert read_with_torch(torch, torch_out, view, handle) == (DONE, DONE)


@pytest.mark.parametrize("ordered", [True, NEGATIVE_CONTROL])
def test_handoff_to_cuda_core_strided_memory_view(cuda_core, torch, spin_cycles, torch_streams, ordered,
                                                  settled_views, torch_out):
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
