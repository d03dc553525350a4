"""Small networks of each library, for tests/test_adapters.py and `jdp train --model tests/adapter_models.py:...`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import jdp


class NnxCNN(nnx.Module):
    """conv → BatchNorm → ReLU → pool → dropout → dense: every kind of NNX variable jdp must carry."""

    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.3):
        self.conv = nnx.Conv(1, 8, (3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(8 * 14 * 14, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x.reshape(len(x), 28, 28, 1))))
        x = nnx.avg_pool(x, (2, 2), (2, 2))
        return self.out(self.drop(x.reshape(len(x), -1)))


class LinenMLP(nn.Module):
    """dense → BatchNorm (synchronised over `jdp.AXIS`) → ReLU → dropout → dense."""

    dropout: float = 0.3

    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Dense(64)(x.reshape(len(x), -1))
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, axis_name=jdp.AXIS)(x))
        return nn.Dense(10)(nn.Dropout(self.dropout, deterministic=not train)(x))


def equinox_mlp(key: jax.Array, dropout: float = 0.3):
    """flatten → linear → ReLU → dropout → linear, on one image at a time."""
    import equinox as eqx

    k1, k2 = jax.random.split(key)
    return eqx.nn.Sequential([eqx.nn.Lambda(jnp.ravel), eqx.nn.Linear(784, 64, key=k1), eqx.nn.Lambda(jax.nn.relu),
                              eqx.nn.Dropout(dropout), eqx.nn.Linear(64, 10, key=k2)])


def make_nnx_cnn(batchnorm: str = "sync") -> jdp.Model:
    return jdp.from_nnx(lambda rngs: NnxCNN(rngs), batchnorm=batchnorm)


def make_linen_mlp() -> jdp.Model:
    return jdp.from_linen(LinenMLP())


def make_equinox_mlp() -> jdp.Model:
    return jdp.from_equinox(equinox_mlp)


def not_a_model():
    return NnxCNN(nnx.Rngs(0))
