"""Exchange tracing in Python: the ``with handoff.trace()`` block, a trace's text summary, its Chrome
trace JSON (Perfetto, chrome://tracing), the ownership graph as Graphviz DOT, and the classification
of source files into libraries that the runtime uses to find the user code behind an exchange.

The runtime records the events (see ``_handoff._trace_begin``); everything here only reads them, so
it also works on events loaded from a saved trace file.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import site
import sysconfig
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Union

from . import _activity, _handoff, _settings
from ._activity import complete_slice

__all__ = [
    "chrome_trace",
    "device_name",
    "format_event",
    "graph_to_dot",
    "library_of_file",
    "summary",
    "trace",
]

Event = dict[str, Any]
Graph = dict[str, Any]
PathLike = Union[str, "os.PathLike[str]"]

# The short name of each DLPack device type, by its code (the runtime owns the table).
_DEVICE_NAMES: dict[int, str] = _handoff._device_type_labels()

# Shown for a library that is None: an export asked for by user code, or a producer not known.
_NO_LIBRARY = "-"


def _snapshot_graph() -> Graph:
    """The ownership graph now."""
    return dict(_handoff._ownership_graph())


def _version() -> str:
    return str(_handoff.__version__)


class trace:
    """Records the exchanges made while the block runs, on every thread.

    Used as ``with handoff.trace() as t: ...``; afterwards ``t.events`` holds one dict per import,
    export and release, ``t.hazards()`` those with a hazard, ``t.summary()`` a text report, and
    ``t.graph`` the ownership graph as it was when the block ended.

    Args:
        path: Where to save the trace as Chrome trace JSON when the block ends (open it in
            https://ui.perfetto.dev or chrome://tracing, or with ``handoff-trace show``).
        limit: Keep at most the newest ``limit`` events, and up to ``limit`` older hazards besides
            (``dropped`` counts the rest); None keeps every event.
        libraries: Also record the exchanges between other libraries (NumPy, PyTorch, CuPy, JAX,
            numba-cuda, cuda.core and those registered with :func:`handoff.register_library`)
            that the program makes without handoff, while the block runs.
        launches: Also record every kernel launch, copy, set, stream operation and host
            synchronization of the process (CUDA: through CUPTI; the simulator: its own
            operations), and check them for races after the exchange: a ``"race"`` or ``"reuse"``
            hazard names both sides. Where the backend cannot report them, ``launch_problem`` says
            why and the exchanges are recorded as usual.
    """

    def __init__(
        self,
        path: PathLike | None = None,
        *,
        limit: int | None = None,
        libraries: bool = False,
        launches: bool = False,
    ) -> None:
        _settings.check_limit(limit)
        for name, value in (("libraries", libraries), ("launches", launches)):
            if not isinstance(value, bool):  # "false" would turn it on
                raise TypeError(f"handoff.trace({name}=...) takes True or False, not {value!r}")
        self._path: str | None = os.fspath(path) if path is not None else None
        self._limit = limit
        self._libraries = libraries
        self._launches = launches
        self._watching = False
        #: Why device activity could not be recorded (``launches=True`` on a backend that cannot
        #: report it: no device, no CUPTI, no driver); None otherwise.
        self.launch_problem: str | None = None
        self._token: int | None = None
        self._events: list[Event] = []
        self._dropped = 0
        self._used = False
        #: The ownership graph when the block ended (None before, or when the runtime has none).
        self.graph: Graph | None = None

    def __enter__(self) -> trace:
        if self._used:
            raise RuntimeError("this handoff.trace was already used: each `with` block needs a new handoff.trace()")
        self._token = int(_handoff._trace_begin(self._limit or 0, self._launches))
        self._used = True
        if self._launches:
            self.launch_problem = _handoff._watch_activity(True)
            self._watching = self.launch_problem is None
        if self._libraries:
            from . import _interpose

            _interpose.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        token, self._token = self._token, None
        if token is None:
            return
        if self._libraries:
            from . import _interpose

            _interpose.release()
        if self._watching:
            self._watching = False
            _handoff._watch_activity(False)
        self._dropped = int(_handoff._trace_dropped(token))
        self._events = list(_handoff._trace_end(token))
        self.graph = _snapshot_graph()
        if self._path is not None:
            self.save(self._path)

    def __repr__(self) -> str:
        state = "recording" if self.active else ("finished" if self._used else "not started")
        return f"<handoff.trace {state}, {len(self.events)} events>"

    @property
    def active(self) -> bool:
        """Whether the block is running (events are still being recorded)."""
        return self._token is not None

    @property
    def events(self) -> list[Event]:
        """The events recorded so far while the block runs; all of them once it has ended."""
        if self._token is not None:
            return list(_handoff._trace_events(self._token))
        return list(self._events)

    @property
    def dropped(self) -> int:
        """How many events a trace with a ``limit`` no longer keeps (the oldest that were not hazards)."""
        if self._token is not None:
            return int(_handoff._trace_dropped(self._token))
        return self._dropped

    def hazards(self) -> list[Event]:
        """The events that the runtime flagged with a hazard (``event["hazard"]`` is not None)."""
        return [e for e in self.events if e.get("hazard") is not None]

    def summary(self) -> str:
        """A text report: the hazards first, then the exchanges per producer and consumer (and, with
        ``launches=True``, the device activity and the host waits by line)."""
        return summary(
            self.events,
            title="handoff trace",
            dropped=self.dropped,
            limit=self._limit,
            launch_problem=self.launch_problem,
        )

    def save(self, path: PathLike) -> None:
        """Writes the trace as Chrome trace JSON, with the raw events and graph under ``"handoff"``."""
        graph = self.graph if not self.active else _snapshot_graph()
        data = chrome_trace(self.events, graph=graph, pid=os.getpid())
        data["handoff"].update(dropped=self.dropped, limit=self._limit)
        if self.launch_problem is not None:
            data["handoff"]["launch_problem"] = self.launch_problem
        Path(path).write_text(dumps(data), encoding="utf-8")


def dumps(data: Any) -> str:
    """Strict JSON text (no NaN or Infinity, which Perfetto rejects); tuples become lists."""
    return json.dumps(data, allow_nan=False, ensure_ascii=False, default=str)


# --- reading events -------------------------------------------------------------------------------


def device_name(device: Any) -> str:
    """``"cuda:0"`` for the DLPack device ``(2, 0)``; ``"?"`` when the device is not a pair."""
    try:
        device_type, device_id = int(device[0]), int(device[1])
    except (TypeError, ValueError, IndexError, KeyError):
        return "?"
    return f"{_DEVICE_NAMES.get(device_type, f'device{device_type}')}:{device_id}"


def _library(name: Any) -> str:
    return _NO_LIBRARY if name is None else str(name)


def _pair(event: Mapping[str, Any]) -> str:
    return f"{_library(event.get('producer'))} -> {_library(event.get('consumer'))}"


def _stream(handle: Any) -> str:
    if handle is None:
        return "host"
    try:
        return hex(int(handle))
    except (TypeError, ValueError):
        return str(handle)


def _human_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _data(event: Mapping[str, Any]) -> str:
    """``float32[2, 3] 24 B``; ``?`` for what the event does not know (a release of a buffer exchanged
    before the trace began)."""
    shape, dtype, nbytes = event.get("shape"), event.get("dtype"), event.get("nbytes")
    dims = ", ".join(str(d) for d in shape) if isinstance(shape, (list, tuple)) else "?"
    size = "? B" if nbytes is None else _human_bytes(_activity.int_or_zero(nbytes))
    return f"{'?' if dtype is None else dtype}[{dims}] {size}"


def format_event(event: Mapping[str, Any]) -> str:
    """One line for an event: time, kind, producer -> consumer, array, streams, action, hazard, where
    (for device activity: time, kind, operation, kernel, stream, memory, blocked time, hazard, where)."""
    time_ns = _activity.int_or_zero(event.get("time_ns"))
    try:
        stamp = f"{time.strftime('%H:%M:%S', time.localtime(time_ns // 1_000_000_000))}.{time_ns % 1_000_000_000 // 1000:06d}"
    except (OverflowError, OSError, ValueError):  # a time no clock shows
        stamp = "?"
    if _activity.is_activity(event):
        return f"{stamp}  {_activity.format_activity(event, device_name(event.get('device')))}"
    parts = [
        stamp,
        f"{event.get('kind', '?')!s:<7}",
        _pair(event),
        _data(event),
        device_name(event.get("device")),
        f"stream {_stream(event.get('producer_stream'))} -> {_stream(event.get('consumer_stream'))}",
        str(event.get("action", "?")),
    ]
    if event.get("hazard") is not None:
        parts.append(f"HAZARD {event['hazard']}")
    if event.get("where"):
        parts.append(f"at {event['where']}")
    return "  ".join(parts)


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def _own_actions(events: Sequence[Mapping[str, Any]]) -> list[bool]:
    """Per event, whether its action is its own to count. An import from an exporter that handoff
    runs itself (handoff.Exporter, handoff.sim) records two events, the export to "handoff" and the
    import, with one action between them: the import's counts, and the matching export's does not."""

    def key(event: Mapping[str, Any]) -> tuple[str, ...]:
        return tuple(
            str(event.get(k)) for k in ("pid", "thread", "where", "producer_stream", "consumer_stream", "action")
        )

    imports = Counter(key(e) for e in events if e.get("kind") == "import")
    own = []
    for event in events:
        if event.get("kind") == "export" and event.get("consumer") == "handoff" and imports[key(event)] > 0:
            imports[key(event)] -= 1
            own.append(False)
        else:
            own.append(True)
    return own


# --- the text summary -----------------------------------------------------------------------------


def _table(
    header: Sequence[str], rows: Iterable[Sequence[str]], *, right: Iterable[int] = (), indent: str = "  "
) -> list[str]:
    """Rows aligned under the header; the columns in `right` (numbers) are aligned to the right."""
    cells_of = [list(header), *([str(cell) for cell in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells_of) for i in range(len(header))]
    numeric = set(right)
    lines = []
    for row in cells_of:
        cells = [cell.rjust(w) if i in numeric else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def summary(
    events: Sequence[Mapping[str, Any]],
    *,
    title: str | None = None,
    dropped: int = 0,
    limit: int | None = None,
    processes: int = 1,
    launch_problem: str | None = None,
) -> str:
    """A human-readable report of `events`: hazards first (grouped by hazard and source line), then
    the exchanges per producer -> consumer pair, then the totals, the views still held when the
    trace ended (not hazards), and how many events a bounded trace dropped. A launch trace adds its
    device activity's counts and the host waits by line (`launch_problem`: why it has none).

    A library shown as ``-`` is not known: for a consumer, the export was asked for by user code.
    The waits, elided and unordered hand-offs count each hand-off once, though an import from an
    exporter that handoff runs records both halves. `processes` is how many processes' traces
    `events` merges.
    """
    lines = [title, "=" * len(title)] if title else []
    if launch_problem:
        lines.append(f"launches not recorded: {launch_problem}")
    held = [e for e in events if e.get("kind") == "held"]
    everything = [e for e in events if e.get("kind") != "held"]
    activity = [e for e in everything if _activity.is_activity(e)]
    exchanges = [e for e in everything if not _activity.is_activity(e)]
    if not exchanges and not held and not activity:
        return "\n".join([*lines, "no exchanges recorded", *_bounded_note(dropped, limit)])

    hazard_lines, hazard_count = _hazard_lines(everything)
    lines += [*hazard_lines, ""]
    if activity and (host_waits := _activity.host_wait_lines(everything, _table)):
        lines += [*host_waits, ""]
    table, totals = _exchange_lines(_exchange_counts(exchanges))
    lines += ["EXCHANGES", *table, ""]
    ordered = sum(1 for e in exchanges if e.get("interposed") == "ordered")
    lines.append(
        f"{_plural(len(exchanges), 'event')}"
        + (f" in {processes} processes" if processes > 1 else "")
        + f", {_plural(totals['wait'], 'wait')} inserted, {totals['elided']} elided, "
        f"{_plural(hazard_count, 'hazard')}" + (f", {ordered} ordered by handoff's hooks" if ordered else "")
    )
    if activity:
        lines.append(_activity.counts_line(activity))
    if held:
        lines.append(_held_line(held))
    lines += _bounded_note(dropped, limit)
    return "\n".join(lines)


def _hazard_lines(events: Sequence[Mapping[str, Any]]) -> tuple[list[str], int]:
    """The HAZARDS section, grouped by (hazard, where) in the order they first happened, each group
    with its first event's detail and fix; and how many hazards there are."""
    groups: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
    for event in events:
        if event.get("hazard") is not None:
            key = (str(event["hazard"]), str(event.get("where") or _NO_LIBRARY))
            groups.setdefault(key, []).append(event)
    if not groups:
        return ["no hazards"], 0
    count = sum(len(group) for group in groups.values())
    rows, details = [], []
    for (hazard, where), group in groups.items():
        first = group[0]
        pair = _activity.sides(first) if _activity.is_activity(first) else _pair(first)
        rows.append([f"{len(group)}x", hazard, where, str(first.get("kind", "?")), pair])
        details.append([str(first.get(key) or "") for key in ("detail", "fix")])
    table = _table(["count", "hazard", "where", "kind", "producer -> consumer"], rows, right=[0])
    lines = [f"HAZARDS ({count})", table[0]]
    for row, (detail, fix) in zip(table[1:], details):
        lines.append(row)
        if detail:
            lines.append(f"        {detail}")
        if fix:
            lines.append(f"        fix: {fix}")
    return lines, count


_EXCHANGE_COLUMNS = ("import", "export", "release", "wait", "elided", "unordered", "refused")


def _exchange_counts(events: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], dict[str, int]]:
    """The exchanges' counts per (producer, consumer), in the order the pairs first appear."""
    pairs: dict[tuple[str, str], dict[str, int]] = {}
    # A release names no consumer: it is counted with the hand-off it ends, found by its view's id
    # or else its buffer's latest import or export.
    pair_of: dict[Any, tuple[str, str]] = {}
    # An exchange makes one view: a later event of the same kind and view (a hazard reported at
    # exit, such as a leak, repeats the exchange's fields) is not another exchange. Ids count in
    # each process: those of a trace merged from several are told apart by their `pid`.
    exchanges: set[tuple[str, Any, str]] = set()
    for event, own_action in zip(events, _own_actions(events)):
        kind, view, pid = str(event.get("kind")), event.get("view"), event.get("pid")
        if kind in ("import", "export") and view is not None:
            if (kind, pid, str(view)) in exchanges:
                continue
            exchanges.add((kind, pid, str(view)))
        key = (_library(event.get("producer")), _library(event.get("consumer")))
        ids = [(pid, i) for i in (event.get("view"), event.get("buffer")) if i is not None]
        if kind == "release" and event.get("consumer") is None:
            key = next((pair_of[i] for i in ids if i in pair_of), key)
        elif kind in ("import", "export"):
            pair_of.update(dict.fromkeys(ids, key))
        counts = pairs.setdefault(key, dict.fromkeys((*_EXCHANGE_COLUMNS, "bytes"), 0))
        action = event.get("action")
        if kind in ("import", "export", "release"):
            counts[kind] += 1
            if kind != "release" and own_action:  # a release hands nothing over
                counts["bytes"] += _activity.int_or_zero(event.get("nbytes"))
        if own_action and action in ("wait", "elided", "unordered", "refused"):
            counts[str(action)] += 1
    return pairs


