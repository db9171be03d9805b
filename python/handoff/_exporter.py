"""handoff.Exporter: every array protocol of handoff.Array for a class that describes its data."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _handoff

if TYPE_CHECKING:
    from typing_extensions import CapsuleType


class Exporter:
    """A mixin for array classes: define ``__handoff_array__(self) -> handoff.Array`` (usually a
    :func:`handoff.view` of the instance's memory with ``owner=self``) and the class gets
    ``__dlpack__``, ``__dlpack_device__``, ``__cuda_array_interface__`` (CUDA memory only; otherwise
    ``hasattr`` is False) and ``__array_interface__`` (CPU only), with exactly the semantics of
    :class:`handoff.Array`'s: the stream table, ordering after the stream the data is ready on,
    ``max_version``, ``dl_device``, ``copy`` and the same errors. An exported capsule keeps the
    instance alive.
    """

    __slots__ = ()

    def __handoff_array__(self) -> _handoff.Array:
        """The instance's data as a :class:`handoff.Array`; subclasses must define it."""
        raise NotImplementedError(f"{type(self).__name__} must define __handoff_array__() to export its data")

    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> CapsuleType:
        """Exports the data as a DLPack capsule, as :meth:`handoff.Array.__dlpack__` does; the capsule keeps
        the instance alive."""
        return _handoff._exporter_dlpack(self, self.__handoff_array__(), stream, max_version, dl_device, copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """The ``(device_type, device_id)`` of the data, with DLPack's codes."""
        return _array_of(self).__dlpack_device__()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3 of CUDA memory (elsewhere AttributeError: ``hasattr`` is False)."""
        return _array_of(self).__cuda_array_interface__

    @property
    def __array_interface__(self) -> dict[str, Any]:
        """NumPy's array interface v3 of CPU arrays (elsewhere AttributeError: ``hasattr`` is False)."""
        return _array_of(self).__array_interface__


def _array_of(instance: Exporter) -> _handoff.Array:
    exported = instance.__handoff_array__()
    if not isinstance(exported, _handoff.Array):
        raise TypeError(
            f"{type(instance).__name__}.__handoff_array__() must return a handoff.Array, not {type(exported).__name__}"
        )
    return exported
