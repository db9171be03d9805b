"""Exchange arrays between NumPy and PyTorch through handoff, and show what happened."""

import numpy as np
import torch

import handoff


def describe(label, array):
    print(f"  {label:<28} shape={array.shape} dtype={array.dtype} device={array.device} "
          f"data_ptr={array.data_ptr:#x} readonly={array.readonly}")


def main():
    info = handoff.runtime_info()
    print(f"handoff {handoff.__version__}, DLPack {info['dlpack_version']}, backend {info['backend']!r} "
          f"({info['device_count']} device(s))")
    if info["backend_error"]:
        print(f"  (no device backend: {info['backend_error']})")
    handoff.reset_stats()

    print("\n1. NumPy -> handoff -> PyTorch, zero-copy")
    source = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = handoff.from_dlpack(source)
    describe("handoff.from_dlpack(numpy)", view)
    tensor = torch.from_dlpack(view)
    print(f"  torch.from_dlpack(view)      same memory: {tensor.data_ptr() == source.ctypes.data}")
    source[0, 0] = 42.0
    print(f"  a write through NumPy is seen by PyTorch: tensor[0, 0] = {tensor[0, 0].item()}")

    print("\n2. PyTorch (bfloat16, strided) -> handoff -> back to PyTorch")
    weights = torch.arange(20, dtype=torch.bfloat16).reshape(4, 5)[:, ::2]
    view = handoff.from_dlpack(weights)
    describe("handoff.from_dlpack(torch)", view)
    print(f"  strides in bytes: {view.strides} (torch reports {weights.stride()} elements)")
    again = torch.from_dlpack(view)
    print(f"  round trip same memory: {again.data_ptr() == weights.data_ptr()}, equal: {torch.equal(again, weights)}")

    print("\n3. A read-only NumPy view keeps its flag, and a legacy consumer is refused")
    frozen = np.broadcast_to(np.arange(3, dtype=np.int64), (2, 3))
    view = handoff.from_dlpack(frozen)
    describe("handoff.from_dlpack(broadcast)", view)
    try:
        view.__dlpack__()  # no max_version: a legacy capsule cannot say "read-only"
    except BufferError as e:
        print(f"  legacy export refused: BufferError: {e}")

    print("\n4. Other protocols: the buffer protocol and __array_interface__")
    raw = bytearray(b"handoff!")
    view = handoff.asarray(raw)
    describe("handoff.asarray(bytearray)", view)
    print(f"  np.asarray(view) -> {np.asarray(view).tobytes()!r}")

    print("\n5. Ownership: the producer lives exactly as long as a view needs it")
    live = handoff.stats()["live_views"]
    print(f"  live producers now: {live}")
    del view, tensor, again
    print(f"  after dropping the views: {handoff.stats()['live_views']}")

    print("\nstats:", handoff.stats())


if __name__ == "__main__":
    main()
