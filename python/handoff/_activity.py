"""Reading a launch trace's device activity (``handoff.trace(launches=True)``, ``handoff-trace run
--launches``): its events in one line, the summary's activity counts and host waits by line, the
Perfetto slices (each stream a track, each race an arrow between its two sides) and the race edges of
the graph. Like the rest of handoff._trace it only reads events, so it works on saved traces too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

Event = dict[str, Any]

#: The event kinds of device activity (the others are exchanges).
KINDS = frozenset({"launch", "copy", "sync", "stream", "memory"})

# Host waits that guard an exchange whose consumer is on the device: an event wait would do.
_DEVICE_WAITS = frozenset({"stream", "device", "event"})


def is_activity(event: Mapping[str, Any]) -> bool:
    return event.get("kind") in KINDS


def int_or_zero(value: Any) -> int:
    """A trace field as an int, 0 where it is missing or not a number (traces are read as written)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def stream_label(handle: Any) -> str:
    if handle is None:
        return "-"
    number = int_or_zero(handle)
    if number == 1:
        return "legacy"
    if number == 2:
        return "per-thread"
    return hex(number)


def _what(event: Mapping[str, Any], prefix: str = "") -> str:
    kind, kernel = event.get(prefix + "kind"), event.get(prefix + "kernel")
    if kernel:
        return f"'{kernel}'"
    return str(kind or "?")


def sides(event: Mapping[str, Any]) -> str:
    """A hazard's two sides in a few words: ``'read' on legacy after 'fill' on 0x5110``."""
    return (
        f"{_what(event)} on {stream_label(event.get('stream'))} after "
        f"{_what(event, 'other_')} on {stream_label(event.get('other_stream'))}"
    )


def duration(ns: int) -> str:
    if ns >= 1_000_000_000:
        return f"{ns / 1e9:.2f} s"
    if ns >= 1_000_000:
        return f"{ns / 1e6:.1f} ms"
    if ns >= 1_000:
        return f"{ns / 1e3:.1f} us"
    return f"{ns} ns"


def format_activity(event: Mapping[str, Any], device: str) -> str:
    """The part of a one-line event after its time: kind, what, stream, memory, blocked time, hazard."""
    parts = [f"{event.get('kind', '?')!s:<7}", str(event.get("op") or "")]
    if event.get("kernel"):
        parts.append(f"'{event['kernel']}'")
    parts.append(f"{device} stream {stream_label(event.get('stream'))}")
    buffers = event.get("buffers") or []
    if buffers:
        parts.append(
            ", ".join(
                f"{b.get('access', '?')} {b.get('buffer') or hex(int_or_zero(b.get('address')))}"
                for b in buffers
                if isinstance(b, Mapping)
            )
        )
    if int_or_zero(event.get("blocked_ns")):
        parts.append(f"blocked {duration(int_or_zero(event.get('blocked_ns')))}")
    if event.get("library"):
        parts.append(f"in {event['library']}")
    if event.get("hazard") is not None:
        parts.append(f"HAZARD {event['hazard']}")
    if event.get("where"):
        parts.append(f"at {event['where']}")
    return "  ".join(part for part in parts if part)


