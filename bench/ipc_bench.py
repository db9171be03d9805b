"""The hand-off across processes, per transfer: the host cost of share + open + release (the first
open of an allocation, and with its mapping cached), beside PyTorch's own path for the same data
(torch.multiprocessing's reduction of a shared CPU tensor here; of a CUDA tensor on a GPU), and, with
--ray, Ray's object store beside the "handoff" tensor transport for a 64 MiB array.

    HANDOFF_BACKEND=sim .venv/bin/python bench/ipc_bench.py [--count N] [--ray]

Host cost: the producer's pickling (handoff: the share; PyTorch: the storage's reduction) plus the
consumer's unpickling and release, each timed in its own process; the pipe between them is not
counted. Prints a Markdown table (docs/benchmarks.md keeps one)."""

from __future__ import annotations

import argparse
import multiprocessing
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np


def consumer(connection) -> None:
    """Unpickles what arrives, drops it, and answers how long that took (ns)."""
    import handoff  # noqa: F401 - registers the reductions, starts the backend

    keep = None
    while True:
        message = connection.recv_bytes()
        if not message:
            return
        start = time.perf_counter_ns()
        received = ForkingPickler.loads(message)
        if keep is None:
            keep = received  # holds the first allocation's mapping: later opens of it are cached
        else:
            del received
        elapsed = time.perf_counter_ns() - start
        connection.send(elapsed)


def measure(connection, make, count: int) -> float:
    """Median ns per transfer of the objects `make()` returns."""
    samples = []
    for _ in range(count):
        item = make()
        start = time.perf_counter_ns()
        message = ForkingPickler.dumps(item)
        produced = time.perf_counter_ns() - start
        del item
        connection.send_bytes(bytes(message))
        samples.append(produced + connection.recv())
    return float(np.median(samples))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--ray", action="store_true", help="also Ray's object store vs the handoff transport, 64 MiB")
    args = parser.parse_args()

    import torch
    import torch.multiprocessing

    import handoff

    backend = handoff.runtime_info()["backend"]
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=consumer, args=(theirs,))
    process.start()
    rows = []
    if backend.startswith("sim"):
        from handoff import sim

        cached_source = sim.zeros(1 << 10, "float32")
        rows.append(("handoff, sim array, cached mapping", measure(ours, lambda: cached_source, args.count)))
        rows.append(
            ("handoff, sim array, first open", measure(ours, lambda: sim.zeros(1 << 10, "float32"), args.count))
        )
    host = np.ones(1 << 10, dtype=np.float32)
    rows.append(("handoff, NumPy array (copied once)", measure(ours, lambda: handoff.asarray(host), args.count)))
    shared_tensor = torch.ones(1 << 10).share_memory_()
    rows.append(("torch.multiprocessing, shared CPU tensor", measure(ours, lambda: shared_tensor, args.count)))
    ours.send_bytes(b"")
    process.join()

    print(f"backend: {backend}, {args.count} transfers each, 4 KiB arrays\n")
    print("| transfer | host ns (share + open + release) |")
    print("|---|---:|")
    for name, ns in rows:
        print(f"| {name} | {ns:,.0f} |")
    if args.ray:
        ray_rows()


def ray_rows() -> None:
    """A 64 MiB device array (the simulator's, or PyTorch's on CUDA) between two actors of one node:
    Ray's object store (which needs the data on the host, so the producer copies it there, as a GPU
    tensor's serialization does) beside the "handoff" transport (zero-copy, stream-ordered). And a
    64 MiB NumPy array both ways: the handoff transport copies host memory into shared memory once
    per share, as the object store does."""
    import os

    import ray

    import handoff.ray

    handoff.ray.register()
    keep = {name: os.environ[name] for name in os.environ if name.startswith("HANDOFF_")}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": keep})

    @ray.remote
    class Producer:
        def __init__(self):
            self.host = np.ones(64 << 18, dtype=np.float32)  # 64 MiB
            if handoff.runtime_info()["backend"].startswith("sim"):
                from handoff import sim

                stream = sim.Stream(non_blocking=True)
                self.device = sim.zeros(self.host.size, "float32")
                sim.fill(self.device, 1.0, stream=stream)
                self.to_host = lambda array: sim.to_numpy(array, stream=stream)
            else:
                import torch

                self.device = torch.ones(self.host.size, device="cuda")
                self.to_host = lambda tensor: tensor.cpu().numpy()

        def device_by_object_store(self):
            return self.to_host(self.device)

        @ray.method(tensor_transport="handoff")
        def device_by_handoff(self):
            return handoff.from_dlpack(self.device)

        def host_by_object_store(self):
            return self.host

        @ray.method(tensor_transport="handoff")
        def host_by_handoff(self):
            return handoff.asarray(self.host)

    @ray.remote(max_concurrency=2)  # receives while a task waits for its argument (docs/ipc.md, Ray)
    class Consumer:
        def take(self, value):
            return type(value).__name__

    producer, consumer = Producer.remote(), Consumer.remote()
    transfers = (
        ("device array, Ray object store (copied to the host)", producer.device_by_object_store),
        ("device array, handoff transport", producer.device_by_handoff),
        ("NumPy array, Ray object store", producer.host_by_object_store),
        ("NumPy array, handoff transport (copied into shared memory)", producer.host_by_handoff),
    )
    timings = {}
    for name, method in transfers:
        ray.get(consumer.take.remote(method.remote()))  # untimed: the first of each sets the actors up
        samples = []
        for _ in range(15):
            start = time.perf_counter_ns()
            ray.get(consumer.take.remote(method.remote()))
            samples.append(time.perf_counter_ns() - start)
        timings[name] = float(np.median(samples))
    ray.shutdown()
    print("\n| 64 MiB between two actors of one node | ms per transfer |")
    print("|---|---:|")
    for name, ns in timings.items():
        print(f"| {name} | {ns / 1e6:.2f} |")
    ratio = timings[transfers[0][0]] / timings[transfers[1][0]]
    print(f"\ndevice array: the handoff transport is {ratio:.1f}x faster than the object store")


if __name__ == "__main__":
    main()
