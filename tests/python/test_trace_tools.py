"""The Python side of tracing, on fixture events (no runtime needed): the text summary, the Chrome
trace JSON, the ownership graph as DOT, the classification of source files into libraries, the
``with handoff.trace()`` block over a fake runtime, and the ``handoff-trace`` command's subcommands
(run, show, graph, attach, info) with their error paths."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import handoff
import handoff._handoff as extension
from handoff import _trace, _trace_cli
from handoff._trace import (
    chrome_trace,
    format_event,
    graph_to_dot,
    library_of_file,
    process_state,
    summary,
    unfinished_trace,
)

TRAIN = "/home/me/train.py"
UNORDERED = "handed over with no ordering while its producer stream 0x10 still had work pending"


def event(**fields: Any) -> dict[str, Any]:
    """An event with every key of the runtime's events; `fields` override the defaults."""
    out: dict[str, Any] = {
        "kind": "import",
        "time_ns": 1_000_000_000,
        "thread": 77,
        "device": (2, 0),
        "shape": [4, 4],
        "dtype": "float32",
        "nbytes": 64,
        "producer": "torch",
        "consumer": "handoff",
        "producer_stream": None,
        "consumer_stream": None,
        "action": "none",
        "hazard": None,
        "detail": None,
        "where": None,
        "buffer": "buffer:1",
        "view": "view:2",
        "protocol": "dlpack",
    }
    out.update(fields)
    return out


def unordered_import(time_ns: int, *, buffer: str, view: str) -> dict[str, Any]:
    """An import from line 20 of TRAIN handed over with no ordering while its producer stream had work."""
    return event(
        time_ns=time_ns,
        producer_stream=0x10,
        action="unordered",
        hazard="unordered",
        detail=UNORDERED,
        where=f"{TRAIN}:20",
        buffer=buffer,
        view=view,
    )


# The fields of a numpy array of 3 float64s on the CPU, which one event imports and the next releases.
NUMPY_ARRAY: dict[str, Any] = {"producer": "numpy", "device": (1, 0), "shape": [3], "dtype": "float64", "nbytes": 24}

EVENTS = [
    event(time_ns=1_000_000_000, producer_stream=0x10, consumer_stream=0x20, action="wait", where=f"{TRAIN}:10"),
    event(
        kind="export",
        time_ns=1_000_002_000,
        consumer="cupy",
        producer_stream=0x20,
        consumer_stream=0x30,
        action="elided",
        view="view:3",
        where=f"{TRAIN}:11",
    ),
    # The same unordered hand-over twice, from one line: the summary groups them as "2x".
    unordered_import(1_000_005_000, buffer="buffer:4", view="view:5"),
    unordered_import(1_000_006_000, buffer="buffer:6", view="view:7"),
    event(time_ns=1_000_007_000, **NUMPY_ARRAY, where=f"{TRAIN}:30", buffer="buffer:8", view="view:9"),
    event(
        kind="release",
        time_ns=1_000_008_000,
        **NUMPY_ARRAY,
        consumer=None,
        where=f"{TRAIN}:31",
        buffer="buffer:8",
        view=None,
        protocol="release",
    ),
    event(
        kind="export",
        time_ns=1_000_009_000,
        producer="numpy",
        consumer=None,
        device=(1, 0),
        nbytes=8,
        hazard="leak",
        detail="still held at exit",
        where=f"{TRAIN}:40",
        buffer="buffer:10",
        view="view:11",
    ),
]

GRAPH: dict[str, Any] = {
    "nodes": [
        {
            "id": "buffer:1",
            "kind": "buffer",
            "library": "torch",
            "device": [2, 0],
            "shape": [4, 4],
            "dtype": "float32",
            "nbytes": 64,
            "holders": 2,
        },
        {"id": "view:2", "kind": "view", "holder": "handoff.Array", "where": f"{TRAIN}:10"},
        {"id": "stream:2:0:0x10", "kind": "stream", "device": [2, 0], "handle": 0x10},
        {"id": "view:3", "kind": "view"},  # the optional keys missing
    ],
    "edges": [
        {"src": "view:2", "dst": "buffer:1", "kind": "view-of"},
        {"src": "view:3", "dst": "buffer:1", "kind": "view-of"},
        {"src": "buffer:1", "dst": "stream:2:0:0x10", "kind": "ready-on"},
        {"src": "buffer:1", "dst": "stream:2:0:0x10", "kind": "released-after"},
    ],
}


def as_json(value: Any) -> Any:
    return json.loads(json.dumps(value))


def row_of(text: str, *leading: str) -> list[str]:
    """The cells of the table row of `text` that starts with the cells `leading`."""
    for line in text.splitlines():
        cells = line.split()
        if cells[: len(leading)] == list(leading):
            return cells
    raise AssertionError(f"no row starts with {leading}:\n{text}")


# --- summary ----------------------------------------------------------------------------------------


def test_summary_puts_the_hazards_first_grouped_by_line_with_their_detail():
    text = summary(EVENTS, title="my trace")
    assert text.startswith("my trace\n========")
    assert text.index("HAZARDS (3)") < text.index("EXCHANGES")
    unordered = row_of(text, "2x", "unordered")
    assert unordered[2:] == [f"{TRAIN}:20", "import", "torch", "->", "handoff"]
    assert UNORDERED in text and text.index(f"{TRAIN}:20") < text.index(UNORDERED) < text.index(f"{TRAIN}:40")
    assert row_of(text, "1x", "leak")[2:] == [f"{TRAIN}:40", "export", "numpy", "->", "-"]


def test_summary_counts_the_exchanges_of_each_producer_consumer_pair():
    text = summary(EVENTS)
    #                                           imports exports releases waits elided unordered refused bytes
    assert row_of(text, "torch", "handoff")[2:] == ["3", "0", "0", "1", "0", "2", "0", "192", "B"]
    assert row_of(text, "torch", "cupy")[2:] == ["0", "1", "0", "0", "1", "0", "0", "64", "B"]
    # The release names no consumer: it is counted with the import it ends.
    assert row_of(text, "numpy", "handoff")[2:] == ["1", "0", "1", "0", "0", "0", "0", "24", "B"]
    assert row_of(text, "numpy", "-")[2:] == ["0", "1", "0", "0", "0", "0", "0", "8", "B"]
    assert row_of(text, "total")[1:] == ["4", "2", "1", "1", "1", "2", "0", "288", "B"]
    assert text.splitlines()[-1] == "7 events, 1 wait inserted, 1 elided, 3 hazards"


def test_summary_table_columns_are_aligned():
    lines = summary(EVENTS).splitlines()
    start = lines.index("EXCHANGES") + 1
    table = lines[start : lines.index("", start)]
    header = table[0]
    # Numbers are right-aligned under their header: each row ends where the header does.
    assert {len(line) for line in table} == {len(header)}


