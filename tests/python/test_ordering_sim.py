"""Stream ordering through the real export and import paths, on the simulated device.

Run with HANDOFF_BACKEND=sim (arrays report as CUDA) or sim-rocm (as ROCm); skipped otherwise.
Every ordering test has a negative control that shows the race when ordering is turned off, and
holds its race with sim.hold (the producer's work waits for the block's end), never with a delay.
"""

from __future__ import annotations

import gc
import textwrap
import threading
import types
import weakref

import numpy as np
import pytest

import handoff

from support import (
    BACKEND,
    DEFAULT_STREAM,
    DEVICE_TYPE,
    HOLD_DEADLOCK,
    SIM_ROCM,
    behind,
    needs_sim,
    needs_two_devices,
    run_python,
    sim_leak_check,
    waiting_read,
)

pytestmark = needs_sim
if BACKEND.startswith("sim"):
    from handoff import sim

N = 4096


@pytest.fixture
def streams():
    producer = sim.Stream(non_blocking=True)
    consumer = sim.Stream(non_blocking=True)
    yield producer, consumer
    sim.synchronize()


@pytest.fixture(autouse=True)
def no_leaks():
    yield from sim_leak_check()


def pending_write(stream, value=1.0, device=0):
    """A device array whose producer write (`value` everywhere) is enqueued on `stream`: still pending
    while the caller holds `stream` (sim.hold)."""
    array = sim.zeros(N, "float32", device)
    sim.fill(array, value, stream=stream)
    return array


def import_and_read(source, consumer, ordered: bool) -> tuple:
    """Inside a hold of `source`'s producer: imports it for `consumer` (with no ordering, stream=-1, in
    the negative control) and enqueues a read of it there, which waits for the hold when ordered and
    reads stale data at once in the negative control. Returns (the view, the read's PendingCopy)."""
    view = handoff.from_dlpack(source, stream=consumer if ordered else -1)
    read = waiting_read(view, consumer) if ordered else sim.to_numpy(view, stream=consumer, wait=False)
    if not ordered:
        assert read.result()[0] == 0.0, "expected stale data without ordering"
    return view, read


class OlderTorchStream:
    """PyTorch's stream before its CUDA stream protocol (pytorch/pytorch#163614, 2025), which handoff
    reads by `.cuda_stream`; its `.device` a torch.device."""

    def __init__(self, stream):
        self.cuda_stream = stream.handle
        self.device = types.SimpleNamespace(type="cuda", index=stream.device)


class OlderCupyStream:
    """CuPy 13's stream, before `__cuda_stream__` (CuPy 14), which handoff reads by `.ptr` and
    `.device_id`."""

    def __init__(self, stream):
        self.ptr, self.device_id = stream.handle, stream.device


CONSUMER_SPELLINGS = {
    "int": lambda s: s.handle,
    "handoff.Stream": lambda s: handoff.Stream(s.handle),
    "sim.Stream (__cuda_stream__)": lambda s: s,
    ".cuda_stream": OlderTorchStream,
    ".ptr": OlderCupyStream,
}


def test_arrays_report_the_simulated_device_type():
    array = sim.zeros((2, 3))
    assert array.device == (DEVICE_TYPE, 0)
    assert array.__dlpack_device__() == (DEVICE_TYPE, 0)


@needs_two_devices
def test_arrays_of_the_second_device_report_its_id():
    assert sim.zeros(4, device=1).device == (DEVICE_TYPE, 1)


@pytest.mark.parametrize(
    "spelling", [*CONSUMER_SPELLINGS, None], ids=[*CONSUMER_SPELLINGS, "the enclosing stream block"]
)
def test_import_orders_a_pending_write_for_every_stream_spelling(streams, spelling):
    producer, consumer = streams
    with sim.hold(producer):
        source = pending_write(producer)
        if spelling is None:  # no stream argument: the enclosing handoff.stream block names the consumer
            with handoff.stream(consumer):
                view = handoff.from_dlpack(source)
        else:
            view = handoff.from_dlpack(source, stream=CONSUMER_SPELLINGS[spelling](consumer))
        read = waiting_read(view, consumer)
    assert read.result()[[0, -1]].tolist() == [1.0, 1.0]


def test_negative_control_no_ordering_shows_the_race(streams):
    producer, consumer = streams
    with sim.hold(producer):
        source = pending_write(producer)
        view = handoff.from_dlpack(source, stream=-1)  # the consumer asks for no ordering
        assert sim.to_numpy(view, stream=consumer)[0] == 0.0, "expected stale data without ordering"


def test_export_orders_before_the_consumer_stream_without_blocking(streams):
    producer, consumer = streams
    with sim.hold(producer):
        source = pending_write(producer)
        before = handoff.stats()
        # A host wait for the held producer would raise here (handoffErrorHoldDeadlock): none is made.
        capsule = source.__dlpack__(stream=consumer.handle, max_version=(1, 1))
        assert handoff.stats()["waits_inserted"] == before["waits_inserted"] + 1
        view = handoff.from_dlpack(capsule, stream=consumer)
        read = waiting_read(view, consumer)
    assert read.result()[0] == 1.0


def test_same_stream_is_elided(streams):
    _, consumer = streams
    with sim.hold(consumer):
        source = pending_write(consumer)
        before = handoff.stats()
        view = handoff.from_dlpack(source, stream=consumer)
        after = handoff.stats()
        assert after["waits_elided"] == before["waits_elided"] + 1
        assert after["waits_inserted"] == before["waits_inserted"]
        read = waiting_read(view, consumer)
    assert read.result()[0] == 1.0  # in-order on one stream


