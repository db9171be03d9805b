"""What a stream-ordered release costs the device: how long the consumer streams take to run N small
writes when a view imported onto them is dropped after each write (a deferred release each time),
against the same writes with no release. On the simulator (HANDOFF_BACKEND=sim), whose host
functions run one at a time per device, as CUDA's do, so a design that enqueues one per release
shows its stall here.

    HANDOFF_BACKEND=sim .venv/bin/python bench/release_bench.py
"""

from __future__ import annotations

import statistics
import time

import handoff

if not handoff.runtime_info()["backend"].startswith("sim"):
    raise SystemExit("run with HANDOFF_BACKEND=sim or sim-rocm")

from handoff import sim

N = 2000
REPEATS = 5


def run(streams: int, release: bool) -> tuple[float, float]:
    """Seconds the host took to enqueue N writes per stream (with their imports and drops), and
    seconds the streams then still needed to finish: the device's lag behind the host."""
    consumers = [sim.Stream(non_blocking=True) for _ in range(streams)]
    data = [sim.zeros(16) for _ in consumers]
    sim.synchronize()
    sim.drain()
    start = time.perf_counter()
    for i in range(N):
        for stream, array in zip(consumers, data):
            sim.fill(array, float(i), stream=stream)
            if release:
                view = handoff.from_dlpack(array, stream=stream)  # ready there: no wait, a release after it
                del view
    enqueued = time.perf_counter()
    for stream in consumers:
        stream.synchronize()
    done = time.perf_counter()
    sim.drain()
    return enqueued - start, done - enqueued


def main() -> None:
    print(f"{handoff.runtime_info()['backend']}: {N} writes per stream, median of {REPEATS}")
    print(f"{'streams':>7} | {'releases':>8} | {'host ms':>8} | {'stream lag ms':>13}")
    for streams in (1, 4):
        for release in (False, True):
            runs = [run(streams, release) for _ in range(REPEATS)]
            host = statistics.median(r[0] for r in runs) * 1e3
            lag = statistics.median(r[1] for r in runs) * 1e3
            print(f"{streams:>7} | {'yes' if release else 'no':>8} | {host:>8.1f} | {lag:>13.1f}")
    stats = handoff.stats()
    print(f"deferred releases {stats['deferred_releases']}, events created {stats['events_created']}")


if __name__ == "__main__":
    main()
