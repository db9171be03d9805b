"""One exchange between two other libraries, as a hooked consumer function makes it (see
handoff._interpose, which installs the hooks).

Each call of a consumer (``torch.from_dlpack(cupy_array)``) that hands over another library's array
is one exchange: both libraries' current streams are asked of their adapters and resolved by handoff's
exchange once; in the ordering mode the consumer's stream then waits for the producer's, and the
consumer is handed handoff's import of the array instead of the array itself, so that the producer is
released by the consumer's own release of what it imported (its storage's, which views share), after
the work its stream had by then; in a trace the call is recorded as one event.

The hooked call itself (``_handoff._interposed_call``) decides in C++ whether a call is an exchange
and of what data, and records an exchange of host data whole (no stream orders it); an exchange of
device data comes here.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable
from typing import Any

from . import _handoff
from ._adapters import LibraryAdapter

Protocol = _handoff._InterposedProtocol
Hazard = _handoff._InterposedHazard
Kind = _handoff._TraceKind
Action = _handoff._TraceAction


@dataclasses.dataclass(frozen=True)
class Consumer:
    """A hooked consumer function: its library, and how it takes the array."""

    adapter: LibraryAdapter
    interface_first: bool  # it reads the CUDA Array Interface before DLPack
    parameter: str | None  # the array's parameter, when the function takes it by keyword too

    def with_argument(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], value: Any
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's arguments with the array replaced by `value`."""
        if args:
            return (value, *args[1:]), kwargs
        assert self.parameter is not None
        return args, {**kwargs, self.parameter: value}


# --- what is said once ---------------------------------------------------------------------------

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        _handoff._log_warning(message)


def _current_stream(adapter: LibraryAdapter | None, seen: Any, set_stream: Callable[[object], None]) -> object:
    """The library's current stream on the data's device as its adapter says it, given to `seen`; None
    when it has none, or when the adapter's answer names no stream (said once per adapter: the
    exchange is then seen without it, as the program runs without hooks)."""
    if adapter is None or adapter.current_stream is None:
        return None
    device = seen.work_device
    if device is None:
        return None
    try:
        stream = adapter.current_stream(device)
    except Exception as error:  # noqa: BLE001 - a library that cannot say: the trace names no stream
        _warn_once(
            f"{adapter.name}:raised",
            f"handoff: the library adapter {adapter.name!r}: current_stream({device}) raised "
            f"{type(error).__name__}: {error}; its exchanges are seen without its stream, and not ordered",
        )
        return None
    try:
        set_stream(stream)
    except Exception as error:  # noqa: BLE001 - an adapter's mistake never breaks the program
        _warn_once(
            f"{adapter.name}:answer",
            f"handoff: the library adapter {adapter.name!r}: current_stream({device}) returned {stream!r:.80} "
            f"({type(stream).__name__}), which names no stream of device {seen.work_device}: {error}. It must "
            "return a stream object (anything handoff.as_stream takes), a DLPack stream value (an int) or None; "
            "its exchanges are seen without its stream, and not ordered",
        )
        return None
    return stream


# --- reading the arrays ------------------------------------------------------------------------


def _interface_stream(value: Any) -> object:
    """The producer's stream a CUDA Array Interface names (CUDA's numbering, as DLPack's), or None."""
    try:
        return value.__cuda_array_interface__.get("stream")
    except Exception:  # noqa: BLE001 - the consumer's own call will say what is wrong
        return None


# --- one exchange --------------------------------------------------------------------------------


def exchange(
    original: Callable[..., Any],
    consumer: Consumer,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None,
    decided: tuple[Any, Any, str, LibraryAdapter | None, tuple[int, int]],
    tracing: bool,
    ordering: bool,
) -> Any:
    """Calls the consumer `original` as the program did, seen (tracing) and ordered (ordering): an
    exchange of device data, as the hooked call decided it (the array handed over, the protocol, the
    producer, its adapter, the data's device).
    (The call decides, and records an exchange of host data, in C++: _handoff._interposed_call.)"""
    kwargs = kwargs or {}
    argument, protocol, producer_name, producer, device = decided
    seen = _handoff._InterposedExchange(protocol, producer_name, consumer.adapter.name, device)
    consumer_stream, interface_stream = _streams(seen, consumer, producer, argument, protocol)
    if ordering:
        seen.ordered = _order(seen)

    # A producer or consumer built on handoff exchanges through it inside: this event covers those.
    _handoff._interposed_begin(argument, device)
    try:
        handed_on = seen.ordered and seen.consumer_stream_outlives_releases and _stands_in(consumer, protocol, kwargs)
        if handed_on:
            args, kwargs = consumer.with_argument(args, kwargs, _import(argument, protocol, consumer_stream))
        result = original(*args, **kwargs)
    except BaseException as error:
        seen.stream_argument, _ = _handoff._interposed_end()
        if tracing:
            try:
                seen.record_refusal(error)
            except Exception as failure:  # noqa: BLE001
                not_recorded(failure)
        raise
    seen.stream_argument, producer_device = _handoff._interposed_end()
    if tracing:
        try:
            how = _classify(
                seen, device, producer_device, argument, producer, interface_stream is not None, ordering, handed_on
            )
            _record(seen, how, result, argument)
        except Exception as failure:  # noqa: BLE001
            not_recorded(failure)
    return result


