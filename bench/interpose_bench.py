"""What handoff's hooks on other libraries' exchanges cost: an unchanged program's `torch.from_dlpack`
of a NumPy array and `np.from_dlpack` of a tensor, timed with handoff not imported, imported with
tracing off (nothing is wrapped), tracing other libraries (each exchange recorded), and in the
ordering mode with no trace. Each configuration runs in its own process (handoff must be absent from
the first); the host cost per exchange is the best of several repeats, with the ratio to the first.

    .venv/bin/python bench/interpose_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

# Runs in a child: prints {"torch.from_dlpack(ndarray)": ns, "np.from_dlpack(tensor)": ns}.
CHILD = r"""
import gc, json, sys, timeit
import numpy as np, torch
number, repeat, setup = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
array, tensor = np.ones(16, dtype=np.float32), torch.ones(16)
block = None
if setup != "absent":
    import handoff
    if setup == "tracing":
        block = handoff.trace(libraries=True, limit=1000)
        block.__enter__()
    elif setup == "ordering":
        handoff.order_libraries(True)
    assert setup != "off" or np.from_dlpack.__module__ != "handoff._interpose", "tracing off wraps nothing"
cases = {
    "torch.from_dlpack(ndarray)": lambda: torch.from_dlpack(array),
    "np.from_dlpack(tensor)": lambda: np.from_dlpack(tensor),
}
out = {}
for name, call in cases.items():
    gc.collect()
    out[name] = min(timeit.timeit(call, number=number) for _ in range(repeat)) / number * 1e9
print(json.dumps(out))
"""

SETUPS = (
    ("absent", "handoff not imported"),
    ("off", "imported, tracing off"),
    ("tracing", "tracing other libraries"),
    ("ordering", "ordering mode, no trace"),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    args = parser.parse_args()
    number, repeat = (500, 3) if args.quick else (20_000, 7)
    env = {k: v for k, v in os.environ.items() if k not in ("HANDOFF_TRACE", "HANDOFF_ORDER", "PYTHONPATH")}
    results = {}
    for setup, _ in SETUPS:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, str(number), str(repeat), setup],
            capture_output=True,
            text=True,
            check=True,
            env=env,
        )
        results[setup] = json.loads(child.stdout)
    print(
        f"host cost per exchange, best of {repeat} x {number} ({platform.python_implementation()} {platform.python_version()})"
    )
    cases = list(results["absent"])
    print(f"{'':<28}" + "".join(f"{case:>30}" for case in cases))
    for setup, label in SETUPS:
        cells = []
        for case in cases:
            ns, base = results[setup][case], results["absent"][case]
            cells.append(f"{ns / 1000:8.2f} us  {ns / base:5.2f}x  {(ns - base) / 1000:+6.2f} us")
        print(f"{label:<28}" + "".join(f"{cell:>30}" for cell in cells))


if __name__ == "__main__":
    main()