def _exchange_lines(pairs: dict[tuple[str, str], dict[str, int]]) -> tuple[list[str], dict[str, int]]:
    """The EXCHANGES table of `pairs` (with a total row where there are several), and the totals."""
    totals = {name: sum(c[name] for c in pairs.values()) for name in (*_EXCHANGE_COLUMNS, "bytes")}
    rows = [
        [producer, consumer, *(str(c[n]) for n in _EXCHANGE_COLUMNS), _human_bytes(c["bytes"])]
        for (producer, consumer), c in pairs.items()
    ]
    if len(pairs) > 1:
        rows.append(["total", "", *(str(totals[n]) for n in _EXCHANGE_COLUMNS), _human_bytes(totals["bytes"])])
    header = ["producer", "consumer", "imports", "exports", "releases", "waits", "elided", "unordered", "refused"]
    return _table([*header, "bytes"], rows, right=range(2, 10)), totals


def _held_line(held: Sequence[Mapping[str, Any]]) -> str:
    """The views still held when the trace ended, by the three places that made most of them."""
    places = Counter(str(e.get("where") or _NO_LIBRARY) for e in held)
    shown = ", ".join(f"{where} ({count})" for where, count in places.most_common(3))
    more = "" if len(places) <= 3 else f" and {len(places) - 3} more places"
    return f"{_plural(len(held), 'view')} still held when the trace ended (not a hazard): made at {shown}{more}"


