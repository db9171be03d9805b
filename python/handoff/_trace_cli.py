"""handoff-trace: record, read and follow handoff's exchange traces.

    handoff-trace run [-o FILE] [--json] [--order] [--launches] -- CMD ARGS...
                                                           trace a program; its summary on stderr
    handoff-trace show FILE [--json]                       the summary of a saved trace
    handoff-trace graph FILE [--format dot|json|svg|png]   the ownership graph saved in a trace
    handoff-trace attach PID [--count N] [--json]          follow a running process's exchanges
    handoff-trace info [--json]                            the runtime: backend, devices, versions

With no command it prints the runtime, as ``info`` does. Exit status: 0 on success, 1 when a command
fails (a process that refuses a client, Graphviz failing, an output that cannot be written), 2 for
bad arguments (an output path refused before any work) or input files, 130 on Ctrl-C; ``run`` exits
with the status of the program it ran (128 + N for signal N), or 1 when the program succeeded but its
trace could not be saved.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from . import _activity
from ._trace import (
    _plural,
    chrome_trace,
    dumps,
    exchanges_between_libraries,
    format_event,
    graph_to_dot,
    process_state,
    still_running_note,
    summary,
    unfinished_note,
)

Trace = dict[str, Any]

PERFETTO = "https://ui.perfetto.dev"

# `run` puts this first on the program's PYTHONPATH as sitecustomize.py, which Python's `site` module
# imports at start-up: the program is traced without importing handoff itself.
SITECUSTOMIZE = '''\
"""Written by handoff-trace run: imports handoff, which traces this process to $HANDOFF_TRACE, after
running the sitecustomize module that this one hides, if there is one."""


def _run_hidden_sitecustomize():
    import importlib.machinery
    import importlib.util
    import os
    import sys

    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    rest = [p for p in sys.path if os.path.realpath(os.path.abspath(p or os.curdir)) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _run_hidden_sitecustomize()
finally:
    try:
        import handoff  # noqa: F401
    except ImportError:
        pass  # not a Python that has handoff: the program runs untraced
    except Exception as error:  # handoff is there but broken: say so, and let the program run
        import sys

        print(f"handoff-trace: handoff failed to import: {error!r}", file=sys.stderr)
'''


class CommandError(Exception):
    """A failure reported as one line on stderr, with the exit status `status`."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


# --- trace files ----------------------------------------------------------------------------------


def load_trace(file: str) -> Trace:
    """The ``"handoff"`` section of a trace file (``-``: stdin): ``version``, ``events``, ``graph``."""
    name = "stdin" if file == "-" else file
    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CommandError(f"{name}: no such file") from None
    except UnicodeDecodeError:
        raise CommandError(f"{name}: not JSON (not UTF-8 text)") from None
    except OSError as error:
        raise CommandError(f"{name}: cannot read it: {error.strerror or error}") from None
    try:
        data = parse_json(text)
    except json.JSONDecodeError as error:
        raise CommandError(f"{name}: not JSON ({error.msg} at line {error.lineno}, column {error.colno})") from None
    except NumberOutOfRange as error:
        raise CommandError(f"{name}: not a handoff trace ({error})") from None
    except ValueError as error:  # NaN or Infinity, which JSON does not have
        raise CommandError(f"{name}: not JSON ({error})") from None
    except RecursionError:
        raise CommandError(f"{name}: not a handoff trace (nested too deeply)") from None
    section = data.get("handoff") if isinstance(data, dict) else None
    if (
        not isinstance(section, dict)
        or not isinstance(section.get("events"), list)
        or not all(isinstance(e, dict) for e in section["events"])
    ):
        raise CommandError(
            f'{name}: not a handoff trace (no "handoff" section with the events; handoff writes one with '
            "handoff.trace(path=...), HANDOFF_TRACE=FILE or handoff-trace run -o FILE)"
        )
    for index, event in enumerate(section["events"]):
        _check_fields(event, f"{name}: event {index}")
    graph = section.get("graph")
    if graph is not None:
        _check_graph(graph, name)
    return section


