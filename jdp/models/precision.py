"""Mixed precision: float32 master params, low-precision compute, float32 loss and gradients.

`mixed(model, "bf16")` wraps any `Model` so that each step

* casts the float32 params and the images to bfloat16 as they enter the forward pass;
* runs the forward and backward passes in bfloat16 (a model may keep a layer's elementwise work in
  float32 on the bfloat16 values, as the fast LeNet's fused first layer does: CPUs have no bfloat16
  elementwise arithmetic);
* computes the loss in float32 (`summed_cross_entropy` and the BatchNorm models upcast the logits);
* returns float32 gradients: the transpose of a float32 → bfloat16 cast is the bfloat16 → float32
  cast, so the allreduce receives float32 arrays and sums them in float32;
* keeps the params, optimizer state and checkpoints in float32 (the optimizer never sees bfloat16).

This is the usual GPU setting (as in Flax's `dtype=bfloat16, param_dtype=float32`), done from
outside the model so that every model, strategy and backend gets it unchanged.
"""

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jdp.errors import Arg, ConfigError
from jdp.types import PyTree

if TYPE_CHECKING:
    from jdp.models import Model


# `precision` name (TrainConfig's, `--precision`) -> compute dtype (None: compute in the params' own float32).
PRECISIONS: dict[str, Any] = {"float32": None, "bf16": jnp.bfloat16}


def check(precision: str) -> None:
    """Raises ConfigError unless `precision` is one of `PRECISIONS`."""
    if precision not in PRECISIONS:
        raise ConfigError(Arg("precision"), f" must be one of {', '.join(PRECISIONS)}, got `{precision}`.")


def cast_floats(tree: PyTree, dtype: Any) -> PyTree:
    """`tree` with its float32 leaves cast to `dtype` (integer and other leaves untouched)."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.asarray(x).dtype == jnp.float32 else x, tree)


def _like(tree: PyTree, reference: PyTree) -> PyTree:
    """`tree` cast leaf by leaf to the dtypes of `reference` (a model's state keeps its float32)."""
    return jax.tree.map(lambda x, ref: x.astype(ref.dtype), tree, reference)


def mixed(model: "Model", precision: str) -> "Model":
    """`model` computing in `precision`'s dtype, with float32 params, loss, gradients and state.

    Args:
      model: any `jdp.models.Model`.
      precision: a key of `PRECISIONS`; "float32" returns `model` itself.
    """
    check(precision)
    dtype = PRECISIONS[precision]
    if dtype is None:
        return model
    if model.stateful:

        def loss(params, state, images, labels):
            value, new_state = model.loss(cast_floats(params, dtype), state, cast_floats(images, dtype), labels)
            return value.astype(jnp.float32), _like(new_state, state)

        def apply(variables, images):
            low = {**variables, "params": cast_floats(variables["params"], dtype)}
            return model.apply(low, cast_floats(images, dtype)).astype(jnp.float32)

    else:

        def loss(params, images, labels):
            return model.loss(cast_floats(params, dtype), cast_floats(images, dtype), labels).astype(jnp.float32)

        def apply(params, images):
            return model.apply(cast_floats(params, dtype), cast_floats(images, dtype)).astype(jnp.float32)

    return model._replace(loss=loss, apply=apply)
