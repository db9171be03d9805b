"""Checks an installed handoff wheel in a virtual environment that has nothing else of the project:
what a user who ran `pip install handoff-*.whl` gets. Run by `tools/build-wheel --test`:

    python tests/wheel/check_wheel.py VERSION

Exits non-zero at the first check that fails, saying which.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ORDERED_HAND_OFF = """
import handoff
from handoff import sim
producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
for stream, expected in ((consumer, 1.0), (-1, 0.0)):  # ordered, then the negative control
    x = sim.zeros(1024, "float32")
    sim.synchronize()
    sim.fill(x, 1.0, stream=producer, delay=0.3)
    seen = float(sim.to_numpy(handoff.from_dlpack(x, stream=stream), stream=consumer)[0])
    assert seen == expected, f"stream={stream!r}: read {seen}, expected {expected}"
    sim.synchronize()
print("ordered")
"""


def check(condition: bool, what: str) -> None:
    if not condition:
        sys.exit(f"check_wheel: FAILED: {what}")
    print(f"  ok  {what}")


def main() -> None:
    version = sys.argv[1]
    import numpy as np

    import handoff

    package = Path(handoff.__file__).parent
    check(str(package).startswith(sysconfig.get_paths()["purelib"]), f"handoff is the installed wheel ({package})")
    check(handoff.__version__ == version, f"handoff.__version__ is {version} (is {handoff.__version__})")

    a = np.arange(6.0).reshape(2, 3)
    h = handoff.from_dlpack(a)
    back = np.from_dlpack(h)
    check(back.ctypes.data == a.ctypes.data and (back == a).all(), "NumPy -> handoff -> NumPy, zero-copy")

    info = handoff.runtime_info()
    if info.get("cuda_runtime"):
        usable = info["backend"] == "cuda" or "driver" in info.get("backend_error", "")
        check(usable, f"the CUDA backend starts or says why not ({info['backend']}: {info.get('backend_error')})")
    else:
        print("  --  the wheel has no CUDA backend (built without the toolkit)")

    include = Path(handoff.get_include())
    check(
        (include / "handoff" / "pybind11.hpp").is_file(), f"handoff.get_include() has handoff/pybind11.hpp ({include})"
    )
    cmake = Path(handoff.get_cmake_dir())
    check((cmake / "handoff-config.cmake").is_file(), f"handoff.get_cmake_dir() has handoff-config.cmake ({cmake})")

    trace_cli = Path(sys.executable).with_name("handoff-trace")
    info_run = subprocess.run([str(trace_cli), "info"], capture_output=True, text=True, timeout=60, check=False)
    check(info_run.returncode == 0 and version in info_run.stdout, "handoff-trace info runs")

    env = {**os.environ, "HANDOFF_BACKEND": "sim"}
    run = subprocess.run(
        [sys.executable, "-c", ORDERED_HAND_OFF], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    check(run.returncode == 0 and run.stdout.strip() == "ordered", f"an ordered hand-off on the simulator {run.stderr}")
    print(f"check_wheel: handoff {version} from the wheel works")


if __name__ == "__main__":
    main()