class NumberOutOfRange(ValueError):
    """A number JSON allows that no trace holds: handoff writes 64-bit integers and finite floats."""


def parse_json(text: str | bytes) -> Any:
    """JSON as a trace holds it; ValueError for NaN and Infinity (not JSON), NumberOutOfRange for a
    number no trace holds (1e400, an integer of 400 digits), RecursionError for deep nesting."""
    return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_int64)


def _refuse_constant(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON value")


def _shown(number: str) -> str:
    return number if len(number) <= 24 else f"{number[:12]}... ({len(number)} characters)"


def _finite_float(number: str) -> float:
    value = float(number)
    if not math.isfinite(value):
        raise NumberOutOfRange(f"the number {_shown(number)} is out of a float's range")
    return value


def _int64(number: str) -> int:
    # Refused by length first: Python converts at most 4300 digits, and slowly.
    if len(number.lstrip("-")) > 20 or not -(2**64) < (value := int(number)) < 2**64:
        raise NumberOutOfRange(f"the integer {_shown(number)} is out of the 64-bit range")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: The fields handoff writes as lists of ints: each other field is a string, a number, a bool or null.
_INT_LIST_FIELDS = frozenset({"device", "shape"})


def _check_fields(item: dict[str, Any], where: str) -> None:
    """A trace item's fields are what handoff writes: a string, a number, a bool, null, or a list of
    ints (a device, a shape: no other field); ids are strings; a device activity's `buffers` a list of
    such items. A file that says otherwise is refused, naming the field."""
    for key, value in item.items():
        if key == "buffers" and isinstance(value, list) and all(isinstance(b, dict) for b in value):
            for index, buffer in enumerate(value):
                _check_fields(buffer, f"{where}: buffers {index}")
            continue
        if key in ("id", "src", "dst", "buffer", "view") and not (value is None or isinstance(value, str)):
            raise CommandError(f"{where}: field {key!r} is not an id (a string)")
        scalar = value is None or isinstance(value, (str, int, float))
        ints = key in _INT_LIST_FIELDS and isinstance(value, list) and all(_is_int(v) for v in value)
        if not (scalar or ints):
            raise CommandError(f"{where}: field {key!r} holds {type(value).__name__}, not what handoff writes")


def _check_graph(graph: Any, name: str) -> None:
    if not isinstance(graph, dict):
        raise CommandError(f"{name}: the ownership graph is not an object")
    for part, required in (("nodes", ("id", "kind")), ("edges", ("src", "dst", "kind"))):
        items = graph.get(part, [])
        if not isinstance(items, list):
            raise CommandError(f"{name}: the ownership graph's {part} are not a list")
        for index, item in enumerate(items):
            where = f"{name}: graph {part} {index}"
            if not isinstance(item, dict):
                raise CommandError(f"{where} is not an object")
            _check_fields(item, where)
            missing = [key for key in required if not isinstance(item.get(key), str)]
            if missing:
                raise CommandError(f"{where} has no {missing[0]!r}")


def print_json(data: Any, file: IO[str] | None = None) -> None:
    print(json.dumps(data, indent=2, allow_nan=False, default=str), file=file or sys.stdout)


# --- output files ---------------------------------------------------------------------------------


def _reason(error: OSError) -> str:
    return error.strerror or str(error)


def check_output(option: str, file: str) -> None:
    """Refuses an output path that cannot be written (a folder, a missing folder, no permission, a
    read-only file system) with status 2, before any work. Leaves no file behind."""
    target = Path(file)
    try:
        if target.is_dir():
            raise CommandError(f"{option} {file}: is a directory; name the file to write")
        folder = target.absolute().parent
        if not folder.is_dir():
            raise CommandError(f"{option} {file}: no directory {folder} to write it in")
        existed = target.exists()
        # Appends nothing, so an existing file is not touched; never waits for a FIFO's reader.
        os.close(os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o666))
    except OSError as error:
        raise CommandError(f"{option} {file}: cannot write it: {_reason(error)}") from None
    if not existed:
        with contextlib.suppress(OSError):
            target.unlink()


