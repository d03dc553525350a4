"""The models `jdp train --model` trains, each as pure functions over pytrees the step replicates.

A stateless model's variables are its params. A model with BatchNorm also carries state that the
forward pass updates but gradients do not touch (the running statistics); its variables are
`{"params": ..., "state": {"batch_stats": ...}}` and its loss returns the new state, so the train
step (`jdp.step.make_train_step(..., stateful=True)`) differentiates "params" only and carries
"state" through. Both are plain pytrees: `replicate`, the allreduce strategies, checkpoints and
guards treat them like any other.

BatchNorm over several devices (`--batchnorm`):

* ``sync``: the batch mean and mean square are averaged over the device axis inside the step
  (`lax.pmean`, in Flax's `BatchNorm(axis_name="data")`): k devices compute exactly what one
  device computes on the global batch, and every replica keeps the same running statistics.
* ``per-replica``: each device normalises over its own shard (B/k images) and updates its own
  running statistics; gradients still go through the allreduce, so params stay identical while
  the statistics drift apart. Like Flax's ImageNet example, `jdp.train` averages them over the
  devices at the end of each epoch (`average_state`), before evaluating and checkpointing, so
  evaluation uses one set of statistics whichever device evaluates.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax import lax

from jdp import flax_models, lenet
from jdp.errors import ConfigError
from jdp.lenet_fast import IMPLEMENTATIONS
from jdp.placement import AXIS
from jdp.step import summed_cross_entropy

PyTree = Any
NAMES = ("lenet", "lenet_flax", "resnet18")
BATCHNORM = ("sync", "per-replica")


class Model(NamedTuple):
    """What the data-parallel machinery needs of a model."""

    init: Callable[[jax.Array], PyTree]  # key -> variables (params, or {"params", "state"} if stateful)
    loss: Callable[..., Any]  # (params, images, labels) -> summed loss; stateful: (params, state, images,
    #                           labels) -> (summed loss, new state)
    apply: Callable[[PyTree, jax.Array], jax.Array]  # (variables, images) -> logits, inference mode
    stateful: bool = False
    per_replica_state: bool = False  # the state differs between devices during an epoch


def get(name: str, *, impl: str = "fast", batchnorm: str | None = None) -> Model:
    """The model `--model name` trains.

    Args:
      name: one of `NAMES`.
      impl: the from-scratch LeNet's formulation (`jdp.lenet_fast.IMPLEMENTATIONS`), for "lenet".
      batchnorm: "sync" (default) or "per-replica", for models with BatchNorm only.

    Raises:
      ConfigError: for an unknown name or mode, or `batchnorm` given for a model without BatchNorm.
    """
    if name not in NAMES:
        raise ConfigError(f"`--model` must be one of {', '.join(NAMES)}, got `{name}`.")
    if batchnorm is not None and name != "resnet18":
        raise ConfigError(f"`--batchnorm` applies to models with BatchNorm (resnet18), not `--model {name}`.")
    if name == "lenet":
        if impl not in IMPLEMENTATIONS:
            raise ConfigError(f"`--model-impl` must be one of {', '.join(IMPLEMENTATIONS)}, got `{impl}`.")
        return Model(lenet.init, summed_cross_entropy(IMPLEMENTATIONS[impl]), IMPLEMENTATIONS[impl])
    if name == "lenet_flax":
        module = flax_models.LeNet()
        apply = lambda variables, images: module.apply(variables, images)  # noqa: E731
        return Model(lambda key: module.init(key, _example()), summed_cross_entropy(apply), apply)
    batchnorm = batchnorm or "sync"
    if batchnorm not in BATCHNORM:
        raise ConfigError(f"`--batchnorm` must be one of {', '.join(BATCHNORM)}, got `{batchnorm}`.")
    return batchnorm_model(flax_models.ResNet18(batchnorm_axis=AXIS if batchnorm == "sync" else None))


def batchnorm_model(module: Any) -> Model:
    """A Linen module with BatchNorm, called as `module(images, train=...)`, as a stateful `Model`."""

    def init(key: jax.Array) -> PyTree:
        variables = jax.jit(lambda k: module.init(k, _example(), train=False))(key)
        return {"params": variables["params"], "state": {"batch_stats": variables["batch_stats"]}}

    def loss(params, state, images, labels):
        logits, state = module.apply({"params": params, **state}, images, train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum(), state

    def apply(variables, images):
        return module.apply({"params": variables["params"], **variables["state"]}, images, train=False)

    return Model(init, loss, apply, stateful=True, per_replica_state=module.batchnorm_axis is None)


def trainable(model: Model, variables: PyTree) -> PyTree:
    """The part of `variables` the optimizer updates: all of a stateless model's, a stateful one's "params"."""
    return variables["params"] if model.stateful else variables


def average_state(variables: PyTree) -> PyTree:
    """Per-device variables → the same with "state" averaged over the mapped device axis `AXIS`.

    Call inside `jax.pmap(..., axis_name=AXIS)`; params pass through untouched.
    """
    return {"params": variables["params"], "state": lax.pmean(variables["state"], AXIS)}


def _example() -> jax.Array:
    return jax.numpy.zeros((1, 1, 28, 28), jax.numpy.float32)
