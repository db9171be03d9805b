"""Imports through a producer type's DLPack C exchange API (`__dlpack_c_exchange_api__`).

PyTorch's table, and tables built in ctypes whose calls fail or whose version is unknown: those
imports fall back to `__dlpack__`, and a tensor already made is deleted exactly once. On sim and
sim-rocm the consumer stream is ordered after the stream `current_work_stream` reports.
"""

from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

import handoff

from dlpack_ctypes import DLManagedTensorVersioned, DLPackVersion, HandMadeTensor, new_capsule
from support import BACKEND, CUDA_ORDERING_REFUSED, DEVICE_TYPE, SIM, needs_sim, settle_sim, waiting_read

if SIM:
    from handoff import sim

FROM_PY_OBJECT = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.py_object, ctypes.POINTER(ctypes.POINTER(DLManagedTensorVersioned))
)
CURRENT_WORK_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))


class DLPackExchangeAPI(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("prev_api", ctypes.c_void_p),
        ("managed_tensor_allocator", ctypes.c_void_p),
        ("managed_tensor_from_py_object_no_sync", FROM_PY_OBJECT),
        ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
        ("dltensor_from_py_object_no_sync", ctypes.c_void_p),
        ("current_work_stream", CURRENT_WORK_STREAM),
    ]


class TableProducer:
    """Hands out `tensor` through its type's table and `source`'s capsules through `__dlpack__`."""

    def __init__(self, source: object, tensor: HandMadeTensor) -> None:
        self.source = source
        self.tensor = tensor
        self.dlpack_calls = 0

    def __dlpack__(self, **kwargs: object) -> object:
        self.dlpack_calls += 1
        return self.source.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.source.__dlpack_device__()


class Table:
    """A ctypes DLPack C exchange API and a TableProducer type publishing it. `from_py_fails` and
    `stream_fails` make those calls return -1; `stream` is what current_work_stream reports."""

    def __init__(
        self,
        *,
        major: int = 1,
        from_py_fails: bool = False,
        stream_fails: bool = False,
        stream: int | None = None,
        null_from_py: bool = False,
        form: str = "capsule",
        newer: DLPackExchangeAPI | None = None,
    ) -> None:
        self.calls = {"from_py": 0, "stream": 0}
        self.from_py_fails = from_py_fails
        self.stream_fails = stream_fails
        self.stream = stream
        self.api = DLPackExchangeAPI()
        self.api.version = DLPackVersion(major, 2)
        self._from_py = FROM_PY_OBJECT(self._from_py_object)
        self._current_work_stream = CURRENT_WORK_STREAM(self._work_stream)
        if not null_from_py:
            self.api.managed_tensor_from_py_object_no_sync = self._from_py
        self.api.current_work_stream = self._current_work_stream
        # `newer`: a table of a version handoff does not read, published instead, whose prev_api is this one.
        published = self.api
        if newer is not None:
            newer.prev_api = ctypes.addressof(self.api)
            published = newer
        self.newer = newer
        # DLPack 1.3's form (a capsule) or 1.2's (the table's address as an int).
        attribute = (
            {"__dlpack_c_exchange_api__": new_capsule(ctypes.addressof(published), b"dlpack_exchange_api")}
            if form == "capsule"
            else {"__c_dlpack_exchange_api__": ctypes.addressof(published)}
        )
        # The type holds the tables too: an attribute handoff caches must never outlive what it names.
        self.type = type("TableProducer", (TableProducer,), {**attribute, "_table": self})

    def _from_py_object(self, producer: TableProducer, out: object) -> int:
        self.calls["from_py"] += 1
        if self.from_py_fails:
            return -1
        out[0] = ctypes.pointer(producer.tensor.managed)
        return 0

    def _work_stream(self, _device_type: int, _device_id: int, out: object) -> int:
        self.calls["stream"] += 1
        if self.stream_fails:
            return -1
        out[0] = self.stream
        return 0

    def producer(self, source: object, tensor: HandMadeTensor) -> TableProducer:
        return self.type(source, tensor)


def host_producer(table: Table) -> tuple[TableProducer, np.ndarray]:
    source = np.arange(6, dtype=np.float32)
    return table.producer(source, HandMadeTensor(source.ctypes.data, (6,))), source


