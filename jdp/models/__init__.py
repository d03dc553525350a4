"""Models as pure functions over pytrees, and the registry `jdp train --model` looks them up in.

A stateless model's variables are its params. A model with BatchNorm also carries state that the
forward pass updates but gradients do not touch (the running statistics); its variables are
`{"params": ..., "state": {"batch_stats": ...}}` and its loss returns the new state, so the train
step (`jdp.make_train_step(model, ...)`, given the model) differentiates "params" only and carries
"state" through. Both are plain pytrees: `replicate`, the allreduce strategies, checkpoints and
guards treat them like any other.

BatchNorm over several devices (`batchnorm`, the CLI's `--batchnorm`):

* ``sync``: the batch mean and mean square are averaged over the device axis inside the step
  (`lax.pmean`, in Flax's `BatchNorm(axis_name="data")`): k devices compute exactly what one
  device computes on the global batch, and every replica keeps the same running statistics.
* ``per-replica``: each device normalises over its own shard (B/k images) and updates its own
  running statistics; gradients still go through the allreduce, so params stay identical while
  the statistics drift apart. Like Flax's ImageNet example, `jdp.train` averages them over the
  devices at the end of each epoch (`average_state`), before evaluating and checkpointing, so
  evaluation uses one set of statistics whichever device evaluates.
"""

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jdp.errors import Arg, ConfigError, Message
from jdp.models import lenet
from jdp.models.lenet_fast import FORMULATIONS
from jdp.runtime.devices import AXIS
from jdp.types import PyTree

BATCHNORM = ("sync", "per-replica")


class Model(NamedTuple):
    """What the data-parallel machinery needs of a model: three pure functions over pytrees.

    Attributes:
      init: key -> variables (the params, or {"params", "state"} if `stateful`).
      loss: (params, images, labels) -> loss SUMMED over the images (the step divides by the full
        batch); if `stateful`, (params, state, images, labels) -> (summed loss, new state).
      apply: (variables, images) -> logits, in inference mode.
      stateful: the model carries state the forward pass updates but gradients do not touch.
      per_replica_state: that state differs between devices during an epoch (per-replica BatchNorm).
      name: how runs, checkpoints and plots call it.
    """

    init: Callable[[jax.Array], PyTree]
    loss: Callable[..., Any]
    apply: Callable[[PyTree, jax.Array], jax.Array]
    stateful: bool = False
    per_replica_state: bool = False
    name: str = "custom"


def summed_cross_entropy(apply_fn: Callable[[PyTree, jax.Array], jax.Array]) -> Callable[..., jax.Array]:
    """Softmax cross-entropy summed (not averaged) over the batch, as the lesson's `l.sum()`.

    Computed in float32 whatever the logits' dtype (a bfloat16 forward pass under `--precision bf16`).
    """

    def loss_fn(params: PyTree, images: jax.Array, labels: jax.Array) -> jax.Array:
        import optax  # here, not at the top: `import optax` costs a tenth of `import jax`

        logits = apply_fn(params, images).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

    return loss_fn


def _lenet(impl: str = "fast", batchnorm: str | None = None) -> Model:
    _no_batchnorm("lenet", batchnorm)
    if impl not in FORMULATIONS:
        raise ConfigError("`impl` (a TrainConfig's ", Arg("formulation"),
                          f") must be one of {', '.join(FORMULATIONS)}, got `{impl}`.")
    return Model(lenet.init, summed_cross_entropy(FORMULATIONS[impl]), FORMULATIONS[impl], name="lenet")


def _lenet_flax(impl: str = "fast", batchnorm: str | None = None) -> Model:
    _no_batchnorm("lenet_flax", batchnorm)
    from jdp.models import flax as flax_nets  # Flax takes a quarter of a second to import: only for its models

    module = flax_nets.LeNet()
    apply = lambda variables, images: module.apply(variables, images)  # noqa: E731
    return Model(lambda key: module.init(key, _example()), summed_cross_entropy(apply), apply, name="lenet_flax")


def _resnet18(impl: str = "fast", batchnorm: str | None = None) -> Model:
    batchnorm = batchnorm or "sync"
    if batchnorm not in BATCHNORM:
        raise ConfigError(Arg("batchnorm"), f" must be one of {', '.join(BATCHNORM)}, got `{batchnorm}`.")
    from jdp.models import flax as flax_nets

    module = flax_nets.ResNet18(batchnorm_axis=AXIS if batchnorm == "sync" else None)
    return batchnorm_model(module)._replace(name="resnet18")


def _no_batchnorm(name: str, batchnorm: str | None) -> None:
    if batchnorm is not None:
        raise ConfigError(Arg("batchnorm"), " applies to models with BatchNorm (resnet18), not ",
                          Arg("model", name), ".")


# The registry: name -> build(**options) -> Model. Built-ins take `impl` and `batchnorm` (a TrainConfig's
# `formulation` and `batchnorm`); `register` adds more.
_MODELS: dict[str, Callable[..., Model]] = {"lenet": _lenet, "lenet_flax": _lenet_flax, "resnet18": _resnet18}


