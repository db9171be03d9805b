"""What handoff is for: a producer's kernel is still running when its data is handed to a consumer on
another stream. Ordered, the consumer sees the finished data; unordered, it reads stale data, and the
trace flags the line that did it. Then zero-copy exchanges between NumPy and PyTorch.

Runs on a GPU when the CUDA backend has one and PyTorch can use it; else on handoff's simulated
device (it re-runs itself with HANDOFF_BACKEND=sim, and says so).
"""

import os
import sys

import numpy as np
import torch

import handoff


def describe(label, array):
    print(
        f"  {label:<28} shape={array.shape} dtype={array.dtype} device={array.device} "
        f"data_ptr={array.data_ptr:#x} readonly={array.readonly}"
    )


def streams_demo():
    """A producer with pending work, handed over ordered and unordered; returns the trace."""
    if handoff.runtime_info()["backend"] == "cuda" and torch.cuda.is_available():
        return streams_demo_on_gpu()
    from handoff import sim

    producer, consumer = sim.Stream(), sim.Stream()
    print("A producer enqueues a slow kernel that writes 42 on its stream; the data is still zeros.")
    with handoff.trace() as t:
        data = sim.zeros((4,), "float32")
        sim.fill(data, 42.0, stream=producer, delay=0.3)
        ordered = handoff.from_dlpack(data, stream=consumer)  # the consumer stream waits for the producer's
        print(f"  ordered hand-off   (stream=consumer): consumer reads {sim.to_numpy(ordered, stream=consumer)}")

        data = sim.zeros((4,), "float32")
        sim.fill(data, 42.0, stream=producer, delay=0.3)
        unordered = handoff.from_dlpack(data, stream=-1)  # DLPack's "no synchronization": the race
        print(f"  unordered hand-off (stream=-1):       consumer reads {sim.to_numpy(unordered, stream=consumer)}")
        sim.synchronize()
    return t


def streams_demo_on_gpu():
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    print("A producer enqueues a slow kernel, then writes 42 on its stream; the data is still zeros.")
    with handoff.trace() as t:
        for label, stream in (
            ("ordered hand-off   (stream=consumer)", consumer),
            ("unordered hand-off (stream=-1)", -1),
        ):
            data = torch.zeros(4, device="cuda")
            torch.cuda.synchronize()
            with torch.cuda.stream(producer):
                torch.cuda._sleep(500_000_000)  # about 0.3 s of GPU cycles
                data.fill_(42.0)
            produced = handoff.from_dlpack(data, stream=producer)  # ready on the producer's stream
            view = handoff.from_dlpack(produced, stream=stream)
            with torch.cuda.stream(consumer):
                seen = torch.from_dlpack(view).clone()
            consumer.synchronize()
            print(f"  {label}: consumer reads {seen.cpu().numpy()}")
        torch.cuda.synchronize()
    return t


def main():
    info = handoff.runtime_info()
    if info["backend"] == "none" and "HANDOFF_BACKEND" not in os.environ:
        print(f"No GPU here ({info['backend_error'] or 'no device backend'}):")
        print("running on handoff's simulated device instead (HANDOFF_BACKEND=sim).\n", flush=True)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "HANDOFF_BACKEND": "sim"})
    print(
        f"handoff {handoff.__version__}, DLPack {info['dlpack_version']}, backend {info['backend']!r} "
        f"({info['device_count']} device(s))"
    )

    print("\n1. Streams: the same hand-off, ordered and unordered")
    t = streams_demo()
    print()
    print(t.summary())
    handoff.reset_stats()

    print("\n2. NumPy -> handoff -> PyTorch, zero-copy")
    source = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = handoff.from_dlpack(source)
    describe("handoff.from_dlpack(numpy)", view)
    tensor = torch.from_dlpack(view)
    print(f"  torch.from_dlpack(view)      same memory: {tensor.data_ptr() == source.ctypes.data}")
    source[0, 0] = 42.0
    print(f"  a write through NumPy is seen by PyTorch: tensor[0, 0] = {tensor[0, 0].item()}")

    print("\n3. PyTorch (bfloat16, strided) -> handoff -> back to PyTorch")
    weights = torch.arange(20, dtype=torch.bfloat16).reshape(4, 5)[:, ::2]
    view = handoff.from_dlpack(weights)
    describe("handoff.from_dlpack(torch)", view)
    print(f"  strides in bytes: {view.strides} (torch reports {weights.stride()} elements)")
    again = torch.from_dlpack(view)
    print(f"  round trip same memory: {again.data_ptr() == weights.data_ptr()}, equal: {torch.equal(again, weights)}")

    print("\n4. A read-only NumPy view keeps its flag, and a legacy consumer is refused")
    frozen = np.broadcast_to(np.arange(3, dtype=np.int64), (2, 3))
    view = handoff.from_dlpack(frozen)
    describe("handoff.from_dlpack(broadcast)", view)
    try:
        view.__dlpack__()  # no max_version: a legacy capsule cannot say "read-only"
    except BufferError as e:
        print(f"  legacy export refused: BufferError: {e}")

    print("\n5. Other protocols: the buffer protocol and __array_interface__")
    raw = bytearray(b"handoff!")
    view = handoff.asarray(raw)
    describe("handoff.asarray(bytearray)", view)
    print(f"  np.asarray(view) -> {np.asarray(view).tobytes()!r}")

    print("\n6. Ownership: the producer lives exactly as long as a view needs it")
    live = handoff.stats()["live_views"]
    print(f"  live producers now: {live}")
    del view, tensor, again
    print(f"  after dropping the views: {handoff.stats()['live_views']}")

    print("\nstats:", handoff.stats())

    print("\n7. A pipeline that never imports handoff: traced, its race flagged, then ordered")
    cross_library_demo()

    print("\n8. Across processes: a hand-off between two processes, ordered on the device (handoff.ipc)")
    two_process_demo()


def cross_library_demo():
    """examples/cross_library.py, under `handoff-trace run` and then `handoff-trace run --order`, on
    the simulated device (its two libraries are simulated ones)."""
    import subprocess
    from pathlib import Path

    pipeline = Path(__file__).with_name("cross_library.py")
    trace = [sys.executable, "-m", "handoff._trace_cli", "run"]
    env = {**os.environ, "HANDOFF_BACKEND": "sim"}
    for options, label in (((), "traced"), (("--order",), "traced and ordered (--order)")):
        command = " ".join(["handoff-trace", "run", *options, "--", "python", pipeline.name])
        print(f"\n  $ {command}   # {label}", flush=True)
        subprocess.run([*trace, *options, "--", sys.executable, str(pipeline)], env=env, check=True)


def two_process_demo():
    """examples/two_processes.py on the simulated device."""
    import subprocess
    from pathlib import Path

    example = Path(__file__).with_name("two_processes.py")
    subprocess.run([sys.executable, str(example)], env={**os.environ, "HANDOFF_BACKEND": "sim"}, check=True)


if __name__ == "__main__":
    main()
