"""The ownership graph and exchange tracing through the real import and export paths: the graph's
nodes and edges, each event's fields, the hazards (each with a negative control), the process-wide
trace, debug logging and the live socket."""

from __future__ import annotations

import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import handoff
from handoff._trace import format_event

from support import (
    BACKEND,
    attached_client,
    go_on,
    needs_sim,
    needs_two_devices,
    pending_write,
    run_python,
    serving_child,
    waiting_read,
)

THIS_FILE = Path(__file__).resolve()


def line_of(marker: str) -> str:
    """`file:line` of the line of this file that holds `marker` (after the one that names it)."""
    for number, text in enumerate(THIS_FILE.read_text().splitlines(), start=1):
        if marker in text and "line_of(" not in text:
            return f"{THIS_FILE}:{number}"
    raise AssertionError(f"no line holds {marker!r}")


def nodes(graph: dict, kind: str) -> dict[str, dict]:
    return {n["id"]: n for n in graph["nodes"] if n["kind"] == kind}


def edges(graph: dict, kind: str) -> set[tuple[str, str]]:
    return {(e["src"], e["dst"]) for e in graph["edges"] if e["kind"] == kind}


# --- the ownership graph -------------------------------------------------------------------------


def test_an_imported_array_is_a_view_of_a_buffer_of_its_library():
    source = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = handoff.from_dlpack(source)
    graph = handoff.ownership_graph()
    buffers = nodes(graph, "buffer")
    mine = [b for b in buffers.values() if b["library"] == "numpy" and b["shape"] == [2, 3]]
    assert len(mine) == 1, buffers
    buffer = mine[0]
    assert buffer["dtype"] == "float32" and buffer["nbytes"] == 24 and tuple(buffer["device"]) == (1, 0)
    holders = {src for src, dst in edges(graph, "view-of") if dst == buffer["id"]}
    assert len(holders) == 1
    assert nodes(graph, "view")[holders.pop()]["holder"] == "handoff.Array"
    del view
    gc.collect()
    assert buffer["id"] not in nodes(handoff.ownership_graph(), "buffer")


def test_an_export_to_another_library_is_a_second_view_of_the_same_buffer(torch):
    view = handoff.from_dlpack(torch.arange(4, dtype=torch.float32))
    tensor = torch.from_dlpack(view)
    graph = handoff.ownership_graph()
    (buffer,) = [b for b in nodes(graph, "buffer").values() if b["library"] == "torch" and b["shape"] == [4]]
    holders = sorted(nodes(graph, "view")[src]["holder"] for src, dst in edges(graph, "view-of") if dst == buffer["id"])
    assert holders == ["dlpack", "handoff.Array"]
    assert buffer["holders"] == 2
    del tensor


def test_the_graph_as_json_and_dot():
    view = handoff.from_dlpack(np.zeros(3, dtype=np.int16))
    as_json = json.loads(handoff.ownership_graph(format="json"))
    assert {"nodes", "edges"} <= as_json.keys()
    dot = handoff.ownership_graph(format="dot")
    assert dot.startswith("digraph") and "view-of" in dot and "int16" in dot
    with pytest.raises(ValueError, match="format"):
        handoff.ownership_graph(format="yaml")
    del view


@needs_sim
def test_a_buffer_is_ready_on_and_released_after_its_consumer_stream(sim_streams):
    from handoff import sim

    _, consumer = sim_streams
    data = sim.zeros(8, "float32")
    view = handoff.from_dlpack(data, stream=consumer)
    graph = handoff.ownership_graph()
    streams = nodes(graph, "stream")

    def handles(kind: str, buffer: str) -> list[int]:
        return [streams[dst]["handle"] for src, dst in edges(graph, kind) if src == buffer]

    mine = [b for b in nodes(graph, "buffer").values() if b["shape"] == [8]]
    assert len(mine) == 1, "the simulator's allocation, which the re-import shares"
    buffer = mine[0]["id"]
    assert consumer.handle in handles("ready-on", buffer)
    assert handles("released-after", buffer) == [consumer.handle]
    del view, data


# --- tracing -------------------------------------------------------------------------------------


def test_each_event_names_the_line_it_came_from_however_often_that_line_runs():
    # Locations are remembered per code object and offset: two lines of one function stay two, and
    # a line run again is named again, as it was the first time.
    data = np.ones(4, dtype=np.float32)
    with handoff.trace() as t:
        for _ in range(3):
            handoff.from_dlpack(data)  # marker: first line
            handoff.from_dlpack(data)  # marker: second line
    imports = [e["where"] for e in t.events if e["kind"] == "import"]
    assert imports == [line_of("# marker: first line"), line_of("# marker: second line")] * 3


