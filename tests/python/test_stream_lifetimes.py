"""Consumer streams that outlive their objects: CuPy, cuda.core and Numba destroy their stream when
the stream object is collected, so a view bound to a stream keeps its object alive until the
view's stream-ordered release has run. Run with HANDOFF_BACKEND=sim or sim-rocm; skipped otherwise.
"""

from __future__ import annotations

import gc
import textwrap
import weakref

import pytest

import handoff

from support import BACKEND, needs_sim, run_python, waiting_read

pytestmark = needs_sim
if BACKEND.startswith("sim"):
    from handoff import sim


class CudaStreamWrapper:
    """A stream object of another library: handoff sees it through __cuda_stream__ only."""

    def __init__(self):
        self.stream = sim.Stream(non_blocking=True)

    def __cuda_stream__(self):
        return (0, self.stream.handle)


def _in_block(source, stream):
    with handoff.stream(stream):
        return handoff.from_dlpack(source)


IMPORTS = {
    "from_dlpack(stream=sim.Stream)": lambda source, stream: handoff.from_dlpack(source, stream=stream),
    "handoff.stream block": _in_block,
    "asarray": lambda source, stream: handoff.asarray(source, stream=stream),
}


@pytest.mark.parametrize("how", IMPORTS)
@pytest.mark.parametrize("wrapped", [False, True], ids=["sim.Stream", "foreign stream object"])
def test_a_view_keeps_its_consumer_stream_alive_until_its_release_has_run(how, wrapped, capfd):
    producer = sim.Stream(non_blocking=True)
    source = sim.zeros(1024)
    consumer = CudaStreamWrapper() if wrapped else sim.Stream(non_blocking=True)
    stream = consumer.stream if wrapped else consumer
    gone = weakref.ref(stream)
    with sim.hold(producer):  # the consumer stream still waits for the producer when the view goes
        sim.fill(source, 3.0, stream=producer)
        view = IMPORTS[how](source, consumer)
        del consumer, stream
        gc.collect()
        assert gone() is not None, "the consumer stream was destroyed while a view was bound to it"
        # Inside a block, the source's export holds the block's stream too: its release waits for it.
        del view, source
        gc.collect()
    sim.synchronize()
    sim.drain()
    gc.collect()
    assert gone() is None, "the consumer stream was kept after the releases had run"
    assert "invalid" not in capfd.readouterr().err


def test_a_fill_keeps_its_stream_alive_while_the_data_is_ready_on_it(capfd):
    source = sim.zeros(1024)
    producer = sim.Stream(non_blocking=True)
    gone = weakref.ref(producer)
    with sim.hold(producer.handle):  # by its handle: the hold keeps no reference to the stream object
        sim.fill(source, 4.0, stream=producer)
        del producer
        gc.collect()
        assert gone() is not None
        consumer = sim.Stream(non_blocking=True)
        view = handoff.from_dlpack(source, stream=consumer)  # orders after the fill's stream
        read = waiting_read(view, consumer)
    assert read.result()[0] == 4.0
    del view, source
    sim.synchronize()
    sim.drain()
    gc.collect()
    assert gone() is None
    assert "invalid" not in capfd.readouterr().err


GLOBALS_AT_EXIT = textwrap.dedent(
    """
    import atexit
    import handoff
    from handoff import sim

    producer = sim.Stream(non_blocking=True)
    consumer = sim.Stream(non_blocking=True)
    source = sim.zeros(1 << 12)
    hold = sim.hold(producer)
    hold.__enter__()
    sim.fill(source, 1.0, stream=producer)
    view = handoff.from_dlpack(source, stream=consumer)
    block = handoff.stream(consumer)
    with block:
        second = handoff.from_dlpack(view)
    copy = handoff.from_dlpack(second, stream=producer, copy=True)
    atexit.register(hold.__exit__, None, None, None)  # after handoff's: the write is pending as the exit begins
    print("exiting")
    """
)


def test_views_and_streams_left_in_module_globals_exit_cleanly():
    result = run_python(GLOBALS_AT_EXIT)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "exiting\n"
    assert result.stderr == "", "exit printed errors"


def test_a_view_dropped_while_its_consumer_stream_captures_is_released_once_after_the_capture():
    consumer = sim.Stream(non_blocking=False)
    source = sim.zeros(1024)
    sim.fill(source, 2.0, stream=consumer)  # ready on the consumer stream: the import needs no wait
    sim.synchronize()
    live = handoff.stats()["live_views"]
    sim.begin_capture(consumer)
    view = handoff.from_dlpack(source, stream=consumer)
    del view  # its release must not become a node of the graph
    assert len(sim.end_capture(consumer)) == 0, "the release went into the captured graph"
    sim.drain()
    gc.collect()
    assert handoff.stats()["live_views"] == live
    del source
    sim.synchronize()
    sim.drain()
