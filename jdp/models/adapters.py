"""Flax NNX, Flax Linen and Equinox models as `jdp.Model`s.

Each adapter splits a library's model into three parts: what the optimizer updates (the trainable
params), what the forward pass updates without gradients (BatchNorm statistics and any other
non-trainable arrays), and what the library keeps as structure (held in the adapter's closures).
The variables are plain nested dicts of arrays, `{"params": ..., "state": {"model": ..., "rng": ...}}`,
so every allreduce strategy, backend, `shard_optimizer`, checkpoint and the replica check handle
them as they handle jdp's own models. An adapted model is always `stateful`.

Randomness (dropout): `state["rng"]` is the key data of the next training step's key, the same on
every device. Each training forward pass splits it into this pass's key and the next one, and
folds in the device's index on the mapped axis `AXIS`. Device i's masks at step t therefore
differ from every other device's and step's, depend on the seed, t and i only, and a checkpoint
(which saves the state) resumes them exactly. `apply` (evaluation) runs in inference mode,
without randomness. The loss is called inside the mapped step, where `AXIS` is bound.
"""

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jdp.errors import Arg, ConfigError
from jdp.models import BATCHNORM, Model
from jdp.runtime.devices import AXIS
from jdp.types import PyTree

# (logits, labels) -> loss SUMMED over the batch (the step divides by the full batch)
LogitsLoss = Callable[[jax.Array, jax.Array], jax.Array]


def summed_softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """The adapters' default loss: softmax cross-entropy summed over the batch, in float32."""
    import optax  # here, not at the top: `import jdp` stays light

    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).sum()