def test_lines_stay_right_when_more_locations_ran_than_are_remembered():
    # Past 4,096 (code, offset) locations the remembered ones are forgotten and learnt again: every
    # call is still named by its own line, the first run's and the second's (negative control: the
    # expected lines are all different, so a location answered from a forgotten one shows).
    calls = 4_200
    source = "def run(f, x):\n" + "    f(x)\n" * calls
    namespace: dict[str, object] = {}
    exec(compile(source, "many_locations.py", "exec"), namespace)
    run = namespace["run"]
    assert callable(run)
    data = np.ones(4, dtype=np.float32)
    with handoff.trace() as t:
        run(handoff.from_dlpack, data)
        run(handoff.from_dlpack, data)
    imports = [e["where"] for e in t.events if e["kind"] == "import"]
    expected = [f"many_locations.py:{line}" for line in range(2, calls + 2)]
    assert imports == expected * 2


def test_a_release_of_an_array_imported_before_the_trace_began_says_its_data_is_unknown():
    # It was written as an empty float32 array on cpu:0, whatever the array was.
    before = handoff.from_dlpack(np.ones((2, 3), dtype=np.int16))
    with handoff.trace() as t:
        del before
        seen = handoff.from_dlpack(np.ones(0, dtype=np.float64))  # the negative control: a known release
        del seen
        gc.collect()
    releases = [e for e in t.events if e["kind"] == "release"]
    assert len(releases) == 2
    unseen, known = releases
    assert [unseen[field] for field in ("device", "shape", "dtype", "nbytes")] == [None] * 4
    assert [known[field] for field in ("device", "shape", "dtype", "nbytes")] == [(1, 0), [0], "float64", 0]
    assert "?[?] ? B  ?" in format_event(unseen) and "float64[0] 0 B  cpu:0" in format_event(known)


def test_each_exchange_is_an_event_with_the_contracts_fields(torch):
    with handoff.trace() as t:
        view = handoff.from_dlpack(np.ones(4, dtype=np.float64))  # marker: numpy import
        tensor = torch.from_dlpack(view)  # marker: torch export
        del tensor, view
        gc.collect()
    kinds = [e["kind"] for e in t.events]
    assert kinds.count("import") == 1 and kinds.count("export") == 1 and kinds.count("release") >= 1
    required = {
        "kind",
        "time_ns",
        "thread",
        "device",
        "shape",
        "dtype",
        "nbytes",
        "producer",
        "consumer",
        "producer_stream",
        "consumer_stream",
        "action",
        "hazard",
        "where",
    }
    for event in t.events:
        assert required <= event.keys()
    imported = next(e for e in t.events if e["kind"] == "import")
    assert (imported["producer"], imported["consumer"]) == ("numpy", "handoff")
    assert imported["shape"] == [4] and imported["dtype"] == "float64" and imported["nbytes"] == 32
    assert imported["action"] == "none" and imported["hazard"] is None
    assert imported["where"] == line_of("# marker: numpy import")
    assert imported["thread"] == __import__("threading").get_native_id()
    exported = next(e for e in t.events if e["kind"] == "export")
    assert (exported["producer"], exported["consumer"]) == ("numpy", "torch")
    assert exported["where"] == line_of("# marker: torch export")
    assert not t.hazards()


def test_a_refused_exchange_is_traced():
    frozen = np.broadcast_to(np.arange(3), (2, 3))
    view = handoff.from_dlpack(frozen)
    with handoff.trace() as t, pytest.raises(BufferError):
        view.__dlpack__()  # a legacy consumer cannot be told "read-only"
    (event,) = [e for e in t.events if e["kind"] == "export"]
    assert event["action"] == "refused"


def test_a_trace_sees_only_its_own_block():
    handoff.from_dlpack(np.zeros(2))
    with handoff.trace() as t:
        pass
    handoff.from_dlpack(np.zeros(2))
    assert t.events == []


def test_save_writes_chrome_trace_json(tmp_path):
    path = tmp_path / "trace.json"
    with handoff.trace(path=path):
        handoff.from_dlpack(np.zeros(2))
    saved = json.loads(path.read_text())
    assert isinstance(saved["traceEvents"], list) and saved["traceEvents"]