def _streams(
    seen: Any, consumer: Consumer, producer: LibraryAdapter | None, argument: Any, protocol: Any
) -> tuple[object, object]:
    """Both libraries' current streams, given to `seen`: (the consumer's as its adapter said it, the
    producer's as a CUDA Array Interface names it, or None)."""
    consumer_stream = _current_stream(consumer.adapter, seen, seen.set_consumer_stream)
    interface_stream = None
    if protocol == Protocol.cuda_array_interface:
        interface_stream = _interface_stream(argument)
        try:
            seen.set_producer_stream(interface_stream)
        except Exception:  # noqa: BLE001 - a malformed interface: the consumer's own call says so
            interface_stream = None
    if interface_stream is None:
        _current_stream(producer, seen, seen.set_producer_stream)
    return consumer_stream, interface_stream


def not_recorded(error: Exception) -> None:
    """A tracing tool never breaks the program it watches: what fails to be recorded is said once. (A
    plain ``except`` at each place: a context manager would cost each exchange a microsecond.)"""
    _warn_once(f"record:{type(error).__name__}", f"handoff could not record an exchange: {error!r}")


def _order(seen: Any) -> bool:
    """The ordering mode: the consumer's stream waits for the producer's; False when it cannot."""
    if not seen.knows_streams:
        _warn_once(
            f"unordered:{seen.producer}:{seen.consumer}",
            f"handoff's ordering mode cannot order {_why_not_ordered(seen)}",
        )
        return False
    try:
        return bool(seen.order())
    except Exception as error:  # noqa: BLE001 - the program runs as it would without the ordering mode
        _warn_once(
            f"order:{seen.producer}:{seen.consumer}",
            f"handoff could not order an exchange from {seen.producer} to {seen.consumer}: {error}",
        )
        return False


def _why_not_ordered(seen: Any) -> str:
    unknown = [
        name
        for name, stream in ((seen.producer, seen.producer_stream), (seen.consumer, seen.consumer_stream))
        if stream is None
    ]
    if not unknown:
        return f"the exchanges from {seen.producer} to {seen.consumer}: the wait failed (see handoff's log)"
    return (
        f"the exchanges from {seen.producer} to {seen.consumer}: handoff knows no current stream of "
        f"{' nor of '.join(unknown)} (give its handoff.LibraryAdapter a current_stream, or make one stream every "
        "library's with handoff.stream(s, frameworks=True))"
    )


def _stands_in(consumer: Consumer, protocol: Any, kwargs: dict[str, Any]) -> bool:
    """Whether handoff's import may stand in for the producer's array without changing what the consumer
    makes of it: the consumer reads it through the protocol it reads the producer's through (a
    handoff.Array offers both, where the producer may offer one), and passes no `copy` or `device`,
    which the producer honours or refuses itself and handoff's import would answer in its place."""
    if (protocol == Protocol.cuda_array_interface) != consumer.interface_first:
        return False
    return all(kwargs.get(name) is None for name in ("copy", "device", "dl_device"))


def _import(argument: Any, protocol: Any, consumer_stream: Any) -> Any:
    """handoff's import of `argument` onto the consumer's stream, whose release waits for the work that
    stream has by then, for the consumer to import in its place; `argument` itself where handoff cannot
    import it."""
    take = _handoff.asarray if protocol == Protocol.cuda_array_interface else _handoff.from_dlpack
    try:
        return take(argument, stream=consumer_stream)
    except Exception as error:  # noqa: BLE001 - ordered still; only the producer is not kept past the consumer
        _warn_once(
            f"import:{type(argument).__name__}",
            f"handoff: the ordering mode hands {type(argument).__name__} to its consumer as it is (it could not "
            f"import it: {type(error).__name__}: {error}): its release is not ordered after the consumer's work",
        )
        return argument