def test_summary_counts_one_action_for_the_two_halves_of_an_import_from_handoffs_own_exporter():
    exchange = {
        "producer": "handoff.sim",
        "producer_stream": 1,
        "consumer_stream": 2,
        "action": "wait",
        "where": "x.py:1",
    }
    halves = [
        event(kind="export", **exchange, buffer="buffer:1", view="view:2"),
        event(kind="import", **exchange, buffer="buffer:3", view="view:4"),
    ]
    text = summary(halves)
    assert row_of(text, "handoff.sim", "handoff")[2:] == ["1", "1", "0", "1", "0", "0", "0", "64", "B"]
    assert text.splitlines()[-1] == "2 events, 1 wait inserted, 0 elided, 0 hazards"
    assert "no hazards" in text
    flows = [e for e in chrome_trace(halves)["traceEvents"] if e["ph"] == "s"]
    assert len(flows) == 1


def test_summary_does_not_count_a_hazard_that_repeats_an_exchange_as_another():
    made = event(where="x.py:1")
    leak = {**made, "time_ns": made["time_ns"] + 5, "hazard": "leak", "detail": "view:2 was still alive at exit"}
    text = summary([made, leak])
    assert row_of(text, "torch", "handoff")[2:] == ["1", "0", "0", "0", "0", "0", "0", "64", "B"]
    assert row_of(text, "1x", "leak")[2] == "x.py:1" and "view:2 was still alive at exit" in text


def test_summary_of_no_events():
    assert summary([]) == "no exchanges recorded"
    assert summary([], title="t") == "t\n=\nno exchanges recorded"


def test_summary_tolerates_missing_and_odd_fields():
    text = summary([{"kind": "import"}, {"kind": "mystery", "hazard": "new-kind", "nbytes": "lots"}])
    assert "new-kind" in text and "2 events" in text


# --- Chrome trace JSON ------------------------------------------------------------------------------


def test_chrome_trace_is_strict_json_with_one_named_track_per_stream():
    trace = chrome_trace(EVENTS, graph=GRAPH, pid=42)
    text = json.dumps(trace, allow_nan=False)
    assert json.loads(text) == trace
    assert trace["displayTimeUnit"] == "ns"
    metadata = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    (process,) = [e for e in metadata if e["name"] == "process_name"]
    assert process["pid"] == 42 and "handoff" in process["args"]["name"]
    names = {e["tid"]: e["args"]["name"] for e in metadata if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["cuda:0 stream 0x10", "cuda:0 stream 0x20", "cuda:0 stream 0x30", "host"]
    assert len(set(names)) == len(names)
    assert all(e["pid"] == 42 for e in trace["traceEvents"])


def test_chrome_trace_has_a_slice_per_exchange_on_the_consumer_stream():
    trace = chrome_trace(EVENTS)
    tracks = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "handoff"]
    assert len(slices) == len(EVENTS)
    # The events are kept once, under "handoff": a slice shows the exchange in one line.
    assert [s["args"]["exchange"] for s in slices] == [format_event(e) for e in EVENTS]
    assert all("time_ns" not in s["args"] for s in slices)
    assert slices[0]["name"] == "import torch\u2192handoff" and slices[0]["tid"] == tracks["cuda:0 stream 0x20"]
    assert slices[0]["ts"] == 0.0 and slices[1]["ts"] == 2.0 and all(isinstance(s["ts"], float) for s in slices)
    assert all(s["dur"] > 0 for s in slices)
    # No consumer stream: the producer's track; host data: the host track.
    assert slices[2]["tid"] == tracks["cuda:0 stream 0x10"] and slices[4]["tid"] == tracks["host"]
    hazards = [s for s in slices if s.get("cname") == "terrible"]
    assert [s["args"]["hazard"] for s in hazards] == ["unordered", "unordered", "leak"]
    assert all(s["name"].startswith("\u26a0 ") for s in hazards)
    assert "cname" not in slices[0]


def test_chrome_trace_draws_each_wait_as_an_arrow_from_the_producer_stream_to_the_consumer_stream():
    trace = chrome_trace(EVENTS)
    tracks = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    starts = [e for e in trace["traceEvents"] if e["ph"] == "s"]
    ends = [e for e in trace["traceEvents"] if e["ph"] == "f"]
    assert len(starts) == len(ends) == 1  # the one wait; elided and unordered hand-offs draw none
    (start,), (end,) = starts, ends
    assert start["id"] == end["id"] and start["cat"] == end["cat"] and end["bp"] == "e"
    assert start["tid"] == tracks["cuda:0 stream 0x10"] and end["tid"] == tracks["cuda:0 stream 0x20"]
    # A flow binds to slices: one encloses each end.
    for point in (start, end):
        assert any(
            e["ph"] == "X" and e["tid"] == point["tid"] and e["ts"] <= point["ts"] <= e["ts"] + e["dur"]
            for e in trace["traceEvents"]
        )


def test_chrome_trace_keeps_the_events_and_graph_and_is_deterministic():
    trace = chrome_trace(EVENTS, graph=GRAPH)
    assert trace["handoff"]["events"] == as_json(EVENTS) and trace["handoff"]["graph"] == GRAPH
    assert trace["handoff"]["version"] == handoff.__version__
    assert json.dumps(trace) == json.dumps(chrome_trace(list(EVENTS), graph=dict(GRAPH)))
    assert chrome_trace([])["traceEvents"][0]["name"] == "process_name"
    assert chrome_trace([])["handoff"] == {"version": handoff.__version__, "events": [], "graph": None}


# --- the graph as DOT -------------------------------------------------------------------------------


def test_graph_to_dot_draws_each_kind_of_node_and_edge():
    dot = graph_to_dot(GRAPH)
    assert dot.startswith("digraph handoff {") and dot.rstrip().endswith("}")
    lines = dot.splitlines()
    (buffer,) = [line for line in lines if line.strip().startswith('"buffer:1" [')]
    assert "shape=box" in buffer
    assert all(part in buffer for part in ("torch", "float32", "[4x4]", "cuda:0", "64 B", "2 holders"))
    (view,) = [line for line in lines if line.strip().startswith('"view:2" [')]
    assert "shape=ellipse" in view and "handoff.Array" in view and f"{TRAIN}:10" in view
    (stream,) = [line for line in lines if line.strip().startswith('"stream:2:0:0x10" [')]
    assert "shape=hexagon" in stream and "cuda:0\\nstream 0x10" in stream
    assert '"view:2" -> "buffer:1" [label="view-of", style=solid' in dot
    assert '"buffer:1" -> "stream:2:0:0x10" [label="ready-on", style=dashed' in dot
    assert '"buffer:1" -> "stream:2:0:0x10" [label="released-after", style=dotted' in dot