def register(name: str, build: Callable[..., Model], *, replace: bool = False) -> None:
    """Makes `build(**options) -> Model` available as `get(name)` and `jdp train --model name`.

    `jdp.train` calls it with `impl=` and `batchnorm=` (a TrainConfig's `formulation` and `batchnorm`,
    the CLI's `--formulation` and `--batchnorm`); a model without such options accepts and ignores them
    or refuses them by name.

    Raises:
      ConfigError: if `name` is taken (unless `replace`).
    """
    if name in _MODELS and not replace:
        raise ConfigError(f"A model named `{name}` is registered already; pass `replace=True`.")
    _MODELS[name] = build


def names() -> tuple[str, ...]:
    """The registered models' names, built-ins first."""
    return tuple(_MODELS)


def get(name: "str | Model", **options: Any) -> Model:
    """The model called `name` (or `name` itself if it is a `Model`), built with `options`.

    Raises:
      ConfigError: for an unknown name or a bad option.
    """
    if isinstance(name, Model):
        return name
    if name not in _MODELS and ":" in name:
        return load(name, batchnorm=options.get("batchnorm"))
    if name not in _MODELS:
        raise ConfigError(Arg("model"), f" must be one of {', '.join(_MODELS)}, got `{name}`; or `module:factory` (a "
                          "function in a module or .py file that returns a `jdp.Model`).")
    model = _MODELS[name](**options)
    return model if model.name != "custom" else model._replace(name=name)


def load(spec: str, batchnorm: str | None = None) -> Model:
    """The `Model` that `factory()` returns, for `spec` "module:factory" (the CLI's `--model module:factory`).

    `module` is an importable module ("my_models", "pkg.models") or a Python file ("models.py",
    "path/to/models.py"); `factory` is called with no arguments, or with `batchnorm=` when given.

    Raises:
      ConfigError: if the module cannot be imported, has no such factory, or the factory does not
        return a `Model`.
    """
    where, _, attribute = spec.rpartition(":")
    module = _import(where, spec)
    factory = getattr(module, attribute, None)
    if not callable(factory):
        found = ", ".join(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                          and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(Arg("model", spec), f": `{where}` has no function `{attribute}`"
                          + (f"; it defines {found}." if found else "."))
    options = {} if batchnorm is None else {"batchnorm": batchnorm}
    try:
        inspect.signature(factory).bind(**options)
    except TypeError:
        why = (Message(f": `{attribute}` has no parameter batchnorm to receive ", Arg("batchnorm", batchnorm),
                       "; add one or drop ", Arg("batchnorm"), ".") if options else
               f": `{attribute}` must be callable with no arguments.")
        raise ConfigError(Arg("model", spec), why) from None
    model = factory(**options)
    if not isinstance(model, Model):
        raise ConfigError(Arg("model", spec), f": `{attribute}()` returned a `{type(model).__name__}`, not a "
                          "`jdp.Model`; wrap the network with `jdp.from_nnx`, `jdp.from_linen` or `jdp.from_equinox`, "
                          "or build a `jdp.Model(init, loss, apply)`.")
    return model if model.name != "custom" else model._replace(name=spec)


def _import(where: str, spec: str) -> Any:
    """The module `where` names: a dotted module name, or a `.py` file (loaded once per path)."""
    import importlib
    import importlib.util
    import sys
    from pathlib import Path

    if not where.endswith(".py"):
        try:
            return importlib.import_module(where)
        except ImportError as e:
            raise ConfigError(Arg("model", spec), f": `{where}` cannot be imported ({e}); put it on PYTHONPATH or name "
                              "its file, e.g. ",
                              Arg("model", f"path/to/{where.rpartition('.')[2]}.py:{spec.rpartition(':')[2]}"),
                              ".") from None
    path = Path(where).resolve()
    if not path.is_file():
        raise ConfigError(Arg("model", spec), f": there is no file `{where}`.")
    name = f"jdp_model_file_{abs(hash(str(path)))}"
    if name not in sys.modules:
        loader_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module  # dataclasses and pickling look classes up by module name
        try:
            loader_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def batchnorm_model(module: Any) -> Model:
    """A Linen module with BatchNorm, called as `module(images, train=...)`, as a stateful `Model`."""

    def init(key: jax.Array) -> PyTree:
        variables = jax.jit(lambda k: module.init(k, _example(), train=False))(key)
        return {"params": variables["params"], "state": {"batch_stats": variables["batch_stats"]}}

    def loss(params, state, images, labels):
        import optax

        logits, state = module.apply({"params": params, **state}, images, train=True, mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels).sum(), state

    def apply(variables, images):
        return module.apply({"params": variables["params"], **variables["state"]}, images, train=False)

    return Model(init, loss, apply, stateful=True, per_replica_state=module.batchnorm_axis is None)


def trainable(model: Model, variables: PyTree) -> PyTree:
    """The part of `variables` the optimizer updates: all of a stateless model's, a stateful one's "params"."""
    return variables["params"] if model.stateful else variables


def average_state(variables: PyTree) -> PyTree:
    """Per-device variables → the same with "state"'s floating-point arrays averaged over the mapped axis `AXIS`.

    Call inside a function mapped over the devices (`jdp.map_over_devices`); params pass through
    untouched, and so do integer state arrays (an adapted model's dropout key, the same everywhere).
    """
    average = lambda x: lax.pmean(x, AXIS) if jnp.issubdtype(x.dtype, jnp.inexact) else x  # noqa: E731
    return {"params": variables["params"], "state": jax.tree.map(average, variables["state"])}


def _example() -> jax.Array:
    return jax.numpy.zeros((1, 1, 28, 28), jax.numpy.float32)