@needs_sim
def test_an_unordered_hand_off_of_pending_work_is_flagged_where_it_happened(sim_streams):
    from handoff import sim

    producer, consumer = sim_streams
    with sim.hold(producer):
        data = pending_write(producer)
        with handoff.trace() as t:
            stale = handoff.from_dlpack(data, stream=-1)  # marker: unordered hand-off
            seen = sim.to_numpy(stale, stream=consumer)
    assert seen[0] == 0.0, "the negative control of the trace: the consumer did read stale data"
    (hazard,) = t.hazards()
    assert hazard["hazard"] == "unordered" and hazard["action"] == "unordered"
    assert hazard["where"] == line_of("# marker: unordered hand-off")
    assert hazard["producer_stream"] == producer.handle
    assert "unordered" in t.summary() and line_of("# marker: unordered hand-off") in t.summary()


class InterfaceOnly:
    """Exposes only another array's __cuda_array_interface__ (v3: with the stream it is ready on)."""

    def __init__(self, array: handoff.Array) -> None:
        self.array = array

    @property
    def __cuda_array_interface__(self) -> dict:
        return self.array.__cuda_array_interface__


@needs_sim
@pytest.mark.skipif(BACKEND == "sim-rocm", reason="the CUDA Array Interface is for CUDA memory")
def test_an_unordered_interface_import_of_pending_work_is_flagged(sim_streams):
    from handoff import sim

    producer, _ = sim_streams
    with handoff.trace() as t:
        with sim.hold(producer):
            pending = pending_write(producer)
            handoff.asarray(InterfaceOnly(pending), stream=-1)  # marker: unordered interface import
        sim.synchronize()
        handoff.asarray(InterfaceOnly(pending), stream=-1)  # negative control: the write is done
    imports = [e for e in t.events if e["kind"] == "import"]
    assert [e["protocol"] for e in imports] == ["cuda-array-interface"] * 2
    assert [e["hazard"] for e in imports] == ["unordered", None]
    assert imports[0]["where"] == line_of("# marker: unordered interface import")


@needs_sim
def test_negative_controls_an_ordered_hand_off_or_finished_work_is_no_hazard(sim_streams):
    from handoff import sim

    producer, consumer = sim_streams
    with handoff.trace() as t:
        with sim.hold(producer):
            ordered = handoff.from_dlpack(pending_write(producer), stream=consumer)
            read = waiting_read(ordered, consumer)
        assert read.result()[0] == 1.0
        finished = pending_write(producer)
        sim.synchronize()
        handoff.from_dlpack(finished, stream=-1)
    assert t.hazards() == []
    actions = [e["action"] for e in t.events if e["kind"] == "import"]  # a handoff.Array is re-imported
    assert actions == ["wait", "unordered"]


@needs_sim
@needs_two_devices
def test_a_consumer_stream_of_another_device_is_flagged(sim_streams):
    from handoff import sim

    data = sim.zeros(4, "float32", device=0)
    with handoff.trace() as t:
        handoff.from_dlpack(data, stream=sim.Stream(device=1))
        handoff.from_dlpack(data, stream=sim.Stream(device=0))  # negative control
    assert [e["hazard"] for e in t.events if e["kind"] == "import"] == ["cross-device", None]


# --- the process-wide trace, the log, the command ------------------------------------------------

HOLDING_SCRIPT = """
import numpy as np, handoff
kept = handoff.from_dlpack(np.zeros(3))  # still held at exit: the program's own choice
handoff.from_dlpack(np.ones(2))
"""


def test_handoff_trace_env_traces_the_whole_process_and_reports_what_is_held_without_a_hazard(tmp_path):
    script = tmp_path / "holding.py"
    script.write_text(HOLDING_SCRIPT)
    path = tmp_path / "process.json"
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HANDOFF_TRACE": str(path)},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    saved = json.loads(path.read_text())
    events = saved["handoff"]["events"]
    assert [e["kind"] for e in events].count("import") == 2
    assert [e for e in events if e["hazard"] is not None] == [], "a clean program shows no hazard"
    held = [e for e in events if e["kind"] == "held"]
    assert len(held) == 1 and held[0]["where"] == f"{script}:3"
    assert "still held" in held[0]["detail"]


