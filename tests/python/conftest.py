"""The suite's fixtures. What the test modules share besides fixtures is in support.py (the backend,
markers, helpers) and dlpack_ctypes.py (DLPack's structs)."""

from __future__ import annotations

import os

import pytest

# A GPU JAX would otherwise take most of the GPU's memory on first use, starving PyTorch and CuPy
# in the same process. Set before anything imports JAX.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# CUDA loads a kernel on its first launch by default (CUDA_MODULE_LOADING=LAZY), and loading one may
# wait for every kernel running on the device: a first launch behind a producer's spin would then be
# ordered after it (hiding the race a negative control must show), and a first launch onto a stream
# that a test holds by a gate would wait for the gate it is inside. The GPU suites need kernels loaded
# when their process makes its CUDA context (the variable is read then; processes started by a test
# inherit it).
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import handoff

from support import SIM, live_views, settle_sim


@pytest.fixture(autouse=True)
def no_violations():
    """Fails a test that leaves a use CUDA leaves undefined (a destroyed stream or event used, a
    runtime call from a host function) in the simulator's record. Sim backends only."""
    if not SIM:
        yield
        return
    from handoff import sim

    sim.clear_violations()
    yield
    found = sim.violations()
    sim.clear_violations()
    if found:
        pytest.fail("uses CUDA leaves undefined: " + "; ".join(found))


@pytest.fixture
def live():
    """Asserts that a test leaves no more live producers than it found.

    A full collection costs a tenth of a second once PyTorch is loaded, so it runs only when the
    count differs; it may then also free garbage older than the test, hence `<=`.
    """
    start = handoff.stats()["live_views"]
    yield start
    if handoff.stats()["live_views"] != start:
        assert live_views() <= start, "the test leaked handoff producers"


@pytest.fixture
def settled():
    """Like `live`, exact: collects garbage before and after, for tests that count producers. On the
    simulator, the deferred releases run first: an earlier test's, still waiting for their streams,
    would otherwise end during this one and change the count."""
    if SIM:
        settle_sim()
    start = live_views()
    yield start
    if SIM:
        settle_sim()
    assert live_views() == start, "the test leaked handoff producers"


@pytest.fixture(scope="session")
def torch():
    """PyTorch, or a skip where it is not installed."""
    return pytest.importorskip("torch")


@pytest.fixture
def sim_streams():
    """A producer and a consumer stream of the simulator (non-blocking), synchronized at the end."""
    from handoff import sim

    producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    yield producer, consumer
    sim.synchronize()
