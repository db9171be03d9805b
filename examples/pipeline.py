"""A small pipeline on handoff's simulated device with one unordered hand-off and one view kept to
the end: run it under `handoff-trace run` to see the race flagged and the view listed as still held,
each with its line.

    HANDOFF_BACKEND=sim handoff-trace run -o pipeline.json -- python examples/pipeline.py
    handoff-trace graph pipeline.json --format svg
"""

import numpy as np

import handoff
from handoff import sim

producer, consumer = sim.Stream(), sim.Stream()

weights = sim.zeros((256, 256), "float32")
sim.fill(weights, 0.5, stream=producer, delay=0.1)  # a producer's kernel, still running
activations = sim.zeros((64, 256), "float32")
sim.fill(activations, 1.0, stream=producer, delay=0.1)

racy = handoff.from_dlpack(activations, stream=-1)  # no ordering while the write is pending: a race
print("racy read:   ", sim.to_numpy(racy, stream=consumer)[0, :4], "(stale: the write had not run)")
ordered = handoff.from_dlpack(weights, stream=consumer)  # the consumer's stream waits for the producer
print("ordered read:", sim.to_numpy(ordered, stream=consumer)[0, :4])

host = handoff.from_dlpack(np.arange(8, dtype=np.int32))  # host data needs no ordering
kept = ordered  # still alive at exit: listed as still held, not a hazard
del racy, host
sim.synchronize()