def _bounded_note(dropped: int, limit: int | None) -> list[str]:
    if not dropped:
        return []
    kept = f"the newest {limit} events and the older hazards" if limit else "the newest events"
    return [
        f"{_plural(dropped, 'older event')} dropped: the trace keeps {kept} (HANDOFF_TRACE_LIMIT sets how many); "
        "the counts above are of the events kept"
    ]


# --- Chrome trace JSON ----------------------------------------------------------------------------


def _json_event(event: Mapping[str, Any]) -> Event:
    """A copy of `event` as JSON reads it back (the device, a tuple, as a list): the raw events a
    trace file keeps compare equal to what is read back."""
    out = dict(event)
    for key, value in out.items():
        if isinstance(value, tuple):
            out[key] = list(value)
    return out


def _slice_args(event: Mapping[str, Any]) -> Event:
    """What a slice shows in Perfetto: the exchange in one line, and a hazard's reason. The event itself
    is kept once, under ``"handoff"``."""
    args: Event = {"exchange": format_event(event)}
    if event.get("hazard") is not None:
        args.update(hazard=event["hazard"], detail=event.get("detail"))
    return args


def _track_name(key: tuple[Any, ...]) -> str:
    if key == ("host",):
        return "host"
    if key[0] == "thread":
        return f"host thread {key[1]} (waits)"
    device, handle = key
    name = f"{device_name(device)} stream {_stream(handle)}"
    return name + " (default)" if handle == 0 else name