def test_default_stream_consumer_after_a_blocking_producer_waits():
    producer = sim.Stream(non_blocking=False)
    with sim.hold(producer):
        source = pending_write(producer)
        before = handoff.stats()
        view = handoff.from_dlpack(source, stream=DEFAULT_STREAM)
        # Not elided: implicit synchronization would order only work that is actually enqueued.
        assert handoff.stats()["waits_inserted"] == before["waits_inserted"] + 1
        read = waiting_read(view, DEFAULT_STREAM)
    assert read.result()[0] == 1.0
    del view, source
    sim.synchronize()


def test_default_stream_consumer_after_a_non_blocking_producer_waits(streams):
    producer, _ = streams
    with sim.hold(producer):
        source = pending_write(producer)
        before = handoff.stats()
        view = handoff.from_dlpack(source)  # None: DLPack's default stream
        assert handoff.stats()["waits_inserted"] == before["waits_inserted"] + 1
        read = waiting_read(view, DEFAULT_STREAM)
    assert read.result()[0] == 1.0


def test_three_hundred_exchanges_create_at_most_sixteen_events(streams):
    producer, consumer = streams
    source = sim.zeros(N)
    before = handoff.stats()
    for i in range(300):
        sim.fill(source, float(i), stream=producer)
        view = handoff.from_dlpack(source, stream=consumer)
    after = handoff.stats()
    assert after["events_created"] - before["events_created"] <= 16
    assert after["waits_inserted"] - before["waits_inserted"] == 300
    assert sim.to_numpy(view, stream=consumer)[0] == 299.0


def test_what_an_ordered_export_and_import_ask_of_the_device(streams):
    """In steady state (the thread's device current, the pool's event made), what each asks the
    simulated device, by operation: an ordered export asks for the memory's owner, the thread's
    context (for the device guard and for the event pool), whether either stream captures into a
    graph and the producer stream's device, then records and waits. An import of a handoff.Array
    shares its producer and asks the same: one owner lookup serves the wait and the binding, and the
    consumer's capture state (a capturing consumer keeps the producer while the graph lives) is the
    one the wait found."""
    producer, consumer = streams
    counted: dict[str, dict[str, int]] = {}
    failed: list[BaseException] = []

    def exchanges():
        try:
            sim.set_device(0)  # as on the thread of a library that has worked on the device
            first, imported, exported = (pending_write(producer) for _ in range(3))
            # Makes the pool's event; kept, as the views below, so that no release takes one
            # meanwhile. Earlier releases are done and no collection runs while calls are counted.
            warm = handoff.from_dlpack(first, stream=consumer)
            gc.collect()
            sim.drain()
            gc.disable()
            try:
                with sim.count_calls() as counted["import"]:
                    view = handoff.from_dlpack(imported, stream=consumer)
                with sim.count_calls() as counted["export"]:
                    capsule = exported.__dlpack__(stream=consumer.handle)
            finally:
                gc.enable()
            del warm, view, capsule
        except BaseException as error:  # noqa: BLE001 (raised again on the test's thread)
            failed.append(error)

    worker = threading.Thread(target=exchanges)  # its own current device
    worker.start()
    worker.join()
    if failed:
        raise failed[0]
    export = {
        "attributes": 1,
        "current_device": 2,
        "stream_capture_status": 2,
        "stream_device": 1,
        "record_event": 1,
        "stream_wait_event": 1,
    }
    assert counted["export"] == export
    assert counted["import"] == export


@needs_two_devices
def test_export_from_a_device_other_than_the_current_one():
    producer = sim.Stream(1, non_blocking=True)
    consumer = sim.Stream(1, non_blocking=True)
    with sim.hold(producer):
        source = pending_write(producer, value=3.0, device=1)
        view = handoff.from_dlpack(source, stream=consumer)  # current device stays 0
        assert view.device == (DEVICE_TYPE, 1)
        read = waiting_read(view, consumer)
    assert read.result()[0] == 3.0
    sim.synchronize()


@needs_two_devices
def test_a_consumer_on_another_device_waits_across_devices():
    producer = sim.Stream(1, non_blocking=True)
    elsewhere = sim.Stream(0, non_blocking=True)  # a peer reader: CUDA lets it wait on device 1's event
    with sim.hold(producer):
        source = pending_write(producer, value=6.0, device=1)
        view = handoff.from_dlpack(source, stream=elsewhere)
        read = waiting_read(view, elsewhere)
    assert read.result()[0] == 6.0


@needs_two_devices
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "negative-control"])
def test_data_written_from_a_peer_devices_stream_is_ordered_on_that_stream(ordered):
    peer = sim.Stream(0, non_blocking=True)
    source = sim.zeros(N, device=1)
    consumer = sim.Stream(1, non_blocking=True)
    with sim.hold(peer):
        sim.fill(source, 5.0, stream=peer)  # device 1's data written from a device 0 stream
        _view, read = import_and_read(source, consumer, ordered)  # the view lives to the end
    assert read.result()[0] == (5.0 if ordered else 0.0)
    sim.synchronize()