def test_a_table_imports_without_calling_dlpack():
    table = Table()
    producer, source = host_producer(table)
    view = handoff.from_dlpack(producer)
    assert (table.calls["from_py"], producer.dlpack_calls) == (1, 0)
    assert table.calls["stream"] == 0, "host data has no stream to ask for"
    assert view.data_ptr == source.ctypes.data
    assert np.from_dlpack(view).tolist() == source.tolist()
    del view
    gc.collect()
    assert producer.tensor.deleted == 1


def test_a_table_published_as_an_address_imports_without_calling_dlpack():
    table = Table(form="address")
    producer, source = host_producer(table)
    assert np.from_dlpack(handoff.from_dlpack(producer)).tolist() == source.tolist()
    assert (table.calls["from_py"], producer.dlpack_calls) == (1, 0)


@pytest.mark.parametrize("form", ["capsule", "address"])
def test_a_table_too_new_is_passed_over_for_its_prev_api(form):
    newer = DLPackExchangeAPI()
    newer.version = DLPackVersion(2, 0)  # a future major version, whose layout handoff cannot know
    table = Table(form=form, newer=newer)
    producer, source = host_producer(table)
    assert np.from_dlpack(handoff.from_dlpack(producer)).tolist() == source.tolist()
    assert (table.calls["from_py"], producer.dlpack_calls) == (1, 0), "the older table of major version 1 is used"


def test_a_cycle_of_prev_api_falls_back_to_dlpack():
    looped = DLPackExchangeAPI()
    looped.version = DLPackVersion(2, 0)
    looped.prev_api = ctypes.addressof(looped)
    producer_type = type(
        "Looped",
        (TableProducer,),
        {"__dlpack_c_exchange_api__": new_capsule(ctypes.addressof(looped), b"dlpack_exchange_api"), "_t": looped},
    )
    source = np.arange(3, dtype=np.float32)
    producer = producer_type(source, HandMadeTensor(source.ctypes.data, (3,)))
    assert np.from_dlpack(handoff.from_dlpack(producer)).tolist() == [0.0, 1.0, 2.0]
    assert producer.dlpack_calls == 1


def test_the_capsule_wins_where_a_type_publishes_both_forms():
    table = Table()
    unused = Table(from_py_fails=True)
    both = type("Both", (table.type,), {"__c_dlpack_exchange_api__": ctypes.addressof(unused.api), "_u": unused})
    source = np.arange(3, dtype=np.float32)
    producer = both(source, HandMadeTensor(source.ctypes.data, (3,)))
    assert np.from_dlpack(handoff.from_dlpack(producer)).tolist() == [0.0, 1.0, 2.0]
    assert (table.calls["from_py"], unused.calls["from_py"], producer.dlpack_calls) == (1, 0, 0)


def test_asarray_and_imports_count_use_the_table():
    table = Table()
    producer, source = host_producer(table)
    before = handoff.stats()["imports"]
    assert np.from_dlpack(handoff.asarray(producer)).tolist() == source.tolist()
    assert handoff.stats()["imports"] == before + 1
    assert producer.dlpack_calls == 0


@pytest.mark.parametrize("kwargs", [{"copy": True}, {"device": "cpu"}])
def test_device_and_copy_arguments_use_dlpack(kwargs):
    table = Table()
    producer, source = host_producer(table)
    assert np.from_dlpack(handoff.from_dlpack(producer, **kwargs)).tolist() == source.tolist()
    assert (table.calls["from_py"], producer.dlpack_calls) == (0, 1)


@pytest.mark.parametrize(
    "table_args",
    [{"major": 2}, {"major": 0}, {"null_from_py": True}, {"from_py_fails": True}],
    ids=["major-2", "major-0", "null-function", "failing-call"],
)
def test_unusable_tables_fall_back_to_dlpack(table_args):
    table = Table(**table_args)
    producer, source = host_producer(table)
    assert np.from_dlpack(handoff.from_dlpack(producer)).tolist() == source.tolist()
    assert producer.dlpack_calls == 1
    gc.collect()
    assert producer.tensor.deleted == 0, "the table made no tensor"


def test_an_address_of_zero_is_no_table():
    producer_type = type("Zero", (TableProducer,), {"__c_dlpack_exchange_api__": 0})
    source = np.arange(3, dtype=np.float32)
    producer = producer_type(source, HandMadeTensor(source.ctypes.data, (3,)))
    assert np.from_dlpack(handoff.from_dlpack(producer)).tolist() == [0.0, 1.0, 2.0]
    assert producer.dlpack_calls == 1