def chrome_trace(
    events: Sequence[Mapping[str, Any]],
    *,
    graph: Mapping[str, Any] | None = None,
    pid: int | None = None,
    start_ns: int | None = None,
) -> dict[str, Any]:
    """The events as a Chrome trace JSON object (Perfetto, chrome://tracing): one track per stream,
    one slice per exchange on the consumer's stream (hazards flagged; its args the exchange in one
    line), and an arrow from the producer's stream to the consumer's for each wait that handoff
    inserted; for a launch trace, each device operation on its stream's track, each host wait on its
    thread's, and each race an arrow from its earlier side to its later one. The raw events, once,
    and the graph are kept under the ``"handoff"`` key, which ``handoff-trace show`` and ``graph``
    read.
    Times count from `start_ns` (default: the first event's), so that several processes' traces
    merged share one clock.
    """
    pid = 1 if pid is None else int(pid)
    raw = [_json_event(e) for e in events]
    start = _activity.earliest_ns(raw) if start_ns is None else start_ns
    tracks: dict[tuple[Any, ...], int] = {}

    def track(device: Any, handle: Any) -> int:
        key: tuple[Any, ...] = ("host",) if handle is None else (tuple(device or ()), _activity.int_or_zero(handle))
        return tracks.setdefault(key, len(tracks) + 1)

    def host_track(thread: Any) -> int:
        return tracks.setdefault(("thread", _activity.int_or_zero(thread)), len(tracks) + 1)

    slices: list[Event] = _activity.chrome_slices(raw, track=track, host_track=host_track, pid=pid, start=start)
    exchanges = [e for e in raw if not _activity.is_activity(e)]
    # Flow ids are global to a file: each process's count from its own base, the races' apart.
    flow_id = _activity.flow_base(pid)
    for event, own_action in zip(exchanges, _own_actions(exchanges)):
        ts = (_activity.int_or_zero(event.get("time_ns")) - start) / 1000.0
        device = event.get("device")
        consumer_stream, producer_stream = event.get("consumer_stream"), event.get("producer_stream")
        tid = track(device, consumer_stream if consumer_stream is not None else producer_stream)
        producer, consumer = event.get("producer") or "?", event.get("consumer") or "?"
        name = f"{event.get('kind', '?')} {producer}" + (f"\u2192{consumer}" if consumer != "?" else "")
        slice_ = complete_slice(
            name, "handoff", ts=ts, dur=1.0, pid=pid, tid=tid, args=_slice_args(event), hazard=event.get("hazard")
        )
        if event.get("hazard") is None and event.get("action") == "refused":
            slice_["cname"] = "bad"
        slices.append(slice_)
        if own_action and event.get("action") == "wait" and producer_stream is not None and consumer_stream is not None:
            # The arrow starts in a slice on the producer's track (a flow binds to enclosing slices).
            flow_id += 1
            source = track(device, producer_stream)
            args = {"buffer": event.get("buffer")}
            slices.append(
                complete_slice(f"ready for {consumer}", "handoff.wait", ts=ts, dur=1.0, pid=pid, tid=source, args=args)
            )
            slices += _activity.arrow("wait", "handoff.wait", flow_id, source=(source, ts), target=(tid, ts), pid=pid)

    metadata: list[Event] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": f"handoff (pid {pid})"}}
    ]
    for key, tid in tracks.items():
        metadata.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": _track_name(key)}})
        metadata.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return {
        "traceEvents": metadata + slices,
        "displayTimeUnit": "ns",
        "handoff": {
            "version": _version(),
            "events": raw,
            "graph": None if graph is None else json.loads(dumps(_activity.with_races(graph, raw))),
        },
    }


