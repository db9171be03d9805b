"""Host cost of one ordered exchange between two streams: handoff next to PyTorch's and CuPy's own
``__dlpack__(stream=...)``, in one process, on the same two streams.

An ordered exchange hands an array from the stream its data is ready on (the producer's) to a
consumer's stream: the producer's ``__dlpack__(stream=consumer)`` makes the consumer stream wait for
the producer's pending work (an event recorded and waited on; the host never blocks), and the
consumer wraps the capsule. Every row does that whole pair, then drops the result (a handoff view
that goes releases its producer in stream order, on handoff's service thread).

    HANDOFF_BACKEND=cuda python3 bench/ordered_exchange_bench.py [--quick] [--check]

Target: an exchange that handoff orders costs the host at most half of PyTorch's (torch -> torch).
Held to it: handoff -> torch (the same consumer) and handoff -> handoff. Shown, not held to it:
handoff -> cupy (next to cupy -> cupy, CuPy consuming in both), and the imports from PyTorch and
CuPy (torch -> handoff, cupy -> handoff), ordered by the producer's own ``__dlpack__``, or by handoff
where the producer has the DLPack C exchange API (PyTorch's ``__dlpack_c_exchange_api__``) and says
which stream its data is ready on. ``--check`` exits 1 unless
every target row was measured and met the target. ``HANDOFF_BACKEND=sim`` needs no GPU and runs
handoff's own row alone (no peer reads simulated arrays, so no target); on a backend without a
device the script says why it measured nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import handoff

TARGET = 0.5  # handoff's host cost per ordered exchange, as a fraction of PyTorch's
BASELINE = "torch -> torch"
MAX_VERSION = (1, 0)  # what torch.from_dlpack asks for; CuPy and handoff accept it too
SHAPE = (256, 256)


@dataclass
class Row:
    name: str  # "producer -> consumer"
    ordered_by: str  # whose __dlpack__ records the event and makes the consumer wait
    exchange: Callable[[], object]
    target: bool = False  # held to TARGET x the baseline


def optional(module: str, notes: list[str]):
    try:
        return importlib.import_module(module)
    except ImportError as error:
        notes.append(f"{module} not importable ({error}): its rows are skipped")
        return None


def per_call_ns(exchange: Callable[[], object], number: int) -> float:
    gc_was_enabled = gc.isenabled()
    gc.disable()  # as timeit does: a collection would land on whichever row happens to run
    try:
        start = time.perf_counter_ns()
        for _ in range(number):
            exchange()
        return (time.perf_counter_ns() - start) / number
    finally:
        if gc_was_enabled:
            gc.enable()


def measure(rows: list[Row], number: int, repeat: int, settle: Callable[[], None]) -> dict[str, float]:
    """Median ns per exchange of each row over `repeat` batches of `number` calls.

    The batches of all rows are interleaved, so that each row sees the same machine load, and the
    device is drained between batches, so that no batch pays for the queue another one left.
    """
    for row in rows:
        per_call_ns(row.exchange, max(number // 10, 50))
        settle()
    samples: dict[str, list[float]] = {row.name: [] for row in rows}
    for _ in range(repeat):
        for row in rows:
            samples[row.name].append(per_call_ns(row.exchange, number))
            settle()
    return {name: statistics.median(values) for name, values in samples.items()}


def cuda_rows(keep: list, stack: contextlib.ExitStack, notes: list[str]) -> tuple[list[Row], Callable[[], None]]:
    """Rows on a CUDA device: one producer and one consumer stream, shared by every library.

    The rows' closures hold the producers and views; `keep` gets the streams."""
    torch = optional("torch", notes)
    if torch is not None and not torch.cuda.is_available():
        notes.append(f"PyTorch {torch.__version__} sees no CUDA device: its rows are skipped")
        torch = None
    cupy = optional("cupy", notes)
    if cupy is not None:
        try:
            cupy.cuda.runtime.getDeviceCount()
        except Exception as error:  # noqa: BLE001 - CuPy raises its own CUDARuntimeError
            notes.append(f"CuPy sees no CUDA device ({error}): its rows are skipped")
            cupy = None
    if torch is not None:
        producer_stream, consumer_stream = torch.cuda.Stream(), torch.cuda.Stream()
        producer, consumer = producer_stream.cuda_stream, consumer_stream.cuda_stream
        # PyTorch and CuPy order from their current stream: make the producer current in both.
        stack.enter_context(torch.cuda.stream(producer_stream))
        settle = torch.cuda.synchronize
    elif cupy is not None:
        producer_stream, consumer_stream = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
        producer, consumer = producer_stream.ptr, consumer_stream.ptr
        settle = cupy.cuda.Device().synchronize
    else:
        notes.append("no library here makes CUDA arrays (PyTorch, CuPy): nothing to exchange")
        return [], lambda: None
    keep += [producer_stream, consumer_stream]

    def exported(library, source) -> Callable[[], object]:
        """`library` importing the capsule that `source` exports for the consumer stream."""
        return lambda: library.from_dlpack(source.__dlpack__(stream=consumer, max_version=MAX_VERSION))

    rows: list[Row] = []
    if torch is not None:
        tensor = torch.ones(SHAPE, device="cuda")  # written on the producer stream
        view = handoff.from_dlpack(tensor, stream=producer)  # its data is ready on the producer
        rows += [
            Row(BASELINE, "PyTorch", exported(torch, tensor)),
            Row("handoff -> torch", "handoff", exported(torch, view), target=True),
            Row("handoff -> handoff", "handoff", lambda: handoff.from_dlpack(view, stream=consumer), target=True),
            Row(
                "torch -> handoff",
                "handoff" if hasattr(torch.Tensor, "__dlpack_c_exchange_api__") else "PyTorch",
                lambda: handoff.from_dlpack(tensor, stream=consumer),
            ),
        ]
    if cupy is not None:
        stack.enter_context(cupy.cuda.ExternalStream(producer))
        array = cupy.ones(SHAPE, dtype=cupy.float32)
        cupy_view = handoff.from_dlpack(array, stream=producer)
        rows += [
            Row("cupy -> cupy", "CuPy", exported(cupy, array)),
            Row("handoff -> cupy", "handoff", exported(cupy, cupy_view)),
            Row("cupy -> handoff", "CuPy", lambda: handoff.from_dlpack(array, stream=consumer)),
        ]
        if torch is None:
            rows.append(
                Row(
                    "handoff -> handoff",
                    "handoff",
                    lambda: handoff.from_dlpack(cupy_view, stream=consumer),
                    target=True,
                )
            )
    return rows, settle