def step_key(rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(this device's key for this forward pass, the next pass's key data), from the state's key data `rng`."""
    this, following = jax.random.split(jax.random.wrap_key_data(rng))
    return jax.random.fold_in(this, lax.axis_index(AXIS)), jax.random.key_data(following)


def from_nnx(make: Callable[[Any], Any], *, loss: LogitsLoss | None = None, batchnorm: str = "sync",
             trainable: Any = None, name: str | None = None) -> Model:
    """A Flax NNX module as a `jdp.Model`.

    Args:
      make: `rngs -> module`, e.g. `lambda rngs: CNN(rngs=rngs)`: jdp builds the module from its
        own seed, so `TrainConfig.seed` decides the init. The module maps images (N, 1, 28, 28) to logits.
      loss: (logits, labels) -> loss summed over the batch; default `summed_softmax_cross_entropy`.
      batchnorm: "sync" sets every `nnx.BatchNorm`'s `axis_name` to `AXIS` (the global batch's
        moments, identical statistics everywhere); "per-replica" to None (each device's own shard;
        `jdp.train` averages the statistics at the end of each epoch, see `jdp.models`).
      trainable: an NNX filter of the variables the optimizer updates; default `nnx.Param`. Every
        other variable except the modules' `nnx.Rngs` is carried as state (BatchNorm statistics,
        frozen params); the `nnx.Rngs` streams are reseeded from `state["rng"]` at each pass.
      name: how runs call it; default the module's class name.

    Raises:
      ConfigError: if `make` is not a function of `rngs` returning an `nnx.Module`, or `batchnorm` is unknown.
    """
    from flax import nnx

    _check_make(make, nnx.Module, "from_nnx", "lambda rngs: CNN(rngs=rngs)")
    _check_batchnorm(batchnorm)
    trainable = nnx.Param if trainable is None else trainable

    def build(rngs: Any) -> Any:
        module = make(rngs)
        if not isinstance(module, nnx.Module):
            raise ConfigError(f"`make` of `from_nnx` must return an `nnx.Module`, got `{type(module).__name__}`.")
        for _, sub in nnx.iter_modules(module):
            if isinstance(sub, nnx.BatchNorm):
                sub.axis_name = AXIS if batchnorm == "sync" else None
        return module

    def split(module: Any) -> tuple[Any, Any, Any, Any]:
        """(graph, trainable, rng streams, the rest): the rest is the state jdp carries."""
        return nnx.split(module, trainable, nnx.RngState, ...)

    abstract = nnx.eval_shape(lambda: build(nnx.Rngs(0)))
    has_batchnorm = any(isinstance(sub, nnx.BatchNorm) for _, sub in nnx.iter_modules(abstract))
    abstract.train()
    train_graph, params_like, rngs_like, state_like = split(abstract)
    abstract.eval()
    eval_graph = split(abstract)[0]

    def merge(graph: Any, params: PyTree, state: PyTree, key: jax.Array) -> Any:
        return nnx.merge(graph, _like(params_like, params), _fresh_streams(rngs_like, key),
                         _like(state_like, state["model"]))

    def init(key: jax.Array) -> PyTree:
        model_key, rng_key = jax.random.split(key)
        _, params, _, rest = split(build(nnx.Rngs(model_key)))
        return {"params": nnx.to_pure_dict(params),
                "state": {"model": nnx.to_pure_dict(rest), "rng": jax.random.key_data(rng_key)}}

    def loss_fn(params: PyTree, state: PyTree, images: jax.Array, labels: jax.Array) -> tuple[jax.Array, PyTree]:
        key, next_rng = step_key(state["rng"])
        module = merge(train_graph, params, state, key)
        value = (loss or summed_softmax_cross_entropy)(module(images), labels)
        return value, {"model": nnx.to_pure_dict(split(module)[3]), "rng": next_rng}

    def apply(variables: PyTree, images: jax.Array) -> jax.Array:
        return merge(eval_graph, variables["params"], variables["state"], jax.random.key(0))(images)

    return Model(init, loss_fn, apply, stateful=True, per_replica_state=has_batchnorm and batchnorm == "per-replica",
                 name=name or type(abstract).__name__)


def from_linen(module: Any, *, loss: LogitsLoss | None = None, rng_streams: tuple[str, ...] = ("dropout",),
               example: jax.Array | None = None, name: str | None = None) -> Model:
    """A Flax Linen module as a `jdp.Model`.

    The module is called as `module(images)`, or `module(images, train=...)` if its `__call__`
    takes `train`. The "params" collection is trainable; every other collection `init` returns
    (BatchNorm's "batch_stats") is state, updated in training with `mutable=`. BatchNorm is
    synchronised over the devices when built with `nn.BatchNorm(axis_name=jdp.AXIS)`, per-replica
    when built without an axis name (Linen modules are frozen descriptions: jdp reads the axis
    names, it does not set them).

    Args:
      module: the `nn.Module`.
      loss: (logits, labels) -> loss summed over the batch; default `summed_softmax_cross_entropy`.
      rng_streams: the rng collections a training pass draws from (`nn.Dropout` uses "dropout").
      example: an input for `init`; default one (1, 1, 28, 28) image of zeros.
      name: how runs call it; default the module's class name.

    Raises:
      ConfigError: if `module` is not a Linen module, or its BatchNorms use an axis other than `AXIS`
        or mix synchronised and per-replica ones.
    """
    import flax.linen as nn

    if not isinstance(module, nn.Module):
        raise ConfigError(f"`module` of `from_linen` must be a `flax.linen.Module`, got `{type(module).__name__}`.")
    example = jnp.zeros((1, 1, 28, 28), jnp.float32) if example is None else example
    mode = (lambda train: {"train": train}) if "train" in inspect.signature(module.__call__).parameters \
        else (lambda train: {})
    axes = _linen_batchnorm_axes(module, example, mode(False))
    if axes - {AXIS, None} or len(axes) > 1:
        raise ConfigError(f"The BatchNorms of `{type(module).__name__}` normalise over axes {sorted(map(str, axes))}; "
                          f"jdp trains with all of them `axis_name=jdp.AXIS` (\"{AXIS}\", synchronised) or all "
                          "without one (per-replica).")

    def init(key: jax.Array) -> PyTree:
        model_key, rng_key = jax.random.split(key)
        variables = jax.jit(lambda k: module.init(k, example, **mode(False)))(model_key)
        rest = {c: v for c, v in variables.items() if c != "params"}
        return {"params": variables["params"], "state": {"model": rest, "rng": jax.random.key_data(rng_key)}}

    def loss_fn(params: PyTree, state: PyTree, images: jax.Array, labels: jax.Array) -> tuple[jax.Array, PyTree]:
        key, next_rng = step_key(state["rng"])
        rngs = {stream: jax.random.fold_in(key, i) for i, stream in enumerate(rng_streams)}
        collections = list(state["model"])
        out = module.apply({"params": params, **state["model"]}, images, **mode(True), rngs=rngs,
                           mutable=collections or False)
        logits, updated = out if collections else (out, {})
        return (loss or summed_softmax_cross_entropy)(logits, labels), {"model": dict(updated), "rng": next_rng}

    def apply(variables: PyTree, images: jax.Array) -> jax.Array:
        return module.apply({"params": variables["params"], **variables["state"]["model"]}, images, **mode(False))

    return Model(init, loss_fn, apply, stateful=True, per_replica_state=None in axes,
                 name=name or type(module).__name__)


def from_equinox(make: Callable[[jax.Array], Any], *, loss: LogitsLoss | None = None, name: str | None = None) -> Model:
    """An Equinox model as a `jdp.Model`.

    Equinox models see one example at a time: the model is called as `model(image, key=key)` on
    one image (1, 28, 28), vmapped over the batch with a key per image; evaluation uses
    `eqx.nn.inference_mode` (dropout off). Its floating-point arrays are trainable; its other
    arrays (integers) are carried as state; everything else (activations, layer sizes) is structure.

    Args:
      make: `key -> model`, e.g. `lambda key: eqx.nn.MLP(784, 10, 64, 2, key=key)` behind a
        reshape: jdp builds the model from its own seed, so `TrainConfig.seed` decides the init.
      loss: (logits, labels) -> loss summed over the batch; default `summed_softmax_cross_entropy`.
      name: how runs call it; default the model's class name.

    Raises:
      ConfigError: if `make` is not a function of a key returning an `eqx.Module`, or the model
        holds `eqx.nn.State` (Equinox's stateful layers such as `eqx.nn.BatchNorm`; use NNX or
        Linen for BatchNorm).
    """
    import equinox as eqx

    _check_make(make, eqx.Module, "from_equinox", "lambda key: MLP(key=key)")
    abstract = eqx.filter_eval_shape(make, jax.random.key(0))
    if not isinstance(abstract, eqx.Module):
        raise ConfigError(f"`make` of `from_equinox` must return an `eqx.Module`, got `{type(abstract).__name__}`.")
    if any(isinstance(leaf, eqx.nn.StateIndex)
           for leaf in jax.tree.leaves(abstract, is_leaf=lambda x: isinstance(x, eqx.nn.StateIndex))):
        raise ConfigError(f"`{type(abstract).__name__}` holds Equinox state (`eqx.nn.State`, e.g. `eqx.nn.BatchNorm`), "
                          "which `from_equinox` does not carry; use `from_nnx` or `from_linen` for BatchNorm.")
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    names = [jax.tree_util.keystr(path) for path, _ in with_paths]
    kinds = ["params" if isinstance(leaf, jax.ShapeDtypeStruct) and jnp.issubdtype(leaf.dtype, jnp.inexact)
             else "model" if isinstance(leaf, jax.ShapeDtypeStruct) else None for _, leaf in with_paths]

    def init(key: jax.Array) -> PyTree:
        model_key, rng_key = jax.random.split(key)
        leaves = treedef.flatten_up_to(make(model_key))
        parts = {kind: {n: leaf for n, k, leaf in zip(names, kinds, leaves) if k == kind}
                 for kind in ("params", "model")}
        return {"params": parts["params"], "state": {"model": parts["model"], "rng": jax.random.key_data(rng_key)}}

    def rebuild(params: PyTree, state: PyTree) -> Any:
        parts = {"params": params, "model": state["model"]}
        return treedef.unflatten([leaf if kind is None else parts[kind][n]
                                  for n, kind, (_, leaf) in zip(names, kinds, with_paths)])

    def loss_fn(params: PyTree, state: PyTree, images: jax.Array, labels: jax.Array) -> tuple[jax.Array, PyTree]:
        key, next_rng = step_key(state["rng"])
        model = rebuild(params, state)
        logits = jax.vmap(lambda x, k: model(x, key=k))(images, jax.random.split(key, len(images)))
        return (loss or summed_softmax_cross_entropy)(logits, labels), {"model": state["model"], "rng": next_rng}

    def apply(variables: PyTree, images: jax.Array) -> jax.Array:
        return jax.vmap(eqx.nn.inference_mode(rebuild(variables["params"], variables["state"])))(images)

    return Model(init, loss_fn, apply, stateful=True, name=name or type(abstract).__name__)


def _check_make(make: Any, module_type: type, adapter: str, example: str) -> None:
    if isinstance(make, module_type) or not callable(make):
        raise ConfigError(f"`make` of `{adapter}` must be a function that builds the model from jdp's key, e.g. "
                          f"`{example}`, so that the run's seed decides the init; got `{type(make).__name__}`.")


def _check_batchnorm(batchnorm: str) -> None:
    if batchnorm not in BATCHNORM:
        raise ConfigError(Arg("batchnorm"), f" must be one of {', '.join(BATCHNORM)}, got `{batchnorm}`.")


def _like(template: PyTree, values: PyTree) -> PyTree:
    """`values` (a plain nested dict) in the structure of `template` (an NNX State of the same keys)."""
    return jax.tree.unflatten(jax.tree.structure(template), jax.tree.leaves(values))


def _fresh_streams(template: PyTree, key: jax.Array) -> PyTree:
    """NNX rng streams shaped like `template`: the i-th stream's key is `fold_in(key, i)`, its count 0."""
    leaves, structure = jax.tree.flatten(template)
    return jax.tree.unflatten(structure, [
        jax.random.fold_in(key, i) if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        else jnp.zeros(leaf.shape, leaf.dtype) for i, leaf in enumerate(leaves)])


def _linen_batchnorm_axes(module: Any, example: jax.Array, kwargs: dict[str, Any]) -> set[str | None]:
    """The `axis_name`s of the module's BatchNorms, seen by intercepting their calls during an abstract init."""
    import flax.linen as nn

    axes: set[str | None] = set()

    def record(next_fun, args, kw, context):
        if isinstance(context.module, nn.BatchNorm) and context.method_name == "__call__":
            axes.add(context.module.axis_name)
        return next_fun(*args, **kw)

    with nn.intercept_methods(record):
        jax.eval_shape(lambda: module.init(jax.random.key(0), example, **kwargs))
    return axes
