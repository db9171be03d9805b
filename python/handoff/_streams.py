"""Consumer streams: handoff.Stream, as_stream, and the ``with handoff.stream(...)`` block."""

from __future__ import annotations

from contextlib import AbstractContextManager
from contextvars import ContextVar, Token
from typing import Any

from . import _handoff

__all__ = ["Stream", "as_stream", "current_stream", "stream"]

# One ContextVar, owned by the extension so that from_dlpack reads it without calling Python:
# context-local, so blocks nest per thread and per asyncio task.
_current = _handoff._stream_var
# The blocks entered in this context and their reset tokens, innermost last. They live in the
# context, not in the block object, so that one block object may be entered by several threads or
# tasks at once; each entry names its block, so that a block leaves with its own token even when
# blocks interleave (a generator's block entered inside ours and suspended while ours ends).
_entered: ContextVar[tuple[tuple[stream, Token[Stream | None], AbstractContextManager[Any] | None], ...]] = ContextVar(
    "handoff.stream_tokens", default=()
)


class Stream:
    """A non-owning reference to a device stream: its raw handle and, if known, its device.

    Made by :func:`as_stream` from a stream object, it keeps that object alive (and with it a stream
    that its library destroys when the object goes); views imported onto it keep it in turn.

    ``handle`` is the native handle (``cudaStream_t`` as an int); DLPack's special values are
    accepted too (1: legacy default, 2: per-thread default for CUDA; 0: default for ROCm).
    """

    # `_source`: the object as_stream made this from, kept alive with the Stream, since CuPy, cuda.core
    # and Numba destroy their stream when its object goes, and views bound to it outlive the call.
    __slots__ = ("_device", "_handle", "_source")

    def __init__(self, handle: int, *, device: int | None = None) -> None:
        _handoff._check_stream(handle, device)  # an int in [0, 2**63); None or an int >= 0
        self._handle = handle
        self._device = device
        self._source: object = None

    @property
    def handle(self) -> int:
        """The native stream handle (or DLPack's special value), an int."""
        return self._handle

    @property
    def device(self) -> int | None:
        """The device ordinal the stream is on, or None when not known."""
        return self._device

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol: ``(0, handle)``."""
        return (0, self._handle)

    def __int__(self) -> int:
        """The handle."""
        return self._handle

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Stream):
            return NotImplemented
        return (self._handle, self._device) == (other._handle, other._device)

    def __hash__(self) -> int:
        return hash((self._handle, self._device))

    def __repr__(self) -> str:
        device = "" if self._device is None else f", device={self._device}"
        return f"handoff.Stream({self._handle:#x}{device})"


def as_stream(obj: object) -> Stream:
    """Converts a stream-like object to a :class:`Stream`.

    Accepts a :class:`Stream`, an int handle, an object with ``__cuda_stream__()`` (returning
    ``(version, handle)``), ``.cuda_stream`` (PyTorch) or ``.ptr`` (CuPy).
    """
    if isinstance(obj, Stream):
        return obj
    handle, device = _handoff._resolve_stream(obj)  # the protocols are read in C++, as imports read them
    made = Stream(handle, device=device)
    if not isinstance(obj, int):
        made._source = obj
    return made


def current_stream() -> Stream | None:
    """The stream of the innermost enclosing ``handoff.stream(...)`` block, or None."""
    return _current.get(None)


class stream:
    """Sets the consumer stream for imports in a block (context-local: per thread, per task).

    ``with handoff.stream(s): handoff.from_dlpack(x)`` imports ``x`` ordered before work that is
    then put on ``s``. Blocks nest; leaving one restores the outer stream.

    With ``frameworks=True`` the block also makes ``s`` the current stream of every imported library
    that has one (PyTorch and CuPy, through their external-stream wrappers, and libraries registered
    with a ``use_stream``), and restores each one's own on exit: the code in the block launches on
    one stream, and nothing needs ordering. JAX, cuda.core and numba-cuda have no current stream.
    """

    __slots__ = ("_frameworks", "_stream")

    def __init__(self, obj: object, *, frameworks: bool = False) -> None:
        self._stream = None if obj is None else as_stream(obj)
        if frameworks and self._stream is None:
            raise ValueError("handoff.stream(None, frameworks=True): name the stream the frameworks should use")
        self._frameworks = bool(frameworks)

    def __enter__(self) -> Stream | None:
        frameworks = None
        if self._frameworks:
            from ._interpose import frameworks_on

            assert self._stream is not None
            frameworks = frameworks_on(self._stream.handle, self._stream.device)
            frameworks.__enter__()
        token = _current.set(self._stream)
        _entered.set((*_entered.get(), (self, token, frameworks)))
        return self._stream

    def __exit__(self, *exc_info: object) -> None:
        # Restores exactly what this block found: its own token, not the innermost one.
        entered = _entered.get()
        for i in range(len(entered) - 1, -1, -1):
            if entered[i][0] is self:
                _entered.set(entered[:i] + entered[i + 1 :])
                _current.reset(entered[i][1])
                frameworks = entered[i][2]
                if frameworks is not None:
                    frameworks.__exit__(None, None, None)
                return
        # Entered in another context (a generator closed elsewhere): nothing of this one to restore.


_handoff._set_stream_type(Stream)