def write_output(option: str, file: str, text: str) -> None:
    """Writes an output file; a failure (a full disk) is a CommandError with status 1."""
    try:
        Path(file).write_text(text, encoding="utf-8")
    except OSError as error:
        raise CommandError(f"{option} {file}: cannot write it: {_reason(error)}", 1) from None


# --- run ------------------------------------------------------------------------------------------


def _wait(command: list[str], env: dict[str, str]) -> int:
    """Runs `command` with the terminal (stdio inherited); its exit status, 128 + N for signal N."""
    try:
        child = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        raise CommandError(f"{command[0]}: command not found", 127) from None
    except PermissionError:
        raise CommandError(f"{command[0]}: permission denied", 126) from None
    # A termination asked of handoff-trace (timeout, a job scheduler) is passed on to the program,
    # which decides whether to end; the traces it wrote are then merged and the scratch removed.
    forwarded = (signal.SIGTERM, signal.SIGHUP)
    previous = (
        {s: signal.signal(s, lambda signum, _: child.send_signal(signum)) for s in forwarded}
        if threading.current_thread() is threading.main_thread()
        else {}
    )
    try:
        while True:
            try:
                status = child.wait()
                break
            except KeyboardInterrupt:
                # The terminal sent Ctrl-C to the program too: it decides whether to end, and its
                # status says what happened.
                continue
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 128 - status if status < 0 else status


def merge_traces(traces: Sequence[tuple[int, Trace]], running: Sequence[int] = ()) -> dict[str, Any]:
    """One Chrome trace of several processes' traces ((pid, "handoff" section) pairs): a process
    per track group on one clock, every event marked with its `pid`, the graphs' ids prefixed with
    their process's when there are several."""
    start = _activity.earliest_ns(e for _, t in traces for e in t["events"])
    chrome_events: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    graph: dict[str, list[Any]] = {"nodes": [], "edges": []}
    dropped = 0
    problems: list[str] = []
    for pid, trace in traces:
        own = [{**event, "pid": pid} for event in trace["events"]]
        events += own
        chrome_events += chrome_trace(own, pid=pid, start_ns=start)["traceEvents"]
        dropped += int(trace.get("dropped") or 0)
        if trace.get("launch_problem"):
            problems.append(
                f"pid {pid}: {trace['launch_problem']}" if len(traces) > 1 else str(trace["launch_problem"])
            )
        part = trace.get("graph") or {}
        prefix = f"{pid}/" if len(traces) > 1 else ""
        graph["nodes"] += [{**node, "id": prefix + str(node["id"])} for node in part.get("nodes", [])]
        graph["edges"] += [
            {**edge, "src": prefix + str(edge["src"]), "dst": prefix + str(edge["dst"])}
            for edge in part.get("edges", [])
        ]
    events.sort(key=lambda e: int(e.get("time_ns") or 0))
    version = traces[0][1].get("version") if traces else None
    return {
        "traceEvents": chrome_events,
        "displayTimeUnit": "ns",
        "handoff": {
            "version": version,
            "events": events,
            "graph": graph,
            "dropped": dropped,
            "processes": [pid for pid, _ in traces],
            "unfinished": [pid for pid, trace in traces if trace.get("unfinished") and pid not in running],
            "still_running": list(running),
            **({"launch_problem": "; ".join(problems)} if problems else {}),
        },
    }


