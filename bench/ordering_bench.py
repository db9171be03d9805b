"""Host cost of ordered exchanges (an event recorded on the producer's stream, waited on by the
consumer's) against unordered and same-stream ones, and events created in steady state.

    HANDOFF_BACKEND=sim .venv/bin/python bench/ordering_bench.py [--quick]

On a machine with a CUDA GPU and a CUDA build of PyTorch (and CuPy, if installed), it also times
their own ``__dlpack__(stream=...)`` on the same streams, side by side, as ratios.
"""

from __future__ import annotations

import argparse
import gc
import timeit

import handoff


def best_ns(fn, number: int, repeat: int) -> float:
    gc.collect()
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e9


def consume(capsule) -> None:
    handoff.from_dlpack(capsule)  # import and drop: the export's full round trip


def simulated_rows(number, repeat):
    from handoff import sim

    producer = sim.Stream(non_blocking=True)
    consumer = sim.Stream(non_blocking=True)
    array = sim.zeros((256, 256))
    sim.fill(array, 1.0, stream=producer)  # the array's data is now ready on `producer`
    sim.synchronize()
    rows = [
        ("export, ordered (wait inserted)", lambda: array.__dlpack__(stream=consumer.handle, max_version=(1, 1))),
        ("export, same stream (elided)", lambda: array.__dlpack__(stream=producer.handle, max_version=(1, 1))),
        ("export, stream=-1 (unordered)", lambda: array.__dlpack__(stream=-1, max_version=(1, 1))),
        ("import, ordered, stream object", lambda: handoff.from_dlpack(array, stream=consumer)),
        ("import, ordered, stream int", lambda: handoff.from_dlpack(array, stream=consumer.handle)),
        ("import, stream=-1 (unordered)", lambda: handoff.from_dlpack(array, stream=-1)),
    ]
    results = [(what, best_ns(fn, number, repeat)) for what, fn in rows]
    sim.synchronize()
    sim.drain()

    def ordered_export(streams=(producer, consumer)):  # the default keeps both streams alive
        return array.__dlpack__(stream=streams[1].handle, max_version=(1, 1))

    return results, ordered_export


def cuda_peer_rows(number, repeat):
    """handoff next to PyTorch and CuPy on a real GPU, when there is one."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(producer):
        tensor = torch.ones((256, 256), device="cuda")
    view = handoff.from_dlpack(tensor, stream=producer)
    rows = [
        ("torch __dlpack__(stream=s)", lambda: tensor.__dlpack__(stream=consumer.cuda_stream),
         lambda: view.__dlpack__(stream=consumer.cuda_stream, max_version=(1, 1))),
    ]
    try:
        import cupy

        cp_producer, cp_consumer = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        with cp_producer:
            cp_array = cupy.ones((256, 256), dtype=cupy.float32)
        cp_view = handoff.from_dlpack(cp_array, stream=cp_producer.ptr)
        rows.append(("cupy __dlpack__(stream=s)", lambda: cp_array.__dlpack__(stream=cp_consumer.ptr),
                     lambda: cp_view.__dlpack__(stream=cp_consumer.ptr, max_version=(1, 1))))
    except ImportError:
        pass
    return [(what, best_ns(ours, number, repeat), best_ns(peer, number, repeat)) for what, peer, ours in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = parser.parse_args()
    number, repeat = (500, 3) if args.quick else (20_000, 5)
    info = handoff.runtime_info()
    print(f"handoff {handoff.__version__}, backend {info['backend']!r}; best of {repeat} x {number} calls\n")

    if info["backend"].startswith("sim"):
        results, ordered_export = simulated_rows(number, repeat)
        baseline = dict(results)["export, stream=-1 (unordered)"]
        print(f"| {'exchange':<32} | {'ns/call':>8} | {'vs unordered export':>19} |")
        print(f"|{'-' * 34}|{'-' * 9}:|{'-' * 20}:|")
        for what, ns in results:
            print(f"| {what:<32} | {ns:>8.0f} | {ns / baseline:>19.2f} |")
        before = handoff.stats()
        for _ in range(10_000):
            ordered_export()
        after = handoff.stats()
        print(f"\nsteady state, 10000 ordered exports: {after['waits_inserted'] - before['waits_inserted']} waits, "
              f"{after['events_created'] - before['events_created']} events created, "
              f"{after['events_reused'] - before['events_reused']} reused")
    else:
        print("(the simulated rows need HANDOFF_BACKEND=sim or sim-rocm)")

    peers = cuda_peer_rows(number, repeat) if info["backend"] == "cuda" else []
    if peers:
        print(f"\n| {'ordered export on CUDA':<28} | {'handoff ns':>10} | {'peer ns':>8} | {'ratio':>5} |")
        print(f"|{'-' * 30}|{'-' * 11}:|{'-' * 9}:|{'-' * 6}:|")
        for what, ours, peer in peers:
            print(f"| {what:<28} | {ours:>10.0f} | {peer:>8.0f} | {ours / peer:>5.2f} |")
    else:
        print("\nCUDA peers (PyTorch, CuPy): not measured here (needs HANDOFF_BACKEND=cuda and a GPU)")


if __name__ == "__main__":
    main()