def test_a_capsule_of_another_name_is_no_table():
    producer_type = type("Named", (TableProducer,), {"__dlpack_c_exchange_api__": new_capsule(1, b"other")})
    source = np.arange(3, dtype=np.float32)
    producer = producer_type(source, HandMadeTensor(source.ctypes.data, (3,)))
    assert np.from_dlpack(handoff.from_dlpack(producer)).tolist() == [0.0, 1.0, 2.0]
    assert producer.dlpack_calls == 1


# ------------------------------------------------------------------------------------------------
# PyTorch's table


def torch_subclass(torch):
    class Counting(torch.Tensor):
        dlpack_calls = 0

        def __dlpack__(self, *args, **kwargs):
            type(self).dlpack_calls += 1
            return super().__dlpack__(*args, **kwargs)

    return Counting


def test_torch_tensors_go_through_the_table(torch, live):
    counting = torch_subclass(torch)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).as_subclass(counting)
    view = handoff.from_dlpack(t)
    assert counting.dlpack_calls == 0
    assert view.data_ptr == t.data_ptr()
    assert np.from_dlpack(view).tolist() == t.tolist()


@pytest.mark.parametrize("dtype", ["float32", "float64", "int8", "int64", "uint8", "bool", "float16", "complex64"])
def test_torch_dtypes_are_zero_copy(torch, dtype, live):
    t = torch.arange(10).to(getattr(torch, dtype))
    view = handoff.from_dlpack(t)
    assert view.data_ptr == t.data_ptr()
    assert np.array_equal(np.from_dlpack(view), t.numpy())


@pytest.mark.parametrize(
    "make",
    [
        lambda torch: torch.tensor(2.5),
        lambda torch: torch.empty(0, 3),
        lambda torch: torch.arange(24.0).reshape(4, 6)[1:, ::2],
        lambda torch: torch.arange(24.0).reshape(4, 6).t(),
    ],
    ids=["0-d", "empty", "sliced", "transposed"],
)
def test_torch_layouts(torch, make, live):
    t = make(torch)
    view = handoff.asarray(t)
    assert view.shape == tuple(t.shape)
    if t.numel():
        assert view.data_ptr == t.data_ptr()
    assert np.array_equal(np.from_dlpack(view), t.numpy())


def test_torch_tensor_is_kept_alive_by_the_view(torch, live):
    t = torch.arange(1000, dtype=torch.int32)
    view = handoff.from_dlpack(t)
    del t
    gc.collect()
    assert np.from_dlpack(view)[[0, -1]].tolist() == [0, 999]


def test_torch_conjugate_views_are_refused_as_by_dlpack(torch):
    # The table exports a lazily conjugated tensor's memory as it is; __dlpack__ refuses it.
    with pytest.raises(BufferError, match="conjugate"):
        handoff.from_dlpack(torch.tensor([1 + 2j]).conj())


@pytest.mark.parametrize(
    "make",
    [
        lambda torch: torch.ones(3, requires_grad=True),
        lambda torch: torch.ones(3, requires_grad=True) * 2,  # not a leaf: still refused
        lambda torch: torch.tensor([1 + 2j]).conj(),
        lambda torch: torch.ones(3, 3).to_sparse(),
    ],
    ids=["requires-grad leaf", "requires-grad", "conjugate", "sparse"],
)
@pytest.mark.parametrize("how", [handoff.from_dlpack, handoff.asarray], ids=["from_dlpack", "asarray"])
def test_what_torch_refuses_to_export_stays_refused(torch, make, how, live):
    t = make(torch)
    with pytest.raises(BufferError) as by_torch:
        t.__dlpack__()
    with pytest.raises(BufferError) as through_handoff:
        how(t)  # the table would hand it over: an autograd leaf written unseen
    assert str(through_handoff.value) == str(by_torch.value)


def test_a_subclass_that_sets_no_table_is_asked_through_its_own_dlpack(torch, live):
    class Refusing(torch.Tensor):
        __dlpack_c_exchange_api__ = None  # its base's table would export what this refuses

        def __dlpack__(self, *args: object, **kwargs: object) -> object:
            raise BufferError("this subclass exports nothing")

    t = torch.arange(4.0).as_subclass(Refusing)
    for how in (handoff.from_dlpack, handoff.asarray, np.from_dlpack):
        with pytest.raises(BufferError, match="this subclass exports nothing"):
            how(t)