@needs_two_devices
def test_a_view_ordered_onto_a_peer_devices_stream_can_be_handed_on():
    producer = sim.Stream(0, non_blocking=True)
    peer = sim.Stream(1, non_blocking=True)
    last = sim.Stream(0, non_blocking=True)
    with sim.hold(producer), sim.hold(peer):
        source = pending_write(producer, value=3.0, device=0)
        view = handoff.from_dlpack(source, stream=peer)  # a reader on device 1: the data is now ready there
        sim.fill(view, 4.0, stream=peer)
        handed_on = handoff.from_dlpack(view, stream=last)
        read = waiting_read(handed_on, last)
    assert read.result()[0] == 4.0
    capsule = view.__dlpack__(stream=last.handle, max_version=(1, 1))  # the export path takes it too
    del capsule
    sim.synchronize()


class CudaArrayInterfaceProducer:
    def __init__(self, interface, owner):
        self.__cuda_array_interface__ = interface
        self.owner = owner


@pytest.mark.skipif(SIM_ROCM, reason="the CUDA Array Interface is for CUDA memory")
def test_cuda_array_interface_v3_import_orders_the_pending_producer(streams):
    producer, consumer = streams
    with sim.hold(producer):
        source = pending_write(producer, value=4.0)
        interface = source.__cuda_array_interface__
        assert interface["version"] == 3 and interface["stream"] == producer.handle
        view = handoff.asarray(CudaArrayInterfaceProducer(interface, source), stream=consumer)
        assert view.data_ptr == source.data_ptr
        read = waiting_read(view, consumer)
    assert read.result()[0] == 4.0


@pytest.mark.skipif(SIM_ROCM, reason="the CUDA Array Interface is for CUDA memory")
def test_cuda_array_interface_without_stream_is_the_negative_control(streams):
    producer, consumer = streams
    with sim.hold(producer):
        source = pending_write(producer, value=4.0)
        interface = dict(source.__cuda_array_interface__, stream=None)  # "no synchronization needed"
        view = handoff.asarray(CudaArrayInterfaceProducer(interface, source), stream=consumer)
        assert sim.to_numpy(view, stream=consumer)[0] == 0.0


# --- CUDA Array Interface v3: the producer's stream runs no later work until the consumer is done ---
#
# consumer_read() is the race: the consumer reads the data on its stream behind a stall (a copy,
# enqueued at once), the view is released, then the producer writes again on its stream. Ordered,
# the consumer reads the old value; unordered, the write lands first.

OLD, NEW = 1.0, 7.0
LEGACY, PER_THREAD = 1, 2  # the interface numbers streams as CUDA does, on every platform


def interface_of(array, stream):
    """A v3 interface of a sim array naming `stream`, made by hand (ROCm memory exports none)."""
    return {"shape": (N,), "typestr": "<f4", "data": (array.data_ptr, False), "version": 3, "stream": stream}


class StreamHoldingProducer(CudaArrayInterfaceProducer):
    """A producer that holds the stream its interface names, as numba-cuda 0.30's device arrays do
    (their `stream` attribute, a stream object with `__cuda_stream__`)."""

    def __init__(self, interface, owner, stream):
        super().__init__(interface, owner)
        self.stream = stream


def ready_source():
    source = sim.zeros(N)
    sim.fill(source, OLD, stream=DEFAULT_STREAM)
    sim.synchronize()
    return source


def consumer_read(producer, consumer, write_on, release=lambda views: views.clear()):
    """What the consumer reads of `producer`'s data when the producer writes on `write_on` once the
    view is released (by `release`, given the list that holds the view's only reference)."""
    source = producer.owner
    views = [handoff.asarray(producer, stream=consumer)]
    del producer
    with sim.hold(consumer):  # the consumer's read waits until the block ends
        read = handoff.from_dlpack(views[0], stream=consumer, copy=True)
        # All of the consumer's work on the data is enqueued. The view's last reference goes now.
        release(views)
        sim.fill(source, NEW, stream=write_on)  # the producer's next write
        sim.synchronize_unheld()  # it lands now unless it waits for the consumer
    value = sim.to_numpy(read, stream=consumer)[0]
    sim.synchronize()
    return value


def release_on_another_thread(views):
    thread = threading.Thread(target=views.clear)
    thread.start()
    thread.join()


def test_interface_legacy_default_producer_waits_for_the_consumer_at_release(streams):
    _, consumer = streams
    source = ready_source()
    before = handoff.stats()["waits_inserted"]
    producer = CudaArrayInterfaceProducer(interface_of(source, LEGACY), source)
    assert consumer_read(producer, consumer, write_on=DEFAULT_STREAM) == OLD
    assert handoff.stats()["waits_inserted"] == before + 2  # at import, and at release


def test_interface_legacy_default_producer_after_a_blocking_consumer_is_ordered_by_the_device():
    consumer = sim.Stream(non_blocking=False)  # the legacy stream's later work waits for its work
    source = ready_source()
    before = handoff.stats()
    producer = CudaArrayInterfaceProducer(interface_of(source, LEGACY), source)
    assert consumer_read(producer, consumer, write_on=DEFAULT_STREAM) == OLD
    after = handoff.stats()
    assert after["waits_inserted"] == before["waits_inserted"] + 1  # at import only
    assert after["waits_elided"] == before["waits_elided"] + 2  # at release, and the same-stream copy