def test_debug_logging_writes_one_line_per_exchange():
    result = run_python(
        "import numpy as np, handoff; v = handoff.from_dlpack(np.zeros(2)); del v", HANDOFF_LOG_LEVEL="debug"
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if "numpy -> handoff" in line or "-buffer:" in line]
    assert any("import numpy -> handoff" in line and "view-of buffer:" in line for line in lines), result.stderr
    assert any("release" in line and "-buffer:" in line for line in lines), result.stderr


@needs_sim
def test_handoff_trace_run_prints_the_hazard_with_the_scripts_line_and_keeps_its_status(tmp_path):
    script = tmp_path / "racy.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        import handoff
        from handoff import sim
        producer = sim.Stream()
        data = sim.zeros(16, "float32")
        with sim.hold(producer):  # the write is pending at the exchange
            sim.fill(data, 1.0, stream=producer)
            stale = handoff.from_dlpack(data, stream=-1)
        sim.synchronize()
        sys.exit(3)
    """)
    )
    cli = Path(sys.executable).with_name("handoff-trace")
    command = [str(cli)] if cli.exists() else [sys.executable, "-m", "handoff._trace_cli"]
    result = subprocess.run(
        [*command, "run", "--", sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 3, result.stderr
    report = result.stdout + result.stderr
    assert "unordered" in report and f"{script}:9" in report, report


# --- the live socket -----------------------------------------------------------------------------


def socket_path(pid: int) -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / "handoff" / f"trace-{pid}.sock"
    return Path(os.environ.get("TMPDIR") or "/tmp") / f"handoff-{os.geteuid()}" / f"trace-{pid}.sock"


# For serving_child: each line written to its stdin lets it go on (first: make three imports; second: exit).
SERVING_SCRIPT = """
import sys, numpy as np, handoff
print(handoff.serve_trace(), flush=True)
sys.stdin.readline()  # the client is attached
for _ in range(3):
    handoff.from_dlpack(np.zeros(5))
sys.stdin.readline()
"""


SERVING_WHILE_RELEASING = """
import socket, sys, threading, handoff
from handoff import sim
path = handoff.serve_trace()
stream = sim.Stream(non_blocking=True)
running, finish = threading.Event(), threading.Event()

class Owner:  # its release runs on the runtime's service thread, and holds it there
    def __del__(self):
        running.set()
        finish.wait(60)

data = sim.zeros(4)
view = handoff.view(data.data_ptr, (4,), "float32", device=data.device, owner=Owner())
handoff.from_dlpack(view, stream=stream)  # imported and dropped: the release waits for the stream
del view
assert running.wait(60), "the release did not run"
clients = [socket.socket(socket.AF_UNIX) for _ in range(17)]
for client in clients:
    client.settimeout(30)
    client.connect(path)
lines = [client.makefile("r").readline() for client in clients]
finish.set()
print(sum('"hello"' in line for line in lines), sum("16 clients are attached already" in line for line in lines))
"""


@needs_sim
def test_the_socket_serves_while_the_service_thread_runs_a_release_and_refuses_clients_past_sixteen():
    # Serving on the thread that runs the deferred releases, a busy release held every client (and
    # idle clients delayed the releases); past 16 clients, memory grew with each.
    result = run_python(SERVING_WHILE_RELEASING)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["16", "1"]


def test_a_served_trace_streams_each_exchange_to_an_attached_client(tmp_path):
    with serving_child(SERVING_SCRIPT, tmp_path) as (child, path):
        assert path == str(tmp_path / "handoff" / f"trace-{child.pid}.sock")
        assert (os.stat(tmp_path / "handoff").st_mode & 0o777) == 0o700
        assert (os.stat(path).st_mode & 0o777) == 0o600
        with attached_client(path) as (hello, reader):
            assert hello["pid"] == child.pid
            go_on(child)
            events = [json.loads(reader.readline()) for _ in range(6)]
        assert sorted(e["kind"] for e in events) == ["import"] * 3 + ["release"] * 3
        assert all(e["shape"] == [5] and e["producer"] == "numpy" for e in events)
        go_on(child)
        assert child.wait(timeout=60) == 0
    assert not Path(path).exists(), "the socket is removed at exit"


BURST_THEN_EXIT = """
import sys, numpy as np, handoff
print(handoff.serve_trace(), flush=True)
sys.stdin.readline()  # the client is attached
a = np.zeros(5)
for _ in range(300):
    handoff.from_dlpack(a)
