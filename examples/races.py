"""Races after a correct exchange, on handoff's simulated device: the hand-off is ordered, but a kernel
then runs on the legacy default stream, which does not wait for non-blocking streams, and a side
stream's copy reads memory that its owner frees on another stream. Traced with --launches, each is
flagged with both sides, their lines and the fix; --fixed runs the same pipeline ordered.

    HANDOFF_BACKEND=sim handoff-trace run --launches -- python examples/races.py           # two races
    HANDOFF_BACKEND=sim handoff-trace run --launches -- python examples/races.py --fixed   # none
"""

import sys

import handoff
from handoff import sim

fixed = "--fixed" in sys.argv[1:]
producer, consumer, side = (sim.Stream(non_blocking=True) for _ in range(3))
# The default stream, where many libraries launch unless told otherwise: CUDA's legacy stream (DLPack's
# stream 1), ROCm's null stream (0); neither waits for non-blocking streams.
LEGACY = 0 if handoff.runtime_info()["backend"] == "sim-rocm" else 1

weights = sim.zeros((256, 256), "float32")
sim.fill(weights, 0.5, stream=producer, delay=0.05)  # a producer's kernel, still running
inputs = handoff.from_dlpack(weights, stream=consumer)  # ordered: the consumer's stream waits for it
scores = sim.zeros((256,), "float32")
# A library's kernel on the legacy stream reads the inputs before the producer's write is done.
sim.launch("score", reads=[inputs], writes=[scores], stream=consumer if fixed else LEGACY)

staging = sim.zeros((256, 256), "float32", stream=consumer)  # allocated on consumer, freed there
sim.launch("stage", writes=[staging], stream=consumer)
copy = sim.zeros((256, 256), "float32")
ready = sim.zeros(1)
sim.fill(ready, 1.0, stream=consumer)
after_stage = handoff.from_dlpack(ready, stream=side)  # the side stream waits for the staging kernel
sim.launch("copy", reads=[staging], writes=[copy], stream=side, delay=0.05)  # a copy still running
if fixed:  # keep the staging memory until the copy is done (what tensor.record_stream does)
    done = sim.zeros(1)
    sim.fill(done, 1.0, stream=side)
    copied = handoff.from_dlpack(done, stream=consumer)
del staging  # freed on consumer: nothing orders the free after the side stream's copy

print("scores:", sim.to_numpy(scores, stream=consumer)[:4])
sim.synchronize()
