"""handoff.ray: the "handoff" tensor transport of Ray Direct Transport, on a local cluster
(ray.init(num_cpus=2)) whose actors run on this test's simulator."""

from __future__ import annotations

import os

import pytest

from support import needs_sim

ray = pytest.importorskip("ray", reason="handoff.ray needs Ray (pip install 'handoff[ray]')")

# Starting the local cluster forks the test process; JAX, when an earlier test imported it, warns at
# every fork that a multithreaded process may deadlock (the child execs Ray's processes at once).
pytestmark = pytest.mark.filterwarnings(r"ignore:os\.fork\(\) was called:RuntimeWarning")


@pytest.fixture(scope="module")
def cluster():
    import handoff.ray

    handoff.ray.register()  # in the driver, before the actors
    keep = {name: os.environ[name] for name in os.environ if name.startswith("HANDOFF_")}
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": keep},
    )
    yield
    ray.shutdown()


@needs_sim
def test_actors_hand_arrays_over_zero_copy_and_ordered(cluster):
    @ray.remote
    class Producer:
        def __init__(self):
            from handoff import sim

            self.stream = sim.Stream(non_blocking=True)
            self.array = sim.zeros(1024, "float32")

        @ray.method(tensor_transport="handoff")
        def weights(self, value):
            from handoff import sim

            sim.fill(self.array, value, stream=self.stream)  # pending when the array is handed over
            return self.array

    # Ray submits the receive after the consuming task when the producer's task is still running (Ray
    # issue 60954): an actor that runs its tasks in order would wait for it behind that task, so the
    # receiving actor takes its tasks concurrently.
    @ray.remote(max_concurrency=2)
    class Consumer:
        def read(self, array):
            import handoff
            from handoff import sim

            stream = sim.Stream(non_blocking=True)
            with handoff.stream(stream):
                ordered = handoff.from_dlpack(array)
            return type(array).__name__, float(sim.to_numpy(ordered, stream=stream).min())

    producer, consumer = Producer.remote(), Consumer.remote()
    for value in (3.0, 4.0, 5.0):  # the same allocation again: a cached mapping, a new event each time
        kind, smallest = ray.get(consumer.read.remote(producer.weights.remote(value)), timeout=50)
        assert kind == "Array"
        assert smallest == value


def test_a_handle_travels_in_any_ray_object(cluster):
    import numpy as np

    from handoff import ipc

    handle = ipc.share(np.arange(5.0))

    @ray.remote
    def total(h):
        import numpy as np

        from handoff import ipc

        return float(np.asarray(ipc.open(h)).sum())

    assert ray.get(total.remote(ray.put(handle))) == 10.0


def test_between_nodes_the_transport_refuses_clearly(cluster):
    from handoff.ray import HandoffTransport, HandoffTransportMetadata

    @ray.remote
    def receive():
        metadata = HandoffTransportMetadata(tensor_meta=[((1,), "float32")], handles=[b"x"], node_id="elsewhere")
        try:
            HandoffTransport().recv_multiple_tensors("id", metadata, None)
        except ValueError as e:
            return str(e)
        return "accepted"

    assert "one node" in ray.get(receive.remote())
