"""Host cost of ordered exchanges (an event recorded on the producer's stream, waited on by the
consumer's) against unordered and same-stream ones, and events created in steady state.

    HANDOFF_BACKEND=sim .venv/bin/python bench/ordering_bench.py [--quick]

handoff next to PyTorch's and CuPy's own ordered exchanges on a GPU: bench/ordered_exchange_bench.py.
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
        print(
            f"\nsteady state, 10000 ordered exports: {after['waits_inserted'] - before['waits_inserted']} waits, "
            f"{after['events_created'] - before['events_created']} events created, "
            f"{after['events_reused'] - before['events_reused']} reused"
        )
    else:
        print("(the simulated rows need HANDOFF_BACKEND=sim or sim-rocm)")

    print("\nNext to PyTorch's and CuPy's own __dlpack__(stream=...) on a GPU: bench/ordered_exchange_bench.py")


if __name__ == "__main__":
    main()