"""


def test_a_client_that_reads_gets_every_event_a_process_made_before_it_ended(tmp_path):
    # The process ends right after its last exchanges: what its client has not read yet is written
    # before the socket closes (it was closed with the lines still queued).
    with serving_child(BURST_THEN_EXIT, tmp_path) as (child, path):
        with attached_client(path) as (_, reader):
            go_on(child)
            lines = [json.loads(line) for line in reader]  # until the process closes the socket
        assert child.wait(timeout=60) == 0
    dropped = sum(line.get("dropped", 0) for line in lines)
    events = [line for line in lines if "kind" in line]
    assert len(events) + dropped == 600, "every event, or its count among those dropped"
    assert dropped == 0, "a client that reads loses nothing"


def test_garbage_and_a_vanishing_client_do_not_disturb_the_traced_process(tmp_path):
    with serving_child(SERVING_SCRIPT, tmp_path) as (child, path):
        with socket.socket(socket.AF_UNIX) as rude:
            rude.connect(path)
            rude.sendall(os.urandom(1 << 20) + b"x" * (1 << 20))  # garbage, and one huge line
        with attached_client(path) as (_, reader):  # the polite one, admitted
            go_on(child)
            assert json.loads(reader.readline())["kind"] in ("import", "release")
        go_on(child)
        assert child.wait(timeout=60) == 0


# A Python that uid 65534 can run (the suite's own may live under /root): the system's.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")

STRANGER = """
import socket, sys
with socket.socket(socket.AF_UNIX) as s:
    s.settimeout(30)
    try:
        s.connect(sys.argv[1])
    except PermissionError:
        print("denied")
    else:
        print(s.makefile("r").readline().strip())
"""


def connect_as_nobody(path: str) -> str:
    """What a process of uid 65534 gets from the socket: "denied" when the file modes keep it out,
    else the first line the server sends it."""
    result = subprocess.run(
        [SYSTEM_PYTHON, "-c", STRANGER, path],
        capture_output=True,
        text=True,
        timeout=60,
        user=65534,
        group=65534,
        extra_groups=[],
        cwd="/",
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
@pytest.mark.skipif(SYSTEM_PYTHON is None, reason="needs a system python3 that another uid can run")
def test_a_client_of_another_uid_is_refused():
    # Outside pytest's private temporary folder, so that another user can reach the directory.
    with tempfile.TemporaryDirectory(dir="/tmp") as runtime_dir:
        os.chmod(runtime_dir, 0o755)
        refused_by_peer_credentials(Path(runtime_dir))


def refused_by_peer_credentials(runtime_dir: Path) -> None:
    with serving_child(SERVING_SCRIPT, runtime_dir) as (child, path):
        assert connect_as_nobody(path) == "denied", "the 0700 directory and 0600 socket keep other users out"
        # Past the file modes (opened up here on purpose), the peer's credentials refuse it.
        os.chmod(runtime_dir / "handoff", 0o711)
        os.chmod(path, 0o666)
        assert connect_as_nobody(path).startswith('{"error":"refused: peer uid 65534')
        go_on(child, 2)
        assert child.wait(timeout=60) == 0


def test_handoff_trace_attach_prints_a_live_process_exchanges(tmp_path):
    with serving_child(SERVING_SCRIPT, tmp_path) as (child, _):
        cli = Path(sys.executable).with_name("handoff-trace")
        command = [str(cli)] if cli.exists() else [sys.executable, "-m", "handoff._trace_cli"]
        with subprocess.Popen(
            [*command, "attach", str(child.pid), "--count", "3", "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)},
        ) as attach:
            assert wait_for_clients(child.pid, tmp_path), "the client attached"
            go_on(child)
            out, err = attach.communicate(timeout=60)
        assert attach.returncode == 0, err
        events = [json.loads(line) for line in out.splitlines()]
        assert len(events) == 3 and all(e["shape"] == [5] for e in events)
        go_on(child)
        assert child.wait(timeout=60) == 0


def wait_for_clients(pid: int, runtime_dir: Path) -> bool:
    """Waits (10 s at most) until the serving process has a client: its socket shows a connection."""
    deadline = time.monotonic() + 10
    path = str(runtime_dir / "handoff" / f"trace-{pid}.sock")
    while time.monotonic() < deadline:
        with open("/proc/net/unix") as table:
            if sum(path in line for line in table) >= 2:  # the listening socket and an accepted one
                return True
        time.sleep(0.05)
    return False