@pytest.mark.skipif(SIM_ROCM, reason="a ROCm per-thread stream has no number the test can write on")
@pytest.mark.parametrize(
    "release",
    [lambda views: views.clear(), release_on_another_thread],
    ids=["released-here", "released-on-another-thread"],
)
def test_interface_per_thread_producer_waits_for_the_consumer_at_release(streams, release):
    _, consumer = streams
    source = ready_source()
    producer = CudaArrayInterfaceProducer(interface_of(source, PER_THREAD), source)
    assert consumer_read(producer, consumer, write_on=PER_THREAD, release=release) == OLD


def test_interface_stream_the_producer_holds_waits_for_the_consumer_at_release(streams):
    stream, consumer = streams
    source = ready_source()
    producer = StreamHoldingProducer(interface_of(source, stream.handle), source, stream)
    assert consumer_read(producer, consumer, write_on=stream) == OLD


HOLDERS = {
    "bare-handle": lambda stream: None,
    "holds-another-stream": lambda stream: sim.Stream(non_blocking=True),
    "holds-a-handle-only": lambda stream: handoff.Stream(stream.handle),
}


@pytest.mark.parametrize("holder", HOLDERS)
def test_interface_stream_nothing_keeps_alive_is_not_touched_the_negative_control(streams, holder):
    # Nothing proves the stream alive at the release, so it gets no wait: the race shows.
    stream, consumer = streams
    source = ready_source()
    held = HOLDERS[holder](stream)
    interface = interface_of(source, stream.handle)
    producer = (
        CudaArrayInterfaceProducer(interface, source)
        if held is None
        else StreamHoldingProducer(interface, source, held)
    )
    assert consumer_read(producer, consumer, write_on=stream) == NEW, "expected the race without a wait"


def test_interface_stream_the_producer_holds_is_kept_until_the_wait_is_enqueued(streams):
    _, consumer = streams
    stream = sim.Stream(non_blocking=True)
    gone = weakref.ref(stream)
    source = ready_source()
    producer = StreamHoldingProducer(interface_of(source, stream.handle), source, stream)
    view = handoff.asarray(producer, stream=consumer)
    producer.stream = None  # the producer lets go of its stream: handoff's reference remains
    del producer, stream
    gc.collect()
    assert gone() is not None, "the producer's stream must outlive the wait at release"
    with sim.hold(consumer):
        sim.fill(view, 2.0, stream=consumer)
        del view  # the wait on the stream (a use of it) is enqueued now; the fixture fails on a dead one
    consumer.synchronize()
    sim.drain()
    gc.collect()
    assert gone() is None, "kept after the release ran"


def test_interface_release_never_breaks_a_capture_on_another_stream(streams):
    # While a blocking stream captures, the legacy default stream cannot be used without invalidating
    # that capture: the release leaves it alone (and logs why).
    _, consumer = streams
    source = ready_source()
    view = handoff.asarray(CudaArrayInterfaceProducer(interface_of(source, LEGACY), source), stream=consumer)
    capturing = sim.Stream(non_blocking=False)
    scratch = sim.zeros(1)
    before = handoff.stats()["waits_inserted"]
    sim.begin_capture(capturing)
    try:
        sim.fill(scratch, 1.0, stream=capturing)
        del view
        gc.collect()
    finally:
        graph = sim.end_capture(capturing)  # raises if the capture was invalidated
    assert len(graph) == 1
    assert handoff.stats()["waits_inserted"] == before


def test_interface_release_puts_no_wait_into_a_capturing_producer_stream(streams):
    stream, consumer = streams
    source = ready_source()
    view = handoff.asarray(StreamHoldingProducer(interface_of(source, stream.handle), source, stream), stream=consumer)
    sim.begin_capture(stream)
    try:
        del view
        gc.collect()
    finally:
        graph = sim.end_capture(stream)
    assert len(graph) == 0, "the release's wait went into the producer's graph"


def test_interface_release_while_the_consumer_captures_orders_the_producer_after_the_capture(streams):
    _, consumer = streams
    source = ready_source()
    view = handoff.asarray(CudaArrayInterfaceProducer(interface_of(source, LEGACY), source), stream=consumer)
    before = handoff.stats()["waits_inserted"]
    sim.begin_capture(consumer)
    try:
        del view  # held back until the capture ends, like the release itself
        gc.collect()
        assert handoff.stats()["waits_inserted"] == before
    finally:
        assert len(sim.end_capture(consumer)) == 0
    sim.drain()
    assert handoff.stats()["waits_inserted"] == before + 1


def test_interface_release_whose_wait_fails_still_releases_the_producer(streams):
    stream, consumer = streams
    source = ready_source()
    live = handoff.stats()["live_views"]
    view = handoff.asarray(StreamHoldingProducer(interface_of(source, stream.handle), source, stream), stream=consumer)
    sim.inject_fault("stream_wait_event", 1, "hipErrorLaunchFailure" if SIM_ROCM else "cudaErrorLaunchFailure")
    try:
        del view  # the wait fails and is logged; the release is not affected
        gc.collect()
    finally:
        sim.clear_faults()
    sim.drain()
    gc.collect()
    assert handoff.stats()["live_views"] == live


