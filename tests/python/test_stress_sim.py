"""A bounded-time stress test of stream ordering on the simulated device: random producer and
consumer streams (blocking, non-blocking, the default streams) on every device, random write
delays, copies, chains of hops through several streams by every exchange path, views dropped in
random order, from two threads at once. Every consumer must read the producer's final value; a
negative control with no ordering (stream=-1) must read stale data. The same with device faults
armed at random: every round either fails with a DeviceError or reads the final value, and every
producer is released exactly once.

HANDOFF_STRESS_SECONDS sets the time of the ordered run (default 8 s; the negative control stops
as soon as it has seen stale data). HANDOFF_STRESS_SEED replays a run: the seed is printed, and
named in every failure.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time

import numpy as np
import pytest

import handoff

from support import BACKEND, DEFAULT_STREAM, DEVICE_COUNT, SIM_ROCM, needs_sim, run_threads, sim_leak_check

pytestmark = needs_sim
if BACKEND.startswith("sim"):
    from handoff import sim

PER_THREAD_STREAM = None if SIM_ROCM else 2  # ROCm's per-thread default stream has no DLPack value
SECONDS = float(os.environ.get("HANDOFF_STRESS_SECONDS", "8"))
THREADS = 2
N = 2048
MAX_DELAY = 0.02  # seconds a producer write may take
# Every write puts a value no earlier write put: memory reused by a new allocation may still hold an
# old value, which would make a read of unwritten memory look right.
VALUES = itertools.count(start=1)
VALUES_LOCK = threading.Lock()


def next_value() -> float:
    with VALUES_LOCK:
        return float(next(VALUES))


@pytest.fixture(scope="module")
def seed():
    value = int(os.environ.get("HANDOFF_STRESS_SEED", random.randrange(2**32)))
    print(f"HANDOFF_STRESS_SEED={value}")
    return value


@pytest.fixture(autouse=True)
def no_leaks():
    yield from sim_leak_check()


class CaiHolder:
    """A producer that speaks the CUDA Array Interface only, as numba-cuda 0.30's device arrays do
    (they have no __dlpack__); the interface is handoff's own."""

    def __init__(self, view):
        self.view = view  # keeps the memory alive
        self.__cuda_array_interface__ = view.__cuda_array_interface__


class Streams:
    """One thread's streams on every device: blocking and non-blocking ones it made, and the
    default streams, named by their DLPack values (they name the default streams of the device of
    the data they are used with)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.made = {
            device: [sim.Stream(device), sim.Stream(device, non_blocking=True), sim.Stream(device, non_blocking=True)]
            for device in range(DEVICE_COUNT)
        }

    def pick(self, device: int):
        defaults = [DEFAULT_STREAM] + ([PER_THREAD_STREAM] if PER_THREAD_STREAM else [])
        return self.rng.choice(self.made[device] + defaults)


def value_of(stream) -> int:
    """The DLPack stream value a producer's __dlpack__ takes for `stream`."""
    return stream if isinstance(stream, int) else stream.handle


def hop(rng: random.Random, source, consumer, *, ordered: bool, log: list):
    """Passes `source` on to `consumer` by a random exchange path, `copy=True` now and then."""
    stream = consumer if ordered else -1
    copy = True if rng.random() < 0.15 else None
    paths = (
        ["from_dlpack", "asarray", "__dlpack__"] + (["block"] if ordered else []) + (["cai"] if not SIM_ROCM else [])
    )
    path = rng.choice(paths)
    log.append(f"{path}(stream={value_of(stream):#x}{', copy' if copy else ''})")
    if path == "from_dlpack":
        return handoff.from_dlpack(source, stream=stream, copy=copy)
    if path == "asarray":
        return handoff.asarray(source, stream=stream, copy=copy)
    if path == "__dlpack__":
        capsule = source.__dlpack__(stream=value_of(stream), max_version=(1, 1), copy=copy)
        return handoff.from_dlpack(capsule, stream=stream)
    if path == "block":  # an int names a default stream by its handle, which is its DLPack value
        with handoff.stream(consumer):
            return handoff.from_dlpack(source, copy=copy)
    return handoff.asarray(CaiHolder(source), stream=stream)  # the interface has no copy


def one_round(rng: random.Random, streams: Streams, *, ordered: bool) -> tuple[bool, str]:
    """A producer writes (maybe twice) and a chain of consumers passes the data on; True when every
    consumer read checked the final value. The description says what was done."""
    device = rng.randrange(DEVICE_COUNT)
    producer = streams.pick(device)
    views = [sim.zeros(N, "float32", device)]
    value = next_value()
    log = [f"device {device}, producer {value_of(producer):#x}"]
    if rng.random() < 0.3:  # an earlier write the final one must follow on the same stream
        sim.fill(views[0], value - 0.5, stream=producer, delay=rng.uniform(0, MAX_DELAY))
    delay = rng.uniform(0, MAX_DELAY)
    sim.fill(views[0], value, stream=producer, delay=delay)
    log.append(f"fill {value} after {delay * 1000:.1f} ms")
    consumers = [None]
    for _ in range(rng.randint(1, 4)):
        consumers.append(streams.pick(device))
        views.append(hop(rng, views[-1], consumers[-1], ordered=ordered, log=log))
    # The last consumer reads; in the ordered run, some earlier ones too. Views are dropped in random
    # order, some before the reads: each keeps what it needs alive, and releases wait for the streams
    # that used them. `views` holds the only references.
    last = len(views) - 1
    readers = [last] + (rng.sample(range(1, last), rng.randint(0, last - 1)) if ordered else [])
    rng.shuffle(readers)
    others = [i for i in range(len(views)) if i not in readers]
    rng.shuffle(others)
    for i in others[: rng.randint(0, len(others))]:
        views[i] = None
    fresh = True
    for i in readers:
        fresh &= bool(np.all(sim.to_numpy(views[i], stream=consumers[i]) == value))
    order = list(range(len(views)))
    rng.shuffle(order)
    for i in order:
        views[i] = None
    return fresh, "; ".join(log)