def sim_rows(keep: list) -> tuple[list[Row], Callable[[], None]]:
    """handoff's own row on the simulated device: no peer can read its arrays."""
    from handoff import sim

    producer, consumer = sim.Stream(non_blocking=True), sim.Stream(non_blocking=True)
    array = sim.zeros(SHAPE)
    sim.fill(array, 1.0, stream=producer)
    view = handoff.from_dlpack(array, stream=producer.handle)
    keep += [producer, consumer]
    handle = consumer.handle
    return [
        Row("handoff -> handoff", "handoff", lambda: handoff.from_dlpack(view, stream=handle), target=True)
    ], sim.synchronize


def working_rows(rows: list[Row], notes: list[str]) -> list[Row]:
    """The rows whose exchange works here; the others become notes."""
    working = []
    for row in rows:
        try:
            row.exchange()
        except Exception as error:  # noqa: BLE001 - a row that cannot run here is a note
            notes.append(f"{row.name}: skipped, the exchange failed ({type(error).__name__}: {error})")
        else:
            working.append(row)
    return working


def report(rows: list[Row], ns: dict[str, float]) -> list[str]:
    """Prints the table; returns the target rows' verdicts ("PASS ..." or "FAIL ...")."""
    baseline = ns.get(BASELINE)
    own = {"torch": ns.get(BASELINE), "cupy": ns.get("cupy -> cupy")}
    vs_own_title = "vs consumer's own"
    print(
        f"| {'exchange':<20} | {'ordered by':<10} | {'us/exchange':>11} | {'vs ' + BASELINE:>17} | {vs_own_title:>17} |"
    )
    print(f"|{'-' * 22}|{'-' * 12}|{'-' * 12}:|{'-' * 18}:|{'-' * 18}:|")
    verdicts = []
    for row in rows:
        cost = ns[row.name]
        consumer_own = own.get(row.name.rsplit(" ", 1)[-1])
        vs_torch = f"{cost / baseline:.2f}" if baseline else "-"
        vs_own = f"{cost / consumer_own:.2f}" if consumer_own else "-"
        print(f"| {row.name:<20} | {row.ordered_by:<10} | {cost / 1e3:>11.2f} | {vs_torch:>17} | {vs_own:>17} |")
        if row.target and baseline:
            verdict = "PASS" if cost <= TARGET * baseline else "FAIL"
            verdicts.append(f"{verdict} {row.name}: {cost / baseline:.2f} x {BASELINE} (target <= {TARGET:.2f})")
    return verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 unless every target row was measured and met the target"
    )
    args = parser.parse_args()
    number, repeat = (300, 5) if args.quick else (5_000, 11)
    info = handoff.runtime_info()
    backend = info["backend"]
    print(
        f"handoff {handoff.__version__}, backend {backend!r} ({info['device_count']} devices) | "
        f"Python {platform.python_version()} | {platform.machine()}"
    )

    notes: list[str] = []
    keep: list = []  # the streams, alive until every view bound to them is gone
    with contextlib.ExitStack() as stack:
        if backend == "cuda" and info["device_count"] > 0:
            rows, settle = cuda_rows(keep, stack, notes)
        elif backend.startswith("sim"):
            notes.append("simulated device: handoff's row alone (PyTorch and CuPy cannot read its arrays); no target")
            rows, settle = sim_rows(keep)
        else:
            why = info["backend_error"] or "no device backend"
            print(
                f"no CUDA device here (HANDOFF_BACKEND={backend}: {why}); run it with HANDOFF_BACKEND=cuda on a "
                "machine with an NVIDIA GPU, or with HANDOFF_BACKEND=sim for handoff's row alone"
            )
            print("target: not measured (no CUDA device)")
            return 1 if args.check else 0
        rows = working_rows(rows, notes)
        settle()
        ns = measure(rows, number, repeat, settle) if rows else {}
        peers = ", ".join(
            f"{name} {sys.modules[name].__version__}" for name in ("torch", "cupy") if name in sys.modules
        )
        print(f"{peers or 'no peers'}; median of {repeat} x {number} exchanges; host time per exchange\n")
        verdicts = report(rows, ns) if rows else []
        producer_ordered_imports = any(not row.target and row.name.endswith("-> handoff") for row in rows)
        # The rows hold the producers and views: they go, and their releases are done, before the
        # streams in `keep` are destroyed.
        del rows
        settle()
        handoff_drain()
        keep.clear()

    print()
    for note in notes:
        print(f"note: {note}")
    if producer_ordered_imports:
        print(
            "note: rows '<peer> -> handoff' are not held to the target: the peer's export, not handoff's, "
            "is the larger part of their cost"
        )
    for verdict in verdicts:
        print(verdict)
    if not verdicts:
        print(f"target (handoff <= {TARGET} x {BASELINE}): not measured (no PyTorch baseline here)")
        return 1 if args.check else 0
    failed = sum(verdict.startswith("FAIL") for verdict in verdicts)
    print(
        f"target (handoff <= {TARGET} x {BASELINE}): {'FAIL' if failed else 'PASS'} "
        f"({len(verdicts) - failed} of {len(verdicts)} rows)"
    )
    return 1 if args.check and failed else 0


def handoff_drain() -> None:
    """Waits for handoff's pending releases where the backend can say (the simulated device)."""
    if handoff.runtime_info()["backend"].startswith("sim"):
        from handoff import sim

        sim.drain()


if __name__ == "__main__":
    sys.exit(main())
