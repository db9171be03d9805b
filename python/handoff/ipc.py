"""Zero-copy hand-off of arrays between processes of one node, ordered on both sides.

``share`` makes a small :class:`Handle` that any pickler carries (a pipe, a queue, a socket, a Ray
object, a file); ``open`` maps the memory in another process of the same node, and makes the
consumer's stream wait on the device for the producer's work: the host never waits. The producer
keeps the array while its ``Handle`` lives there, then until every consumer has released what it
opened and the work its stream had by then is done. A :class:`handoff.Array` sent through
``multiprocessing`` (queues, pipes, pools) travels as a handle and arrives as a ``handoff.Array``.
"""

from __future__ import annotations

import multiprocessing.reduction as _reduction
from typing import Any

from ._handoff import Array, _ipc

__all__ = ["Handle", "open", "share"]


class Handle:
    """What ``share`` made: a few hundred bytes naming the shared array (its memory, its event, its
    producer), picklable by any pickler. In the producer's process the object also holds the array;
    a copy made by pickling holds nothing, it only names the share."""

    __slots__ = ("__weakref__", "_bytes", "_description", "_hold")

    def __init__(self, data: bytes, /) -> None:
        if not isinstance(data, bytes):
            raise TypeError(f"a Handle is made from bytes, not {type(data).__name__}")
        self._description = _ipc.describe(data)  # ValueError for bytes that are no handle
        self._bytes = data
        self._hold: object = None

    def __bytes__(self) -> bytes:
        return self._bytes

    def __reduce__(self) -> tuple[Any, ...]:
        return (Handle, (self._bytes,))  # the name of the share, never the producer's hold

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other._bytes == self._bytes

    def __hash__(self) -> int:
        return hash(self._bytes)

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the shared array."""
        return self._description["shape"]

    @property
    def dtype(self) -> str:
        """The shared array's dtype, as ``handoff.Array.dtype`` names it."""
        return self._description["dtype"]

    @property
    def device(self) -> tuple[int, int]:
        """Where the shared array is, as the producer numbers its devices: ``(device_type,
        device_id)`` with DLPack's codes. A handle names the device by its UUID too: a process that
        numbers the node's devices otherwise (``CUDA_VISIBLE_DEVICES``) opens the array on its own
        ordinal of that device."""
        return self._description["device"]

    @property
    def nbytes(self) -> int:
        """The shared array's size in bytes."""
        return self._description["nbytes"]

    @property
    def producer_pid(self) -> int:
        """The process that shared the array."""
        return self._description["producer_pid"]

    def __repr__(self) -> str:
        d = self._description
        where = "host memory" if d["host_memory"] else f"{d['backend']} device {d['device'][1]}"
        return (
            f"handoff.ipc.Handle(shape={d['shape']}, dtype={d['dtype']!r}, {where}, producer_pid={d['producer_pid']})"
        )


def share(x: Any, /, *, stream: Any = None, copy: bool | None = None) -> Handle:
    """Shares ``x`` (anything :func:`handoff.asarray` takes) with other processes of this node.

    Device memory is shared zero-copy; on the stream its data is ready on (``x``'s own for a
    ``handoff.Array``; ``stream`` names it when handoff cannot know it, and waits for the one handoff
    knows where it names another; else the device's default),
    an interprocess event from a pool is recorded for this share. Host memory (a NumPy array, a CPU
    tensor) is copied once into shared memory; ``copy=False`` refuses that with ``BufferError``.
    The array is kept while the returned Handle lives in this process, then until every consumer has
    released what it opened and its stream's work by then is done.
    """
    data, hold = _ipc.share(x, stream, copy, False)
    handle = Handle(data)
    handle._hold = hold
    return handle


def open(handle: Handle, /, *, stream: Any = None) -> Array:
    """Opens, in this process, a Handle another process of this node made: maps its memory
    zero-copy (once per allocation and process) and makes the consumer stream (``stream``, else the
    enclosing :func:`handoff.stream` block's, else the default) wait on the device for the share's
    event. The host never waits. Releasing the result (and everything exported from it) tells the
    producer, once the work then enqueued on that stream is done. ``stream=-1``, as for
    :func:`handoff.from_dlpack`: the consumer orders its work itself; nothing is waited for, and the
    share is released with the result.

    Raises ``TypeError`` for what is not a Handle; ``ValueError`` for a forged or corrupted handle,
    or one from another node, boot or backend; ``BufferError`` for a handle of this very process, one
    whose producer has exited, or whose share was released.
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"handoff.ipc.open expects a handoff.ipc.Handle, not {type(handle).__name__}")
    return _ipc.open(handle._bytes, stream)


_poll = _ipc._poll  # tests: look at this process's consumers now


def _open_sent(data: bytes) -> Array:
    """Where a handoff.Array sent through multiprocessing arrives: opened on the receiving side's
    consumer stream (its enclosing handoff.stream block, else the default)."""
    return _ipc.open(data, None)


def _reduce_for_multiprocessing(array: Array) -> tuple[Any, ...]:
    # An in-flight share: the array is kept until the receiving side has opened and released it,
    # so that `queue.put(a); del a` is safe.
    data, _ = _ipc.share(array, None, None, True)
    return (_open_sent, (data,))


# multiprocessing's pickler only (queues, pipes, pools); plain pickle keeps refusing handoff.Array.
_reduction.ForkingPickler.register(Array, _reduce_for_multiprocessing)