# Device calls a fault may hit during a round: each must fail the call that made it (a DeviceError),
# never leave a consumer unordered, release a producer early or twice, or leak one. Not here: making
# a device current (push_current_device), whose failure means a broken context: a device copy
# released then keeps its memory rather than free it on the wrong device (logged).
FAULTABLE = [
    "record_event",
    "stream_wait_event",
    "create_event",
    "launch_host_func",
    "copy_async",
    "attributes",
    "stream_capture_status",
    "stream_device",
    "stream_is_blocking",
    "allocate",
    "enqueue_fill",
    "synchronize_stream",
]


def run_for(
    seconds: float, rng: random.Random, *, ordered: bool, stop_when_stale: bool = False, faults: bool = False
) -> dict:
    """Rounds until the time is up: how many, and the descriptions of those that read stale data.
    With `faults`, a device fault is armed at random before a round; a round that a fault fails
    (DeviceError) is counted, its views dropped."""
    streams = Streams(rng)
    outcome = {"rounds": 0, "stale": [], "faulted": 0}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if faults and rng.random() < 0.5:
            sim.inject_fault(rng.choice(FAULTABLE), 1, "cudaErrorLaunchFailure")
        try:
            fresh, description = one_round(rng, streams, ordered=ordered)
        except handoff.DeviceError:
            outcome["faulted"] += 1
            continue
        finally:
            if faults:
                sim.clear_faults()
        outcome["rounds"] += 1
        if not fresh:
            outcome["stale"].append(description)
            if stop_when_stale:
                break
    sim.synchronize()  # the streams go with this function: their work first
    return outcome


def run_in_threads(seed: int, rounds_of) -> list[dict]:
    """The outcomes of rounds_of(index) run on THREADS threads at once; once all have ended, the
    first failure is raised with the seed that replays it."""
    outcomes, errors = [None] * THREADS, []

    def worker(index: int) -> None:
        try:
            outcomes[index] = rounds_of(index)
        except BaseException as error:  # noqa: BLE001 - reported below, with the seed
            errors.append(error)

    run_threads(worker, THREADS)
    if errors:
        raise AssertionError(f"HANDOFF_STRESS_SEED={seed}: a thread failed") from errors[0]
    return outcomes


def test_every_consumer_reads_the_final_value(seed):
    sim.set_copy_delay(random.Random(seed).choice([0.0, 0.0005, 0.002]))
    outcomes = run_in_threads(seed, lambda index: run_for(SECONDS, random.Random(seed + index), ordered=True))
    stale = [description for outcome in outcomes for description in outcome["stale"]]
    rounds = sum(outcome["rounds"] for outcome in outcomes)
    assert not stale, f"HANDOFF_STRESS_SEED={seed}: {len(stale)} of {rounds} rounds read stale data, first: {stale[0]}"
    assert rounds >= 10 * THREADS, f"only {rounds} rounds ran"


def test_faults_armed_at_random_fail_calls_and_lose_nothing(seed):
    # Every round either fails with a DeviceError or reads the final value; afterwards every
    # producer has been released exactly once (no_leaks), and no call used a destroyed handle.
    try:
        outcomes = run_in_threads(
            seed, lambda index: run_for(SECONDS, random.Random(seed + 100 + index), ordered=True, faults=index == 0)
        )
    finally:
        sim.clear_faults()
    stale = [description for outcome in outcomes for description in outcome["stale"]]
    rounds = sum(outcome["rounds"] for outcome in outcomes)
    faulted = sum(outcome["faulted"] for outcome in outcomes)
    assert not stale, f"HANDOFF_STRESS_SEED={seed}: {len(stale)} of {rounds} rounds read stale data, first: {stale[0]}"
    assert faulted > 0, f"HANDOFF_STRESS_SEED={seed}: no fault hit any of {rounds} rounds"


def test_negative_control_with_no_ordering_reads_stale_data(seed):
    # The same rounds with stream=-1 everywhere: without ordering, some consumer reads before the
    # producer's write lands. Otherwise the test above would prove nothing.
    outcome = run_for(max(SECONDS / 2, 3.0), random.Random(seed + THREADS), ordered=False, stop_when_stale=True)
    assert outcome["stale"], f"HANDOFF_STRESS_SEED={seed}: {outcome['rounds']} unordered rounds all read fresh data"
