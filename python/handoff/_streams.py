"""Consumer streams: handoff.Stream, as_stream, and the ``with handoff.stream(...)`` block."""

from __future__ import annotations

import contextlib
import sys
import threading
from contextlib import AbstractContextManager
from contextvars import ContextVar
from types import FrameType
from typing import Any

from . import _handoff

__all__ = ["Stream", "as_stream", "current_stream", "stream"]

# The blocks entered in this context, innermost last; the innermost open one names the current
# stream. Context-local (per thread, per asyncio task), and owned by the extension, which reads it
# on every import without calling Python.
_blocks: ContextVar[tuple[_Entry, ...]] = _handoff._stream_var

# Code whose frames can be suspended with a block open (inspect's CO_GENERATOR, CO_COROUTINE,
# CO_ITERABLE_COROUTINE, CO_ASYNC_GENERATOR), as generators that yield inside a block are.
_SUSPENDABLE = 0x20 | 0x80 | 0x100 | 0x200

# Where contextlib's own code runs (ExitStack, the context managers @contextmanager makes), and the
# methods through which any context manager enters or leaves what it wraps.
_CONTEXTLIB = contextlib.ExitStack.__exit__.__code__.co_filename
_PROTOCOL = frozenset({"__enter__", "__exit__", "__aenter__", "__aexit__"})


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
    for entry in reversed(_blocks.get()):
        if entry.open:
            return entry.stream
    return None


class stream:
    """Sets the consumer stream for imports in a block (context-local: per thread, per task).

    ``with handoff.stream(s): handoff.from_dlpack(x)`` imports ``x`` ordered before work that is
    then put on ``s``. Blocks nest; leaving one restores the outer stream.

    With ``frameworks=True`` the block also makes ``s`` the current stream of every imported library
    that has one (PyTorch and CuPy, through their external-stream wrappers, and libraries registered
    with a ``use_stream``), and restores each one's own once the block and every frameworks block
    entered on its thread after it have ended: the code in the block launches on one stream, and
    nothing needs ordering. Those libraries' current streams are per thread, not per asyncio task:
    see docs/streams.md. JAX, cuda.core and numba-cuda have no current stream.
    """

    # `_entries`: this block's open entries, wherever they were entered (one block object may be
    # entered by several threads, tasks and generators at once, and left in another context than its
    # entry's).
    __slots__ = ("_entries", "_frameworks", "_stream")

    def __init__(self, obj: object, *, frameworks: bool = False) -> None:
        self._stream = None if obj is None else as_stream(obj)
        if frameworks and self._stream is None:
            raise ValueError("handoff.stream(None, frameworks=True): name the stream the frameworks should use")
        self._frameworks = bool(frameworks)
        self._entries: list[_Entry] = []

    def __enter__(self) -> Stream | None:
        blocks = tuple(entry for entry in _blocks.get() if entry.open)
        entry = _Entry(self._stream, self, sys._getframe(1), blocks)
        if self._frameworks:
            assert self._stream is not None
            _framework_blocks.enter(entry, self._stream)
        _blocks.set((*blocks, entry))
        self._entries.append(entry)
        return self._stream

    def __exit__(self, *exc_info: object) -> None:
        entry = self._entry_left(sys._getframe(1))
        if entry is None:
            return
        blocks = _blocks.get()
        if any(listed is entry for listed in blocks):
            _blocks.set(_leaving(blocks, entry))
        # else a generator's block left in another context than its entry's: closed, it is current
        # nowhere (each context skips the closed entries it lists).
        self._entries.remove(entry)
        entry.close()

    def _entry_left(self, frame: FrameType) -> _Entry | None:
        """The entry that leaving the block from `frame` (``__exit__``'s caller) ends.

        The entry whose with-statement this is: the newest entry held by `frame`, or by the frame
        that the context-manager machinery calling from `frame` leaves it for. Matched by frame, not by
        thread or context: a generator's block may be left on another thread or in another task than
        it was entered in, while that thread's or task's own entry of the same block object is still
        open in its own with-statement. Entered and left from different frames (an ExitStack handed
        on, ``__exit__`` called by hand), it is this context's newest entry whose holder is not on this
        thread's stack (a frame there is still inside its own with-statement); else none.
        """
        entries = tuple(self._entries)  # a snapshot: other threads enter and leave this block too
        caller: FrameType | None = frame
        while caller is not None:
            for entry in reversed(entries):
                if entry.holder is caller:
                    return entry
            if not _is_machinery(caller):
                break
            caller = caller.f_back
        running = _stack(frame)
        for entry in reversed(_blocks.get()):
            if entry.block is self and entry.open and id(entry.holder) not in running:
                return entry
        return None