def test_release_waits_for_the_consumer_stream(streams):
    _, consumer = streams
    allocations = sim.live_allocations()
    source = sim.zeros(N)
    view = handoff.from_dlpack(source, stream=consumer)
    del source
    gc.collect()
    assert sim.live_allocations() == allocations + 1, "the view must keep its memory alive"
    with sim.hold(consumer):  # consumer work still using the memory until the block ends
        sim.fill(view, 9.0, stream=consumer)
        before = handoff.stats()["deferred_releases"]
        del view
        gc.collect()
        assert handoff.stats()["deferred_releases"] == before + 1
        assert sim.live_allocations() == allocations + 1, "released while the consumer stream still used it"
    consumer.synchronize()
    sim.drain()
    sim.synchronize()  # the release frees as cudaFree does: once the device is idle
    gc.collect()
    assert sim.live_allocations() == allocations


class DeviceHidingProducer:
    """A producer older than __dlpack_device__: nothing says where its data is before the capsule."""

    def __init__(self, array) -> None:
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)


@pytest.mark.parametrize("ordered", [True, False], ids=["default-stream", "unordered-control"])
def test_data_from_a_producer_that_hides_its_device_is_bound_to_the_default_stream(ordered):
    allocations = sim.live_allocations()
    source = sim.zeros(N)
    sim.synchronize()
    # A capsule handed over directly is imported as it is (stream=-1 is the negative control).
    x = DeviceHidingProducer(source) if ordered else source.__dlpack__(stream=-1)
    view = handoff.from_dlpack(x) if ordered else handoff.from_dlpack(x, stream=-1)
    with pytest.raises(TypeError, match="has no __dlpack_device__, so a consumer stream cannot be passed"):
        handoff.from_dlpack(DeviceHidingProducer(source), stream=DEFAULT_STREAM)
    del source, x
    gc.collect()
    with sim.hold(DEFAULT_STREAM):  # consumer work still using the memory until the block ends
        sim.fill(view, 9.0, stream=DEFAULT_STREAM)
        before = handoff.stats()["deferred_releases"]
        del view
        gc.collect()
        assert handoff.stats()["deferred_releases"] == before + (1 if ordered else 0)
    sim.synchronize()
    sim.drain()
    gc.collect()
    assert sim.live_allocations() == allocations


# create_event is covered in C++ (tests/cpp/core/stream_test.cpp), where the pool starts empty;
# here earlier tests have left idle events in it, so no event is created. Data on device 1 (the
# current device is 0) makes a switch run, which can fail too; on device 0 nothing is pushed.
DEVICE_FAULTS = [("record_event", 0), ("stream_wait_event", 0), ("attributes", 0)] + [
    pytest.param(operation, 1, marks=needs_two_devices)
    for operation in ["record_event", "stream_wait_event", "attributes", "push_current_device"]
]


@pytest.mark.parametrize(("operation", "device"), DEVICE_FAULTS)
def test_a_device_fault_raises_device_error_and_leaks_nothing(operation, device):
    producer = sim.Stream(device, non_blocking=True)
    consumer = sim.Stream(device, non_blocking=True)
    source = pending_write(producer, device=device)
    sim.inject_fault(operation, 1, "hipErrorLaunchFailure" if SIM_ROCM else "cudaErrorLaunchFailure")
    try:
        with pytest.raises(handoff.DeviceError) as failure:
            handoff.from_dlpack(source, stream=consumer, device=None)
    finally:
        sim.clear_faults()
    assert failure.value.error_name.endswith("LaunchFailure")
    assert isinstance(failure.value, RuntimeError)
    view = handoff.from_dlpack(source, stream=consumer)  # works again afterwards
    assert sim.to_numpy(view, stream=consumer)[0] == 1.0


def test_stream_table_through_the_real_path():
    array = sim.zeros(4)
    created = sim.Stream()
    ok = [None, -1, 0, created.handle] if SIM_ROCM else [None, -1, 1, 2, created.handle]
    bad = [1, 2, -2] if SIM_ROCM else [0, -2]
    for value in ok:
        handoff.from_dlpack(array.__dlpack__(stream=value, max_version=(1, 1)))
    for value in bad:
        with pytest.raises(ValueError):
            array.__dlpack__(stream=value, max_version=(1, 1))
    for value in (True, 1.0, "1"):
        with pytest.raises(TypeError):
            array.__dlpack__(stream=value, max_version=(1, 1))
    sim.synchronize()


def test_many_threads_exchange_at_once():
    errors = []

    def worker():
        try:
            stream = sim.Stream(non_blocking=True)
            for i in range(50):
                source = sim.zeros(64)
                sim.fill(source, float(i), stream=stream)
                view = handoff.from_dlpack(source, stream=stream)
                assert sim.to_numpy(view, stream=stream)[0] == float(i)
                del view, source  # a consumer stream must outlive the views imported onto it
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_graph_capture_never_touches_the_default_stream():
    producer = sim.Stream(non_blocking=False)
    outsider = sim.Stream(non_blocking=True)
    array = sim.zeros(N)
    sim.begin_capture(producer)
    try:
        sim.fill(array, 1.0, stream=producer)  # captured, not run
        with pytest.raises(BufferError, match="legacy default stream"):
            array.__dlpack__(stream=DEFAULT_STREAM, max_version=(1, 1))
        with pytest.raises(BufferError, match="only one of them is capturing"):
            array.__dlpack__(stream=outsider.handle, max_version=(1, 1))
    finally:
        assert len(sim.end_capture(producer)) >= 1  # not invalidated: the default stream was never used
    assert sim.to_numpy(array, stream=outsider)[0] == 0.0  # captured work is not launched


