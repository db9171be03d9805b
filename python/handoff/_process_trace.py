"""The process-wide trace, the ordering of other libraries' exchanges, and the live socket, asked for
by the environment or by a call.

``HANDOFF_TRACE=path`` traces the whole process, the exchanges between other libraries included, and
saves the trace to ``path`` at exit (``%p`` in it stands for the process id: each process of a job
writes its own file). It keeps the newest ``HANDOFF_TRACE_LIMIT`` events (default 30,000) and the
older hazards, so a long job's trace stays bounded. ``HANDOFF_ORDER=1`` orders the exchanges between
other libraries (see :func:`handoff.order_libraries`). ``HANDOFF_TRACE_SOCKET=1`` serves the
exchanges live from the start (``handoff-trace attach PID``). ``HANDOFF_TRACE_LAUNCHES=1`` makes the
process trace a launch trace: every kernel launch, copy, stream operation and host wait too, checked
for races after the exchange.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path

from . import _settings
from ._trace import dumps, process_state, trace, unfinished_trace

#: How many events a process trace keeps when HANDOFF_TRACE_LIMIT does not say.
DEFAULT_LIMIT = 30_000

_process_trace: trace | None = None
_trace_path: str | None = None
_socket_path: str | None = None
_marked_pid: int | None = None  # the process whose trace file _mark_unfinished wrote

#: The scripts, in the `ray` package (2.60), of Ray's own services: its dashboard and dashboard agent,
#: its log monitor, its runtime-environment agent, its autoscaler's monitor (both versions) and its
#: process reaper. Its workers' (``_private/workers``) are not among them: they run the program's tasks.
RAY_SERVICES = (
    ("dashboard", "dashboard.py"),
    ("dashboard", "agent.py"),
    ("_private", "log_monitor.py"),
    ("_private", "runtime_env", "agent", "main.py"),
    ("autoscaler", "_private", "monitor.py"),
    ("autoscaler", "v2", "monitor.py"),
    ("_private", "ray_process_reaper.py"),
)

#: The settings a process of Ray's services takes out of its environment, for its children too.
TRACING_SETTINGS = ("HANDOFF_TRACE", "HANDOFF_TRACE_LAUNCHES", "HANDOFF_TRACE_SOCKET")


def serve_trace() -> str:
    """Serves this process's exchanges live on a Unix socket, for ``handoff-trace attach PID``.

    The socket is made in a directory only this user can enter (``$XDG_RUNTIME_DIR/handoff``, else
    ``<tmp>/handoff-<uid>``), mode 0600, and a client of another uid is refused, as is a client past
    the 16 served at once. Serving runs on a thread of its own and starts once; later calls return
    the same path. Returns the socket's path.
    """
    global _socket_path  # noqa: PLW0603 - the process serves one socket
    if _socket_path is None:
        from . import _handoff

        _socket_path = _handoff._serve_trace()
        atexit.register(_handoff._stop_serving_trace)  # removes the socket; runs before _at_exit
    return _socket_path


def _trace_file(pattern: str) -> str:
    return pattern.replace("%p", str(os.getpid()))


def _finish() -> None:
    global _process_trace
    recording, _process_trace = _process_trace, None
    if recording is None or _trace_path is None:
        return
    from . import _handoff

    token = recording._token
    # Views still alive, made by an exchange it saw: reported as held, not as hazards.
    held = _handoff._trace_held(token) if token is not None else []
    recording.__exit__(None, None, None)
    recording._events.extend(held)
    path = _trace_file(_trace_path)
    try:
        _write_whole(path, recording.save)
    except OSError as error:
        _settings.warn(f"HANDOFF_TRACE: could not save the trace to {path}: {error}")


def _write_whole(path: str, write: Callable[[str], object]) -> None:
    """Writes `path` whole or not at all: `write` writes a file beside it, renamed over it. `handoff-
    trace run` may read the file while a process that outlived the program writes it."""
    partial = f"{path}.{os.getpid()}.partial"
    try:
        write(partial)
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def _start_process_trace() -> None:
    global _process_trace  # noqa: PLW0603 - the process writes one trace
    launches = _settings.flag("HANDOFF_TRACE_LAUNCHES")
    _process_trace = trace(limit=_settings.trace_limit(DEFAULT_LIMIT), libraries=True, launches=launches)
    _process_trace.__enter__()


def _mark_unfinished() -> None:
    """Writes this process's trace file as it begins, saying it is unfinished until the process saves
    its trace: one killed (a Pool's terminate()) is reported, not silently absent. For a process of a
    job (``%p``) that runs Python to its end: a program started, or a multiprocessing worker (not
    any forked child, which may run another program: subprocess's preexec_fn, pty.fork)."""
    global _marked_pid  # noqa: PLW0603 - the process marks its file once
    if _trace_path is None or "%p" not in _trace_path or _marked_pid == os.getpid():
        return  # a spawned worker, marked as it started, is marked again as a worker: once is enough
    _marked_pid = os.getpid()
    state = process_state("self")
    text = dumps(unfinished_trace(os.getpid(), state[1] if state is not None else None))
    with contextlib.suppress(OSError):  # said at the exit, where the trace cannot be saved either
        _write_whole(_trace_file(_trace_path), lambda partial: Path(partial).write_text(text, encoding="utf-8"))


def _restart_in_forked_child() -> None:
    """A forked child traces itself to its own file: the parent's events are not its own."""
    global _process_trace
    if _process_trace is None:
        return
    inherited, _process_trace = _process_trace, None
    inherited.__exit__(None, None, None)
    _start_process_trace()


class _ForkedWorkerExit:
    """multiprocessing's forked workers leave through os._exit, which skips atexit; their exit runs
    multiprocessing's finalizers, which it clears as a worker starts: one is registered after that."""

    def __call__(self, _: object) -> None:
        import multiprocessing.util

        multiprocessing.util.Finalize(None, _finish, exitpriority=-100)
        _mark_unfinished()


_forked_worker_exit = _ForkedWorkerExit()


def is_ray_service(script: str) -> bool:
    """Whether `script` (a process's ``sys.argv[0]``) is one of Ray's own services (RAY_SERVICES) in
    the `ray` package this Python imports."""
    if not isinstance(script, str) or f"{os.sep}ray{os.sep}" not in script:  # most programs: no search
        return False
    try:
        spec = importlib.util.find_spec("ray")
    except (ImportError, ValueError):
        return False
    if spec is None or not spec.submodule_search_locations:
        return False
    package = Path(os.path.realpath(next(iter(spec.submodule_search_locations))))
    return Path(os.path.realpath(script)) in {package.joinpath(*parts) for parts in RAY_SERVICES}


def start_from_environment() -> None:
    """Starts what HANDOFF_TRACE, HANDOFF_ORDER and HANDOFF_TRACE_SOCKET ask for (at `import
    handoff`). What cannot be started is a warning on the logger: the program runs as it is."""
    global _trace_path  # noqa: PLW0603
    argv = getattr(sys, "argv", None)  # an embedded interpreter may have none
    if argv and is_ray_service(argv[0]):
        # A service of Ray's exchanges no arrays, and Ray ends it without an exit: traced, it would
        # be reported as a process whose trace was lost. The processes it starts are not traced either.
        for name in TRACING_SETTINGS:
            os.environ.pop(name, None)
    path = _settings.trace_path()
    if path is not None and _process_trace is None:
        _trace_path = os.path.abspath(path)  # where it was asked for, whatever folder the program moves to
        _start_process_trace()
        _mark_unfinished()
        # Registered after handoff's own exit handler, so it runs first: views are still alive.
        atexit.register(_finish)
        if "%p" in path:
            os.register_at_fork(after_in_child=_restart_in_forked_child)
            import multiprocessing.util

            multiprocessing.util.register_after_fork(_forked_worker_exit, _forked_worker_exit)
    elif path is None and _settings.flag("HANDOFF_TRACE_LAUNCHES"):
        _settings.warn(
            "HANDOFF_TRACE_LAUNCHES makes the process trace a launch trace, and HANDOFF_TRACE (its file) is not set: no trace"
        )
    if _settings.flag("HANDOFF_ORDER"):
        from ._interpose import order_libraries

        order_libraries(True)
    if _settings.flag("HANDOFF_TRACE_SOCKET"):
        try:
            serve_trace()
        except (OSError, RuntimeError) as error:
            _settings.warn(f"HANDOFF_TRACE_SOCKET: not serving the trace: {error}")
