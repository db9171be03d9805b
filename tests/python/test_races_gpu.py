"""Races after the exchange on a GPU, through CUPTI: PyTorch, CuPy and a raw CUDA kernel (cuda.core)
in the races test_races_sim.py makes on the simulator, each with its negative control. A launch
trace subscribes to CUPTI's driver API callbacks; memory is matched by the allocations CUPTI reports,
so each test empties its library's cache first (memory allocated before the trace is not known).
Skipped without a CUDA device."""

from __future__ import annotations

import pytest

import handoff

from support import BACKEND, cuda_core_module, cuda_is_usable

pytestmark = pytest.mark.skipif(
    BACKEND != "cuda" or not cuda_is_usable(),
    reason=f"needs a CUDA device and HANDOFF_BACKEND=cuda or auto (backend is {BACKEND!r}): CUPTI launch traces",
)

N = 1 << 20
SPIN = 50_000_000  # GPU cycles the producer spins first: its write is pending when the consumer launches


def races(t: handoff.trace) -> list[dict]:
    return [e for e in t.hazards() if e["hazard"] in ("race", "reuse")]


@pytest.fixture
def torch_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the trace learns its memory from the allocations it sees
    yield torch
    torch.cuda.synchronize()


@pytest.mark.parametrize("ordered", [False, True], ids=["legacy-stream", "waited"])
def test_torch_a_launch_on_the_default_stream_after_a_side_stream_write(torch_cuda, ordered: bool):
    torch = torch_cuda
    producer = torch.cuda.Stream()  # PyTorch's streams are non-blocking
    with handoff.trace(launches=True) as t:
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SPIN)
            data = torch.ones(N, device="cuda")
        if ordered:
            torch.cuda.current_stream().wait_stream(producer)
        doubled = data * 2  # on the default (legacy) stream
        torch.cuda.synchronize()
    assert t.launch_problem is None
    found = races(t)
    if ordered:
        assert found == []
        return
    assert found and found[0]["hazard"] == "race" and found[0]["stream"] == 1
    assert found[0]["other_stream"] == producer.cuda_stream and found[0]["library"] == "torch"
    del doubled


@pytest.mark.parametrize("recorded", [False, True], ids=["no-record-stream", "record-stream"])
def test_torch_a_side_stream_copy_whose_source_is_reused(torch_cuda, recorded: bool):
    torch = torch_cuda
    side = torch.cuda.Stream()
    with handoff.trace(launches=True) as t:
        source = torch.ones(N, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(SPIN)
            target = source.clone()
        if recorded:
            source.record_stream(side)
        del source  # the caching allocator may hand the block out again at once
        reused = torch.zeros(N, device="cuda")  # written on the default stream
        torch.cuda.synchronize()
    found = races(t)
    if recorded:
        assert found == []
    else:
        assert found and "record_stream" in found[0]["fix"]
    del target, reused


def test_torch_host_waits_are_attributed_to_their_lines(torch_cuda):
    torch = torch_cuda
    with handoff.trace(launches=True) as t:
        torch.cuda._sleep(SPIN)
        torch.cuda.synchronize()
    waits = [e for e in t.events if e["kind"] == "sync"]
    assert waits and max(e["blocked_ns"] for e in waits) > 0


@pytest.mark.parametrize("ordered", [False, True], ids=["null-stream", "waited"])
def test_cupy_a_launch_on_the_null_stream_after_a_non_blocking_write(ordered: bool):
    cupy = pytest.importorskip("cupy")
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    producer = cupy.cuda.Stream(non_blocking=True)
    with handoff.trace(launches=True) as t:
        with producer:
            data = cupy.ones(N, dtype=cupy.float32)
        if ordered:
            cupy.cuda.Stream.null.wait_event(producer.record())
        doubled = data * 2  # on the null (legacy) stream
        cupy.cuda.Device().synchronize()
    found = races(t)
    assert (found == []) == ordered
    del doubled


KERNEL = r"""
extern "C" __global__ void scale(const float* in, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = 2.0f * in[i];
}
"""


@pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "waited"])
def test_a_raw_kernel_through_cuda_core_after_an_exchange(torch_cuda, ordered: bool):
    torch = torch_cuda
    core = cuda_core_module()
    device = core.Device()
    device.set_current()
    program = core.Program(KERNEL, code_type="c++")
    kernel = program.compile("cubin").get_kernel("scale")
    producer = torch.cuda.Stream()
    consumer = device.create_stream()  # non-blocking
    with handoff.trace(launches=True) as t:
        with torch.cuda.stream(producer):
            torch.cuda._sleep(SPIN)
            data = torch.ones(N, device="cuda")
        out = torch.empty(N, device="cuda")
        # Ordered, the exchange makes the consumer wait for the producer; unordered, it does not.
        imported = handoff.from_dlpack(data, stream=int(consumer.handle) if ordered else -1)
        config = core.LaunchConfig(grid=(N + 255) // 256, block=256)
        core.launch(consumer, config, kernel, imported.data_ptr, out.data_ptr(), N)
        consumer.sync()
    found = [e for e in races(t) if e["kind"] == "launch" and e["kernel"] == "scale"]
    assert (found == []) == ordered
    del imported