def _classify(
    seen: Any,
    device: tuple[int, int],
    producer_device: int | None,
    argument: Any,
    producer: LibraryAdapter | None,
    interface_stream: bool,
    ordering: bool,
    handed_on: bool,
) -> tuple[Any, Any, str]:
    """How the consumer's stream came to be ordered after the producer's: (action, hazard, why);
    `handed_on`: the consumer was handed handoff's import in place of the producer's array."""
    if producer_device is not None and producer_device != device[1]:
        return (
            Action.unordered,
            Hazard.cross_device,
            f"the producer's __dlpack__ ran while device {producer_device} was current: it ordered that "
            f"device's streams, not those of device {device[1]}, where the data is",
        )
    ignores = (producer is not None and producer.ignores_stream) or _made_by_nanobind(argument)
    action, detail = _action(seen, seen.stream_argument, ignores, interface_stream, handed_on)
    if ordering and action == Action.unordered:
        # Flagged whatever the producer's stream has pending: the mode promised to order it.
        return action, Hazard.unordered, f"the ordering mode could not order {_why_not_ordered(seen)}"
    return action, Hazard.none, detail


def _action(
    seen: Any, stream_argument: int | None, ignores: bool, interface_stream: bool, handed_on: bool
) -> tuple[Any, str]:
    if seen.ordered:
        if handed_on:
            return Action.wait, "ordered by handoff: the consumer's stream waits for the producer's"
        if seen.consumer_stream_outlives_releases:
            return Action.wait, (
                "ordered by handoff: the consumer's stream waits for the producer's; the consumer is handed the "
                "producer's array as it is (it asks the producer for copy or device, or reads it through a protocol "
                "handoff's import would answer in its place), so the producer is not kept past the consumer's array"
            )
        return Action.wait, (
            "ordered by handoff: the consumer's stream waits for the producer's; the producer is not kept past the "
            f"consumer's array, as its stream {seen.consumer_stream:#x} is a bare handle that may be destroyed first "
            "(an adapter's current_stream that returns the stream object lets handoff hold it)"
        )
    producer_stream, consumer_stream = seen.producer_stream, seen.consumer_stream
    if producer_stream is not None and producer_stream == consumer_stream:
        return Action.elided, "the producer's and the consumer's current streams are the same"
    if seen.protocol == Protocol.cuda_array_interface:
        if not interface_stream:
            return Action.unordered, "CUDA Array Interface data without a stream: nothing orders its producer's work"
        return Action.wait, "the consumer synchronizes the interface's stream"
    if ignores:
        return Action.unordered, "the producer ignores DLPack's stream argument: it orders nothing for the consumer"
    if stream_argument == -1:
        return Action.unordered, "the consumer passed stream=-1: it asked for no ordering"
    return Action.wait, ""


def _made_by_nanobind(value: Any) -> bool:
    """nanobind's ndarray exports ignore `stream`; its types' metaclass is nanobind's ``nb_type``."""
    return type(type(value)).__name__.startswith("nb_type")


def _record(seen: Any, how: tuple[Any, Any, str], result: Any, argument: Any) -> None:
    """Records the consumer's import, and watches the release of what it imported."""
    action, hazard, detail = how
    seen.record_import(argument, result, action, hazard, detail)
    if not seen.ordered and seen.consumer_stream is not None:
        _watch_release(result, argument, seen)


# --- what is released early ----------------------------------------------------------------------


def _watch_release(result: Any, argument: Any, seen: Any) -> None:
    """Flags `released early` when the consumer's array goes while its stream still has work queued and
    nothing else holds the producer: its memory then goes back to its library, which may hand it out
    again while that work still reads it. Producers that take no weak reference are not watched; nor
    are consumer streams that may be destroyed before the array (a bare handle: see export_release)."""
    if not seen.consumer_stream_outlives_releases:
        return
    try:
        producer = weakref.ref(argument)
        weakref.finalize(result, _check_release, producer, seen)
    except TypeError:
        return


def _references(producer: weakref.ref[Any]) -> int:
    """sys.getrefcount of what `producer` refers to, as counted here (0 when it is gone)."""
    held = producer()
    return 0 if held is None else sys.getrefcount(held)


class _Probe:
    pass


def _own_references() -> int:
    """How many of the references _references counts are its own (its local, getrefcount's argument):
    measured once, since CPython versions count them differently."""
    probe = _Probe()
    return _references(weakref.ref(probe)) - 1  # `probe` holds the one other


_OWN_REFERENCES = _own_references()


def _check_release(producer: weakref.ref[Any], seen: Any) -> None:
    # Besides the count's own: the consumer's capsule's, which it gives up next, and no other.
    if _references(producer) - _OWN_REFERENCES != 1:
        return  # gone already, or kept by someone else: its memory stays
    try:  # nor does a finalizer's error
        if not seen.consumer_stream_busy():
            return
        seen.record(
            Kind.release,
            Action.unordered,
            Hazard.released_early,
            f"the {seen.consumer} array was dropped while its stream {seen.consumer_stream:#x} still had work "
            f"queued, and with it the last reference to the {seen.producer} array: its memory may be reused before "
            "that work reads it",
        )
    except Exception as failure:  # noqa: BLE001
        not_recorded(failure)