def unfinished_trace(pid: int, started: int | None) -> dict[str, Any]:
    """What a process of a job writes to its trace file as it begins: a trace with no events that says
    process `pid` (which started at `started`, in clock ticks since boot, where known) has not saved
    its own (``"unfinished": [pid]``). Its trace replaces it at exit."""
    section = {"version": _version(), "events": [], "graph": None, "unfinished": [pid], "started": started}
    return {"traceEvents": [], "displayTimeUnit": "ns", "handoff": section}


def process_state(pid: int | str) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) of process `pid` (``"self"``: this one), from
    Linux's /proc; None where it cannot be read. A pid reused later has another start time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def still_running_note(pids: Sequence[int]) -> str:
    """Why the processes `pids`, which outlived the program, have no events in its trace."""
    return f"{processes_named(pids)} still ran when the program ended: not traced here"


def processes_named(pids: Sequence[int]) -> str:
    """``process 12``, ``processes 12, 13``."""
    return f"process {pids[0]}" if len(pids) == 1 else f"processes {', '.join(map(str, pids))}"


def unfinished_note(pids: Sequence[int]) -> str:
    """Why the processes `pids` have no events in a trace, and how to keep them."""
    its = "its" if len(pids) == 1 else "their"
    return (
        f"{processes_named(pids)} ended without saving {its} trace (killed by a signal, or left through os._exit): {its} "
        "exchanges are missing. A multiprocessing Pool's terminate(), which leaving a "
        "`with Pool(...)` block calls, kills its workers: call pool.close() and pool.join() before the block ends "
        "to keep their traces"
    )


