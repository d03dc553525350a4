"""The optimizers `jdp train --optimizer` builds: the lesson's SGD, SGD with momentum, AdamW (optax).

Each is applied to the mean gradient of the full batch (the step divides the summed gradient by
the global batch size), so the learning rates mean what they mean for one device on the whole batch.
All three are elementwise (every element's update depends only on that element's gradient, param and
state), which is what lets `shard_optimizer=True` update each device's slice of the parameters on its own.
"""

from typing import TYPE_CHECKING

from jdp.errors import Arg, ConfigError

if TYPE_CHECKING:
    import optax

OPTIMIZERS = ("sgd", "momentum", "adamw")
DEFAULT_MOMENTUM = 0.9  # `optimizer="momentum"` without `momentum`
ADAMW_WEIGHT_DECAY = 1e-4  # optax.adamw's own default, for `optimizer="adamw"` without `weight_decay`


def make(
    name: str,
    learning_rate: "float | optax.Schedule",
    *,
    momentum: float | None = None,
    weight_decay: float | None = None,
) -> "optax.GradientTransformation":
    """The optax optimizer `name` ("sgd", "momentum" or "adamw").

    Args:
      name: "sgd" (the lesson's: `optax.sgd`, no state), "momentum" (`optax.sgd` with a momentum
        trace, Polyak 1964) or "adamw" (`optax.adamw`, Loshchilov & Hutter 2019).
      learning_rate: a constant or an optax schedule (e.g. the warmup of `warmup_steps`).
      momentum: the trace's decay, for "momentum" only; None means 0.9.
      weight_decay: "sgd"/"momentum": an L2 term wd·p added to the gradient (None or 0: none);
        "adamw": the decoupled decay (None: optax's default, 1e-4).

    Raises:
      ConfigError: for an unknown name, `momentum` given to another optimizer, or a value out of range.
    """
    if name not in OPTIMIZERS:
        raise ConfigError("Unknown ", Arg("optimizer", name), f"; choose one of: {', '.join(OPTIMIZERS)}.")
    if momentum is not None and name != "momentum":
        raise ConfigError(Arg("momentum"), " applies to ", Arg("optimizer", "momentum"),
                          f", not `{name}`; drop it or pass ", Arg("optimizer", "momentum"), ".")
    if momentum is not None and not 0 <= momentum < 1:
        raise ConfigError(Arg("momentum"), f" must be in [0, 1), got {momentum}.")
    if weight_decay is not None and not weight_decay >= 0:
        raise ConfigError(Arg("weight_decay"), f" must be >= 0, got {weight_decay}.")
    import optax  # here, not at the top: `import optax` costs a tenth of `import jax`

    if name == "adamw":
        return optax.adamw(learning_rate, weight_decay=ADAMW_WEIGHT_DECAY if weight_decay is None else weight_decay)
    sgd = optax.sgd(learning_rate, momentum=(DEFAULT_MOMENTUM if momentum is None else momentum)
                    if name == "momentum" else None)
    if not weight_decay:
        return sgd
    return optax.chain(optax.add_decayed_weights(weight_decay), sgd)


OWN = "own"  # how a run's record names an optax optimizer passed as `optimizer` (it has no name)


def check_own(optimizer: object, *, momentum: float | None, weight_decay: float | None,
              warmup_steps: int) -> "optax.GradientTransformation":
    """Returns `optimizer`, a caller's optax optimizer, if it is one and no setting of the built-in ones is given.

    Raises:
      ConfigError: if it has no `init` and `update`, or with `momentum`, `weight_decay` or `warmup_steps`
        (they configure the built-in optimizers; an optax optimizer brings its own, and its own lr).
    """
    if isinstance(optimizer, str) or not all(callable(getattr(optimizer, f, None)) for f in ("init", "update")):
        raise ConfigError(Arg("optimizer"), f" takes a name ({', '.join(OPTIMIZERS)}) or an optax optimizer "
                          f"(with `init` and `update`), got {type(optimizer).__name__}.")
    given = {"momentum": momentum, "weight_decay": weight_decay, "warmup_steps": warmup_steps or None}
    for name, value in given.items():
        if value is not None:
            raise ConfigError(Arg(name, value), " configures a built-in optimizer; your optax optimizer brings its "
                              "own (e.g. `optax.chain(optax.add_decayed_weights(wd), optax.sgd(schedule, momentum))`)"
                              ". Drop ", Arg(name), ".")
    return optimizer

