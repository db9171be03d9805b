"""The process's edges: fork, multiprocessing, sub-interpreters, finalizers that call back into
handoff, reference cycles through a view's owner, pickling, and what the environment asks for at
import. Each crash or hang runs in a child process, so that a failure fails the test, not the suite.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest

import handoff

from support import BACKEND, needs_sim, run_python

# A parent that used the simulated device (its service thread and workers run) before it forks.
USED_THE_DEVICE = """
import gc, os, sys
import numpy as np
import handoff
from handoff import sim
consumer = sim.Stream(0, non_blocking=True)
x = sim.zeros((4,), "float32")
sim.fill(x, 1.0, stream=consumer, delay=0.3)
y = handoff.from_dlpack(x, stream=consumer)
del y  # a release pending while the process forks
"""


@needs_sim
@pytest.mark.parametrize("child", ["cpu", "device", "runtime_info"])
def test_a_child_forked_after_device_use_exits_cleanly(child):
    body = {
        "cpu": "assert handoff.from_dlpack(np.arange(3.0)).shape == (3,)",
        "device": textwrap.dedent("""
            try:
                sim.zeros(4)
            except handoff.DeviceError as e:
                assert e.error_name == "handoffErrorForkedChild", e.error_name
                assert "forked" in str(e)
            else:
                raise AssertionError("the parent's device was usable in the child")"""),
        "runtime_info": "assert 'forked' in handoff.runtime_info()['backend_error']",
    }[child]
    child_code = textwrap.indent(textwrap.dedent(body).strip() + "\nsys.exit(0)", "    ")
    # sys.exit(0): handoff's exit handlers and static destructors run in the child.
    code = (
        USED_THE_DEVICE
        + "pid = os.fork()\nif pid == 0:\n"
        + child_code
        + textwrap.dedent("""
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        """)
    )
    result = run_python(code, HANDOFF_BACKEND=BACKEND)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["0"], result.stderr


# Daemon threads still exchanging when the program ends: each release waits 1 ms of work.
STILL_EXCHANGING = """
import sys, threading, time
import handoff
from handoff import sim

def exchange():
    producer = sim.Stream(non_blocking=True)
    while True:
        a = sim.zeros((16,), "float32")
        sim.fill(a, 1.0, stream=producer, delay=0.001)
        handoff.from_dlpack(a, stream=sim.Stream(non_blocking=True))

for _ in range(4):
    threading.Thread(target=exchange, daemon=True).start()
while handoff.stats()["deferred_releases"] < 100:  # all of them exchanging
    time.sleep(0.01)
print("ending", flush=True)
"""


@needs_sim
def test_the_exit_waits_for_what_was_pending_not_for_releases_that_keep_arriving():
    # The exit's wait counted the releases the threads kept adding: it took its whole limit (10 s)
    # every time, then blamed a capture or work that never finishes.
    result = run_python(STILL_EXCHANGING, HANDOFF_BACKEND=BACKEND, HANDOFF_LOG_LEVEL="info")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["ending"]
    assert "did not run within" not in result.stderr, result.stderr[-2000:]
    assert "capture never ended" not in result.stderr


# The program blocks SIGUSR1 once handoff's threads run, signals itself and waits for the signal,
# as a server waiting in sigwait does; `started_before` also starts a thread of its own first.
AWAITS_ITS_SIGNAL = """
import os, signal, sys, threading
import numpy as np
import handoff
from handoff import sim
# The service thread and the simulator's workers.
handoff.from_dlpack(sim.zeros((4,), "float32"), stream=sim.Stream(0, non_blocking=True))
if sys.argv[1] == "started_before":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
os.kill(os.getpid(), signal.SIGUSR1)
print(signal.sigtimedwait({signal.SIGUSR1}, 30) is not None)
"""


@needs_sim  # a CUDA driver's threads are its own: they may take the signal (the program's to block)
@pytest.mark.parametrize("thread", ["none", "started_before"])
def test_a_signal_the_program_waits_for_is_never_taken_by_handoffs_threads(thread):
    # handoff's threads took every signal: the first one that the program blocked to wait for it
    # went to one of them instead, and SIGUSR1's default action ended the process.
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # NumPy's BLAS starts none
    result = subprocess.run(
        [sys.executable, "-c", AWAITS_ITS_SIGNAL, thread],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    if thread == "none":
        assert (result.returncode, result.stdout) == (0, "True\n"), result.stderr
    else:  # the control: a thread that does not block the signal takes it
        assert result.returncode == -signal.SIGUSR1, (result.returncode, result.stdout, result.stderr)


def _double_through_handoff(n: int) -> float:
    return float(np.from_dlpack(handoff.from_dlpack(np.full(4, float(n)))).sum() * 2)


@needs_sim
def test_multiprocessing_with_fork_works_after_device_use():
    code = USED_THE_DEVICE + textwrap.dedent("""
        import multiprocessing
        sys.path.insert(0, %r)
        from test_process_edges import _double_through_handoff
        with multiprocessing.get_context("fork").Pool(2) as pool:
            print(pool.map(_double_through_handoff, [1, 2, 3]))
        """) % str(__import__("pathlib").Path(__file__).parent)
    result = run_python(code, HANDOFF_BACKEND=BACKEND)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "[8.0, 16.0, 24.0]"


def test_import_in_a_sub_interpreter_is_refused_not_deadlocked():
    code = textwrap.dedent("""
        import _xxsubinterpreters as interpreters
        try:
            interpreters.run_string(interpreters.create(), "import handoff")
        except interpreters.RunFailedError as e:
            print(e)
        """)
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert "ImportError" in result.stdout and "sub-interpreter" in result.stdout


@needs_sim
def test_a_finalizer_that_waits_for_releases_on_the_service_thread_is_refused():
    # An owner's __del__ runs where its producer is released: for a stream-ordered release, on
    # handoff's service thread, which sim.drain() would then wait for forever.
    code = textwrap.dedent("""
        import threading, handoff
        from handoff import sim
        refused = []
        class Owner:
            def __del__(self):
                try:
                    sim.drain()
                except RuntimeError as e:
                    refused.append(str(e))
        x = sim.zeros((4,), "float32")
        v = handoff.view(x.data_ptr, 4, "float32", device=x.device, owner=Owner())
        y = handoff.from_dlpack(v, stream=sim.Stream(0, non_blocking=True))
        del v, y
        sim.synchronize()
        sim.drain()
        later = handoff.from_dlpack(sim.zeros((4,), "float32"), stream=sim.Stream(0, non_blocking=True))
        del later
        sim.drain()  # later releases still run
        print(refused)
        """)
    result = run_python(code, HANDOFF_BACKEND=BACKEND)
    assert result.returncode == 0, result.stderr
    assert "service thread" in result.stdout and "wait for itself" in result.stdout


class CachedView(handoff.Exporter):
    """A library's array that caches its own view, which holds it: a reference cycle."""

    def __init__(self) -> None:
        self.data = np.zeros(1024, np.float32)
        self._view = handoff.view(self.data.ctypes.data, self.data.shape, "float32", device="cpu", owner=self)

    def __handoff_array__(self) -> handoff.Array:
        return self._view