def test_two_captures_into_different_graphs_are_refused_before_either_is_invalidated():
    producer = sim.Stream(non_blocking=True)
    consumer = sim.Stream(non_blocking=True)
    array = sim.zeros(N)
    sim.begin_capture(producer)
    sim.begin_capture(consumer)
    try:
        sim.fill(array, 1.0, stream=producer)  # captured: the array is ready on the capturing producer
        with pytest.raises(BufferError, match="two different graphs"):
            array.__dlpack__(stream=consumer.handle, max_version=(1, 1))
    finally:
        sim.end_capture(consumer)  # neither capture was invalidated: both end cleanly
        sim.end_capture(producer)


def test_copy_to_the_host_waits_for_the_pending_write(streams):
    producer, _ = streams
    with sim.hold(producer):
        source = pending_write(producer, value=2.5)
        with pytest.raises(handoff.DeviceError, match=HOLD_DEADLOCK):  # it waits for the held write
            handoff.from_dlpack(source, device=(1, 0))
    host = handoff.from_dlpack(source, device=(1, 0))  # dl_device=CPU: a copy, in stream order
    assert host.device == (1, 0)
    assert host.data_ptr != source.data_ptr
    import numpy as np

    assert np.from_dlpack(host)[[0, -1]].tolist() == [2.5, 2.5]


def test_numpy_reads_a_device_array_through_a_host_copy(streams):
    import numpy as np

    producer, _ = streams
    with sim.hold(producer):
        source = pending_write(producer, value=7.0)
        with pytest.raises(handoff.DeviceError, match=HOLD_DEADLOCK):  # it waits for the held write
            np.from_dlpack(source, device="cpu")
    values = np.from_dlpack(source, device="cpu")
    assert values.shape == (N,) and values[0] == 7.0 and values[-1] == 7.0


def test_copy_on_the_device_is_stream_ordered(streams):
    producer, _ = streams
    with sim.hold(producer):
        source = pending_write(producer, value=3.0)
        copy = handoff.from_dlpack(source.__dlpack__(copy=True, max_version=(1, 1)))
        assert copy.device == source.device
        assert copy.data_ptr != source.data_ptr
        read = waiting_read(copy, producer)
    assert read.result()[0] == 3.0  # the copy was enqueued after the write


def test_copy_false_to_the_host_is_refused():
    source = sim.zeros(4)
    with pytest.raises(BufferError, match="copy=False"):
        source.__dlpack__(dl_device=(1, 0), copy=False, max_version=(1, 1))
    with pytest.raises(BufferError, match="unreachable"):
        source.__dlpack__(dl_device=(DEVICE_TYPE, 1), max_version=(1, 1))


