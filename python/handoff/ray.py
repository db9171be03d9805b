"""handoff's tensor transport for Ray Direct Transport (Ray 2.60 and later, ``pip install handoff[ray]``).

Call :func:`register` in the driver before the actors are created; then a method declared with
``@ray.method(tensor_transport="handoff")`` hands the :class:`handoff.Array` objects it returns to
actors of the same node zero-copy and stream-ordered, whatever framework made their data (wrap a
CuPy, JAX or PyTorch array with :func:`handoff.from_dlpack`). The producing actor keeps each array
until Ray's reference counting lets the object go (``garbage_collect``) and every receiving actor has
released what it opened. Between nodes the transport refuses with a ``ValueError`` that says so: use
one of Ray's own transports there (``"nccl"``, ``"nixl"``). A :class:`handoff.ipc.Handle` travels in
any Ray object, tasks and ``ray.put`` included.

Give receiving actors ``max_concurrency=2`` (or make them async): Ray may send the receive after the
task that takes the array (Ray issue 60954), and an actor that runs its tasks in order would wait for
it behind that task until Ray's RDT timeout.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, cast

from . import ipc
from ._handoff import Array

__all__ = ["TRANSPORT", "HandoffTransport", "register"]

TRANSPORT = "handoff"
_DEVICE_LABELS = {1: "cpu", 2: "cuda", 10: "rocm"}

try:
    import ray
    from ray.experimental import register_tensor_transport
    from ray.experimental.rdt.tensor_transport_manager import (
        CommunicatorMetadata,
        TensorTransportManager,
        TensorTransportMetadata,
    )
    from ray.experimental.rdt.util import transport_manager_info
except ImportError as missing:  # Ray is optional
    raise ImportError(
        "handoff.ray needs Ray with Ray Direct Transport (2.60 or later): pip install 'handoff[ray]'"
    ) from missing


@dataclass
class HandoffTransportMetadata(TensorTransportMetadata):
    """What the receiving actor needs: the arrays' handles and the node they are on."""

    handles: list[bytes] = field(default_factory=list)
    node_id: str | None = None


@dataclass
class HandoffCommunicatorMetadata(CommunicatorMetadata):
    """The transport is one-sided: the receiver opens the handles, nothing else is agreed."""


class HandoffTransport(TensorTransportManager):
    """A one-sided Ray tensor transport: the sender shares each array (handoff.ipc.share), the
    receiver opens the handles on its consumer stream."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, list[ipc.Handle]] = {}  # the producer's holds, by object id

    def tensor_transport_backend(self) -> str:
        return TRANSPORT.upper()

    @staticmethod
    def is_one_sided() -> bool:
        return True

    @staticmethod
    def can_abort_transport() -> bool:
        return False

    def actor_has_tensor_transport(self, actor: Any) -> bool:
        return True

    def extract_tensor_transport_metadata(self, obj_id: str, rdt_object: list[Any]) -> HandoffTransportMetadata:
        handles = [ipc.share(array) for array in rdt_object]
        with self._lock:
            self._held[obj_id] = handles
        devices = {_DEVICE_LABELS.get(h.device[0], "cpu") for h in handles}
        if len(devices) > 1:
            raise ValueError(f"an RDT object's arrays must all be on one kind of device, not {sorted(devices)}")
        return HandoffTransportMetadata(
            tensor_meta=cast(Any, [(h.shape, h.dtype) for h in handles]),  # handoff's dtype names
            tensor_device=devices.pop() if devices else None,
            handles=[bytes(h) for h in handles],
            node_id=ray.get_runtime_context().get_node_id(),
        )

    def get_communicator_metadata(
        self, src_actor: Any, dst_actor: Any, backend: str | None = None
    ) -> HandoffCommunicatorMetadata:
        return HandoffCommunicatorMetadata()

    def recv_multiple_tensors(
        self,
        obj_id: str,
        tensor_transport_metadata: Any,
        communicator_metadata: Any,
        target_buffers: list[Any] | None = None,
    ) -> list[Array]:
        if target_buffers:
            raise ValueError("the handoff transport maps the sender's memory; it does not receive into buffers")
        here = ray.get_runtime_context().get_node_id()
        if tensor_transport_metadata.handles and tensor_transport_metadata.node_id != here:
            raise ValueError(
                f"the handoff transport moves arrays between actors of one node, but the sender is on node "
                f"{tensor_transport_metadata.node_id} and this actor on {here}: use one of Ray's transports "
                f"between nodes (tensor_transport='nccl' or 'nixl')"
            )
        return [ipc.open(ipc.Handle(data)) for data in tensor_transport_metadata.handles]

    def send_multiple_tensors(
        self, tensors: list[Any], tensor_transport_metadata: Any, communicator_metadata: Any
    ) -> None:
        raise NotImplementedError("the handoff transport is one-sided: the receiver opens the handles")

    def garbage_collect(self, obj_id: str, tensor_transport_meta: Any, tensors: list[Any]) -> None:
        with self._lock:
            self._held.pop(obj_id, None)  # the arrays go once the receivers released what they opened

    def abort_transport(self, obj_id: str, communicator_metadata: Any) -> None:
        raise NotImplementedError("the handoff transport cannot abort a transfer")


def register() -> None:
    """Registers the tensor transport ``"handoff"`` (data type :class:`handoff.Array`) with Ray. Call it
    in the driver, before the actors that use it are created; calling it again does nothing."""
    if TRANSPORT.upper() in transport_manager_info:
        return
    register_tensor_transport(TRANSPORT, ["cpu", "cuda", "rocm"], HandoffTransport, Array)
