"""Instructions per import, counted by callgrind: repeatable where wall-clock timings are noisy.

    .venv/bin/python bench/import_instructions.py

Runs each import in a loop of N and 2N calls under `valgrind --tool=callgrind` and reports
(Ir(2N) - Ir(N)) / N: the instructions of one call, start-up and loop set-up cancelled out.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

N = 20_000
NDARRAY = "np.ones((64, 64), dtype=np.float32)"
TENSOR = "torch.ones((64, 64), dtype=torch.float32)"
CASES = {  # name: (set-up, the argument)
    "handoff.from_dlpack(ndarray)": ("import handoff; f = handoff.from_dlpack", NDARRAY),
    "np.from_dlpack(ndarray)": ("f = np.from_dlpack", NDARRAY),
    "torch.from_dlpack(ndarray)": ("import torch; f = torch.from_dlpack", NDARRAY),
    # Through PyTorch's DLPack C exchange API.
    "handoff.from_dlpack(tensor)": ("import handoff, torch; f = handoff.from_dlpack", TENSOR),
}


def instructions(setup: str, argument: str, calls: int) -> int:
    program = f"import numpy as np\n{setup}\na = {argument}\nfor _ in range({calls}): f(a)\n"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c", program],
                             capture_output=True, text=True, env={**os.environ, "OPENBLAS_NUM_THREADS": "1"})
        match = re.search(r"Collected : (\d+)", run.stderr)
        if run.returncode != 0 or match is None:
            raise RuntimeError(run.stderr[-2000:])
        return int(match.group(1))


def main() -> None:
    print(f"instructions per call (callgrind), (Ir({2 * N}) - Ir({N})) / {N}\n")
    print(f"| {'import':<30} | {'instructions':>12} | {'vs np.from_dlpack':>17} |")
    print(f"|{'-' * 32}|{'-' * 13}:|{'-' * 18}:|")
    counts = {name: (instructions(setup, argument, 2 * N) - instructions(setup, argument, N)) / N
              for name, (setup, argument) in CASES.items()}
    reference = counts["np.from_dlpack(ndarray)"]
    for name, count in counts.items():
        print(f"| {name:<30} | {count:>12.0f} | {count / reference:>17.2f} |")


if __name__ == "__main__":
    main()
