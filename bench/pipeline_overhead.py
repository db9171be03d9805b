"""What tracing costs a realistic pipeline: a loop whose steps each do about 300 us of real work (a
matrix product, a softmax, an FFT) and exchange arrays between PyTorch (CPU) and NumPy four times, in a program that never imports handoff,
run untraced, under `handoff-trace run`, under `handoff-trace run --order`, in the ordering mode alone
(`HANDOFF_ORDER=1`, no trace) and under `handoff-trace run --launches`; and a launch-heavy variant on the simulator (each step also launches
kernels, orders two streams through an exchange and waits for one), untraced and under
`handoff-trace run --launches`. The target: a launch trace costs at most 1.10x the untraced step.
The launch-heavy variant also runs racy (its exchange orders the consumer after the stream the
array was made on, not after the kernels that wrote it, so the race detector reports a race every
step): what a program that races costs while the trace describes each race.

The work's size is found for the step the target assumes (`--step-us`, 300 us by default): the
untraced pipeline is timed at growing matrix sizes until its step reaches that, since how long a
size takes differs from machine to machine (96 took 63 us on one VM and 135 us on another). The
launch-heavy variant does the same work at that size. `--size N` fixes the size instead.

Configurations run interleaved (one process each per round), so that a disturbance of the machine
hits them alike; each process reports its 20th-percentile step time, and each configuration's figure
is the least disturbed (lowest) of the rounds. The programs run with one OpenMP thread unless
OMP_NUM_THREADS says otherwise: PyTorch's idle OpenMP worker spins beside the main thread between
operations, which on a machine of few cores moves every part of a step by tens of microseconds.
With --cpu, every program runs on that one CPU, its threads included: the simulator's device threads
then take turns with the program's instead of waking on another CPU, which on a small shared machine
moves the launch-heavy variant's step by more than the trace costs (a ratio of single-CPU times is
one of all the work done, as an instruction count is).

    .venv/bin/python bench/pipeline_overhead.py [--rounds N] [--steps N] [--step-us US | --size N]
                                                [--launches-per-step N] [--cpu N] [--quick] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# The pipeline: never imports handoff. Prints its step times (ns) as JSON.
PIPELINE = r"""
import json, sys, time
import numpy as np, torch
steps, size = int(sys.argv[1]), int(sys.argv[2])
weights = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)
batch = np.ones((size, size), dtype=np.float32)
times = []
for step in range(steps + steps // 10):
    start = time.perf_counter_ns()
    hidden = torch.from_dlpack(batch) @ torch.from_dlpack(weights)   # NumPy -> PyTorch, twice
    scores = np.from_dlpack(torch.softmax(hidden, dim=1))              # PyTorch -> NumPy
    smooth = np.fft.irfft(np.fft.rfft(scores, axis=1), n=size, axis=1).astype(np.float32)
    batch = np.from_dlpack(torch.from_numpy(smooth).mul_(0.5))         # and once more
    times.append(time.perf_counter_ns() - start)
print(json.dumps(times[steps // 10:]))  # the first tenth warms up
"""

# The launch-heavy variant on the simulator: the same work, and each step launches kernels on one
# stream, hands the result to a second stream through an exchange (an event and a wait) and waits
# for that stream. The producer's last write is a fill on its stream, which makes that stream the
# array's producer stream (as a library that knows its stream says it); "racy" leaves it out, so
# the exchange orders the consumer after the stream the array was made on, not after the kernels.
LAUNCHES = r"""
import json, sys, time
import numpy as np
import handoff
from handoff import sim
steps, size, launches, ordered = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "ordered"
# Scaled, and squashed by tanh each step: the values stay near 1 (no overflow to inf and NaN, no
# decay into subnormals), so every step does the same work.
weights = (np.random.default_rng(0).standard_normal((size, size)) / np.sqrt(size)).astype(np.float32)
batch = np.ones((size, size), dtype=np.float32)
compute, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
buffers = [sim.zeros(1024) for _ in range(4)]
times = []
for step in range(steps + steps // 10):
    start = time.perf_counter_ns()
    batch = np.tanh(batch @ weights)
    for k in range(launches):
        sim.launch("layer", reads=[buffers[k % 4]], writes=[buffers[(k + 1) % 4]], stream=compute)
    if ordered:
        sim.fill(buffers[0], 1.0, stream=compute)
    ready = handoff.from_dlpack(buffers[0], stream=consumer)
    sim.launch("head", reads=[ready], writes=[buffers[1]], stream=consumer)
    consumer.synchronize()
    del ready
    times.append(time.perf_counter_ns() - start)
print(json.dumps(times[steps // 10:]))
"""


def percentile(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def run(command: list[str], env: dict[str, str], cpu: int | None = None) -> Any:
    """Runs one configuration (on `cpu` alone, when given); what its program printed last, as JSON."""
    pin = None if cpu is None else lambda: os.sched_setaffinity(0, {cpu})
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False, timeout=1800, preexec_fn=pin)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:6])} ... failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def size_for_step(
    python: str, pipeline: Path, step_us: float, env: dict[str, str], cpu: int | None
) -> tuple[int, float]:
    """The smallest matrix size (of 32's multiples from 64) whose untraced pipeline step takes at least
    `step_us`, or the one closest to it below; with that step's time (us)."""
    best = (64, 0.0)
    for size in range(64, 1025, 32):
        step = percentile(run([python, str(pipeline), "300", str(size)], env, cpu), 0.2) / 1000
        if step >= step_us:
            return (size, step) if step - step_us < step_us - best[1] else best
        best = (size, step)
    return best


def child_environment() -> dict[str, str]:
    """The environment the measured programs run in: no handoff setting of the caller's, and one
    OpenMP thread unless OMP_NUM_THREADS says otherwise (see above)."""
    ignored = ("HANDOFF_TRACE", "HANDOFF_ORDER", "HANDOFF_TRACE_LAUNCHES", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in ignored}
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--steps", type=int, default=2000, help="steps per process (default 2000)")
    parser.add_argument(
        "--step-us", type=float, default=300.0, help="the untraced step to size the work for (default 300)"
    )
    parser.add_argument("--size", type=int, default=None, help="the work's matrix size (default: found for --step-us)")
    parser.add_argument("--launches-per-step", type=int, default=16, help="the launch-heavy variant's kernels")
    parser.add_argument("--cpu", type=int, default=None, help="run every program on this one CPU (see above)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 200 steps (a smoke run)")
    parser.add_argument("--only", default="", help="run only the configurations whose names contain this")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 200
    python = sys.executable
    trace = [python, "-m", "handoff._trace_cli", "run"]
    env = child_environment()
    with tempfile.TemporaryDirectory(prefix="handoff-bench-") as scratch:
        pipeline, launches = Path(scratch, "pipeline.py"), Path(scratch, "launches.py")
        pipeline.write_text(PIPELINE)
        launches.write_text(LAUNCHES)
        if args.size is None:
            args.size, step = size_for_step(python, pipeline, args.step_us, env, args.cpu)
            sized = f"size {args.size} (an untraced step of {step:.0f} us, for {args.step_us:.0f} us)"
        else:
            sized = f"size {args.size}"
        base = [python, str(pipeline), str(args.steps), str(args.size)]
        heavy = [python, str(launches), str(args.steps), str(args.size), str(args.launches_per_step)]
        racy = [*heavy, "racy"]
        heavy.append("ordered")
        sim_env = {**env, "HANDOFF_BACKEND": "sim"}
        configs = {
            "pipeline, untraced": (base, env),
            "pipeline, handoff-trace run": ([*trace, "--", *base], env),
            "pipeline, handoff-trace run --order": ([*trace, "--order", "--", *base], env),
            "pipeline, HANDOFF_ORDER=1 (no trace)": (base, {**env, "HANDOFF_ORDER": "1"}),
            "pipeline, handoff-trace run --launches": ([*trace, "--launches", "--", *base], env),
            "launch-heavy (sim), untraced": (heavy, sim_env),
            "launch-heavy (sim), handoff-trace run --launches": ([*trace, "--launches", "--", *heavy], sim_env),
            "launch-heavy racy (sim), untraced": (racy, sim_env),
            "launch-heavy racy (sim), handoff-trace run --launches": ([*trace, "--launches", "--", *racy], sim_env),
        }
        configs = {name: config for name, config in configs.items() if args.only in name}
        if not configs:
            raise SystemExit(f"no configuration's name contains {args.only!r}")
        figures: dict[str, list[float]] = {name: [] for name in configs}
        for _ in range(args.rounds):
            for name, (command, environment) in configs.items():
                figures[name].append(percentile(run(command, environment, args.cpu), 0.2))
    best = {name: min(values) for name, values in figures.items()}
    threads = f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}" + ("" if args.cpu is None else f", on CPU {args.cpu} alone")
    print(
        f"{platform.node()}, Python {platform.python_version()}, {args.rounds} rounds of {args.steps} steps, {sized}, "
        f"{threads}"
    )
    print(f"{'configuration':<52} {'p20 step':>10} {'ratio':>6}   every round's p20, lowest first (us)")
    for name, value in best.items():
        baseline = best[name.split(", ")[0] + ", untraced"]
        rounds = " ".join(f"{v / 1000:.0f}" for v in sorted(figures[name]))
        print(f"{name:<52} {value / 1000:>8.1f}us {value / baseline:>6.3f}   {rounds}")


if __name__ == "__main__":
    main()
