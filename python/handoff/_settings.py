"""handoff's settings from the environment that Python reads (the runtime reads HANDOFF_BACKEND,
HANDOFF_SIM_DEVICES, HANDOFF_SIM_VISIBLE_DEVICES, HANDOFF_EXPORT_RELEASE and HANDOFF_LOG_*), each read one way.

A value is read as users write it: blanks around it are ignored, and words in any case. A value that
cannot be used is a warning on handoff's logger (stderr), and the default applies: a setting never
makes ``import handoff`` fail. docs/settings.md has the table of every setting.
"""

from __future__ import annotations

import os

#: How a boolean setting is switched on, and off (unset is off too), in any case.
ON = ("1", "true", "yes", "on")
OFF = ("", "0", "false", "no", "off")

#: The largest event count a trace keeps (the runtime counts in 64 bits).
LIMIT_MAX = 2**64 - 1


def warn(message: str) -> None:
    from . import _handoff

    _handoff._log_warning(message)  # on the logger (stderr), not in the program's own output


def flag(name: str) -> bool:
    """Boolean setting `name`: on for 1, true, yes or on; off when unset, blank, 0, false, no or off;
    anything else is off, with a warning."""
    text = os.environ.get(name)
    if text is None:
        return False
    value = text.strip().lower()
    if value in ON:
        return True
    if value not in OFF:
        warn(f"{name}={text!r} is neither on (1, true, yes, on) nor off (0, false, no, off, blank); it stays off")
    return False


def trace_path() -> str | None:
    """HANDOFF_TRACE: the file a process trace is saved to (``%p``: the process id), or None when
    unset, blank or switched off as a boolean is (0, false, no, off)."""
    text = os.environ.get("HANDOFF_TRACE")
    if text is None or text.strip().lower() in OFF:
        return None
    return text


def check_limit(limit: int | None) -> int | None:
    """A trace's ``limit`` argument: None, or an int from 1 to LIMIT_MAX; else ValueError."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= LIMIT_MAX):
        raise ValueError(f"limit must be None or an int from 1 to 2**64-1, not {limit!r}")
    return limit


def trace_limit(default: int) -> int:
    """HANDOFF_TRACE_LIMIT: how many events a process trace keeps; `default` when unset or blank, and,
    with a warning, when not an int from 1 to 2**64-1."""
    text = os.environ.get("HANDOFF_TRACE_LIMIT", "")
    if not text.strip():
        return default
    try:
        limit = check_limit(int(text))
    except ValueError:
        warn(f"HANDOFF_TRACE_LIMIT={text!r} is not a count of events (an int from 1 to 2**64-1); keeping {default}")
        return default
    assert limit is not None
    return limit