class _Entry:
    """One entry into a ``handoff.stream`` block, listed in the blocks of the context it was entered
    in and of every context copied from it while it is open (asyncio tasks, ``to_thread``).

    Left in any of those contexts, it is closed in all of them: a generator primed here and finished
    by an asyncio task leaves no stream current here.
    """

    __slots__ = (
        "block",
        "enclosing",
        "frame",
        "frameworks",
        "holder",
        "inner",
        "open",
        "stream",
        "thread",
        "thread_frameworks",
    )

    def __init__(self, stream: Stream | None, block: stream, caller: FrameType, blocks: tuple[_Entry, ...]) -> None:
        self.stream = stream
        self.block = block
        self.open = True
        self.thread = threading.get_ident()
        # The frame whose code runs in the block (`caller` itself, or the code that context-manager
        # machinery entered the block for), which the block's exit is matched to; and the generator
        # or coroutine whose suspension pauses that code, None when nothing can (a plain function
        # outside any: its block runs as long as it is open, on its thread).
        self.holder: FrameType | None = _holder(caller)
        self.frame: FrameType | None = _suspendable(self.holder)
        self.enclosing = _running_block(blocks, caller)
        self.frameworks: AbstractContextManager[Any] | None = None
        self.thread_frameworks: list[_Entry] | None = None
        # The blocks entered inside this one and still open: they end with it, wherever it ends.
        self.inner: list[_Entry] = []
        if self.enclosing is not None:
            self.enclosing.inner.append(self)

    def inside(self, outer: _Entry) -> bool:
        """Whether this block was entered while `outer`'s code ran (directly or in blocks inside it)."""
        enclosing = self.enclosing
        while enclosing is not None:
            if enclosing is outer:
                return True
            enclosing = enclosing.enclosing
        return False

    def close(self) -> None:
        """Leaves the block (its with-statement ends)."""
        self._end()
        enclosing = self.enclosing
        if enclosing is not None:
            with contextlib.suppress(ValueError):  # gone if the enclosing block ended it (on any thread)
                enclosing.inner.remove(self)
        self.holder = self.frame = self.enclosing = None

    def _end(self) -> None:
        """Ends the block, and the blocks entered inside it (a generator's, suspended in it), in every
        context that lists them; an inner block still matches its own with-statement's exit."""
        inner, self.inner = self.inner, []
        for entry in inner:
            entry._end()
        if self.open:
            self.open = False
            if self.thread_frameworks is not None:
                _framework_blocks.leave(self)