class _ProcessTraces:
    """The traces the processes of a run write to a folder (trace-PID.json), each read again only
    once its file changed (a trace is tens of MB); a file that cannot be read yet (being written by
    a process that outlived the program) is pending."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._read: dict[Path, tuple[tuple[int, int], Trace | CommandError]] = {}

    def read(self) -> tuple[list[tuple[int, Trace]], list[tuple[str, CommandError]]]:
        """(pid, trace) of each readable file, oldest process first; (file name, why) of the others."""
        found, unreadable = [], []
        for path in self.folder.glob("trace-*.json"):
            try:
                pid = int(path.stem.removeprefix("trace-"))
                stat = path.stat()
            except (ValueError, OSError):
                continue  # not a process's trace, or gone
            key = (stat.st_mtime_ns, stat.st_size)
            known = self._read.get(path)
            if known is None or known[0] != key:
                try:
                    known = (key, load_trace(str(path)))
                except CommandError as error:
                    known = (key, error)
                self._read[path] = known
            if isinstance(known[1], CommandError):
                unreadable.append((path.name, known[1]))
            else:
                found.append((stat.st_mtime_ns, pid, known[1]))
        return [(pid, trace) for _, pid, trace in sorted(found, key=lambda item: (item[0], item[1]))], unreadable


def _running(pid: int, started: object) -> bool:
    """Whether process `pid`, which began its trace at `started` (its start time, where known), still
    runs: not if it is gone, a zombie, or another process that took its pid."""
    seen = process_state(pid)
    if seen is not None:
        state, start = seen
        return state != "Z" and (not _is_int(started) or start == started)
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or another user's process took its pid
        return False
    return True


class _StopWaiting(Exception):
    """A termination asked of handoff-trace while it waits for processes that outlive the program."""


def _stop_waiting(signum: int, _: object) -> None:
    raise _StopWaiting(signum)


def _settled_traces(folder: Path, patience_s: float = 10.0) -> tuple[list[tuple[int, Trace]], list[int]]:
    """The traces of a run's processes once those that outlive the program (a helper it started, as
    multiprocessing's resource tracker, which leaves after it) have saved theirs, waited for up to
    `patience_s` seconds, or until handoff-trace is asked to end (Ctrl-C, SIGTERM, SIGHUP); and the
    processes still running then. A file still unreadable then is said, and skipped."""
    files = _ProcessTraces(folder)
    deadline = time.monotonic() + patience_s
    handled = (signal.SIGTERM, signal.SIGHUP)
    previous = (
        {s: signal.signal(s, _stop_waiting) for s in handled}
        if threading.current_thread() is threading.main_thread()
        else {}
    )

    def still_running(traces: list[tuple[int, Trace]]) -> list[int]:
        return [pid for pid, trace in traces if trace.get("unfinished") and _running(pid, trace.get("started"))]

    try:
        while True:
            traces, unreadable = files.read()
            running = still_running(traces)
            if (not running and not unreadable) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        interrupted = False
    except (KeyboardInterrupt, _StopWaiting):
        interrupted = True
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if interrupted:  # the files as they are now
        traces, unreadable = files.read()
        running = still_running(traces)
    for name, error in unreadable:
        print(f"handoff-trace: skipped {name}: {error}", file=sys.stderr)
    return traces, running


def _launch_problem(traces: Sequence[tuple[int, Trace]]) -> str | None:
    """Why a launch trace recorded no device activity, as its processes said (once each reason)."""
    reasons = list(dict.fromkeys(str(t["launch_problem"]) for _, t in traces if t.get("launch_problem")))
    return "; ".join(reasons) or None


def cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command_line)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise CommandError("run: no command given (handoff-trace run [-o FILE] -- CMD ARGS...)")
    if args.output:
        try:  # said before the program runs (a long job can be stopped), which runs either way
            check_output("run -o", args.output)
        except CommandError as error:
            print(f"handoff-trace: {error} (the program runs, its trace is not saved)", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="handoff-trace-") as scratch:
        shim = Path(scratch, "site")
        shim.mkdir()
        (shim / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
        folder = Path(scratch, "processes")
        folder.mkdir()
        env = dict(os.environ)
        # Each Python process of the program writes its own file (%p: its pid); merged below.
        env["HANDOFF_TRACE"] = str(folder / "trace-%p.json")
        if args.order:
            env["HANDOFF_ORDER"] = "1"
        if args.launches:
            env["HANDOFF_TRACE_LAUNCHES"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(shim), *filter(None, [env.get("PYTHONPATH")])])
        status = _wait(command, env)
        traces, running = _settled_traces(folder)

    if not traces:
        print(
            f"handoff-trace: no trace was written: {command[0]} is not a Python program with handoff importable "
            "(a Python run with -S or -I skips the sitecustomize module that imports it), it ended before it could "
            "write one (killed by a signal, or through os._exit), or its trace could not be written (handoff then "
            "warns above)",
            file=sys.stderr,
        )
        return status
    merged = merge_traces(traces, running)
    section = merged["handoff"]
    _say_unfinished(section)
    saved = True
    if args.output:
        try:
            write_output("run -o", args.output, dumps(merged))
        except CommandError as error:  # the summary and the program's status are not lost with it
            print(f"handoff-trace: {error}", file=sys.stderr)
            saved = False
    if args.json:
        print_json(section["events"])
    else:
        title = f"handoff trace of {shlex.join(command)}"
        print(
            summary(
                shown_from_here(section["events"]),
                title=title,
                dropped=section["dropped"],
                processes=len(traces),
                launch_problem=_launch_problem(traces),
            ),
            file=sys.stderr,
        )
        if args.output and saved:
            print(
                f"\ntrace saved to {args.output}: open it in {PERFETTO}, or run handoff-trace show {args.output}",
                file=sys.stderr,
            )
    return status if status != 0 or saved else 1


def _say_unfinished(trace: Trace) -> None:
    """Names, on stderr, the processes whose exchanges a trace lacks: those that ended without saving
    their trace, and those still running when the program ended."""
    for key, say in (("unfinished", unfinished_note), ("still_running", still_running_note)):
        pids = trace.get(key)
        if isinstance(pids, list) and pids and all(_is_int(pid) for pid in pids):
            print(f"handoff-trace: {say(pids)}", file=sys.stderr)


def shown_from_here(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`events` with each source line below the working directory shown relative to it, as a user
    reads a path from there (the trace file keeps the full paths)."""
    here = os.path.join(os.getcwd(), "")

    def shown(event: dict[str, Any]) -> dict[str, Any]:
        where = event.get("where")
        if isinstance(where, str) and where.startswith(here):
            return {**event, "where": where[len(here) :]}
        return event

    return [shown(event) for event in events]


