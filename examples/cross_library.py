"""A pipeline that never imports handoff: one library's kernel writes an array, and another library
imports it through DLPack and reads it on its own stream. The producer ignores DLPack's `stream`
argument (as cuda.core's and nanobind's arrays do), so the read races the write, and now and then the
numbers are wrong (here always: the simulator holds the kernel until the read is enqueued).
handoff-trace finds the line, and orders it without a change to the code:

    HANDOFF_BACKEND=sim handoff-trace run -- python examples/cross_library.py          # flags the race
    HANDOFF_BACKEND=sim handoff-trace run --order -- python examples/cross_library.py  # fixes it

The two libraries are small ones on handoff's simulated device, written for the tests
(tests/python/peer_library.py): `simnano` ignores `stream`, `simtorch` passes its current stream.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))

from peer_library import make_library

from handoff import sim

simnano = make_library("simnano", honours_stream=False)
simtorch = make_library("simtorch")
compute, reader = simnano.Stream(), simtorch.Stream()
activations = simnano.zeros(1 << 16)

with simnano.use(compute), simtorch.use(reader):
    with sim.hold(compute):  # simnano's kernel is still running until the read is enqueued
        simnano.fill(activations, 1.0)
        tensor = simtorch.from_dlpack(activations)  # the hand-off: simtorch passes its stream; simnano ignores it
        read = simtorch.to_numpy(tensor, wait=False)  # a read on simtorch's stream
    total = float(read.result().sum())
    print(f"sum of the activations: {total:.0f} (expected {1 << 16})")
simtorch.synchronize()