def _is_machinery(frame: FrameType | None) -> bool:
    """Whether `frame` runs context-manager machinery, which enters or leaves a block for other code:
    contextlib's own functions (``ExitStack``, ``@contextmanager``'s ``__enter__`` and ``__exit__``),
    any ``__enter__``/``__exit__`` method (a class that wraps a block), or a generator or coroutine
    that such machinery drives (a ``@contextmanager`` function, suspended while its block runs).

    This is the rule that makes a block the same however it was entered: what runs inside the block
    is the code of the with-statement that the machinery serves, not the machinery, whose frames
    have returned (``ExitStack.enter_context``) or are suspended (a ``@contextmanager`` generator)
    while the block runs, and which leaves the block from other frames than it entered it from."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename == _CONTEXTLIB or code.co_name in _PROTOCOL:
            return True
        if not code.co_flags & _SUSPENDABLE:
            return False
        frame = frame.f_back  # a generator is machinery when machinery drives it
    return False


def _holder(frame: FrameType) -> FrameType:
    """The frame whose code runs in a block entered from `frame`: `frame`, or, through context-manager
    machinery (nested wrappers too), the first frame out from it that is not machinery."""
    while frame.f_back is not None and _is_machinery(frame):
        frame = frame.f_back
    return frame


def _suspendable(holder: FrameType) -> FrameType | None:
    """The innermost generator or coroutine at or out from `holder` that is not machinery: while it
    is suspended, the code of a block that `holder` entered is not running. None when there is none."""
    frame: FrameType | None = holder
    while frame is not None:
        if frame.f_code.co_flags & _SUSPENDABLE and not _is_machinery(frame):
            return frame
        frame = frame.f_back
    return None


def _stack(frame: FrameType | None) -> set[int]:
    """The ids of `frame` and the frames out from it: the code running on this thread."""
    running: set[int] = set()
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    return running


def _running_block(blocks: tuple[_Entry, ...], frame: FrameType) -> _Entry | None:
    """The innermost of `blocks` whose code is running on this thread, `frame`'s caller or below:
    the block a block entered in `frame` is inside. A block that a suspended generator entered is not
    running: a block entered now is beside it."""
    thread = threading.get_ident()
    running: set[int] | None = None
    for entry in reversed(blocks):
        if entry.thread != thread:
            continue
        if entry.frame is None:
            return entry
        if running is None:
            running = _stack(frame)
        if id(entry.frame) in running:
            return entry
    return None


def _leaving(blocks: tuple[_Entry, ...], left: _Entry) -> tuple[_Entry, ...]:
    """This context's blocks once `left` is left: the blocks entered inside it (a generator's block,
    suspended in it) end here with it; those entered beside it (another generator's) stay open."""
    index = next(i for i, entry in enumerate(blocks) if entry is left)
    below = tuple(entry for entry in blocks[:index] if entry.open)
    return below + tuple(entry for entry in blocks[index + 1 :] if entry.open and not entry.inside(left))


class _FrameworkBlocks(threading.local):
    """The open ``frameworks=True`` blocks entered on this thread, in order.

    Frameworks' current streams are per thread (PyTorch's, CuPy's), whatever asyncio task or
    generator sets them, so each thread's are set and restored in that thread's order: a block that
    ends while a block entered after it on its thread is still open leaves the frameworks on the
    later block's stream, and restores them once the later one has ended too.
    """

    def __init__(self) -> None:
        self.entered: list[_Entry] = []

    def enter(self, entry: _Entry, stream: Stream) -> None:
        from ._adapters import frameworks_on

        entered = self.entered
        self._restore(entered)  # blocks of this thread that ended on another
        if entered and not entry.inside(entered[-1]):
            _warn_overlap_once()
        frameworks = frameworks_on(stream.handle, stream.device)
        frameworks.__enter__()
        entry.frameworks, entry.thread_frameworks = frameworks, entered
        entered.append(entry)

    def leave(self, entry: _Entry) -> None:
        # On another thread than its entry's, the entry thread's streams cannot be set from here:
        # they are restored when that thread next enters or leaves a frameworks block.
        if entry.thread_frameworks is self.entered:
            self._restore(self.entered)

    @staticmethod
    def _restore(entered: list[_Entry]) -> None:
        while entered and not entered[-1].open:
            frameworks = entered.pop().frameworks
            assert frameworks is not None
            frameworks.__exit__(None, None, None)


_framework_blocks = _FrameworkBlocks()
_overlap_warned = False


def _warn_overlap_once() -> None:
    global _overlap_warned  # noqa: PLW0603 - one warning a process
    if _overlap_warned:
        return
    _overlap_warned = True
    _handoff._log_warning(
        "handoff.stream(..., frameworks=True): blocks of two asyncio tasks or generators overlap on one thread; "
        "frameworks' current streams are per thread, so until the later block ends, code in the earlier one "
        "launches on the later block's stream (see the Streams page of handoff's documentation)"
    )


_handoff._set_stream_type(Stream)