def test_graph_to_dot_escapes_ids_and_labels():
    graph = {
        "nodes": [
            {"id": 'view:"1"', "kind": "view", "holder": "a\\b", "where": 'C:\\x "y".py:3\nnext'},
            {"id": "odd", "kind": "unknown-kind"},
        ],
        "edges": [{"src": 'view:"1"', "dst": "odd", "kind": 'we"ird'}],
    }
    dot = graph_to_dot(graph)
    assert '"view:\\"1\\"" [' in dot
    assert 'label="a\\\\b\\nC:\\\\x \\"y\\".py:3\\nnext\\nview:\\"1\\""' in dot
    assert '"view:\\"1\\"" -> "odd" [label="we\\"ird"' in dot
    assert len(dot.splitlines()) == 8  # no raw line break escaped a label
    assert graph_to_dot({}) == graph_to_dot({"nodes": [], "edges": []})


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graphviz_reads_the_dot():
    result = subprocess.run(["dot", "-Tsvg"], input=graph_to_dot(GRAPH), capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr


# --- which library a file belongs to ----------------------------------------------------------------


def test_a_file_of_an_installed_package_is_that_library():
    numpy = pytest.importorskip("numpy")
    assert library_of_file(numpy.__file__) == "numpy"
    assert library_of_file(str(Path(numpy.__file__).parent / "linalg" / "x.py")) == "numpy"
    purelib = sysconfig.get_paths()["purelib"]
    assert library_of_file(os.path.join(purelib, "some_module.py")) == "some_module"
    assert library_of_file(os.path.join(purelib, "_pytest", "python.py")) == "_pytest"


def test_handoffs_own_files_are_handoff():
    assert library_of_file(handoff.__file__) == "handoff"
    assert library_of_file(_trace.__file__) == "handoff"
    assert library_of_file(str(Path(_trace.__file__).resolve())) == "handoff"


def test_user_code_is_no_library(tmp_path):
    script = tmp_path / "mine.py"
    script.write_text("x = 1\n")
    assert library_of_file(str(script)) is None
    assert library_of_file(__file__) is None
    assert library_of_file("<string>") is None and library_of_file("<stdin>") is None


def test_the_standard_library_is_python():
    assert library_of_file(json.__file__) == "python"
    assert library_of_file(threading.__file__) == "python"
    assert library_of_file("<frozen importlib._bootstrap>") == "python"


# --- the trace block over a fake runtime -----------------------------------------------------------


class FakeRuntime:
    """The runtime's private trace functions, recording calls; events are added with `record`."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.recording = False

    def begin(self, limit: int = 0, launches: bool = False) -> int:
        self.calls.append(("begin", None))
        self.limit = limit
        self.recording = True
        return 7

    def dropped(self, token: int) -> int:
        return 0

    def events_of(self, token: int) -> list[dict[str, Any]]:
        self.calls.append(("events", token))
        return list(self.events)

    def end(self, token: int) -> list[dict[str, Any]]:
        self.calls.append(("end", token))
        self.recording = False
        return list(self.events)

    def graph(self) -> dict[str, Any]:
        self.calls.append(("graph", None))
        return GRAPH

    def record(self, *events: dict[str, Any]) -> None:
        assert self.recording
        self.events += events


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    fake = FakeRuntime()
    monkeypatch.setattr(extension, "_trace_begin", fake.begin, raising=False)
    monkeypatch.setattr(extension, "_trace_events", fake.events_of, raising=False)
    monkeypatch.setattr(extension, "_trace_end", fake.end, raising=False)
    monkeypatch.setattr(extension, "_trace_dropped", fake.dropped, raising=False)
    monkeypatch.setattr(extension, "_ownership_graph", fake.graph, raising=False)
    monkeypatch.setattr(extension, "ownership_graph", fake.graph, raising=False)
    return fake


def test_trace_records_the_block_and_snapshots_the_graph(runtime: FakeRuntime):
    t = _trace.trace()
    assert t.events == [] and t.graph is None and not t.active
    with t as entered:
        assert entered is t and t.active
        runtime.record(*EVENTS[:2])
        assert t.events == EVENTS[:2]  # live, while the block runs
        runtime.record(*EVENTS[2:])
    assert runtime.calls == [("begin", None), ("events", 7), ("end", 7), ("graph", None)]
    assert t.events == EVENTS and t.graph == GRAPH and not t.active
    assert t.hazards() == [EVENTS[2], EVENTS[3], EVENTS[6]]
    assert t.summary() == summary(EVENTS, title="handoff trace")
    assert "finished, 7 events" in repr(t)


def test_trace_saves_to_its_path_and_show_reads_it(
    runtime: FakeRuntime, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    path = tmp_path / "trace.json"
    with _trace.trace(path=path):
        runtime.record(*EVENTS)
    saved = json.loads(path.read_text())
    assert saved["handoff"]["events"] == as_json(EVENTS) and saved["handoff"]["graph"] == GRAPH
    assert saved["traceEvents"][0]["args"]["name"] == f"handoff (pid {os.getpid()})"
    assert _trace_cli.main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"handoff trace {path}") and "2x  unordered" in out and UNORDERED in out


def test_trace_ends_when_the_block_raises(runtime: FakeRuntime):
    t = _trace.trace()
    with pytest.raises(ValueError, match="boom"), t:
        runtime.record(EVENTS[0])
        raise ValueError("boom")
    assert ("end", 7) in runtime.calls and t.events == [EVENTS[0]]


def test_a_trace_is_entered_once(runtime: FakeRuntime):
    t = _trace.trace()
    with t:
        pass
    with pytest.raises(RuntimeError, match=r"already used.*new handoff.trace"), t:
        pass
    assert [c for c, _ in runtime.calls].count("begin") == 1


# --- handoff-trace show, graph, info ----------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(chrome_trace(EVENTS, graph=GRAPH)))
    return path


def test_show_prints_the_summary_or_the_events(saved: Path, capsys: pytest.CaptureFixture[str]):
    assert _trace_cli.main(["show", str(saved)]) == 0
    assert capsys.readouterr().out.rstrip("\n").endswith(summary(EVENTS).splitlines()[-1])
    assert _trace_cli.main(["show", "--json", str(saved)]) == 0
    assert json.loads(capsys.readouterr().out) == as_json(EVENTS)


def test_show_gives_source_lines_below_the_working_directory_relative_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    train = str(tmp_path / "project" / "train.py")
    events = [{**e, "where": str(e["where"]).replace(TRAIN, train)} if e.get("where") else e for e in EVENTS]
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(chrome_trace(events)))
    monkeypatch.chdir(tmp_path)
    assert _trace_cli.main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "  project/train.py:20  " in out and train not in out
    assert _trace_cli.main(["show", "--json", str(path)]) == 0
    assert f"{train}:20" in capsys.readouterr().out, "the events themselves keep the full path"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # the negative control: a line not below it stays whole
    assert _trace_cli.main(["show", str(path)]) == 0
    assert f"  {train}:20  " in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no such file"),
        ("{not json", "not JSON"),
        (b"\xff\xfe\x00", "not JSON"),
        ('{"traceEvents": []}', "not a handoff trace"),
        ("[1, 2]", "not a handoff trace"),
        ('{"handoff": {"events": [1]}}', "not a handoff trace"),
    ],
)
def test_show_and_graph_reject_what_is_not_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | bytes | None, message: str
):
    path = tmp_path / "file.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    for command in (["show", str(path)], ["graph", str(path)]):
        assert _trace_cli.main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"handoff-trace: {path}: {message}") and "Traceback" not in err


HOSTILE_EVENT = {
    "kind": "import",
    "time_ns": 1,
    "device": [1, 0],
    "shape": [3],
    "nbytes": 24,
    "buffer": "buffer:1",
    "view": "view:1",
    "action": "none",
    "hazard": None,
    "where": "x.py:1",
}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            json.dumps({"handoff": {"events": [{**HOSTILE_EVENT, "where": float("nan")}]}}),
            "not JSON (NaN is not a JSON",
        ),
        (json.dumps({"handoff": {"events": [{**HOSTILE_EVENT, "nbytes": float("inf")}]}}), "not JSON (Infinity"),
        (json.dumps({"handoff": {"events": [{**HOSTILE_EVENT, "view": [1]}]}}), "event 0: field 'view' is not an id"),
        (
            json.dumps({"handoff": {"events": [{**HOSTILE_EVENT, "shape": {"a": 1}}]}}),
            "event 0: field 'shape' holds dict",
        ),
        (json.dumps({"handoff": {"events": [{**HOSTILE_EVENT, "kind": [1]}]}}), "event 0: field 'kind' holds list"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (
            json.dumps({"handoff": {"events": [], "graph": {"nodes": [1], "edges": []}}}),
            "graph nodes 0 is not an object",
        ),
        (json.dumps({"handoff": {"events": [], "graph": {"nodes": [{"id": 1, "kind": "view"}]}}}), "not an id"),
        (json.dumps({"handoff": {"events": [], "graph": {"edges": [{"src": "a"}]}}}), "graph edges 0 has no 'dst'"),
        (json.dumps({"handoff": {"events": [], "graph": []}}), "the ownership graph is not an object"),
    ],
    ids=["nan", "infinity", "unhashable id", "object field", "list kind", "deep", "node", "node id", "edge", "graph"],
)
def test_hostile_trace_files_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
):
    path = tmp_path / "hostile.json"
    path.write_text(text)
    for command in (["show", str(path)], ["show", "--json", str(path)], ["graph", str(path)]):
        assert _trace_cli.main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"handoff-trace: {path}: ") and message in err and "Traceback" not in err
        assert err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("field", "number", "shown"),
    [
        ("nbytes", "1e400", "the number 1e400 is out of a float's range"),
        ("nbytes", "-1e400", "the number -1e400 is out of a float's range"),
        ("nbytes", "9" * 400, "the integer 999999999999... (400 characters) is out of the 64-bit range"),
        ("time_ns", str(2**64), f"the integer {2**64} is out of the 64-bit range"),
        ("shape", "[" + "9" * 5000 + "]", "the integer 999999999999... (5000 characters) is out of the 64-bit range"),
    ],
)
def test_numbers_no_trace_holds_are_one_line_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, number: str, shown: str
):
    path = tmp_path / "numbers.json"
    event_text = json.dumps({**HOSTILE_EVENT, field: 0}).replace(f'"{field}": 0', f'"{field}": {number}')
    path.write_text('{"handoff": {"events": [' + event_text + "]}}")
    node = '{"id": "a", "kind": "buffer", "nbytes": ' + number + "}"
    graph = tmp_path / "graph.json"
    graph.write_text('{"handoff": {"events": [], "graph": {"nodes": [' + node + '], "edges": []}}}')
    for command in (["show", str(path)], ["show", "--json", str(path)], ["graph", str(graph)]):
        assert _trace_cli.main(command) == 2
        err = capsys.readouterr().err
        assert err == f"handoff-trace: {command[-1]}: not a handoff trace ({shown})\n"


def test_the_largest_numbers_a_trace_holds_are_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "large.json"
    large = {**HOSTILE_EVENT, "nbytes": 2**64 - 1, "time_ns": 2**63 - 1, "shape": [2**63 - 1], "thread": -(2**63)}
    path.write_text(json.dumps({"handoff": {"events": [large, {**HOSTILE_EVENT, "nbytes": 1e300}]}}))
    assert _trace_cli.main(["show", str(path)]) == 0
    assert "2 events" in capsys.readouterr().out
    assert _trace_cli.main(["show", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)[0]["nbytes"] == 2**64 - 1


@pytest.mark.parametrize("pid", ["99999999999", "0", "-3"])
def test_attach_to_a_pid_that_cannot_be_a_process(pid: str, capsys: pytest.CaptureFixture[str]):
    assert _trace_cli.main(["attach", pid]) == 2
    assert capsys.readouterr().err == f"handoff-trace: attach: {pid} is not a process id\n"


def test_graph_prints_dot_or_json(saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert _trace_cli.main(["graph", str(saved)]) == 0
    assert capsys.readouterr().out == graph_to_dot(GRAPH)
    assert _trace_cli.main(["graph", str(saved), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == GRAPH
    out = tmp_path / "g.dot"
    assert _trace_cli.main(["graph", str(saved), "-o", str(out)]) == 0
    assert out.read_text() == graph_to_dot(GRAPH)


@pytest.mark.parametrize(
    ("output", "status", "reason"),
    [
        ("/dev/full", 1, "cannot write it: No space left on device"),
        ("{tmp}", 2, "is a directory"),
        ("{tmp}/missing/g.dot", 2, "no directory"),
        ("{tmp}/a-file/g.dot", 2, "no directory"),
        ("/proc/handoff-graph.dot", 2, "cannot write it: No such file or directory"),
    ],
)
def test_graph_to_an_output_that_cannot_be_written_is_one_line(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], output: str, status: int, reason: str
):
    (tmp_path / "a-file").write_text("")
    output = output.format(tmp=tmp_path)
    for format in ("dot", "json"):
        assert _trace_cli.main(["graph", str(saved), "--format", format, "-o", output]) == status
        err = capsys.readouterr().err
        assert err.startswith(f"handoff-trace: graph -o {output}: ") and reason in err and err.count("\n") == 1, err


def test_graph_of_a_trace_without_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    path = tmp_path / "nograph.json"
    path.write_text(json.dumps(chrome_trace(EVENTS)))
    assert _trace_cli.main(["graph", str(path)]) == 2
    assert "holds no ownership graph" in capsys.readouterr().err


def test_graph_images_without_graphviz_say_how_to_get_it(
    saved: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: None)
    assert _trace_cli.main(["graph", str(saved), "--format", "svg"]) == 2
    err = capsys.readouterr().err
    assert "apt-get install graphviz" in err and "--format dot" in err


def test_graph_images_are_drawn_by_dot(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    fake = tmp_path / "dot"
    fake.write_text('#!/bin/sh\n[ "$1" = -Tpng ] && [ "$2" = -o ] && cat > "$3"\n')
    fake.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: str(fake) if name == "dot" else None)
    assert _trace_cli.main(["graph", str(saved), "--format", "png"]) == 0
    assert saved.with_suffix(".png").read_text() == graph_to_dot(GRAPH)
    assert str(saved.with_suffix(".png")) in capsys.readouterr().out
    failing = tmp_path / "failing-dot"
    failing.write_text("#!/bin/sh\necho 'syntax error' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setattr(shutil, "which", lambda name, *args, **kwargs: str(failing))
    assert _trace_cli.main(["graph", str(saved), "--format", "svg", "-o", str(tmp_path / "x.svg")]) == 1
    assert "syntax error" in capsys.readouterr().err


def test_no_command_and_info_print_the_runtime(capsys: pytest.CaptureFixture[str]):
    assert _trace_cli.main([]) == 0
    default = capsys.readouterr().out
    assert default.startswith(f"handoff {handoff.__version__}") and "backend" in default
    assert _trace_cli.main(["info"]) == 0
    assert capsys.readouterr().out == default
    assert _trace_cli.main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out) == handoff.runtime_info()
    assert _trace_cli.main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == handoff.runtime_info()
    assert _trace_cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"handoff-trace {handoff.__version__}\n"


@pytest.mark.parametrize("command", ["run", "show", "graph", "attach", "info"])
def test_each_command_has_help(command: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        _trace_cli.main([command, "--help"])
    assert exit_.value.code == 0
    assert f"usage: handoff-trace {command}" in capsys.readouterr().out


# --- handoff-trace attach -------------------------------------------------------------------------


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # Short: a Unix socket's path has at most 107 bytes.
    folder = Path(tempfile.mkdtemp(prefix="ht-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def serve(path: Path, lines: list[str], hold: threading.Event | None = None) -> threading.Thread:
    """A fake traced process's socket at `path`: sends `lines` to its one client, then (after `hold`
    is set, if given) closes the connection."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def run() -> None:
        try:
            server.settimeout(30)
            connection, _ = server.accept()
            with connection:
                for line in lines:
                    connection.sendall(line.encode() + b"\n")
                if hold is not None:
                    hold.wait(30)
        except OSError:
            pass  # the client left early: what --count does
        finally:
            server.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


