"""Where a traced pipeline's time goes, exchange by exchange: bench/pipeline_overhead.py's pipeline
(PyTorch on the CPU and NumPy, four exchanges a step, a program that never imports handoff) with each
exchange and each piece of work timed on its own, run untraced and under `handoff-trace run`,
interleaved (one process each per round). Each row is the least disturbed (lowest) of the rounds'
20th-percentile times; the difference is what the trace adds to that exchange inside the loop.

    .venv/bin/python bench/pipeline_exchanges.py [--rounds N] [--steps N] [--size N]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from pathlib import Path

# The same measure, the same way of running a configuration, in the same environment.
from pipeline_overhead import child_environment, percentile, run

# The pipeline of bench/pipeline_overhead.py, each part timed. Prints {part: [ns, ...]} as JSON.
PIPELINE = r"""
import json, sys, time
import numpy as np, torch
steps, size = int(sys.argv[1]), int(sys.argv[2])
weights = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)
batch = np.ones((size, size), dtype=np.float32)
parts = ["torch.from_dlpack(batch)", "torch.from_dlpack(weights)", "matmul, softmax", "np.from_dlpack(softmax)",
         "fft, torch.from_numpy", "mul_", "np.from_dlpack(mul_)"]
times = {part: [] for part in parts}
now = time.perf_counter_ns
for step in range(steps + steps // 10):
    t0 = now(); x = torch.from_dlpack(batch)
    t1 = now(); w = torch.from_dlpack(weights)
    t2 = now(); hidden = torch.softmax(x @ w, dim=1)
    t3 = now(); scores = np.from_dlpack(hidden)
    t4 = now(); smooth = torch.from_numpy(np.fft.irfft(np.fft.rfft(scores, axis=1), n=size, axis=1).astype(np.float32))
    t5 = now(); smooth.mul_(0.5)
    t6 = now(); batch = np.from_dlpack(smooth)  # lets the previous step's batch go, and its import
    t7 = now()
    if step >= steps // 10:  # the first tenth warms up
        for part, spent in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5, t7 - t6)):
            times[part].append(spent)
print(json.dumps(times))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--steps", type=int, default=2000, help="steps per process (default 2000)")
    parser.add_argument("--size", type=int, default=96, help="the work's matrix size (as bench/pipeline_overhead.py)")
    args = parser.parse_args()
    python = sys.executable
    env = child_environment()
    with tempfile.TemporaryDirectory(prefix="handoff-bench-") as scratch:
        pipeline = Path(scratch, "pipeline.py")
        pipeline.write_text(PIPELINE)
        base = [python, str(pipeline), str(args.steps), str(args.size)]
        configs = {
            "untraced": base,
            "traced": [python, "-m", "handoff._trace_cli", "run", "-o", str(Path(scratch, "t.trace")), "--", *base],
        }
        best: dict[str, dict[str, float]] = {name: {} for name in configs}
        for _ in range(args.rounds):
            for name, command in configs.items():
                for part, spent in run(command, env).items():
                    p20 = percentile(spent, 0.2)
                    best[name][part] = min(best[name].get(part, p20), p20)
    threads = f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
    print(
        f"{platform.node()}, Python {platform.python_version()}, {args.rounds} rounds of {args.steps} steps, {threads}"
    )
    print(f"{'part of a step':<28} {'untraced':>10} {'traced':>10} {'added':>9}")
    for part, plain in best["untraced"].items():
        traced = best["traced"][part]
        print(f"{part:<28} {plain / 1000:>8.2f}us {traced / 1000:>8.2f}us {(traced - plain) / 1000:>7.2f}us")


if __name__ == "__main__":
    main()