# --- show, graph ----------------------------------------------------------------------------------


def cmd_show(args: argparse.Namespace) -> int:
    trace = load_trace(args.file)
    if args.json:
        print_json(trace["events"])
    else:
        title = "handoff trace" + ("" if args.file == "-" else f" {args.file}")
        processes = trace.get("processes")
        count = len(processes) if isinstance(processes, list) else 1
        limit = int(trace["limit"]) if _is_int(trace.get("limit")) else None
        dropped = int(trace["dropped"]) if _is_int(trace.get("dropped")) else 0
        problem = str(trace["launch_problem"]) if trace.get("launch_problem") else None
        events = shown_from_here(trace["events"])
        _say_unfinished(trace)
        print(summary(events, title=title, dropped=dropped, limit=limit, processes=count, launch_problem=problem))
    return 0


def _say_what_the_graph_holds(graph: dict[str, Any], exchanges: list[dict[str, Any]]) -> None:
    """The ownership graph holds handoff's own arrays: a program that never calls handoff has none, and
    its exchanges (which the hooks saw) are drawn beside it instead; said on stderr."""
    if exchanges:
        count = sum(pair["imports"] for pair in exchanges)
        print(
            f"handoff-trace: the ownership graph holds handoff's own arrays; the trace saw {_plural(count, 'exchange')} "
            "between other libraries, drawn beside it with a node per library (handoff-trace show lists each)",
            file=sys.stderr,
        )
    elif not graph.get("nodes"):
        print(
            "handoff-trace: the ownership graph is empty: no array handoff made or exported was alive when the "
            "trace ended, and the trace saw no exchange between other libraries",
            file=sys.stderr,
        )