def _count(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def counts_line(activity: Sequence[Mapping[str, Any]]) -> str:
    """``device activity: 12 launches, 3 copies, 5 stream operations, 2 host waits (blocked 31.2 ms),
    1 allocation or free``."""
    kinds = [str(e.get("kind")) for e in activity]
    blocked = sum(int_or_zero(e.get("blocked_ns")) for e in activity)
    parts = [
        _count(kinds.count("launch"), "launch", "launches"),
        _count(kinds.count("copy"), "copy or set", "copies and sets"),
        _count(kinds.count("stream"), "stream operation", "stream operations"),
        _count(kinds.count("sync"), "host wait", "host waits") + (f" (blocked {duration(blocked)})" if blocked else ""),
        _count(kinds.count("memory"), "allocation or free", "allocations and frees"),
    ]
    return "device activity: " + ", ".join(parts)


def guarded_exchanges(events: Sequence[Mapping[str, Any]]) -> dict[int, Mapping[str, Any]]:
    """The host waits (by index in `events`) that only made data ready for an exchange to a device
    consumer: the next exchange of the same thread hands over data whose producer stream the wait
    covered, onto a consumer stream. An event wait on that stream would have done it without
    blocking the host. Each maps to that exchange."""
    guarded: dict[int, Mapping[str, Any]] = {}
    pending: dict[Any, int] = {}  # thread -> index of its latest host wait not yet followed by an exchange
    order = sorted(range(len(events)), key=lambda i: int_or_zero(events[i].get("time_ns")))
    for index in order:
        event = events[index]
        kind, thread = event.get("kind"), event.get("thread")
        if kind == "sync" and event.get("op") in _DEVICE_WAITS:
            pending[thread] = index
        elif kind in ("import", "export") and thread in pending:
            wait_index = pending.pop(thread)
            wait = events[wait_index]
            producer, consumer = event.get("producer_stream"), event.get("consumer_stream")
            covered = wait.get("op") != "stream" or (producer is not None and wait.get("stream") == producer)
            if producer is not None and consumer is not None and consumer != producer and covered:
                guarded[wait_index] = event
    return guarded


def host_wait_lines(events: Sequence[Mapping[str, Any]], table: Callable[..., list[str]]) -> list[str]:
    """HOST WAITS: the blocking synchronizations grouped by line, the most time blocked first."""
    waits = [
        (i, e)
        for i, e in enumerate(events)
        if e.get("kind") == "sync" or (e.get("kind") == "memory" and e.get("op") == "free-sync")
    ]
    if not waits:
        return []
    guarded = guarded_exchanges(events)
    groups: dict[str, dict[str, Any]] = {}
    for index, event in waits:
        where = str(event.get("where") or "-")
        group = groups.setdefault(where, {"count": 0, "blocked": 0, "ops": [], "guards": 0})
        group["count"] += 1
        group["blocked"] += int_or_zero(event.get("blocked_ns"))
        op = str(event.get("op") or "?")
        if op not in group["ops"]:
            group["ops"].append(op)
        group["guards"] += index in guarded
    rows = []
    notes = []
    for where, group in sorted(groups.items(), key=lambda item: -item[1]["blocked"]):
        rows.append([f"{group['count']}x", duration(group["blocked"]), ", ".join(group["ops"]), where])
        notes.append(
            f"        guards {_count(group['guards'], 'exchange', 'exchanges')} to a device consumer: an event wait would do "
            "(handoff.from_dlpack(x, stream=consumer) or --order inserts one; the host need not wait)"
            if group["guards"]
            else ""
        )
    lines = [f"HOST WAITS ({len(waits)}, by line, most time blocked first)"]
    body = table(["count", "blocked", "waited for", "where"], rows, right=[0, 1])
    lines.append(body[0])
    for row, note in zip(body[1:], notes):
        lines.append(row)
        if note:
            lines.append(note)
    return lines


def complete_slice(
    name: str, cat: str, *, ts: float, dur: float, pid: int, tid: int, args: Event, hazard: Any = None
) -> Event:
    """A Chrome trace complete event ("X"); the slice of a hazard is named after it, and drawn red."""
    slice_: Event = {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}
    if hazard is not None:
        slice_["name"] = f"\u26a0 {hazard}: {name}"
        slice_["cname"] = "terrible"
    return slice_


FLOWS_PER_KIND = 1 << 25


def flow_base(pid: int) -> int:
    """Where process `pid`'s flow ids begin: the trace event format's flow ids are global to a file,
    and a trace merged from several processes draws each one's arrows from its own slices."""
    return pid * 2 * FLOWS_PER_KIND


def earliest_ns(events: Iterable[Mapping[str, Any]]) -> int:
    """When the first thing `events` show began: an event's time, less the time it blocked (a host
    wait is recorded when it ends), or the earlier side of a hazard whose own event a bounded trace
    dropped. Perfetto's times count from it, so that none is negative."""
    times = []
    for event in events:
        times.append(int_or_zero(event.get("time_ns")) - int_or_zero(event.get("blocked_ns")))
        if event.get("other_time_ns") is not None:
            times.append(int_or_zero(event.get("other_time_ns")))
    return min(times, default=0)


def arrow(
    name: str, cat: str, flow: int, *, source: tuple[int, float], target: tuple[int, float], pid: int
) -> list[Event]:
    """A Chrome trace flow (an arrow) from the slice at `source` to the one at `target`, each a
    (track, time) pair: a flow binds to the slices that enclose its ends."""
    return [
        {"name": name, "cat": cat, "ph": "s", "id": flow, "ts": source[1], "pid": pid, "tid": source[0]},
        {"name": name, "cat": cat, "ph": "f", "bp": "e", "id": flow, "ts": target[1], "pid": pid, "tid": target[0]},
    ]


def chrome_slices(
    raw: Sequence[Mapping[str, Any]],
    *,
    track: Callable[[Any, Any], int],
    host_track: Callable[[Any], int],
    pid: int,
    start: int,
) -> list[Event]:
    """Perfetto slices of the activity in `raw`: each operation on its stream's track (a host wait on
    its thread's, as long as it blocked), and each race or reuse an arrow from the earlier side's
    slice to the later one's."""
    slices: list[Event] = []
    placed: dict[int, tuple[int, float]] = {}  # seq -> (tid, ts) of its slice
    flow = flow_base(pid) + FLOWS_PER_KIND  # apart from the exchanges' wait arrows
    for event in raw:
        if not is_activity(event):
            continue
        ts = (int_or_zero(event.get("time_ns")) - start) / 1000.0
        blocked = int_or_zero(event.get("blocked_ns"))
        if event.get("kind") == "sync" or blocked:
            tid = host_track(event.get("thread"))
            ts -= blocked / 1000.0  # recorded when the wait ended
        else:
            tid = track(event.get("device"), event.get("stream"))
        name = str(event.get("kernel") or f"{event.get('kind')} {event.get('op') or ''}".strip())
        slices.append(
            complete_slice(
                name,
                f"handoff.{event.get('kind')}",
                ts=ts,
                dur=max(blocked / 1000.0, 1.0),
                pid=pid,
                tid=tid,
                args=dict(event),
                hazard=event.get("hazard"),
            )
        )
        seq = int_or_zero(event.get("seq"))
        placed[seq] = (tid, ts)
        if event.get("hazard") is None or event.get("other_seq") is None:
            continue
        source = placed.get(int_or_zero(event.get("other_seq")))
        if source is None:  # the earlier side was dropped from a bounded trace: where it ran
            source_tid = track(event.get("device"), event.get("other_stream"))
            source = (source_tid, (int_or_zero(event.get("other_time_ns")) - start) / 1000.0)
            other = str(event.get("other_kernel") or event.get("other_kind") or "?")
            args = {"seq": event.get("other_seq"), "where": event.get("other_where")}
            slices.append(
                complete_slice(other, "handoff.race", ts=source[1], dur=1.0, pid=pid, tid=source_tid, args=args)
            )
        flow += 1
        slices += arrow(f"{event['hazard']}", "handoff.race", flow, source=source, target=(tid, ts), pid=pid)
    return slices


def with_races(graph: Mapping[str, Any], events: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """`graph` with a node for each stream a race or reuse involves and an edge ``race`` (or
    ``reuse``) from the earlier side's stream to the later one's, labelled with both lines."""
    nodes = list(graph.get("nodes") or [])
    edges = list(graph.get("edges") or [])
    known = {str(node.get("id")) for node in nodes}

    def stream_node(device: Any, handle: Any) -> str:
        pair = list(device) if isinstance(device, (list, tuple)) else [0, 0]
        node_id = f"stream:{int_or_zero(pair[0]) if pair else 0}:{int_or_zero(pair[1]) if len(pair) > 1 else 0}:{hex(int_or_zero(handle))}"
        if node_id not in known:
            known.add(node_id)
            nodes.append({"id": node_id, "kind": "stream", "device": pair, "handle": int_or_zero(handle)})
        return node_id

    for event in events:
        if not is_activity(event) or event.get("hazard") not in ("race", "reuse"):
            continue
        edges.append(
            {
                "src": stream_node(event.get("device"), event.get("other_stream")),
                "dst": stream_node(event.get("device"), event.get("stream")),
                "kind": str(event["hazard"]),
                "where": f"{event.get('other_where') or '?'} -> {event.get('where') or '?'}",
            }
        )
    return {**graph, "nodes": nodes, "edges": edges}
