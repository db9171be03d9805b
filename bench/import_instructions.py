"""Instructions per exchange, counted by callgrind: repeatable where wall-clock timings are noisy.

    .venv/bin/python bench/import_instructions.py

Runs each call in a loop of N and 2N calls under `valgrind --tool=callgrind` and reports
(Ir(2N) - Ir(N)) / N: the instructions of one call on the calling thread, start-up and loop set-up
cancelled out. Each call's result is dropped at once, so an export's count includes its deleter.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile

N = 20_000
NDARRAY = "np.ones((64, 64), dtype=np.float32)"
TENSOR = "torch.ones((64, 64), dtype=torch.float32)"
HANDOFF_ARRAY = f"handoff.from_dlpack({NDARRAY})"
NUMPY_IMPORT = "np.from_dlpack(ndarray)"  # the reference rows: NumPy importing, and exporting, its own array
NUMPY_EXPORT = "ndarray.__dlpack__()"
IMPORTS = {  # name: (set-up, the argument f is called with, the row it is compared with)
    "handoff.from_dlpack(ndarray)": ("import handoff; f = handoff.from_dlpack", NDARRAY, NUMPY_IMPORT),
    NUMPY_IMPORT: ("f = np.from_dlpack", NDARRAY, NUMPY_IMPORT),
    "torch.from_dlpack(ndarray)": ("import torch; f = torch.from_dlpack", NDARRAY, NUMPY_IMPORT),
    # Through PyTorch's DLPack C exchange API.
    "handoff.from_dlpack(tensor)": ("import handoff, torch; f = handoff.from_dlpack", TENSOR, NUMPY_IMPORT),
}
EXPORTS = {  # each next to NumPy exporting its own array
    "np.from_dlpack(handoff_array)": ("import handoff; f = np.from_dlpack", HANDOFF_ARRAY, NUMPY_IMPORT),
    NUMPY_IMPORT: ("f = np.from_dlpack", NDARRAY, NUMPY_IMPORT),
    "handoff_array.__dlpack__()": ("import handoff; f = handoff.Array.__dlpack__", HANDOFF_ARRAY, NUMPY_EXPORT),
    NUMPY_EXPORT: ("f = np.ndarray.__dlpack__", NDARRAY, NUMPY_EXPORT),
}

# Imports of a simulated device's array (HANDOFF_BACKEND=sim), its data ready on stream p, onto
# stream s; the view is dropped at once, its release deferred until s is done.
SIM_SETUP = (
    "import handoff; from handoff import sim; p = sim.Stream(non_blocking=True); "
    "s = sim.Stream(non_blocking=True); x = sim.zeros((256, 256)); sim.fill(x, 1.0, stream=p); "
    "sim.synchronize(); "
)
ORDERED = {  # name: (set-up, the argument)
    "stream=-1 (unordered)": (SIM_SETUP + "f = lambda a: handoff.from_dlpack(a, stream=-1)", "x"),
    "stream=int, ordered": (SIM_SETUP + "f = lambda a: handoff.from_dlpack(a, stream=s.handle)", "x"),
    "stream=sim.Stream, ordered": (SIM_SETUP + "f = lambda a: handoff.from_dlpack(a, stream=s)", "x"),
}


def instructions(setup: str, argument: str, calls: int, backend: str = "auto", call: str = "f(a)") -> tuple[int, int]:
    """Instructions of the calling thread, and of all other threads together."""
    program = f"import numpy as np\n{setup}\na = {argument}\nfor _ in range({calls}): {call}\n"
    # A fixed hash seed: the type attribute cache's hits and misses depend on the strings' hashes.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0", "HANDOFF_BACKEND": backend}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        run = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--separate-threads=yes",
                f"--callgrind-out-file={out}",
                sys.executable,
                "-c",
                program,
            ],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if run.returncode != 0:
            raise RuntimeError(run.stderr[-2000:])
        threads = []  # one profile per thread: callgrind.out-01 is the thread that ran the program
        for name in sorted(name for name in os.listdir(tmp) if re.fullmatch(r"callgrind\.out-\d+", name)):
            with open(os.path.join(tmp, name)) as profile:
                threads.append(int(re.search(r"^totals: (\d+)", profile.read(), re.MULTILINE).group(1)))
        return threads[0], sum(threads[1:])


@functools.cache  # NumPy's own import is the reference of both tables
def per_call(setup: str, argument: str, backend: str = "auto", call: str = "f(a)") -> tuple[float, float]:
    once = instructions(setup, argument, N, backend, call)
    twice = instructions(setup, argument, 2 * N, backend, call)
    return (twice[0] - once[0]) / N, (twice[1] - once[1]) / N


def print_table(columns: list[tuple[str, int, str]], rows: list[tuple]) -> None:
    """Prints a Markdown table and a blank line. `columns`: (title, width, format) each: a text column,
    left-aligned, where the format is "", else a number column, right-aligned, in that format."""
    print("| " + " | ".join(f"{title:>{w}}" if f else f"{title:<{w}}" for title, w, f in columns) + " |")
    print("|" + "|".join(f"{'-' * (w + 1)}:" if f else "-" * (w + 2) for _, w, f in columns) + "|")
    for row in rows:
        print("| " + " | ".join(f"{c:>{w}{f}}" if f else f"{c:<{w}}" for c, (_, w, f) in zip(row, columns)) + " |")
    print()


def table(what: str, cases: dict[str, tuple[str, str, str]]) -> None:
    counts = {name: per_call(setup, argument)[0] for name, (setup, argument, _) in cases.items()}
    print_table(
        [(what, 30, ""), ("instructions", 12, ".0f"), ("vs", 24, ""), ("ratio", 5, ".2f")],
        [
            (name, counts[name], reference, counts[name] / counts[reference])
            for name, (_, _, reference) in cases.items()
        ],
    )


def ordered_table() -> None:
    print("handoff.from_dlpack(sim array, ...) on HANDOFF_BACKEND=sim; other threads: the deferred releases")
    print("on the service thread and the simulator's own threads (timing-dependent: about 1% run to run)\n")
    print_table(
        [("import", 26, ""), ("calling thread", 14, ".0f"), ("other threads", 13, ".0f")],
        [(name, *per_call(setup, argument, backend="sim")) for name, (setup, argument) in ORDERED.items()],
    )


TRACE_ON = "t = handoff.trace(); t.__enter__(); "  # open for the whole loop: every call is recorded
TRACED = {  # name: (set-up, the argument, the backend)
    "from_dlpack(ndarray)": ("import handoff; f = handoff.from_dlpack", NDARRAY, "auto"),
    "from_dlpack(ndarray), traced": ("import handoff; " + TRACE_ON + "f = handoff.from_dlpack", NDARRAY, "auto"),
    "sim stream=int, ordered": (SIM_SETUP + "f = lambda a: handoff.from_dlpack(a, stream=s.handle)", "x", "sim"),
    "sim stream=int, ordered, traced": (
        SIM_SETUP + TRACE_ON + "f = lambda a: handoff.from_dlpack(a, stream=s.handle)",
        "x",
        "sim",
    ),
}


def traced_table() -> None:
    print("the cost of tracing: the same import with a handoff.trace() open (events kept in memory)\n")
    print_table(
        [("import", 34, ""), ("calling thread", 14, ".0f")],
        [(name, per_call(setup, argument, backend=backend)[0]) for name, (setup, argument, backend) in TRACED.items()],
    )


def main() -> None:
    print(f"instructions per call (callgrind), (Ir({2 * N}) - Ir({N})) / {N}\n")
    table("import", IMPORTS)
    table("export", EXPORTS)
    ordered_table()
    traced_table()


if __name__ == "__main__":
    main()
