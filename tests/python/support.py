"""What the suite runs on (the backend HANDOFF_BACKEND started, and its values), the markers that
skip what it cannot run, and the helpers the test modules share. Fixtures are in conftest.py."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import socket
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np
import pytest

import handoff

_INFO = handoff.runtime_info()
BACKEND = _INFO["backend"]
SIM = BACKEND.startswith("sim")  # the simulated device: sim (CUDA's rules) or sim-rocm (HIP's)
SIM_ROCM = BACKEND == "sim-rocm"
DEVICE_TYPE = 10 if SIM_ROCM else 2  # the backend's DLPack device type: kDLROCM, kDLCUDA
DEFAULT_STREAM = 0 if SIM_ROCM else 1  # the DLPack stream value naming the device's default stream
# Devices of the active backend: HANDOFF_SIM_DEVICES sets the simulator's (the suite runs with 1 and 2).
DEVICE_COUNT = _INFO["device_count"]
# The error of a wait, on the thread that holds a stream (sim.hold), for the work the hold holds: it
# would wait for ever. Inside a hold, a blocking call that raises it is one that waits for the producer.
HOLD_DEADLOCK = "handoffErrorHoldDeadlock"

# HANDOFF_BACKEND=auto without a usable CUDA device: CUDA data that needs ordering is refused with a
# DeviceError rather than exchanged unordered (HANDOFF_BACKEND=none exchanges it as it comes).
CUDA_ORDERING_REFUSED = BACKEND == "none" and os.environ.get("HANDOFF_BACKEND", "") in ("", "auto")

needs_sim = pytest.mark.skipif(not SIM, reason=f"needs HANDOFF_BACKEND=sim or sim-rocm (backend is {BACKEND!r})")
needs_two_devices = pytest.mark.skipif(
    DEVICE_COUNT < 2, reason=f"needs a second device (the backend has {DEVICE_COUNT}; see HANDOFF_SIM_DEVICES)"
)


def live_views() -> int:
    """Producers handoff keeps alive now, after collecting garbage."""
    gc.collect()
    return handoff.stats()["live_views"]


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter with extra environment variables."""
    environment = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=120, check=False
    )


def run_threads(worker, count: int) -> None:
    """Runs worker(0) to worker(count - 1), each on a thread of its own, all at once, and waits for
    them all to end."""
    threads = [threading.Thread(target=worker, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def assert_dl_device_refused(dl_device: object, error: type[BaseException]) -> None:
    """A CPU export asked to copy to `dl_device` (`__dlpack__(dl_device=...)`) raises `error`, which
    names dl_device."""
    array = handoff.from_dlpack(np.arange(3.0))
    with pytest.raises(error, match="dl_device"):
        array.__dlpack__(dl_device=dl_device, max_version=(1, 1))


@contextlib.contextmanager
def serving_child(script: str, runtime_dir: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """A process running `script`, which serves its trace (handoff.serve_trace), with XDG_RUNTIME_DIR
    at `runtime_dir`: (the process, the path of the socket it printed first). Killed at the block's
    end if it has not exited."""
    with subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)},
    ) as child:
        try:
            yield child, child.stdout.readline().strip()
        finally:
            if child.poll() is None:
                child.kill()


@contextlib.contextmanager
def attached_client(path: str) -> Iterator[tuple[dict, IO[str]]]:
    """A client of the trace socket at `path` that the server admitted: (the hello it sent, a reader
    of the lines it sends next, a JSON object each)."""
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(30)
        client.connect(path)
        with client.makefile("r") as reader:
            hello = json.loads(reader.readline())  # sent once the server has admitted the client
            assert hello.get("hello") == "handoff", hello
            yield hello, reader


def go_on(child: subprocess.Popen, steps: int = 1) -> None:
    """Writes `steps` lines to the stdin of a serving_child, each of which lets its script go on."""
    child.stdin.write("\n" * steps)
    child.stdin.flush()


@functools.cache
def cuda_is_usable() -> bool:
    """Whether the CUDA backend starts here (a driver and a device), asked of a fresh process so that
    the backend of this one does not matter."""
    code = "import handoff; i = handoff.runtime_info(); print(not i.get('backend_error') and i['device_count'] > 0)"
    result = run_python(code, HANDOFF_BACKEND="cuda")
    return result.returncode == 0 and result.stdout.strip() == "True"


def settle_sim() -> None:
    """Lets every deferred release of the simulator run: the releases wait for their streams, and
    the frees they enqueue for theirs."""
    from handoff import sim

    sim.synchronize()
    gc.collect()
    sim.drain()
    sim.synchronize()


def sim_leak_check() -> Iterator[None]:
    """The body of a sim suite's autouse fixture: fails the test that leaves more live producers or
    simulated allocations than it found. Faults and copy delays a test set are cleared first."""
    from handoff import sim

    sim.clear_faults()
    settle_sim()
    live = handoff.stats()["live_views"]
    allocations = sim.live_allocations()
    yield
    sim.clear_faults()
    sim.set_copy_delay(0.0)
    settle_sim()
    assert handoff.stats()["live_views"] == live, "a producer was leaked"
    assert sim.live_allocations() == allocations, "a device allocation was leaked"


def pending_write(stream: object, n: int = 4096) -> handoff.Array:
    """Simulator memory of `n` float32 zeros whose write of 1.0 is enqueued on `stream`: still pending
    while the caller holds `stream` (`with sim.hold(stream):`)."""
    from handoff import sim

    memory = sim.zeros(n, "float32")
    sim.fill(memory, 1.0, stream=stream)
    return memory


def waiting_read(view: handoff.Array, stream: object) -> object:
    """A read of `view` enqueued on `stream` inside a sim.hold block of its producer, asserted to wait
    for the hold (sim.waits_for_hold, a question of dependencies, not timing): a PendingCopy, whose
    result() is asked for once the block has ended."""
    from handoff import sim

    read = sim.to_numpy(view, stream=stream, wait=False)
    assert sim.waits_for_hold(stream), "the consumer's read does not wait for the held producer"
    return read


def behind(held: object, stream: object) -> None:
    """Makes `stream`, as the calling thread names it, wait for the work enqueued so far on `held`
    (an ordered import of data written there), so that a hold of `held` holds `stream`'s later work
    too: for a per-thread default stream, which only its own thread can name, and so hold."""
    from handoff import sim

    marker = sim.zeros(1)
    sim.fill(marker, 0.0, stream=held)
    handoff.from_dlpack(marker, stream=stream)


class DlpackOnly:
    """Forwards the DLPack protocol only, recording the keyword arguments of each `__dlpack__` call:
    a consumer goes through `__dlpack__`, not through a producer's DLPack C exchange API."""

    def __init__(self, array: object) -> None:
        self.array = array
        self.calls: list[dict] = []

    def __dlpack__(self, **kwargs):
        self.calls.append(kwargs)
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def cuda_core_module() -> types.ModuleType:
    """cuda.core's public module, whichever of its layouts is installed (older releases kept the API
    in cuda.core.experimental); skips the test where cuda.core is not installed."""
    core = pytest.importorskip("cuda.core")
    return core if hasattr(core, "Device") else pytest.importorskip("cuda.core.experimental")