def test_a_cycle_through_a_views_owner_is_collected():
    refs = []
    for _ in range(10):
        cached = CachedView()
        assert np.asarray(cached).shape == (1024,)
        refs.append(weakref.ref(cached))
        del cached
    gc.collect()
    assert [r() for r in refs] == [None] * 10


@needs_sim
def test_a_cycle_through_a_stream_object_a_view_keeps_is_collected():
    from handoff import sim

    class LibraryStream:
        """A library's stream object, named by `.ptr` as CuPy 13's are, that caches what was
        imported onto it."""

        def __init__(self) -> None:
            self.stream = sim.Stream(non_blocking=True)
            self.ptr = self.stream.handle
            self.views: list[handoff.Array] = []

    stream = LibraryStream()
    stream.views.append(handoff.from_dlpack(sim.zeros(4), stream=stream))  # the view keeps the stream object
    gone = weakref.ref(stream)
    del stream
    sim.synchronize()
    sim.drain()
    gc.collect()
    sim.drain()  # the release the collection asked for
    gc.collect()
    assert gone() is None


def test_a_collected_array_is_left_empty_for_whatever_still_sees_it():
    seen = []

    class Watcher:
        def __del__(self) -> None:
            seen.append(self.view.shape)  # the view may be cleared first: never read freed memory

    cached = CachedView()
    cached.watcher = Watcher()
    cached.watcher.view = cached._view
    del cached
    gc.collect()
    assert seen in ([(1024,)], [(0,)])


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_arrays_refuse_every_pickle_protocol(protocol):
    array = handoff.asarray(np.arange(4, dtype=np.float32))
    with pytest.raises(TypeError, match=r"cannot pickle 'handoff\.Array'"):
        pickle.dumps(array, protocol=protocol)


def test_arrays_refuse_copy():
    array = handoff.asarray(np.arange(4, dtype=np.float32))
    with pytest.raises(TypeError, match="cannot pickle"):
        copy.copy(array)


def test_a_trace_socket_directory_refused_at_import_is_a_warning(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "handoff").symlink_to(tmp_path / "real")  # refused: a symbolic link
    result = run_python("import handoff; print('imported')", HANDOFF_TRACE_SOCKET="1", XDG_RUNTIME_DIR=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "imported\n"
    assert "[warning]" in result.stderr and "HANDOFF_TRACE_SOCKET" in result.stderr


def test_an_unwritable_trace_path_is_a_warning_on_stderr(tmp_path):
    code = "import numpy as np, handoff; handoff.from_dlpack(np.zeros(2)); print('ran')"
    result = run_python(code, HANDOFF_TRACE=str(tmp_path))  # a directory
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ran\n", "the program's own output is left alone"
    assert "[warning]" in result.stderr and "could not save the trace" in result.stderr
