"""Flax Linen versions of the lesson's networks: the LeNet and its concise section's ResNet-18.

Linen keeps parameters outside the module: `init` returns a variables dict and `apply` is a pure
function of it, so params and BatchNorm statistics are plain pytrees that `jdp.replicate`
and every allreduce strategy handle unchanged (see `jdp.models` for how the step uses them).

Images arrive as the lesson's NCHW (N, 1, 28, 28); with one channel NCHW → NHWC is a reshape.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from jdp.models import lenet

# The lesson initialises every conv and dense weight from N(0, 0.01²), biases at 0.
_WEIGHTS = nn.initializers.normal(stddev=0.01)


def _nhwc(images: jax.Array) -> jax.Array:
    return images.reshape(images.shape[0], 28, 28, 1)


def _batchnorm(train: bool, axis_name: str | None) -> nn.BatchNorm:
    """PyTorch's BatchNorm defaults (momentum 0.1 is Flax's 0.9); moments averaged over `axis_name` if given."""
    return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5, axis_name=axis_name)


class LeNet(nn.Module):
    """The lesson's LeNet: conv 3×3 (20) → avg-pool → conv 5×5 (50) → avg-pool → dense 128 → dense 10."""

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        def pool(x):  # 2×2 average pooling, stride 2, floor on odd sizes (PyTorch's `avg_pool2d`)
            return nn.avg_pool(x, (2, 2), strides=(2, 2), padding="VALID")

        h = pool(nn.relu(nn.Conv(20, (3, 3), padding="VALID", kernel_init=_WEIGHTS)(_nhwc(images))))
        h = pool(nn.relu(nn.Conv(50, (5, 5), padding="VALID", kernel_init=_WEIGHTS)(h)))
        h = h.transpose(0, 3, 1, 2).reshape(h.shape[0], -1)  # flatten in the lesson's (C, H, W) order
        h = nn.relu(nn.Dense(128, kernel_init=_WEIGHTS)(h))
        return nn.Dense(10, kernel_init=_WEIGHTS)(h)


def lenet_variables(params: lenet.Params) -> dict:
    """The from-scratch LeNet's params as `LeNet`'s variables: the same numbers, Flax's layouts."""
    hwio = lambda w: w.transpose(2, 3, 1, 0)  # noqa: E731  OIHW → HWIO
    return {"params": {
        "Conv_0": {"kernel": hwio(params["W1"]), "bias": params["b1"]},
        "Conv_1": {"kernel": hwio(params["W2"]), "bias": params["b2"]},
        "Dense_0": {"kernel": params["W3"], "bias": params["b3"]},
        "Dense_1": {"kernel": params["W4"], "bias": params["b4"]},
    }}


class Residual(nn.Module):
    """Two 3×3 convs with BatchNorm; a 1×1 conv on the shortcut where the shape changes (d2l's `Residual`)."""

    channels: int
    strides: int = 1
    batchnorm_axis: str | None = None

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        conv = lambda size, strides=1: nn.Conv(self.channels, (size, size), strides=strides,  # noqa: E731
                                               padding=1 if size == 3 else 0, kernel_init=_WEIGHTS)
        y = nn.relu(_batchnorm(train, self.batchnorm_axis)(conv(3, self.strides)(x)))
        y = _batchnorm(train, self.batchnorm_axis)(conv(3)(y))
        if self.strides != 1 or x.shape[-1] != self.channels:
            x = conv(1, self.strides)(x)
        return nn.relu(y + x)


class ResNet18(nn.Module):
    """The lesson's ResNet-18 for 28×28 inputs: 3×3 stride-1 first conv and no max-pool, then residual
    stages of 64-128-256-512 channels (two blocks each, stride 2 entering stages 2-4), global
    average pooling and a dense layer.

    `batchnorm_axis`: None normalises over each device's shard (per-replica statistics); a mapped
    axis name ("data") averages the batch moments over that axis (synchronised, the global batch's).
    """

    num_classes: int = 10
    batchnorm_axis: str | None = None

    @nn.compact
    def __call__(self, images: jax.Array, train: bool = False) -> jax.Array:
        x = nn.Conv(64, (3, 3), padding=1, kernel_init=_WEIGHTS)(_nhwc(images))
        x = nn.relu(_batchnorm(train, self.batchnorm_axis)(x))
        for stage, channels in enumerate((64, 128, 256, 512)):
            for block in range(2):
                strides = 2 if stage > 0 and block == 0 else 1
                x = Residual(channels, strides, self.batchnorm_axis)(x, train)
        x = jnp.mean(x, axis=(1, 2))  # global average pooling
        return nn.Dense(self.num_classes, kernel_init=_WEIGHTS)(x)
