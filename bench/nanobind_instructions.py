"""handoff's pybind11 helper beside nanobind's nb::ndarray: instructions per call, counted by callgrind.

    .venv/bin/pip install nanobind==3.1.0
    .venv/bin/python bench/nanobind_instructions.py

Builds bench/nanobind (the same small extension written with <handoff/pybind11.hpp> and with
nanobind, 16-element float32 arrays) against the installed handoff, then counts each call as
bench/import_instructions.py does: (Ir(2N) - Ir(N)) / N on the calling thread, the call's result
dropped at once (its release included). Prints a Markdown table with handoff / nanobind and the
target of each row.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from import_instructions import N, per_call

import handoff

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "bench-nanobind"
NDARRAY = "np.ones(16, dtype=np.float32)"
TENSOR = "torch.ones(16, dtype=torch.float32)"
ROWS = {  # name: (set-up after `import bench_<side> as m`, the argument, the call, the target ratio)
    "sum3(ndarray, ndarray, ndarray)": ("f = m.sum3", NDARRAY, "f(a, a, a)", 1.0),
    "scale(ndarray, 1.0), in place": ("f = m.scale", NDARRAY, "f(a, 1.0)", 1.0),
    "arange(16), a new numpy.ndarray": ("f = m.arange", "16", "f(a)", 1.0),
    "np.from_dlpack(Buffer())": ("f = np.from_dlpack", "m.Buffer()", "f(a)", 1.0),
    "sum3(tensor, tensor, tensor)": ("import torch; f = m.sum3", TENSOR, "f(a, a, a)", 0.2),
}


def build() -> None:
    def cmake_dir(*argv: str) -> str:
        return subprocess.run([sys.executable, *argv], capture_output=True, text=True, check=True).stdout.strip()

    configure = [
        "cmake",
        "-S",
        str(ROOT / "bench" / "nanobind"),
        "-B",
        str(BUILD),
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-Dpybind11_DIR={cmake_dir('-m', 'pybind11', '--cmakedir')}",
        f"-Dnanobind_DIR={cmake_dir('-m', 'nanobind', '--cmake_dir')}",
        f"-Dhandoff_DIR={handoff.get_cmake_dir()}",
    ]
    subprocess.run(configure, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["cmake", "--build", str(BUILD), "-j", str(os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL
    )


def main() -> None:
    build()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BUILD), os.environ.get("PYTHONPATH")]))
    print(f"instructions per call (callgrind), (Ir({2 * N}) - Ir({N})) / {N}, 16 float32 elements\n")
    print(f"| {'call':<34} | {'handoff':>8} | {'nanobind':>8} | {'ratio':>5} | {'target':>6} |")
    print(f"|{'-' * 36}|{'-' * 9}:|{'-' * 9}:|{'-' * 6}:|{'-' * 7}:|")
    for name, (setup, argument, call, target) in ROWS.items():
        ours = per_call(f"import bench_handoff as m; {setup}", argument, call=call)[0]
        theirs = per_call(f"import bench_nanobind as m; {setup}", argument, call=call)[0]
        print(f"| {name:<34} | {ours:>8.0f} | {theirs:>8.0f} | {ours / theirs:>5.2f} | <= {target:<3} |")


if __name__ == "__main__":
    main()