def cmd_graph(args: argparse.Namespace) -> int:
    if args.output:
        check_output("graph -o", args.output)
    trace = load_trace(args.file)
    graph = trace.get("graph")
    if not isinstance(graph, dict):
        raise CommandError(f"{args.file}: the trace holds no ownership graph")
    exchanges = exchanges_between_libraries(trace["events"])
    _say_what_the_graph_holds(graph, exchanges)
    if args.format in ("dot", "json"):
        shown = {**graph, "exchanges": exchanges} if exchanges else graph
        text = graph_to_dot(graph, exchanges) if args.format == "dot" else json.dumps(shown, indent=2) + "\n"
        if args.output:
            write_output("graph -o", args.output, text)
            print(f"wrote {args.output}", file=sys.stderr)
        else:
            sys.stdout.write(text)
        return 0
    dot = shutil.which("dot")
    if dot is None:
        raise CommandError(
            f"--format {args.format} needs Graphviz's `dot`, which is not on PATH: install Graphviz "
            "(apt-get install graphviz, brew install graphviz or conda install graphviz), or print DOT text "
            "with --format dot, which needs nothing"
        )
    if args.output:
        output = Path(args.output)
    elif args.file == "-":
        raise CommandError(f"--format {args.format} of a trace read from stdin needs -o OUT")
    else:
        output = Path(args.file).with_suffix(f".{args.format}")
    result = subprocess.run(
        [dot, f"-T{args.format}", "-o", str(output)],
        input=graph_to_dot(graph, exchanges),
        text=True,
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        raise CommandError(f"dot failed (status {result.returncode}): {result.stderr.strip()}", 1)
    print(f"wrote {output}")
    return 0


# --- attach ---------------------------------------------------------------------------------------


def socket_paths(pid: int) -> list[Path]:
    """Where process `pid` serves its trace, the paths to try in order (the runtime's rule: under
    $XDG_RUNTIME_DIR when that is a folder, else, and also tried, under $TMPDIR or /tmp)."""
    from . import _handoff

    return [Path(path) for path in _handoff._trace_socket_paths(pid)]


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def _process_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _connect(pid: int) -> tuple[socket.socket, Path]:
    paths = socket_paths(pid)
    path, closed = None, None
    for candidate in paths:
        try:
            if candidate.exists():
                path = candidate
                break
        except PermissionError:  # another user's folder (mode 0700): its socket may be there
            closed = closed or candidate.parent
    if path is None:
        if not _process_exists(pid):
            raise CommandError(f"no process with id {pid}", 1)
        if closed is not None:
            owner = _process_uid(pid)
            raise CommandError(
                f"permission denied: {closed} (process {pid} runs as uid {owner}: attach as the user that runs it)", 1
            )
        raise CommandError(
            f"process {pid} is not serving its trace (no socket at {' or '.join(map(str, paths))}): start it with "
            "HANDOFF_TRACE_SOCKET=1 in its environment, or call handoff.serve_trace() in it",
            1,
        )
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(10)
    try:
        client.connect(str(path))
    except PermissionError:
        client.close()
        raise CommandError(f"permission denied: {path} (attach as the user that runs process {pid})", 1) from None
    except (ConnectionRefusedError, FileNotFoundError):
        client.close()
        state = "is not accepting clients" if _process_exists(pid) else "has ended"
        raise CommandError(f"process {pid} {state} (stale socket {path})", 1) from None
    except OSError as error:
        client.close()
        raise CommandError(f"cannot connect to {path}: {error.strerror or error}", 1) from None
    return client, path


def cmd_attach(args: argparse.Namespace) -> int:
    if not 0 < args.pid < 2**31:
        raise CommandError(f"attach: {args.pid} is not a process id")
    if args.count is not None and args.count < 1:
        raise CommandError("attach: --count must be at least 1")
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    client, path = _connect(args.pid)
    with client, client.makefile("rb") as reader:

        def read_line() -> bytes | None:
            """The next line; None once the --timeout has passed."""
            if deadline is None:
                client.settimeout(None)
            else:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                client.settimeout(remaining)
            try:
                return reader.readline()
            except socket.timeout:
                return None

        def message(line: bytes) -> Any:
            try:  # a huge number is shown as "?" (format_event): one line, not the whole follow, is odd
                return json.loads(line, parse_constant=_refuse_constant)
            except (ValueError, RecursionError):
                return None

        first = read_line()
        if first is None:
            print(f"handoff-trace: process {args.pid} said nothing within {args.timeout} s", file=sys.stderr)
            return 1
        hello = message(first)
        if isinstance(hello, dict) and "error" in hello:
            raise CommandError(f"process {args.pid}: {hello['error']}", 1)
        if not isinstance(hello, dict) or hello.get("hello") != "handoff":
            raise CommandError(f"{path} is not a handoff trace socket", 1)
        print(
            f"attached to process {hello.get('pid', args.pid)} (handoff {hello.get('version', '?')}); Ctrl-C to stop",
            file=sys.stderr,
        )

        seen = 0
        while args.count is None or seen < args.count:
            line = read_line()
            if line is None:
                print(f"handoff-trace: stopped after {args.timeout} s", file=sys.stderr)
                return 0
            if not line:
                print(f"handoff-trace: process {args.pid} closed its trace (it has ended)", file=sys.stderr)
                return 0
            item = message(line)
            if not isinstance(item, dict):
                print(f"handoff-trace: skipped a line that is not a JSON object: {line[:80]!r}", file=sys.stderr)
                continue
            try:
                _check_fields(item, "a line")
            except CommandError as odd:
                print(f"handoff-trace: skipped {odd}: {line[:80]!r}", file=sys.stderr)
                continue
            if "error" in item:
                raise CommandError(f"process {args.pid}: {item['error']}", 1)
            if "dropped" in item:
                dropped = _plural(int(item["dropped"]), "event")
                print(f"... {dropped} dropped (client too slow)", file=sys.stderr, flush=True)
                continue
            seen += 1
            if args.json:
                print(line.decode("utf-8", "replace").rstrip("\r\n"), flush=True)
            else:
                print(format_event(item), flush=True)
    return 0


# --- info -----------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    import handoff

    info = handoff.runtime_info()
    if args.json:
        print_json(info)
        return 0
    print(f"handoff {handoff.__version__} (DLPack {info['dlpack_version']})")
    for key in ("backend", "device_count", "cuda_compiled", "cuda_runtime", "cuda_driver_minimum", "backend_error"):
        print(f"  {key:>19}: {info[key]}")
    return 0


# --- the command line -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="handoff-trace",
        description="Record, read and follow handoff's exchange traces. With no command: the runtime (info).",
        epilog="Exit status: 0 ok, 1 a command failed, 2 bad arguments or input, 130 Ctrl-C; "
        "run: the program's status.",
    )
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument(
        "--json", dest="info_json", action="store_true", help="with no command: print the runtime information as JSON"
    )
    commands = parser.add_subparsers(dest="subcommand", metavar="COMMAND")

    def command(
        name: str, handler: Callable[[argparse.Namespace], int], *, help: str, description: str | None = None
    ) -> argparse.ArgumentParser:
        """The parser of the subcommand `name`, which `handler` runs, with its help and description."""
        sub = commands.add_parser(name, help=help, description=description)
        sub.set_defaults(handler=handler)
        return sub

    run = command(
        "run",
        cmd_run,
        help="run a program with tracing on and summarize its exchanges",
        description="Runs CMD with HANDOFF_TRACE set, and a sitecustomize.py on its PYTHONPATH that imports "
        "handoff (so a Python program is traced without changes, its exchanges between NumPy, PyTorch, "
        "CuPy, JAX, numba-cuda and cuda.core included; an existing sitecustomize still runs). Every "
        "Python process that CMD starts is traced to its own file, and the traces are merged, a "
        "process per track. When CMD ends, prints the summary on stderr (CMD's stdout stays its "
        "own) and exits with CMD's status.",
    )
    run.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help=f"keep the trace there (Chrome trace JSON: {PERFETTO}); default: a temporary file",
    )
    run.add_argument("--json", action="store_true", help="print the events as JSON on stdout instead of the summary")
    run.add_argument(
        "--order",
        action="store_true",
        help="also order the exchanges between other libraries (HANDOFF_ORDER=1): the consumer's stream waits "
        "for the producer's, and the producer is kept until the consumer's stream is done with it",
    )
    run.add_argument(
        "--launches",
        action="store_true",
        help="also record every kernel launch, copy, stream operation and host wait (HANDOFF_TRACE_LAUNCHES=1: "
        "CUPTI on CUDA, the simulator's own operations on sim) and flag races after the exchange and the host "
        "waits by line",
    )
    run.add_argument("command_line", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...", help="the program to run")

    show = command(
        "show",
        cmd_show,
        help="summarize a saved trace",
        description="Prints the summary of a trace file: hazards first, then the exchanges per producer and consumer.",
    )
    show.add_argument("file", metavar="FILE", help="a trace file (handoff.trace(path=...), HANDOFF_TRACE); - for stdin")
    show.add_argument("--json", action="store_true", help="print the events as JSON instead")

    graph = command(
        "graph",
        cmd_graph,
        help="the ownership graph saved in a trace",
        description="Prints or draws the ownership graph of a trace file (buffers, "
        "views, streams) as it was when the trace ended.",
    )
    graph.add_argument("file", metavar="FILE", help="a trace file; - for stdin")
    graph.add_argument(
        "--format",
        choices=("dot", "json", "svg", "png"),
        default="dot",
        help="dot (default) or json text, or an svg or png image drawn by Graphviz's dot",
    )
    graph.add_argument(
        "-o",
        "--output",
        metavar="OUT",
        help="where to write; default: stdout for dot and json, FILE.svg or FILE.png for images",
    )

    attach = command(
        "attach",
        cmd_attach,
        help="follow the exchanges of a running process",
        description="Connects to the trace socket of a process that serves one (HANDOFF_TRACE_SOCKET=1 or "
        "handoff.serve_trace()) and prints each exchange as it happens, until the process ends.",
    )
    attach.add_argument("pid", type=int, metavar="PID", help="the process id")
    attach.add_argument("--count", type=int, metavar="N", help="stop after N events")
    attach.add_argument("--json", action="store_true", help="print each event as its JSON line")
    attach.add_argument("--timeout", type=float, metavar="SECONDS", help="stop after SECONDS")

    info = command(
        "info",
        cmd_info,
        help="the runtime: version, backend, devices",
        description="Prints handoff's runtime: backend, devices and versions.",
    )
    info.add_argument("--json", action="store_true", help="print it as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``handoff-trace`` command; returns its exit status."""
    args = build_parser().parse_args(argv)
    if args.version:
        import handoff

        print(f"handoff-trace {handoff.__version__}")
        return 0
    if args.subcommand is None:
        args.json = args.info_json
        args.handler = cmd_info
    try:
        status: int = args.handler(args)
    except CommandError as error:
        print(f"handoff-trace: {error}", file=sys.stderr)
        return error.status
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Output piped to a program that stopped reading (| head): not an error worth a traceback.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return status


if __name__ == "__main__":
    sys.exit(main())