HELLO = json.dumps({"hello": "handoff", "version": "0.1.0", "pid": os.getpid()})
LIVE = [json.dumps(as_json(e)) for e in EVENTS[:4]]


def test_attach_prints_each_event_until_the_process_ends(runtime_dir: Path, capsys: pytest.CaptureFixture[str]):
    path = runtime_dir / "handoff" / f"trace-{os.getpid()}.sock"
    thread = serve(path, [HELLO, LIVE[0], json.dumps({"dropped": 5}), LIVE[2], "garbage"])
    assert _trace_cli.main(["attach", str(os.getpid())]) == 0
    thread.join(10)
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert len(lines) == 2
    assert "import" in lines[0] and "torch -> handoff" in lines[0] and "float32[4, 4] 64 B" in lines[0]
    assert "stream 0x10 -> 0x20" in lines[0] and "wait" in lines[0] and f"at {TRAIN}:10" in lines[0]
    assert "HAZARD unordered" in lines[1] and f"at {TRAIN}:20" in lines[1] and "stream 0x10 -> host" in lines[1]
    assert f"attached to process {os.getpid()} (handoff 0.1.0)" in err
    assert "... 5 events dropped (client too slow)" in err
    assert "not a JSON object" in err and "it has ended" in err


def test_attach_json_prints_the_lines_and_count_stops_early(runtime_dir: Path, capsys: pytest.CaptureFixture[str]):
    path = runtime_dir / "handoff" / f"trace-{os.getpid()}.sock"
    hold = threading.Event()
    thread = serve(path, [HELLO, *LIVE], hold)
    try:
        assert _trace_cli.main(["attach", str(os.getpid()), "--json", "--count", "3", "--timeout", "20"]) == 0
    finally:
        hold.set()
        thread.join(10)
    assert capsys.readouterr().out.splitlines() == LIVE[:3]


