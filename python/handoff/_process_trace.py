"""The process-wide trace and the live socket, asked for by the environment or by a call.

``HANDOFF_TRACE=path`` traces the whole process and saves the trace to ``path`` at exit, with a
``leak`` hazard for each view still alive then. ``HANDOFF_TRACE_SOCKET=1`` serves the exchanges live
from the start (``handoff-trace attach PID``).
"""

from __future__ import annotations

import atexit
import os

from ._trace import trace

_process_trace: trace | None = None
_socket_path: str | None = None


def serve_trace() -> str:
    """Serves this process's exchanges live on a Unix socket, for ``handoff-trace attach PID``.

    The socket is made in a directory only this user can enter (``$XDG_RUNTIME_DIR/handoff``, else
    ``<tmp>/handoff-<uid>``), mode 0600, and a client of another uid is refused. Serving starts once;
    later calls return the same path. Returns the socket's path.
    """
    global _socket_path  # noqa: PLW0603 - the process serves one socket
    if _socket_path is None:
        from . import _handoff

        _socket_path = _handoff._serve_trace()
        atexit.register(_handoff._stop_serving_trace)  # removes the socket; runs before _at_exit
    return _socket_path


def _finish(path: str) -> None:
    global _process_trace
    recording, _process_trace = _process_trace, None
    if recording is None:
        return
    from . import _handoff

    token = recording._token
    # Views still alive, made by an exchange it saw.
    leaks = _handoff._trace_leaks(token) if token is not None else []
    recording.__exit__(None, None, None)
    recording._events.extend(leaks)
    try:
        recording.save(path)
    except OSError as error:
        # On the logger (stderr), not in the program's own output.
        _handoff._log_warning(f"HANDOFF_TRACE: could not save the trace to {path}: {error}")


def start_from_environment() -> None:
    """Starts what HANDOFF_TRACE and HANDOFF_TRACE_SOCKET ask for (at `import handoff`). What cannot
    be started is a warning on the logger: the program runs, untraced."""
    global _process_trace  # noqa: PLW0603 - the process writes one trace
    path = os.environ.get("HANDOFF_TRACE")
    if path and _process_trace is None:
        _process_trace = trace()
        _process_trace.__enter__()
        # Registered after handoff's own exit handler, so it runs first: views are still alive.
        atexit.register(_finish, path)
    if os.environ.get("HANDOFF_TRACE_SOCKET", "") not in ("", "0"):
        try:
            serve_trace()
        except (OSError, RuntimeError) as error:
            from . import _handoff

            _handoff._log_warning(f"HANDOFF_TRACE_SOCKET: not serving the trace: {error}")
