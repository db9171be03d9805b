"""handoff's settings from the environment (docs/settings.md): each read as users write it, a value
that cannot be used a warning on the logger, never a failed import."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

import handoff
from handoff import _settings

from support import run_python

ON = ["1", "true", "TRUE", "Yes", " on "]
OFF = ["", " ", "0", "false", "No", "OFF"]


def _logged(capfd: pytest.CaptureFixture[str]) -> str:
    return capfd.readouterr().err


# --- booleans ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ON)
def test_a_boolean_setting_is_on_as_users_write_it(value, monkeypatch, capfd):
    monkeypatch.setenv("HANDOFF_ORDER", value)
    assert _settings.flag("HANDOFF_ORDER") is True
    assert _logged(capfd) == ""


@pytest.mark.parametrize("value", OFF)
def test_a_boolean_setting_is_off_as_users_write_it(value, monkeypatch, capfd):
    monkeypatch.setenv("HANDOFF_ORDER", value)
    assert _settings.flag("HANDOFF_ORDER") is False
    assert _logged(capfd) == ""


def test_an_unset_boolean_setting_is_off(monkeypatch):
    monkeypatch.delenv("HANDOFF_ORDER", raising=False)
    assert _settings.flag("HANDOFF_ORDER") is False


@pytest.mark.parametrize("value", ["2", "enable", "tru", "-1"])
def test_a_boolean_setting_that_is_neither_stays_off_with_a_warning(value, monkeypatch, capfd):
    monkeypatch.setenv("HANDOFF_TRACE_SOCKET", value)
    assert _settings.flag("HANDOFF_TRACE_SOCKET") is False
    logged = _logged(capfd)
    assert "[warning]" in logged and f"HANDOFF_TRACE_SOCKET={value!r} is neither on" in logged


CHECK_MODES = "import handoff, handoff._interpose as i, handoff._process_trace as p; print(i._hooks.ordering, p._socket_path is not None)"


@pytest.mark.parametrize(
    ("value", "on"), [("false", False), ("no", False), ("off", False), (" ", False), ("Yes", True), ("ON", True)]
)
def test_the_ordering_mode_and_the_socket_follow_their_boolean_settings(value, on, tmp_path):
    result = run_python(CHECK_MODES, HANDOFF_ORDER=value, HANDOFF_TRACE_SOCKET=value, XDG_RUNTIME_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(on), str(on)]
    assert "[warning]" not in result.stderr


def test_a_boolean_setting_that_is_neither_is_a_warning_at_import():
    result = run_python(CHECK_MODES, HANDOFF_ORDER="enabled")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
    assert "HANDOFF_ORDER='enabled' is neither on (1, true, yes, on) nor off" in result.stderr


# --- HANDOFF_TRACE and HANDOFF_TRACE_LIMIT ---------------------------------------------------------


def test_a_launch_trace_asked_for_without_the_process_traces_file_is_a_warning(tmp_path):
    result = run_python("pass", HANDOFF_TRACE_LAUNCHES="1")  # a program that never imports handoff
    assert result.returncode == 0, result.stderr
    assert "HANDOFF_TRACE (its file) is not set: no trace" in result.stderr
    traced = run_python("import handoff", HANDOFF_TRACE_LAUNCHES="1", HANDOFF_TRACE=str(tmp_path / "t.json"))
    assert traced.returncode == 0, traced.stderr
    assert "[warning]" not in traced.stderr


@pytest.mark.parametrize("value", ["", " ", "0", "off", "False"])
def test_a_process_trace_switched_off_as_a_boolean_is_no_trace(value, monkeypatch):
    monkeypatch.setenv("HANDOFF_TRACE", value)
    assert _settings.trace_path() is None


def test_a_process_trace_path_is_kept_as_written(monkeypatch):
    monkeypatch.setenv("HANDOFF_TRACE", "traces/run-%p.json")
    assert _settings.trace_path() == "traces/run-%p.json"


@pytest.mark.parametrize("limit", [0, -1, 2**64, 10**30, True, 1.5, "10"])
def test_a_trace_limit_out_of_range_is_a_value_error(limit):
    with pytest.raises(ValueError, match=r"limit must be None or an int from 1 to 2\*\*64-1"):
        handoff.trace(limit=limit)


def test_the_largest_trace_limit_is_accepted():
    with handoff.trace(limit=2**64 - 1) as t:
        pass
    assert t.events == []


@pytest.mark.parametrize(
    ("text", "limit"), [("12", 12), (" 12 ", 12), (str(2**64 - 1), 2**64 - 1), ("", 30), (" ", 30)]
)
def test_the_trace_limit_setting(text, limit, monkeypatch, capfd):
    monkeypatch.setenv("HANDOFF_TRACE_LIMIT", text)
    assert _settings.trace_limit(30) == limit
    assert _logged(capfd) == ""


@pytest.mark.parametrize("text", ["0", "-5", str(2**64), "99999999999999999999999", "1e5", "lots", "9" * 5000])
def test_a_trace_limit_setting_out_of_range_keeps_the_default_with_a_warning(text, monkeypatch, capfd):
    monkeypatch.setenv("HANDOFF_TRACE_LIMIT", text)
    assert _settings.trace_limit(30) == 30
    assert "is not a count of events (an int from 1 to 2**64-1); keeping 30" in _logged(capfd)


def test_a_trace_limit_setting_out_of_range_never_fails_the_import(tmp_path):
    result = run_python(
        "import handoff; print('imported')",
        HANDOFF_TRACE=str(tmp_path / "t-%p.json"),
        HANDOFF_TRACE_LIMIT="99999999999999999999999",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "imported"
    assert "HANDOFF_TRACE_LIMIT='99999999999999999999999' is not a count of events" in result.stderr


# --- the runtime's settings: HANDOFF_LOG_*, HANDOFF_BACKEND, HANDOFF_EXPORT_RELEASE, HANDOFF_SIM_DEVICES ---

AN_EXCHANGE = "import handoff, numpy as np\nhandoff.from_dlpack(np.arange(2.0))"


def _log_of_an_exchange(**env: str) -> str:
    result = run_python(AN_EXCHANGE, HANDOFF_BACKEND="none", **env)
    assert result.returncode == 0, result.stderr
    return result.stderr


@pytest.mark.parametrize("level", ["debug", "DEBUG", "Debug", " debug ", "trace", "TRACE"])
def test_the_log_level_is_read_in_any_case(level):
    logged = _log_of_an_exchange(HANDOFF_LOG_LEVEL=level)
    assert "[debug]" in logged and "[warning]" not in logged


@pytest.mark.parametrize("level", ["WARNING", "warning", "warn", "ERROR", "err", "CRITICAL", "fatal", "off", "OFF"])
def test_the_log_level_takes_spdlogs_and_pythons_names(level):
    assert _log_of_an_exchange(HANDOFF_LOG_LEVEL=level) == ""


@pytest.mark.parametrize("level", ["verbose", "10", "notset", "debug2"])
def test_an_unknown_log_level_is_a_warning_and_warn_applies(level):
    logged = _log_of_an_exchange(HANDOFF_LOG_LEVEL=level)
    assert f"HANDOFF_LOG_LEVEL={level} is not a level (trace, debug, info, warn, error, critical or off" in logged
    assert "[debug]" not in logged


def test_the_log_file_is_made_with_its_folders(tmp_path: Path):
    log = tmp_path / "logs" / "today" / "handoff.log"
    assert _log_of_an_exchange(HANDOFF_LOG_LEVEL="debug", HANDOFF_LOG_FILE=str(log)) == ""
    assert "[debug]" in log.read_text()


def test_a_log_file_that_cannot_be_opened_is_a_warning_and_the_log_goes_to_stderr(tmp_path: Path):
    (tmp_path / "a-file").write_text("")
    unwritable = tmp_path / "a-file" / "handoff.log"  # a folder that is a file: never makeable
    logged = _log_of_an_exchange(HANDOFF_LOG_LEVEL="debug", HANDOFF_LOG_FILE=str(unwritable))
    assert f"HANDOFF_LOG_FILE={unwritable}: " in logged and "; logging to stderr" in logged
    assert "[debug]" in logged


def test_the_backend_and_the_export_release_are_read_in_any_case():
    code = textwrap.dedent("""
        import handoff
        print(handoff.runtime_info()["backend"], handoff.runtime_info()["device_count"])
        print(handoff.set_export_release("known-streams"))
    """)
    result = run_python(code, HANDOFF_BACKEND=" SIM ", HANDOFF_SIM_DEVICES=" 1 ", HANDOFF_EXPORT_RELEASE="Every-Stream")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["sim", "1", "every-stream"]
    assert "[warning]" not in result.stderr
