"""The hand-off across processes (handoff.ipc): two processes of one node, on the simulator (and
host memory on any backend). The other process is an ipc_agent driven through pipes: a test waits
for its answers, never for time. Races are held with the simulator's gate, in the process whose
stream must not get there yet."""

from __future__ import annotations

import json
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import handoff
from handoff import ipc

from support import BACKEND, SIM, SIM_ROCM, needs_sim, needs_two_devices, run_python

AGENT = Path(__file__).with_name("ipc_agent.py")
# How long a test waits for another process's answer, or for a release that must come: a bound on a
# wait for an event, not a delay that orders anything.
DEADLINE = 60.0


class Agent:
    """Another process of this node, on this test's backend (HANDOFF_BACKEND and its settings)."""

    def __init__(self, **env: str) -> None:
        environment = {**os.environ, **env}
        self.process = subprocess.Popen(
            [sys.executable, str(AGENT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=environment,
        )
        assert self._answer() == "ready"

    def _answer(self):
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the agent ended (status {self.process.wait()})")
        answer = json.loads(line)
        if "error" in answer:
            raise AgentError(answer["error"], answer["message"])
        return answer["ok"]

    def run(self, code: str):
        """Runs `code` there; returns its `result`, or raises AgentError with what it raised."""
        self.process.stdin.write(json.dumps(code) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            self.process.wait(timeout=DEADLINE)
        for pipe in (self.process.stdin, self.process.stdout):
            if not pipe.closed:
                pipe.close()


class AgentError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@pytest.fixture
def agent():
    made = Agent()
    yield made
    made.close()


def wait_until(condition, what: str) -> None:
    """Looks at the producer's consumers until `condition()` holds (an asynchronous release)."""
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        ipc._poll()


def reforge(data: bytes, at: int, replacement: bytes) -> bytes:
    """A handle with `replacement` at byte `at`, its checksum made to match (a forger's work)."""
    body = bytearray(data[:-8])
    body[at : at + len(replacement)] = replacement
    checksum = 0xCBF29CE484222325
    for byte in body:
        checksum = ((checksum ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return bytes(body) + struct.pack("<Q", checksum)


# --- handles ------------------------------------------------------------------------------------


def test_a_handle_is_small_and_any_pickler_carries_it():
    handle = ipc.share(np.arange(6, dtype=np.int32).reshape(2, 3))
    data = bytes(handle)
    assert len(data) < 1024
    copied = pickle.loads(pickle.dumps(handle))
    assert copied == handle and copied.shape == (2, 3) and copied.dtype == "int32"
    assert copied.producer_pid == os.getpid()
    assert "host memory" in repr(handle)


def test_open_refuses_what_is_not_a_handle():
    with pytest.raises(TypeError, match=r"expects a handoff\.ipc\.Handle"):
        ipc.open(b"not a handle")
    with pytest.raises(ValueError, match="not a handoff IPC handle"):
        ipc.Handle(b"\x00" * 64)


def test_a_corrupted_or_forged_handle_is_refused():
    data = bytes(ipc.share(np.ones(4)))
    with pytest.raises(ValueError, match="corrupted or forged"):
        ipc.Handle(data[:40] + bytes([data[40] ^ 1]) + data[41:])


def test_a_forged_handle_whose_array_lies_outside_its_memory_is_refused():
    # Opened, it would be a view past the shared memory's end: a crash at the first read.
    data = bytes(ipc.share(np.ones(4)))
    shape_at = (
        120  # after the fixed fields, the backend's name, the device and its UUID, the dtype and the dimension count
    )
    assert struct.unpack_from("<Iqq", data, shape_at - 4) == (1, 4, 1)
    for shape, stride in ((1 << 24, 1), (4, -1), (5, 1)):
        forged = reforge(data, shape_at, struct.pack("<qq", shape, stride))
        with pytest.raises(ValueError, match="does not lie inside the 32 bytes it shares"):
            ipc.Handle(forged)
    float24 = reforge(data, shape_at - 8, struct.pack("<BBH", 2, 24, 1))  # the dtype: code, bits, lanes
    with pytest.raises(ValueError, match="corrupted or forged"):
        ipc.Handle(float24)


def test_a_handle_of_another_boot_or_node_is_refused(agent):
    data = bytes(ipc.share(np.ones(4)))
    foreign = reforge(data, 16, b"\x5a" * 16)  # the boot id follows the magic, version and flags
    with pytest.raises(AgentError, match="another node"):
        agent.run(f"ipc.open(ipc.Handle({foreign!r}))")


def test_a_process_cannot_open_its_own_handle():
    handle = ipc.share(np.ones(4))
    with pytest.raises(BufferError, match="this very process"):
        ipc.open(handle)


def test_plain_pickle_still_refuses_an_array():
    with pytest.raises(TypeError, match="cannot pickle"):
        pickle.dumps(handoff.asarray(np.ones(3)))


# --- host memory (any backend) ----------------------------------------------------------------------


def test_host_memory_is_copied_once_into_shared_memory(agent):
    source = np.arange(12, dtype=np.float64).reshape(3, 4)
    handle = ipc.share(source)
    source[:] = -1  # the share copied the data once: later writes here are not seen
    assert agent.run(f"a = ipc.open(ipc.Handle({bytes(handle)!r})); result = numpy.asarray(a).tolist()") == (
        np.arange(12, dtype=np.float64).reshape(3, 4).tolist()
    )
    assert agent.run("result = a.device") == [1, 0]
    with pytest.raises(BufferError, match="copy=False"):
        ipc.share(source, copy=False)


def test_a_share_and_its_opens_are_traced_as_exchanges(agent):
    # They were not in the trace at all: a job's hand-offs between processes went unseen.
    source = np.arange(6, dtype=np.float32)
    with handoff.trace() as t:
        handle = ipc.share(source)
    (shared,) = [e for e in t.events if e["protocol"] == "ipc"]  # beside the release of its import
    assert [shared[key] for key in ("kind", "protocol", "consumer", "device", "shape", "action")] == [
        "export", "ipc", "ipc", (1, 0), [6], "none"
    ]  # fmt: skip
    opened = agent.run(
        f"h = ipc.Handle({bytes(handle)!r})\n"
        "with handoff.trace() as t:\n    a = ipc.open(h)\n"
        "result = [[e[k] for k in ('kind', 'protocol', 'producer', 'consumer', 'shape', 'action')] for e in t.events]"
    )
    assert opened == [["import", "ipc", "ipc", "handoff", [6], "none"]]
    agent.run("del a")


@needs_sim
def test_a_device_share_is_traced_with_its_stream_and_each_open_with_its_wait_or_none(agent):
    from handoff import sim

    producer = sim.Stream(non_blocking=True)
    a = sim.zeros(64, "float32")
    sim.fill(a, 2.0, stream=producer)
    with handoff.trace() as t:
        handle = ipc.share(a, stream=producer)
    (shared,) = [e for e in t.events if e["protocol"] == "ipc"]
    assert (shared["kind"], shared["producer_stream"]) == ("export", producer.handle)
    # The ready stream's own wait for the array's (elided here: the same stream) is no hand-over.
    assert (shared["action"], shared["consumer_stream"]) == ("none", None)
    refused = 2 if handoff.runtime_info()["backend"] == "sim-rocm" else 0
    opens = agent.run(
        f"from handoff import sim; h = ipc.Handle({bytes(handle)!r}); consumer = sim.Stream(non_blocking=True)\n"
        "with handoff.trace() as t:\n"
        "    ordered = ipc.open(h, stream=consumer)\n"
        "    unordered = ipc.open(h, stream=-1)\n"
        f"    try:\n        ipc.open(h, stream={refused})\n    except ValueError:\n        pass\n"
        "result = [[e['action'], e['consumer_stream'] == consumer.handle, e['hazard']] for e in t.events]"
    )
    assert opens == [["wait", True, None], ["unordered", False, None], ["refused", False, None]]
    agent.run("del ordered, unordered")
    sim.synchronize()


def test_the_producer_keeps_host_memory_until_the_consumer_released_it(agent):
    handle = ipc.share(np.full(8, 3.0))
    agent.run(f"a = ipc.open(ipc.Handle({bytes(handle)!r}))")
    del handle  # the producer's own hold goes: the consumer's open still holds the share
    ipc._poll()
    assert handoff.stats()["ipc_pending_remote_releases"] >= 1
    assert agent.run("result = float(numpy.asarray(a).sum())") == 24.0
    agent.run("del a")
    wait_until(
        lambda: handoff.stats()["ipc_pending_remote_releases"] == 0, "the consumer's release reached the producer"
    )


def test_a_process_takes_one_place_in_a_share_however_often_it_opens_it_and_a_ninth_process_is_refused(agent):
    handle = ipc.share(np.arange(4.0))
    opening = f"h = ipc.Handle({bytes(handle)!r}); opened = [ipc.open(h) for _ in range(20)]"
    agent.run(opening)  # one place, held until the last of the twenty goes
    others = [Agent() for _ in range(7)]
    try:
        for other in others:
            other.run(opening)
        ninth = Agent()
        with pytest.raises(AgentError, match="open in 8 processes already") as error:
            ninth.run(opening)
        assert error.value.kind == "BufferError"
        ninth.close()
        assert agent.run("result = float(sum(numpy.from_dlpack(a).sum() for a in opened))") == 120.0
    finally:
        for other in others:
            other.close()
    agent.run("del opened")


def test_a_process_that_opens_and_releases_one_share_again_and_again_keeps_one_place(agent):
    producer = Agent()
    try:
        data = producer.run("h = ipc.share(numpy.arange(4.0)); result = list(bytes(h))")
        # Stopped, the producer sees none of the releases below: each open must take back the place
        # its process released, not a ninth one.
        producer.process.send_signal(signal.SIGSTOP)
        try:
            reopened = agent.run(
                f"h = ipc.Handle({bytes(data)!r})\n"
                "result = 0.0\n"
                "for _ in range(24):\n"
                "    a = ipc.open(h); result += float(numpy.asarray(a).sum()); del a"
            )
        finally:
            producer.process.send_signal(signal.SIGCONT)
        assert reopened == 24 * 6.0
        pending = "ipc._poll(); result = handoff.stats()['ipc_pending_remote_releases']"
        assert producer.run(pending) == 0, "the one place is counted out once the producer looks"
        assert agent.run("a = ipc.open(h); result = float(numpy.asarray(a).sum())") == 6.0
        agent.run("del a")
    finally:
        producer.close()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_a_consumer_lets_go_of_an_ended_producers_control_block_once_nothing_opened_from_it_is_held(agent):
    producer = Agent()
    pid = producer.run("import os; result = os.getpid()")
    data = producer.run("a = numpy.arange(4.0); h = ipc.share(a); result = list(bytes(h))")
    live = ipc.share(np.zeros(2))
    agent.run(f"b = ipc.open(ipc.Handle({bytes(data)!r})); live = ipc.Handle({bytes(live)!r}); import time")
    producer.close()  # ended, while the consumer holds what it opened
    # An open asks about ended producers, at most every 50 ms: each waits that long first.
    mapped_after_an_open = f"time.sleep(0.06); ipc.open(live); result = sum(f'handoff-ipc.{pid}.' in line for line in open('/proc/self/maps'))"
    assert agent.run(mapped_after_an_open) == 1, "kept while an array opened from it is held"
    assert agent.run("result = float(numpy.from_dlpack(b).sum())") == 6.0
    agent.run("del b")
    assert agent.run(mapped_after_an_open) == 0, "let go of once nothing opened from it is held"


@needs_sim
@needs_two_devices
def test_a_handle_of_a_device_the_consumer_does_not_have_is_a_value_error_naming_it():
    from handoff import sim

    handle = ipc.share(sim.zeros(4, device=1))
    one_device = Agent(HANDOFF_SIM_DEVICES="1")
    try:
        with pytest.raises(
            AgentError, match=r"memory of GPU-68616e64-6f66-662d-7369-6d0000000001 \(device 1 of process"
        ) as error:
            one_device.run(f"ipc.open(ipc.Handle({bytes(handle)!r}))")
        assert error.value.kind == "ValueError"
        assert "it sees GPU-68616e64-6f66-662d-7369-6d0000000000 (do the two" in error.value.args[0]
    finally:
        one_device.close()


@needs_sim
@needs_two_devices
def test_a_process_that_numbers_the_devices_otherwise_opens_the_memory_on_the_device_it_is_on():
    from handoff import sim

    on_second = sim.zeros(4, device=1)
    stream = sim.Stream(1)
    sim.fill(on_second, 7.0, stream=stream)
    handle = ipc.share(on_second, stream=stream)
    # The node's devices listed the other way round, as CUDA_VISIBLE_DEVICES=1,0 lists them: the
    # memory is on this process's device 0. Opened on its device 1 (the producer's ordinal), the
    # simulator refuses it, as CUDA without peer access does.
    swapped = Agent(HANDOFF_SIM_VISIBLE_DEVICES="1,0")
    try:
        opened = (
            "from handoff import sim; on = sim.Stream(0)\n"
            f"a = ipc.open(ipc.Handle({bytes(handle)!r}), stream=on)\n"
            "result = [a.device, sim.to_numpy(a, stream=on).tolist()]"
        )
        assert swapped.run(opened) == [[on_second.device[0], 0], [7.0] * 4]
        swapped.run("del a")
    finally:
        swapped.close()


def test_a_released_share_cannot_be_opened(agent):
    handle = ipc.share(np.ones(4))
    data = bytes(handle)
    del handle
    with pytest.raises(AgentError, match="released the share") as refused:
        agent.run(f"ipc.open(ipc.Handle({data!r}))")
    assert refused.value.kind == "BufferError"


def test_a_handle_whose_producer_exited_is_refused(agent):
    producer = Agent()
    data = producer.run("h = ipc.share(numpy.ones(4)); result = list(bytes(h))")
    producer.close()
    with pytest.raises(AgentError, match="has ended") as refused:
        agent.run(f"ipc.open(ipc.Handle({bytes(data)!r}))")
    assert refused.value.kind == "BufferError"


def test_a_consumer_killed_holding_an_array_is_noticed(agent):
    handle = ipc.share(np.ones(1024))
    agent.run(f"a = ipc.open(ipc.Handle({bytes(handle)!r}))")
    del handle
    ipc._poll()
    assert handoff.stats()["ipc_pending_remote_releases"] >= 1
    agent.kill()
    wait_until(lambda: handoff.stats()["ipc_pending_remote_releases"] == 0, "the killed consumer's hold released")


FORKED = """
import gc, os, subprocess, sys
import numpy as np
from handoff import ipc

OPEN = "import sys, numpy as np; from handoff import ipc; print(np.from_dlpack(ipc.open(ipc.Handle(bytes.fromhex(sys.argv[1])))).tolist())"
def opened(handle):  # read by another process
    return subprocess.run([sys.executable, "-c", OPEN, bytes(handle).hex()], capture_output=True, text=True).stdout.strip()

parents = ipc.share(np.arange(4.0))
handles, go = os.pipe(), os.pipe()
child = os.fork()
if child == 0:  # drops its copy of the parent's handle, shares its own array, and exits as a program does
    del parents
    gc.collect()
    mine = ipc.share(np.full(3, 7.0))
    os.write(handles[1], bytes(mine).hex().encode() + b"\\n")
    os.read(go[0], 1)
    sys.exit(0)
childs = ipc.Handle(bytes.fromhex(os.fdopen(handles[0]).readline().strip()))
print(opened(childs))
os.write(go[1], b"x")
os.waitpid(child, 0)
print(opened(parents))
"""


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_leaves_its_parents_shares_alone_and_shares_its_own():
    result = run_python(FORKED)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[7.0, 7.0, 7.0]", "[0.0, 1.0, 2.0, 3.0]"], result.stderr


def test_an_array_through_a_multiprocessing_queue_arrives_as_an_array():
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Pool(1) as pool:
        source = handoff.asarray(np.arange(10, dtype=np.int64))
        assert pool.apply(_sum_of_received, (source,)) == 45
        del source


def _sum_of_received(array):
    assert type(array).__name__ == "Array"
    return int(np.asarray(array).sum())


# --- device memory on the simulator -------------------------------------------------------------


@needs_sim
def test_the_consumer_stream_waits_for_the_producer_and_reads_the_finished_data(agent):
    from handoff import sim

    producer = sim.Stream(non_blocking=True)
    a = sim.zeros(256, "float32")
    with sim.hold(producer):
        sim.fill(a, 7.0, stream=producer)  # held: the data is not written yet
        handle = ipc.share(a)
        assert agent.run(
            f"from handoff import sim; consumer = sim.Stream(non_blocking=True); other = sim.Stream(non_blocking=True)\n"
            f"b = ipc.open(ipc.Handle({bytes(handle)!r}), stream=consumer)\n"
            "waiting = sim.to_numpy(b, stream=consumer, wait=False)\n"
            # The negative control: a stream that did not wait reads what is there now.
            "result = [float(sim.to_numpy(b, stream=other)[0]), waiting.done()]"
        ) == [0.0, False]
        assert agent.run("result = float(sim.to_numpy(b, stream=other).max())") == 0.0
    assert agent.run("result = float(waiting.result().min())") == 7.0
    agent.run("del b, waiting")


@needs_sim
@pytest.mark.parametrize("named", ["default-stream", "another-stream"])
def test_a_share_on_a_stream_named_is_ready_after_the_stream_the_array_is_known_to_be_ready_on_too(agent, named):
    from handoff import sim

    producer = sim.Stream(non_blocking=True)
    before = sim.live_allocations()
    a = sim.zeros(256, "float32")
    default = 0 if handoff.runtime_info()["backend"] == "sim-rocm" else 1
    with sim.hold(producer):
        sim.fill(a, 7.0, stream=producer)  # the array's own stream, held: not written yet
        stream = default if named == "default-stream" else sim.Stream(non_blocking=True)
        handle = ipc.share(a, stream=stream)
        assert (
            agent.run(
                "from handoff import sim; consumer = sim.Stream(non_blocking=True)\n"
                f"b = ipc.open(ipc.Handle({bytes(handle)!r}), stream=consumer)\n"
                "waiting = sim.to_numpy(b, stream=consumer, wait=False)\n"
                "result = waiting.done()"
            )
            is False
        ), "the consumer waits for the held write, not only for the stream named"
    assert agent.run("result = float(waiting.result().min())") == 7.0
    agent.run("del b, waiting")
    del a, handle  # released here before the next test counts this process's allocations
    wait_until(lambda: sim.live_allocations() == before, "the share released")


@needs_sim
def test_a_consumer_that_orders_its_work_itself_opens_without_a_wait_and_a_refused_stream_maps_nothing(agent):
    from handoff import sim

    before = sim.live_allocations()
    a = sim.zeros(64, "float32")
    sim.fill(a, 3.0, stream=sim.Stream(non_blocking=True))
    sim.synchronize()
    handle = ipc.share(a)
    refused = 2 if handoff.runtime_info()["backend"] == "sim-rocm" else 0  # the stream table's ValueError
    agent.run(f"h = ipc.Handle({bytes(handle)!r}); from handoff import sim")
    with pytest.raises(AgentError, match=f"stream={refused}") as error:
        agent.run(f"ipc.open(h, stream={refused})")
    assert error.value.kind == "ValueError"
    assert agent.run("result = handoff.stats()['ipc_mappings_cached']") == 0, "nothing left mapped"
    waits = agent.run("result = handoff.stats()['waits_inserted']")
    read = agent.run(
        "b = ipc.open(h, stream=-1)\nresult = [float(sim.to_numpy(b, stream=sim.Stream()).min()), "
        "handoff.stats()['waits_inserted'], handoff.stats()['ipc_mappings_cached']]"
    )
    assert read == [3.0, waits, 1], "no wait inserted: stream=-1 orders its work itself"
    assert agent.run("del b\nresult = handoff.stats()['ipc_mappings_cached']") == 0, "released with the array"
    del a, handle
    wait_until(lambda: sim.live_allocations() == before, "the share released")


@needs_sim
def test_every_share_is_waited_for_not_only_the_first(agent):
    from handoff import sim

    producer = sim.Stream(non_blocking=True)
    a = sim.zeros(64, "float32")
    first = ipc.share(a)
    agent.run(
        "from handoff import sim; consumer = sim.Stream(non_blocking=True)\n"
        f"first = ipc.open(ipc.Handle({bytes(first)!r}), stream=consumer)"
    )
    with sim.hold(producer):
        sim.fill(a, 9.0, stream=producer)
        second = ipc.share(a)  # the same allocation: its mapping is cached there
        mappings = agent.run(
            f"second = ipc.open(ipc.Handle({bytes(second)!r}), stream=consumer)\n"
            "pending = sim.to_numpy(second, stream=consumer, wait=False)\n"
            "result = handoff.stats()['ipc_mappings_cached']"
        )
        assert mappings == 1
        assert agent.run("result = pending.done()") is False
    assert agent.run("result = float(pending.result().min())") == 9.0
    agent.run("del first, second, pending")


@needs_sim
@pytest.mark.parametrize("back_signal", [True, pytest.param(False, marks=pytest.mark.negative_control)])
def test_the_producer_releases_only_after_the_consumer_stream_is_done(agent, back_signal):
    from handoff import sim

    a = sim.zeros(1 << 12, "float32")
    handle = ipc.share(a)
    before = sim.live_allocations()
    agent.run(
        "from handoff import sim, _handoff\n"
        f"_handoff._ipc._set_back_signal({back_signal})\n"
        "consumer = sim.Stream(non_blocking=True)\n"
        f"b = ipc.open(ipc.Handle({bytes(handle)!r}), stream=consumer)\n"
        "gate = sim.hold(consumer); gate.__enter__()\n"
        "reading = sim.to_numpy(b, stream=consumer, wait=False)\n"
        "del b"  # released while its stream still has a read of it queued (held)
    )
    del a, handle
    for _ in range(5):
        ipc._poll()
    released_early = sim.live_allocations() < before
    assert released_early is (not back_signal)
    agent.run("gate.__exit__(None, None, None); reading.result()")
    wait_until(lambda: sim.live_allocations() < before, "the producer's memory released")


@needs_sim
def test_a_producer_that_dies_leaves_the_opened_array_readable(agent):
    producer = Agent()
    data = producer.run(
        "from handoff import sim; a = sim.zeros(32, 'float32'); s = sim.Stream(non_blocking=True)\n"
        "sim.fill(a, 5.0, stream=s); h = ipc.share(a); result = list(bytes(h))"
    )
    agent.run(
        "from handoff import sim; consumer = sim.Stream(non_blocking=True)\n"
        f"b = ipc.open(ipc.Handle({bytes(data)!r}), stream=consumer)\n"
        "result = float(sim.to_numpy(b, stream=consumer).min())"
    )
    producer.kill()
    assert agent.run("result = float(sim.to_numpy(b, stream=consumer).min())") == 5.0
    agent.run("del b")


@needs_sim
def test_memory_that_was_freed_cannot_be_opened(agent):
    from handoff import sim

    a = sim.zeros(16, "float32")
    handle = ipc.share(a)
    data = bytes(handle)
    del a, handle  # no consumer holds it: released at once
    with pytest.raises(AgentError, match="released the share") as refused:
        agent.run(f"ipc.open(ipc.Handle({data!r}))")
    assert refused.value.kind == "BufferError"


@needs_sim
def test_an_empty_device_array_with_no_memory_is_refused_saying_so():
    from handoff import sim

    device = sim.zeros(4).device
    with pytest.raises(BufferError, match="empty device array with no memory"):
        ipc.share(handoff.view(0, (0,), "float32", device=device))


@needs_sim
def test_pinned_and_managed_memory_are_refused_clearly():
    from handoff import sim

    for memory in ("pinned", "managed") if not SIM_ROCM else ("pinned",):  # ROCm has no managed DLPack type
        with pytest.raises(BufferError, match="cannot be shared between processes"):
            ipc.share(sim.zeros(4, memory=memory))


@pytest.fixture
def value_ordered():
    """A producer whose shares are ordered by stream memory operations (HANDOFF_IPC_SYNC=value, as
    where interprocess events cannot be made), and a consumer."""
    producer, consumer = Agent(HANDOFF_IPC_SYNC="value"), Agent()
    yield producer, consumer
    producer.close()
    consumer.close()


@needs_sim
def test_stream_memory_operations_order_where_events_cannot_be_made(value_ordered):
    producer, consumer = value_ordered
    data = producer.run(
        "from handoff import sim; s = sim.Stream(non_blocking=True); a = sim.zeros(64, 'float32')\n"
        "gate = sim.hold(s); gate.__enter__(); sim.fill(a, 4.0, stream=s); h = ipc.share(a)\n"
        "result = list(bytes(h))"
    )
    assert (
        consumer.run(
            "from handoff import sim; c = sim.Stream(non_blocking=True)\n"
            f"b = ipc.open(ipc.Handle({bytes(data)!r}), stream=c)\n"
            "pending = sim.to_numpy(b, stream=c, wait=False); result = pending.done()"
        )
        is False
    )
    producer.run("gate.__exit__(None, None, None)")
    assert consumer.run("result = float(pending.result().min())") == 4.0
    consumer.run("del b, pending")


@needs_sim
def test_a_slot_ordered_by_a_value_is_not_reused_before_its_value_is_written(value_ordered):
    # Released at once, the first share's slot would go to the second, whose value the first's held
    # write would then lower: the second's consumer would wait forever.
    producer, consumer = value_ordered
    data = producer.run(
        "from handoff import sim; s1, s2 = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)\n"
        "x, y = sim.zeros(64, 'float32'), sim.zeros(64, 'float32')\n"
        "gate = sim.hold(s1); gate.__enter__(); sim.fill(x, 1.0, stream=s1); first = ipc.share(x); del first\n"
        "sim.fill(y, 2.0, stream=s2); second = ipc.share(y)\n"
        "result = list(bytes(second))"
    )
    producer.run("gate.__exit__(None, None, None); sim.synchronize()")  # the first's value is written now
    assert (
        consumer.run(
            "from handoff import sim; c = sim.Stream(non_blocking=True)\n"
            f"b = ipc.open(ipc.Handle({bytes(data)!r}), stream=c)\n"
            # Every value is written by now: the read is done soon, or never (a bounded wait, not a delay).
            "import time; pending = sim.to_numpy(b, stream=c, wait=False); end = time.monotonic() + 20\n"
            "while not pending.done() and time.monotonic() < end: time.sleep(0.01)\n"
            "result = float(pending.result().min()) if pending.done() else 'still waiting'"
        )
        == 2.0
    )
    consumer.run("del b")


@needs_sim
def test_nothing_leaks_over_many_share_open_release_cycles(agent):
    """HANDOFF_IPC_CYCLES cycles (default 200; HANDOFF_IPC_CYCLES=10000 runs ten thousand)."""
    from handoff import sim

    cycles = max(int(os.environ.get("HANDOFF_IPC_CYCLES", "200")), 200)
    agent.run("from handoff import sim; consumer = sim.Stream(non_blocking=True); import threading")
    a = sim.zeros(1024, "float32")
    producer = sim.Stream(non_blocking=True)

    def run(count: int) -> tuple[int, int, list[int]]:
        for i in range(count):
            sim.fill(a, float(i), stream=producer)
            handle = ipc.share(a)
            agent.run(f"b = ipc.open(ipc.Handle({bytes(handle)!r}), stream=consumer); del b")
            del handle
            # Each cycle's release is seen before the next: the pools then hold what one share needs,
            # however far a loaded machine lets the consumer's releases fall behind.
            wait_until(lambda: handoff.stats()["ipc_pending_remote_releases"] == 0, "the consumer's release")
        there = agent.run(
            "sim.synchronize(); sim.drain(); import os\n"
            "result = [handoff.stats()['ipc_mappings_cached'], threading.active_count(), len(os.listdir('/proc/self/fd'))]"
        )
        mine = (f".{os.getpid()}.", f".{agent.process.pid}.")  # other processes share /dev/shm too
        files = sum(1 for f in os.listdir("/dev/shm") if f.startswith("handoff-") and any(p in f for p in mine))
        return len(os.listdir("/proc/self/fd")), files, there

    # The pools (interprocess events, control blocks) grow with the shares still awaiting their
    # consumer's release at once (one here), never with the number of cycles.
    fds, files, there = run(cycles // 2)
    fds_after, files_after, there_after = run(cycles - cycles // 2)
    assert there_after[0] == 0, "the consumer keeps no mapping of released arrays"
    assert there_after[1:] == there[1:], "the consumer's threads and descriptors did not grow"
    assert fds_after == fds
    assert files_after <= files + 32 < cycles // 2, "no shared memory file per cycle"
    del a


pytestmark = pytest.mark.skipif(BACKEND == "cuda" and not SIM, reason="the CUDA tests are in test_ipc_gpu.py")