def test_attach_stops_at_its_timeout(runtime_dir: Path, capsys: pytest.CaptureFixture[str]):
    path = runtime_dir / "handoff" / f"trace-{os.getpid()}.sock"
    hold = threading.Event()
    thread = serve(path, [HELLO, LIVE[0]], hold)
    try:
        assert _trace_cli.main(["attach", str(os.getpid()), "--timeout", "0.5"]) == 0
    finally:
        hold.set()
        thread.join(10)
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 1 and "stopped after 0.5 s" in err


def test_attach_finds_the_socket_under_tmpdir_without_xdg_runtime_dir(
    runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    path = runtime_dir / f"handoff-{os.geteuid()}" / f"trace-{os.getpid()}.sock"
    assert _trace_cli.socket_paths(os.getpid()) == [path]
    thread = serve(path, [HELLO, LIVE[0]])
    assert _trace_cli.main(["attach", str(os.getpid())]) == 0
    thread.join(10)
    assert "torch -> handoff" in capsys.readouterr().out
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime_dir / "not-a-folder"))
    assert _trace_cli.socket_paths(os.getpid()) == [path]


@pytest.mark.parametrize(
    "lines", [[HELLO, LIVE[0], '{"error": "refused: not the same user"}'], ['{"error": "refused: too many clients"}']]
)
def test_attach_reports_a_refusal(runtime_dir: Path, capsys: pytest.CaptureFixture[str], lines: list[str]):
    path = runtime_dir / "handoff" / f"trace-{os.getpid()}.sock"
    thread = serve(path, lines)
    assert _trace_cli.main(["attach", str(os.getpid())]) == 1
    thread.join(10)
    err = capsys.readouterr().err
    assert f"handoff-trace: process {os.getpid()}: refused: " in err


def test_attach_to_a_process_not_serving_says_how_to_serve(runtime_dir: Path, capsys: pytest.CaptureFixture[str]):
    assert _trace_cli.main(["attach", str(os.getpid())]) == 1
    err = capsys.readouterr().err
    assert f"process {os.getpid()} is not serving its trace" in err
    assert "HANDOFF_TRACE_SOCKET=1" in err and "handoff.serve_trace()" in err


OTHER_UID = 65534  # nobody
needs_another_user = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to run as another user"
)


def as_user(uid: int, *command: str) -> list[str]:
    return ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", *command]