# --- the ownership graph as DOT -------------------------------------------------------------------


def _quote(text: Any) -> str:
    """A DOT quoted string: backslashes and quotes escaped, line breaks as DOT's centred ``\\n``."""
    escaped = str(text).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\n") + '"'


def _label(*lines: Any) -> str:
    """A DOT label of several lines, each escaped (a literal backslash stays one)."""
    return _quote("\n".join(str(line) for line in lines if line not in (None, "")))


_NODE_STYLES = {
    "buffer": 'shape=box, style="rounded,filled", fillcolor="#e8f0fe"',
    "view": 'shape=ellipse, style=filled, fillcolor="#fef7e0"',
    "stream": 'shape=hexagon, style=filled, fillcolor="#e6f4ea"',
}
_EDGE_STYLES = {
    "view-of": "style=solid",
    "ready-on": 'style=dashed, color="#1a73e8"',
    "released-after": 'style=dotted, color="#d93025"',
    "race": 'style=bold, color="#d93025", fontcolor="#d93025"',
    "reuse": 'style=bold, color="#d93025", fontcolor="#d93025"',
}


def _node_label(node: Mapping[str, Any]) -> str:
    kind = node.get("kind")
    if kind == "buffer":
        shape = node.get("shape")
        dims = "x".join(str(d) for d in shape) if isinstance(shape, (list, tuple)) else "?"
        holders = node.get("holders")
        return _label(
            f"{node.get('library') or '?'} buffer",
            f"{node.get('dtype', '?')} [{dims}]",
            device_name(node.get("device")),
            _human_bytes(_activity.int_or_zero(node.get("nbytes"))) if "nbytes" in node else None,
            None if holders is None else f"{holders} holder{'s' if holders != 1 else ''}",
            node.get("id"),
        )
    if kind == "view":
        return _label(node.get("holder") or "view", node.get("where"), node.get("id"))
    if kind == "stream":
        return _label(device_name(node.get("device")), f"stream {_stream(node.get('handle'))}")
    return _label(node.get("id"), kind)


