"""The steady-state training loop reads nothing back from the devices: on a GPU every read makes the host wait
for the device, and a few per step make the loop several times slower than its own compute."""

import jax
import numpy as np
import pytest
from adapter_models import make_nnx_cnn
from host_reads import counting_reads

import jdp
from jdp import data
from jdp.bench.loop import tiny_mlp
from jdp.training.config import TrainConfig
from jdp.training.loop import train

MODELS = {"nnx-cnn": make_nnx_cnn, "mlp": tiny_mlp}
STEPS_PER_EPOCH = 24  # fewer than the guards' read interval (`jdp.training.guards.Watch`): no read is due


def test_the_counter_sees_the_reads_a_cpu_makes(devices):
    """The ways the loop used to read its finite checks: per-shard numpy views and Python scalars."""
    x = jax.pmap(lambda a: a * 2)(np.ones((2, 3), np.float32))
    with counting_reads() as reads:
        [np.asarray(s.data) for s in x.addressable_shards]
        bool(x[0, 0] > 0)
        float(x.sum())
    assert reads.count("np.asarray") == 2 and "__bool__" in reads and "__float__" in reads


@pytest.mark.parametrize(("backend", "allreduce", "steps_per_call", "model"), [
    ("pmap", "psum", 1, "lenet"),  # the default: data resident on the devices, step and tally in one call
    ("pmap", "psum", 4, "mlp"),  # the loop's reads do not depend on the model: a small one compiles fast
    ("pmap", "manual", 1, "mlp"),  # an allreduce outside the compiled step: the tally is its own call
    ("shard_map", "psum", 1, "mlp"),  # batches copied from the host
    ("pmap", "psum", 1, "nnx-cnn"),  # BatchNorm and dropout: variables with state
    pytest.param("pmap", "psum", 1, "resnet18", marks=pytest.mark.slow),  # 110 leaves: the old guard read 111 flags
])
def test_the_steady_state_loop_reads_nothing_from_the_devices(devices, backend, allreduce, steps_per_call, model):
    batch = 32
    dataset = data.synthetic(jax.random.key(0), n_train=batch * STEPS_PER_EPOCH + 5, n_test=16)
    reads_per_epoch = []

    def progress(calls, total):  # wraps each epoch's calls: the steady-state loop runs inside the block
        with counting_reads() as reads:
            yield from calls
        reads_per_epoch.append(list(reads))

    config = TrainConfig(batch_size=batch, lr=0.1, epochs=2, backend=backend, allreduce=allreduce,
                         model=MODELS.get(model, lambda: model)(), steps_per_call=steps_per_call)
    _, history = train(config, dataset, devices[:2], hooks=jdp.Hooks(progress=progress))
    assert [len(reads) for reads in reads_per_epoch] == [0, 0], f"reads in epoch 1: {reads_per_epoch[0][:4]}..."
    assert all(np.isfinite(record.train_loss) for record in history)