@contextlib.contextmanager
def serving_process(uid: int) -> Iterator[tuple[int, Path]]:
    """A process of user `uid` that serves its trace (under /tmp, as with no XDG_RUNTIME_DIR) until
    the block ends: its pid and its socket."""
    env = {key: value for key, value in os.environ.items() if key != "XDG_RUNTIME_DIR"}
    code = "import handoff, sys\nprint(handoff.serve_trace(), flush=True)\nsys.stdin.read()"
    command = [sys.executable, "-c", code]
    server = subprocess.Popen(
        as_user(uid, *command) if uid != os.geteuid() else command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**env, "TMPDIR": "/tmp", "HOME": "/tmp"},
        cwd="/tmp",
    )
    with server:  # closes its pipes: the closed stdin makes it leave, removing its socket
        assert server.stdout is not None
        yield server.pid, Path(server.stdout.readline().strip())


@needs_another_user
def test_attach_to_another_users_process_reaches_its_refusal(capsys: pytest.CaptureFixture[str]):
    with serving_process(OTHER_UID) as (pid, path):
        assert path == Path(f"/tmp/handoff-{OTHER_UID}/trace-{pid}.sock")
        assert _trace_cli.socket_paths(pid)[0] == path, "found where that user's process serves it"
        assert _trace_cli.main(["attach", str(pid), "--timeout", "20"]) == 1
    err = capsys.readouterr().err
    assert err == f"handoff-trace: process {pid}: refused: peer uid 0 is not the server's uid {OTHER_UID}\n"


@needs_another_user
def test_attach_as_another_user_says_whose_process_it_is():
    cli = "import sys\nfrom handoff._trace_cli import main\nsys.exit(main())"
    with serving_process(0) as (pid, path):
        assert path.parent == Path("/tmp/handoff-0")
        result = subprocess.run(
            as_user(OTHER_UID, sys.executable, "-c", cli, "attach", str(pid), "--timeout", "20"),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd="/tmp",
            env={key: value for key, value in os.environ.items() if key != "XDG_RUNTIME_DIR"},
        )
    assert result.returncode == 1
    assert result.stderr.startswith("handoff-trace: permission denied: ")
    assert f"process {pid} runs as uid 0: attach as the user that runs it" in result.stderr
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def test_attach_to_no_process(runtime_dir: Path, capsys: pytest.CaptureFixture[str]):
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    assert _trace_cli.main(["attach", str(ended.pid)]) == 1
    assert f"no process with id {ended.pid}" in capsys.readouterr().err


def test_attach_to_a_stale_socket(runtime_dir: Path, capsys: pytest.CaptureFixture[str]):
    path = runtime_dir / "handoff" / f"trace-{os.getpid()}.sock"
    path.parent.mkdir()
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.close()  # the file stays, nobody listens
    assert _trace_cli.main(["attach", str(os.getpid())]) == 1
    assert "stale socket" in capsys.readouterr().err


def test_attach_to_something_else(runtime_dir: Path, capsys: pytest.CaptureFixture[str]):
    path = runtime_dir / "handoff" / f"trace-{os.getpid()}.sock"
    thread = serve(path, ["HTTP/1.1 200 OK"])
    assert _trace_cli.main(["attach", str(os.getpid())]) == 1
    thread.join(10)
    assert "is not a handoff trace socket" in capsys.readouterr().err


def test_attach_skips_odd_values_a_server_sends(runtime_dir: Path, capsys: pytest.CaptureFixture[str]):
    path = runtime_dir / "handoff" / f"trace-{os.getpid()}.sock"
    odd = [
        '{"kind": {"x": 1}}',
        '{"time_ns": NaN}',
        json.dumps({**as_json(EVENTS[0]), "time_ns": 10**30}),
        "[" * 5000 + "]" * 5000,
    ]
    thread = serve(path, [HELLO, *odd])
    assert _trace_cli.main(["attach", str(os.getpid())]) == 0
    thread.join(10)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert err.count("skipped") == 3, err  # the huge time is shown as "?"
    assert out.count("\n") == 1 and out.startswith("?")


# --- handoff-trace run ----------------------------------------------------------------------------


def child_script(trace: dict[str, Any], report: Path, status: int) -> str:
    """A program that writes `trace` where HANDOFF_TRACE says, with what it saw of its start-up to
    `report`, and exits with `status` without running exit handlers (a traced handoff would write
    its own trace at exit)."""
    return textwrap.dedent(f"""
        import json, os, sys
        seen = {{
            "handoff_imported": "handoff" in sys.modules,
            "original_ran": os.environ.get("HANDOFF_TEST_ORIGINAL_SITECUSTOMIZE"),
            "sitecustomize": getattr(sys.modules.get("sitecustomize"), "__file__", None),
            "pythonpath": os.environ["PYTHONPATH"],
            "trace": os.environ["HANDOFF_TRACE"],
        }}
        with open({str(report)!r}, "w") as f:
            json.dump(seen, f)
        with open(os.environ["HANDOFF_TRACE"].replace("%p", str(os.getpid())), "w") as f:
            f.write({json.dumps(trace)!r})
        sys.stdout.flush()
        os._exit({status})
    """)