def exchanges_between_libraries(events: Sequence[Mapping[str, Any]]) -> list[Event]:
    """The exchanges between other libraries that handoff's hooks saw (which the ownership graph, of
    handoff's own arrays, does not hold), per producer -> consumer pair: ``producer``, ``consumer``,
    ``imports``, ``hazards`` and ``protocols``, in the order they first happened."""
    pairs: dict[tuple[str, str], Event] = {}
    for event in events:
        if not event.get("interposed") or event.get("kind") not in ("import", "release"):
            continue
        producer, consumer = str(event.get("producer") or "?"), str(event.get("consumer") or "?")
        pair = pairs.setdefault(
            (producer, consumer),
            {"producer": producer, "consumer": consumer, "imports": 0, "hazards": 0, "protocols": []},
        )
        pair["imports"] += event.get("kind") == "import"
        pair["hazards"] += event.get("hazard") is not None
        if event.get("kind") == "import" and event.get("protocol") not in pair["protocols"]:
            pair["protocols"].append(event.get("protocol"))
    return list(pairs.values())


def graph_to_dot(graph: Mapping[str, Any], exchanges: Sequence[Mapping[str, Any]] = ()) -> str:
    """The ownership graph as Graphviz DOT: buffers as boxes, views as ellipses, streams as hexagons;
    ``view-of`` edges solid, ``ready-on`` dashed, ``released-after`` dotted. `exchanges` (see
    exchanges_between_libraries) are drawn beside it, a library per node and an edge per pair."""
    lines = [
        "digraph handoff {",
        "  rankdir=LR;",
        '  node [fontname="Helvetica", fontsize=10];',
        '  edge [fontname="Helvetica", fontsize=9];',
    ]
    if exchanges:
        lines.append('  subgraph cluster_libraries {\n    label="exchanges between other libraries";')
        for library in dict.fromkeys(name for pair in exchanges for name in (pair["producer"], pair["consumer"])):
            lines.append(f"    {_quote('library:' + library)} [shape=component, label={_quote(library)}];")
        for pair in exchanges:
            hazards = pair.get("hazards") or 0
            label = _label(
                f"{_plural(_activity.int_or_zero(pair.get('imports')), 'import')} ({', '.join(map(str, pair.get('protocols') or ()))})",
                _plural(hazards, "hazard") if hazards else None,
            )
            color = ', color="#d93025"' if hazards else ""
            lines.append(
                f"    {_quote('library:' + str(pair['producer']))} -> {_quote('library:' + str(pair['consumer']))} "
                f"[label={label}{color}];"
            )
        lines.append("  }")
    for node in graph.get("nodes") or ():
        style = _NODE_STYLES.get(str(node.get("kind")), "shape=note")
        lines.append(f"  {_quote(node.get('id', '?'))} [{style}, label={_node_label(node)}];")
    for edge in graph.get("edges") or ():
        kind = edge.get("kind", "")
        style = _EDGE_STYLES.get(str(kind), 'style=solid, color="#5f6368"')
        label = _label(kind, edge.get("where")) if edge.get("where") else _quote(kind)
        lines.append(f"  {_quote(edge.get('src', '?'))} -> {_quote(edge.get('dst', '?'))} [label={label}, {style}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


# --- which library a source file belongs to -------------------------------------------------------


def _normalized(path: str) -> str:
    return os.path.normcase(os.path.abspath(path))


def _find_library_roots() -> tuple[list[str], list[str], list[str]]:
    """(site directories, standard library directories, handoff's package directories)."""
    sites: list[str] = []
    for key in ("purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            sites.append(path)
    with contextlib.suppress(AttributeError):  # virtualenv's old site.py lacks it
        sites += site.getsitepackages()
    user = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if user:
        sites.append(user)
    stdlib = [p for p in (sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib")) if p]
    here = Path(__file__)
    # The package's folder as imported and, for a folder of links to the sources, the sources'.
    package = {str(here.parent), str(here.resolve().parent)}
    return ([_normalized(p) for p in sites], [_normalized(p) for p in stdlib], sorted(_normalized(p) for p in package))


# Cached by assignment, not as decorators, so that stubtest sees the functions' own signatures.
_library_roots = functools.lru_cache(maxsize=1)(_find_library_roots)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def library_of_file(filename: str) -> str | None:
    """The library a source file belongs to, or None for user code.

    ``"handoff"`` for handoff's own files; for a file under a site directory (site-packages), its
    top-level package or module (``.../site-packages/numpy/core/x.py`` -> ``"numpy"``); ``"python"``
    for the standard library and frozen modules (``<frozen importlib._bootstrap>``). Other
    ``<...>`` names (``<string>``, ``<stdin>``, notebook cells) are user code. Results are cached
    per file name.
    """
    return _classify(filename)


def _classify_file(filename: str) -> str | None:
    if filename.startswith("<"):
        return "python" if filename.startswith("<frozen ") else None
    sites, stdlib, package = _library_roots()
    path = _normalized(filename)
    candidates = {path}
    with contextlib.suppress(OSError, ValueError):
        candidates.add(_normalized(os.path.realpath(filename)))
    if any(_under(p, root) for p in candidates for root in package):
        return "handoff"
    # The longest root that holds the file wins: site-packages lies inside the standard library's
    # folder in many layouts (a venv's platstdlib, /usr/lib/python3.x/site-packages).
    best: tuple[int, str, str] | None = None
    for kind, roots in (("site", sites), ("stdlib", stdlib)):
        for root in roots:
            if _under(path, root) and (best is None or len(root) > best[0]):
                best = (len(root), kind, root)
    if best is None:
        return None
    _, kind, root = best
    if kind == "stdlib":
        return "python"
    relative = path[len(root.rstrip(os.sep)) + 1 :]
    top = relative.split(os.sep, 1)[0]
    return top.split(".", 1)[0] or None


_classify = functools.lru_cache(maxsize=4096)(_classify_file)
# The extension names the library of each exchange's calling code with it (it never imports the package).
_handoff._set_library_of_file(library_of_file)