@pytest.mark.skipif(SIM_ROCM, reason="uses the CUDA Array Interface")
def test_exit_runs_pending_releases_while_python_is_alive():
    import os
    import subprocess
    import sys
    import textwrap

    program = textwrap.dedent(
        """
        import atexit
        import handoff
        from handoff import sim

        class Producer:
            def __init__(self, array):
                self.array = array
                self.__cuda_array_interface__ = array.__cuda_array_interface__
            def __del__(self):
                print("released", flush=True)

        consumer = sim.Stream(non_blocking=True)
        view = handoff.asarray(Producer(sim.zeros(1024)), stream=consumer)
        hold = sim.hold(consumer)
        hold.__enter__()
        sim.fill(view, 1.0, stream=consumer)
        del view  # the release now waits for the consumer stream, held until the interpreter exits
        atexit.register(hold.__exit__, None, None, None)  # after handoff's: runs before its exit drain
        print("exiting", flush=True)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HANDOFF_BACKEND": BACKEND},
        check=False,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["exiting", "released"]


# --- releases: a producer outlives every consumer stream that may still read it --------------------


class Owner:
    """What a library's array keeps alive; a weak reference to it says when handoff let go."""


def owned_view(device=0):
    """A handoff.view of fresh simulator memory, owned by an Owner only the view holds."""
    memory = sim.zeros(N, "float32", device)
    sim.synchronize()
    owner = Owner()
    owner.memory = memory
    view = handoff.view(memory.data_ptr, (N,), "float32", device=(DEVICE_TYPE, device), owner=owner)
    return view, weakref.ref(owner)


def settle():
    sim.synchronize()
    sim.drain()
    gc.collect()


def dropped_while_the_consumer_works(view, dlpack_stream, work_stream):
    """Exports `view` for `dlpack_stream`, then plays a consumer that imports the capsule, enqueues work
    on `work_stream` (which the caller holds: the work is still queued) and lets go at once (PyTorch and
    CuPy call the deleter at their refcount zero, whatever their stream still has queued)."""
    capsule = view.__dlpack__(stream=dlpack_stream, max_version=(1, 0))
    imported = handoff.from_dlpack(capsule, stream=-1)  # the export ordered it already
    sim.fill(imported, 9.0, stream=work_stream)
    del imported, capsule
    gc.collect()


DEFAULT_STREAMS = {"default stream": DEFAULT_STREAM} if SIM_ROCM else {"legacy (1)": 1, "per-thread (2)": 2}


@pytest.mark.parametrize("value", DEFAULT_STREAMS.values(), ids=DEFAULT_STREAMS.keys())
def test_an_export_keeps_its_producer_until_the_default_consumer_stream_is_done(value):
    view, gone = owned_view()
    with sim.hold(value):
        dropped_while_the_consumer_works(view, value, value)
        del view
        gc.collect()
        assert gone() is not None, "the producer was released while the consumer's stream still used it"
    settle()
    assert gone() is None


def test_an_export_keeps_its_producer_until_a_stream_the_block_holds_is_done():
    view, gone = owned_view()
    consumer = sim.Stream(non_blocking=True)
    with sim.hold(consumer.handle):  # by its handle: the hold keeps no reference to the stream object
        with handoff.stream(consumer):
            dropped_while_the_consumer_works(view, consumer.handle, consumer)
        del view, consumer  # the export holds the stream object until the release has run
        gc.collect()
        assert gone() is not None, "the producer was released while the consumer's stream still used it"
    settle()
    assert gone() is None


def exported_to_a_bare_handle_that_works() -> tuple:
    """An owned_view exported to a consumer stream named by its bare handle and dropped while held
    work of that stream's uses it: (whether the producer was kept while the work was held, a weak
    reference to the producer), once everything settled."""
    view, gone = owned_view()
    consumer = sim.Stream(non_blocking=True)
    with sim.hold(consumer):
        dropped_while_the_consumer_works(view, consumer.handle, consumer)
        del view
        gc.collect()
        kept = gone() is not None
    settle()
    return kept, gone


@pytest.mark.negative_control
def test_negative_control_a_bare_consumer_handle_is_not_waited_for_at_release():
    # A stream named by a bare handle may be destroyed before the deleter runs: it is not touched,
    # and the producer goes with the deleter (the consumer's duty; see HANDOFF_EXPORT_RELEASE).
    kept, _ = exported_to_a_bare_handle_that_works()
    assert not kept


def test_every_stream_policy_waits_for_bare_consumer_handles_too():
    previous = handoff.set_export_release("every-stream")
    try:
        kept, gone = exported_to_a_bare_handle_that_works()
        assert kept, "the producer was released while the consumer's stream still used it"
        assert gone() is None
    finally:
        assert handoff.set_export_release(previous) == "every-stream"


def test_export_release_policy_names_are_checked():
    with pytest.raises(ValueError, match="'known-streams' or 'every-stream'"):
        handoff.set_export_release("sometimes")


@pytest.mark.parametrize("threads", [1, 4])
def test_ordered_imports_dropped_at_once_use_a_bounded_set_of_events(threads):
    source = sim.zeros(16)
    sim.synchronize()

    def churn(count):
        consumer = sim.Stream(non_blocking=True)
        for _ in range(count):
            handoff.from_dlpack(source, stream=consumer)  # dropped at once: a deferred release each

    churn(2000)  # warm-up: the pool fills
    before = handoff.stats()
    workers = [threading.Thread(target=churn, args=(20000 // threads,)) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    after = handoff.stats()
    assert after["deferred_releases"] - before["deferred_releases"] == 20000
    # Releases between two polls share their stream's event: the count follows the streams, not the calls.
    assert after["events_created"] - before["events_created"] <= 8 * threads
    sim.drain()
    assert handoff.stats()["pending_releases"] == 0


def test_a_failed_poll_is_asked_again_and_the_producer_still_released(streams):
    _, consumer = streams
    view, gone = owned_view()
    imported = handoff.from_dlpack(view, stream=consumer)
    with sim.hold(consumer):  # the release waits: the first poll of its event fails
        sim.fill(imported, 1.0, stream=consumer)
        sim.inject_fault("query_event", 1)  # one transient failure while the release waits
        del imported, view
        gc.collect()
    settle()
    assert gone() is None, "one failed poll kept the producer forever"


def test_a_device_that_keeps_failing_abandons_its_releases_keeps_the_producer_and_says_so_once():
    program = textwrap.dedent(
        """
        import gc, weakref
        import handoff
        from handoff import sim

        class Owner:
            pass

        memory = sim.zeros(1024)
        sim.synchronize()
        owner = Owner()
        view = handoff.view(memory.data_ptr, (1024,), "float32", device=({device_type}, 0), owner=owner)
        gone = weakref.ref(owner)
        del owner
        consumer = sim.Stream(non_blocking=True)
        imported = handoff.from_dlpack(view, stream=consumer)
        with sim.hold(consumer):  # the release is deferred: the consumer still works
            sim.fill(imported, 1.0, stream=consumer)
            sim.inject_fault("query_event", 100000)
            del imported, view
            gc.collect()
        sim.drain()  # returns: the release was given up, not run
        assert gone() is not None, "released although nothing said the consumer was done"
        assert handoff.stats()["pending_releases"] == 0
        sim.clear_faults()
        print("ok")
        """
    ).format(device_type=DEVICE_TYPE)
    result = run_python(program, HANDOFF_BACKEND=BACKEND)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"
    assert result.stderr.count("cannot be waited for") == 1, result.stderr


# --- threads that end while their per-thread default stream still works -------------------------


def in_a_thread(body):
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()


@pytest.mark.skipif(SIM_ROCM, reason="the per-thread default stream (2) is CUDA's")
def test_a_view_bound_to_an_ended_threads_default_stream_is_released_after_its_work():
    view, gone = owned_view()
    gate = sim.Stream(non_blocking=True)
    held = []

    def body():
        behind(gate, 2)
        imported = handoff.from_dlpack(view, stream=2)
        sim.fill(imported, 2.0, stream=2)  # still queued when the thread ends
        held.append(imported)

    with sim.hold(gate):
        in_a_thread(body)
        del view
        held.clear()
        gc.collect()
        assert gone() is not None, "released before the ended thread's queued work"
    settle()
    assert gone() is None


@pytest.mark.skipif(SIM_ROCM, reason="the per-thread default stream (2) is CUDA's")
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "negative-control"])
def test_data_ready_on_an_ended_threads_default_stream_is_read_finished(streams, ordered):
    _, consumer = streams
    gate = sim.Stream(non_blocking=True)
    source = sim.zeros(N)
    sim.synchronize()

    def write():
        behind(gate, 2)
        sim.fill(source, 7.0, stream=2)  # still queued when the thread ends

    with sim.hold(gate):
        in_a_thread(write)
        _view, read = import_and_read(source, consumer, ordered)  # the view lives to the end
    assert read.result()[0] == (7.0 if ordered else 0.0)
    sim.synchronize()


# --- the host waits through an event, and producers are called on their data's device -----------


@pytest.mark.skipif(SIM_ROCM, reason="the per-thread default stream (2) and managed memory are CUDA's")
@pytest.mark.parametrize("memory", ["managed", "pinned"])
def test_a_host_view_of_data_on_a_per_thread_stream_waits_for_its_work(memory):
    source = sim.zeros(N, memory=memory)
    sim.synchronize()
    with sim.hold(2):
        sim.fill(source, 4.0, stream=2)  # bound as the legacy stream, which a sync does not cover
        with pytest.raises(handoff.DeviceError, match=HOLD_DEADLOCK):  # the host view waits for the held write
            handoff.from_dlpack(source, device="cpu")
    values = np.asarray(handoff.from_dlpack(source, device="cpu"))
    assert values[0] == 4.0 and values[-1] == 4.0
    sim.synchronize()


@pytest.mark.skipif(SIM_ROCM, reason="the per-thread default stream (2) and managed memory are CUDA's")
@pytest.mark.negative_control
def test_negative_control_the_same_memory_read_on_the_host_without_a_wait_is_stale():
    source = sim.zeros(N, memory="managed")
    sim.synchronize()
    with sim.hold(2):
        sim.fill(source, 4.0, stream=2)
        unordered = handoff.view(source.data_ptr, (N,), "float32", device="cpu", owner=source)
        assert np.asarray(unordered)[0] == 0.0
    sim.synchronize()


class DeviceRecordingProducer:
    """A tensor of PyTorch 2.13 on another device than 0: its __dlpack__ refuses to export while
    another device is current, with its BufferError, and orders the current device's streams."""

    def __init__(self, array):
        self.array = array
        self.called_on = None

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        expected, current = self.array.__dlpack_device__()[1], sim.current_device()
        if current != expected:
            raise BufferError(
                f"Can't export tensors on a different CUDA device index. Expected: {expected}. Current device: {current}."
            )
        self.called_on = current
        return self.array.__dlpack__(**kwargs)


@needs_two_devices
def test_a_producer_is_called_with_its_datas_device_current():
    consumer = sim.Stream(1, non_blocking=True)
    producer = DeviceRecordingProducer(sim.zeros(N, device=1))
    assert sim.current_device() == 0
    handoff.from_dlpack(producer, stream=consumer)
    assert producer.called_on == 1
    assert sim.current_device() == 0, "the consumer's current device was not restored"
    sim.synchronize()


# --- a device context reset (numba-cuda's cuda.close()) --------------------------------------------


def test_exchanges_after_a_device_context_reset_use_fresh_events():
    program = textwrap.dedent(
        """
        import gc
        import handoff
        from handoff import sim

        def exchange(value):
            producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
            source = sim.zeros(1024)
            sim.synchronize()
            with sim.hold(producer):
                sim.fill(source, value, stream=producer)
                view = handoff.from_dlpack(source, stream=consumer)
                read = sim.to_numpy(view, stream=consumer, wait=False)
                assert not read.done()
            seen = read.result()[0]
            del view, source, producer, consumer
            sim.synchronize(); sim.drain(); gc.collect()
            return seen

        assert exchange(1.0) == 1.0  # the pool now holds events of the device's context
        sim.reset_device(0)
        assert exchange(2.0) == 2.0
        assert sim.violations() == [], sim.violations()
        print("ok")
        """
    )
    result = run_python(program, HANDOFF_BACKEND=BACKEND)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "ok\n"


# --- graph capture: a release waits for the graph, not the capture's end -------------------------


def test_a_view_dropped_during_a_capture_is_kept_until_the_graph_is_destroyed():
    consumer = sim.Stream(non_blocking=False)
    view, gone = owned_view()
    imported = handoff.from_dlpack(view, stream=consumer)
    del view
    consumer.synchronize()
    sim.begin_capture(consumer)
    sim.fill(imported, 2.0, stream=consumer)  # a node of the graph: it writes the data at each launch
    del imported  # as a torch.cuda.graph body drops its temporaries
    gc.collect()
    graph = sim.end_capture(consumer)
    graph.launch(consumer)
    consumer.synchronize()
    gc.collect()
    sim.drain()  # waits for every deferred release but those bound to graphs the program holds
    assert gone() is not None, "released while the graph that writes the data can still be launched"
    graph.launch(consumer)
    del graph  # the launch still holds it
    consumer.synchronize()
    settle()
    assert gone() is None