@pytest.fixture
def original_sitecustomize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A sitecustomize.py already on the PYTHONPATH that `run` gives its program."""
    folder = tmp_path / "original"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text("import os\nos.environ['HANDOFF_TEST_ORIGINAL_SITECUSTOMIZE'] = '1'\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    return folder


def test_run_prints_the_summary_and_exits_with_the_programs_status(
    tmp_path: Path, original_sitecustomize: Path, capsys: pytest.CaptureFixture[str]
):
    report, output = tmp_path / "report.json", tmp_path / "out" / "trace.json"
    output.parent.mkdir()
    script = child_script(chrome_trace(EVENTS, graph=GRAPH), report, 3)
    assert _trace_cli.main(["run", "-o", str(output), "--", sys.executable, "-c", script]) == 3
    out, err = capsys.readouterr()
    assert out == ""  # the program's stdout is its own
    assert f"handoff trace of {sys.executable} -c" in err and "2x  unordered" in err and f"{TRAIN}:20" in err
    assert f"trace saved to {output}" in err
    saved = json.loads(output.read_text())["handoff"]
    assert [{k: v for k, v in e.items() if k != "pid"} for e in saved["events"]] == as_json(EVENTS)
    assert len(saved["processes"]) == 1 and {e["pid"] for e in saved["events"]} == set(saved["processes"])

    seen = json.loads(report.read_text())
    assert Path(seen["trace"]).name == "trace-%p.json", "each process writes its own file"
    shim = seen["pythonpath"].split(os.pathsep)[0]
    assert Path(shim, "sitecustomize.py") != original_sitecustomize / "sitecustomize.py"
    assert seen["pythonpath"].split(os.pathsep)[1] == str(original_sitecustomize)
    assert seen["handoff_imported"] is True  # by the shim: the program does not import it
    # The shim ran the sitecustomize it hides, which is then the module of that name.
    assert seen["original_ran"] == "1" and seen["sitecustomize"] == str(original_sitecustomize / "sitecustomize.py")
    assert not Path(shim).exists(), "the shim's folder is removed afterwards"


def test_run_json_prints_the_events_on_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    script = child_script(chrome_trace(EVENTS), tmp_path / "report.json", 0)
    assert _trace_cli.main(["run", "--json", sys.executable, "-c", script]) == 0
    out, err = capsys.readouterr()
    assert [{k: v for k, v in e.items() if k != "pid"} for e in json.loads(out)] == as_json(EVENTS)
    assert "HAZARDS" not in err
    trace = json.loads((tmp_path / "report.json").read_text())["trace"]
    assert not Path(trace).parent.exists(), "the temporary traces are removed"


def test_run_says_when_no_trace_was_written(capsys: pytest.CaptureFixture[str]):
    assert _trace_cli.main(["run", "--", sys.executable, "-S", "-c", "raise SystemExit(5)"]) == 5
    assert "no trace was written" in capsys.readouterr().err
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    assert _trace_cli.main(["run", "--", sys.executable, "-S", "-c", kill]) == 128 + signal.SIGTERM


def test_run_keeps_an_existing_output_file_unread_when_no_new_trace_comes(
    saved: Path, capsys: pytest.CaptureFixture[str]
):
    assert _trace_cli.main(["run", "-o", str(saved), "--", sys.executable, "-S", "-c", "pass"]) == 0
    assert "no trace was written" in capsys.readouterr().err


def test_run_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    assert _trace_cli.main(["run"]) == 2
    assert "no command given" in capsys.readouterr().err
    assert _trace_cli.main(["run", "--", "/nonexistent/program"]) == 127
    assert "command not found" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("output", "reason"),
    [
        ("{tmp}", "is a directory; name the file to write"),
        ("{tmp}/missing/t.json", "no directory {tmp}/missing to write it in"),
        ("{tmp}/a-file/t.json", "no directory {tmp}/a-file to write it in"),
        ("/proc/handoff-run.json", "cannot write it: No such file or directory"),
    ],
)
@pytest.mark.parametrize(("program_status", "status"), [(3, 3), (0, 1)])
def test_run_says_at_once_that_it_cannot_write_its_output_and_still_runs_the_program(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    output: str,
    reason: str,
    program_status: int,
    status: int,
):
    (tmp_path / "a-file").write_text("")
    output, reason = output.format(tmp=tmp_path), reason.format(tmp=tmp_path)
    report = tmp_path / "report.json"
    script = child_script(chrome_trace(EVENTS), report, program_status)
    assert _trace_cli.main(["run", "-o", output, "--", sys.executable, "-c", script]) == status
    first, *rest = capsys.readouterr().err.splitlines()
    assert first == f"handoff-trace: run -o {output}: {reason} (the program runs, its trace is not saved)"
    assert report.exists(), "the program ran"
    assert "EXCHANGES" in rest and "2x  unordered" in "\n".join(rest), "its summary is printed"
    assert any(line.startswith(f"handoff-trace: run -o {output}: cannot write it: ") for line in rest), (
        "the trace's loss is said again at its end"
    )
    assert not any("Traceback" in line or "trace saved" in line for line in rest)


def test_run_makes_no_output_file_when_no_trace_comes(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    output = tmp_path / "t.json"
    assert _trace_cli.main(["run", "-o", str(output), "--", sys.executable, "-S", "-c", "pass"]) == 0
    assert not output.exists(), "checking the path left no empty file"


@pytest.mark.parametrize(("program_status", "status"), [(3, 3), (0, 1)])
def test_run_that_cannot_save_its_trace_keeps_the_summary_and_the_programs_status(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], program_status: int, status: int
):
    script = child_script(chrome_trace(EVENTS), tmp_path / "report.json", program_status)
    assert _trace_cli.main(["run", "-o", "/dev/full", "--", sys.executable, "-c", script]) == status
    err = capsys.readouterr().err
    assert "handoff-trace: run -o /dev/full: cannot write it: No space left on device\n" in err
    assert "EXCHANGES" in err and "2x  unordered" in err, "the summary is printed"
    assert "trace saved" not in err and "Traceback" not in err


def test_the_shim_never_breaks_the_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
):
    # A `handoff` that cannot be imported, first on the path: the program runs, untraced.
    broken = tmp_path / "broken"
    (broken / "handoff").mkdir(parents=True)
    (broken / "handoff" / "__init__.py").write_text("raise ImportError('not here')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken))
    assert _trace_cli.main(["run", "--", sys.executable, "-c", "print('ran')"]) == 0
    out, err = capfd.readouterr()
    assert out == "ran\n" and "no trace was written" in err and "Traceback" not in err
    # A broken one: one line says so, and the program still runs.
    (broken / "handoff" / "__init__.py").write_text("raise RuntimeError('broken')\n")
    assert _trace_cli.main(["run", "--", sys.executable, "-c", "print('ran')"]) == 0
    out, err = capfd.readouterr()
    assert out == "ran\n" and "handoff failed to import: RuntimeError('broken')" in err


def test_a_trace_merged_from_processes_tells_their_exchanges_and_arrows_apart():
    # Each process counts its views and buffers from 1: the same ids name two exchanges here.
    def exchange(producer: str, start: int) -> list[dict[str, Any]]:
        ordered = {"producer_stream": 0x10, "consumer_stream": 0x20, "action": "wait", "producer": producer}
        return [
            event(time_ns=start, **ordered),
            event(time_ns=start + 10, kind="release", consumer=None, view=None, **ordered),
        ]

    merged = _trace_cli.merge_traces(
        [(100, {"events": exchange("torch", 1_000), "dropped": 0}), (200, {"events": exchange("numpy", 2_000)})]
    )
    text = summary(merged["handoff"]["events"])
    rows = {
        line.split()[0]: line.split()[1:5] for line in text.splitlines() if line.split()[:1] in (["torch"], ["numpy"])
    }
    assert rows == {"torch": ["handoff", "1", "0", "1"], "numpy": ["handoff", "1", "0", "1"]}, text
    flows: dict[tuple[Any, ...], list[int]] = {}
    for e in merged["traceEvents"]:
        if e.get("ph") in ("s", "f"):
            flows.setdefault((e["cat"], e["name"], e["id"], e["ph"]), []).append(e["pid"])
    assert flows and all(len(pids) == 1 for pids in flows.values()), "a flow id is global to the file"
    assert {pids[0] for pids in flows.values()} == {100, 200}


def _unfinished(tmp_path: Path, pid: int, started: int | None) -> None:
    (tmp_path / f"trace-{pid}.json").write_text(json.dumps(unfinished_trace(pid, started)))


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads start times from /proc")
def test_a_process_is_waited_for_only_while_it_is_the_one_that_began_the_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    state = process_state(os.getpid())
    assert state is not None
    ended = subprocess.run(["/bin/sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
    dead = int(ended.stdout)
    _unfinished(tmp_path, os.getpid(), state[1] + 1)  # a pid another process took since: not it
    _unfinished(tmp_path, dead, None)  # gone
    (tmp_path / "trace-7.json").write_text('{"handoff": ')  # still being written, then given up on
    traces, running = _trace_cli._settled_traces(tmp_path, patience_s=0.0)
    assert sorted(pid for pid, _ in traces) == sorted([os.getpid(), dead]) and running == []
    assert capsys.readouterr().err.count("skipped trace-7.json") == 1, "said once, when the wait ends"
    _unfinished(tmp_path, os.getpid(), state[1])  # the control: this very process, still running
    assert _trace_cli._settled_traces(tmp_path, patience_s=0.0)[1] == [os.getpid()]
    merged = _trace_cli.merge_traces(_trace_cli._settled_traces(tmp_path, patience_s=0.0)[0], [os.getpid()])
    assert (merged["handoff"]["unfinished"], merged["handoff"]["still_running"]) == ([dead], [os.getpid()])
    saved = tmp_path / "merged.json"
    saved.write_text(json.dumps(merged))
    capsys.readouterr()
    assert _trace_cli.main(["show", str(saved)]) == 0
    err = capsys.readouterr().err
    assert f"process {dead} ended without saving" in err and f"process {os.getpid()} still ran" in err


def test_run_does_not_wait_for_or_report_a_forked_child_that_runs_another_program(tmp_path: Path):
    # Every fork began a trace file: a subprocess started with preexec_fn (forked, then another
    # program) was reported as killed, or waited for while it ran.
    script = "import os, subprocess; subprocess.run(['true'], preexec_fn=os.getpid, check=True)"
    output = tmp_path / "trace.json"
    done = subprocess.run(
        [sys.executable, "-m", "handoff._trace_cli", "run", "-o", str(output), "--", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    section = json.loads(output.read_text())["handoff"]
    assert (section["unfinished"], section["still_running"]) == ([], [])
    assert "without saving" not in done.stderr and "still ran" not in done.stderr


TERMINATED = """
import os, select, signal, sys, numpy as np, handoff
signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))  # ends as it chooses: its exit writes its trace
# signal.pause() would miss a termination that came between the print and the pause (the handler
# runs between bytecodes): the wake-up byte Python writes for each signal is waited on instead.
woken, wake = os.pipe()
os.set_blocking(wake, False)
signal.set_wakeup_fd(wake)
handoff.from_dlpack(np.ones(3))
print("ready", flush=True)
select.select([woken], [], [])
"""


def test_run_passes_a_termination_on_to_the_program_and_still_sums_up_what_it_traced(tmp_path: Path):
    # A job scheduler or `timeout` ends handoff-trace with SIGTERM: the program was orphaned, its
    # trace lost and the scratch folder left behind.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-m", "handoff._trace_cli", "run", "--", sys.executable, "-c", TERMINATED]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert run.stdout.readline() == "ready\n"
        run.send_signal(signal.SIGTERM)
        _, err = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 7, err
    assert re.search(r"numpy +handoff +1 ", err) and "2 events" in err
    assert not list(tmp_path.glob("handoff-trace-*")), "the scratch folder is removed"


def test_a_relative_trace_path_is_where_the_program_started(tmp_path: Path):
    (tmp_path / "elsewhere").mkdir()
    code = "import os, numpy as np, handoff; handoff.from_dlpack(np.ones(2)); os.chdir('elsewhere')"
    env = {**os.environ, "HANDOFF_TRACE": "trace.json"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "trace.json").exists() and not (tmp_path / "elsewhere" / "trace.json").exists()


# A Ray job: a task exchanges an array on a worker; before the shutdown it says which of Ray's
# processes run its services (by their scripts, RAY_SERVICES) and which processes began a trace file.
RAY_JOB = """
import json, os, pathlib
import numpy as np
import ray
import handoff
from handoff._process_trace import RAY_SERVICES