# ------------------------------------------------------------------------------------------------
# Device data


@pytest.mark.skipif(BACKEND != "none", reason="the rules for CUDA data without a backend")
def test_cuda_data_without_a_backend_follows_the_dlpack_rules():
    table = Table()
    producer = table.producer(np.zeros(4, np.float32), HandMadeTensor(0x10000, (4,), device=(2, 0)))
    if CUDA_ORDERING_REFUSED:  # auto found no CUDA device: nothing could order the exchange
        with pytest.raises(handoff.DeviceError):
            handoff.from_dlpack(producer)
    else:  # HANDOFF_BACKEND=none asks for unordered exchanges
        assert handoff.from_dlpack(producer).device == (2, 0)
    gc.collect()
    assert (table.calls["stream"], producer.tensor.deleted) == (0, 1)


N = 4096


def pending_producer(table: Table, stream: object) -> TableProducer:
    """A table producer of a sim array whose write of 1.0 is enqueued on `stream`: still pending while
    the caller holds `stream` (sim.hold)."""
    source = sim.zeros(N, "float32")
    sim.fill(source, 1.0, stream=stream)
    table.stream = stream.handle
    return table.producer(source, HandMadeTensor(source.data_ptr, (N,), device=(DEVICE_TYPE, 0)))


@pytest.fixture
def streams():
    producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    yield producer, consumer
    sim.synchronize()


@needs_sim
@pytest.mark.parametrize(
    ("stream_fails", "dlpack_calls"),
    [
        pytest.param(False, 0, id="the consumer waits for the current work stream"),
        # The read is then ordered by the producer's __dlpack__, and the table's tensor is still
        # deleted exactly once.
        pytest.param(True, 1, id="a failing current_work_stream falls back without leaking"),
    ],
)
def test_an_ordered_import_through_the_table(streams, stream_fails, dlpack_calls):
    producer_stream, consumer = streams
    table = Table(stream_fails=stream_fails)
    with sim.hold(producer_stream):
        producer = pending_producer(table, producer_stream)
        view = handoff.from_dlpack(producer, stream=consumer.handle)
        assert (table.calls["from_py"], table.calls["stream"], producer.dlpack_calls) == (1, 1, dlpack_calls)
        read = waiting_read(view, consumer)
    assert read.result()[[0, -1]].tolist() == [1.0, 1.0]
    del view
    settle_sim()
    assert producer.tensor.deleted == 1, "the table's tensor is deleted exactly once"


@needs_sim
def test_the_stream_block_is_the_consumer(streams):
    producer_stream, consumer = streams
    with sim.hold(producer_stream):
        producer = pending_producer(Table(), producer_stream)
        with handoff.stream(consumer):
            view = handoff.from_dlpack(producer)
        read = waiting_read(view, consumer)
    assert read.result()[0] == 1.0


@needs_sim
def test_negative_control_stream_minus_one_reads_stale_data(streams):
    producer_stream, consumer = streams
    table = Table()
    with sim.hold(producer_stream):
        producer = pending_producer(table, producer_stream)
        view = handoff.from_dlpack(producer, stream=-1)
        assert table.calls["stream"] == 0, "no ordering asked, so no stream to ask for"
        assert sim.to_numpy(view, stream=consumer)[0] == 0.0, "expected stale data without ordering"


@needs_sim
@pytest.mark.parametrize("consumer", [None, -1], ids=["ordered", "stream=-1"])
def test_a_table_tensor_is_checked_at_the_door_as_every_import(consumer):
    # Past its allocation (a crash when read, before), or of the device family the backend does not
    # order: refused as a capsule of it is, not passed over for __dlpack__.
    small = sim.zeros((6,), "float32")
    other_family = 2 if BACKEND == "sim-rocm" else 10
    for device_type, error, match in (
        (DEVICE_TYPE, ValueError, "run past the end of their allocation"),
        (other_family, handoff.DeviceError, "cannot be ordered by the"),
    ):
        shape = (1 << 24,) if device_type == DEVICE_TYPE else (6,)
        table = Table()
        producer = table.producer(small, HandMadeTensor(small.data_ptr, shape, device=(device_type, 0)))
        with pytest.raises(error, match=match):
            handoff.from_dlpack(producer, stream=consumer)
        assert (table.calls["from_py"], producer.dlpack_calls) == (1, 0)
        gc.collect()
        assert producer.tensor.deleted == 1