ray.init(address="local", num_cpus=1, log_to_driver=False)  # a cluster of its own, under `run`

@ray.remote
def total(x):
    return os.getpid(), float(np.from_dlpack(handoff.from_dlpack(x)).sum())

worker, result = ray.get(total.remote(np.ones(3)))
package = pathlib.Path(ray.__file__).parent
scripts = {str(package.joinpath(*parts)) for parts in RAY_SERVICES}
services = []
for entry in pathlib.Path("/proc").iterdir():
    try:
        arguments = (entry / "cmdline").read_bytes().decode().split(chr(0))
    except (OSError, ValueError):
        continue
    if scripts & set(arguments):
        services.append(int(entry.name))
folder = pathlib.Path(os.environ["HANDOFF_TRACE"]).parent
traced = [int(p.stem.removeprefix("trace-")) for p in folder.glob("trace-*.json")]
print(json.dumps({"worker": worker, "result": result, "services": services, "traced": traced}), flush=True)
ray.shutdown()
"""


def test_run_leaves_rays_own_services_untraced_and_traces_its_workers():
    # Ray's dashboard, log monitor, agents and autoscaler monitor imported handoff as any Python
    # process under `run` does, and Ray ends them without an exit: each was reported as a process
    # whose trace was lost, in a program whose exchanges are all in its driver and workers.
    pytest.importorskip("ray", reason="the job runs a local Ray cluster")
    command = [sys.executable, "-m", "handoff._trace_cli", "run", "--", sys.executable, "-c", RAY_JOB]
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"worker"')))
    assert seen["result"] == 3.0
    assert seen["services"], "the control: Ray runs services of its own"
    assert seen["worker"] in seen["traced"], "a worker, which runs the program's tasks, is traced"
    assert not set(seen["services"]) & set(seen["traced"]), "no service began a trace"
    said = "\n".join(line for line in done.stderr.splitlines() if line.startswith("handoff-trace:"))
    for service in seen["services"]:
        assert not re.search(rf"\b{service}\b", said), said


def test_only_rays_service_scripts_are_services(tmp_path: Path):
    ray = pytest.importorskip("ray", reason="needs the ray package's files")
    from handoff._process_trace import RAY_SERVICES, is_ray_service

    package = Path(ray.__file__).parent
    for parts in RAY_SERVICES:
        assert is_ray_service(str(package.joinpath(*parts))), parts
    assert not is_ray_service(str(package / "_private" / "workers" / "default_worker.py"))
    lookalike = tmp_path / "ray" / "dashboard" / "dashboard.py"  # a program's own folder named ray
    assert not is_ray_service(str(lookalike))
    assert not is_ray_service("-c") and not is_ray_service("") and not is_ray_service(None)  # type: ignore[arg-type]
