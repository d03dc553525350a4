"""`TrainConfig`: every setting of a training run, validated once, when it is made."""

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

import jax

from jdp import models
from jdp.errors import Arg, ConfigError, check_positive, moved_arguments
from jdp.models import Model, precision
from jdp.parallel import allreduce as allreduce_lib
from jdp.parallel import compress as compress_lib
from jdp.parallel import sync as sync_lib
from jdp.parallel.evaluate import EVAL_ON
from jdp.parallel.feeders import AUTO
from jdp.parallel.layout import check_backend, check_divisible
from jdp.parallel.step import check_strategy
from jdp.parallel.strategy import Allreduce
from jdp.training import formulation, optimizers, resume

if TYPE_CHECKING:
    import optax


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines a training run (with the data and devices).

    Made once and checked then: a bad field raises `ConfigError` naming it (`batch_size`, ...),
    which the CLI reports as its flag (`--batch-size`). `dataclasses.replace` checks again.
    """

    # the run: the lesson's hyper-parameters
    batch_size: int = 256
    lr: float = 0.2
    epochs: int = 10
    seed: int = 0
    warmup_steps: int = 0  # ramp the lr linearly from 0 over this many steps (Goyal et al. 2017)
    eval_on: str = "all"  # "all": split evaluation over the devices; "device0": the lesson's way
    # the model: which, how its step is written, in what precision
    model: str | Model = "lenet"  # a registered name (jdp.model_names()) or your own Model
    formulation: str = "fast"  # model "lenet": a key of jdp.models.lenet_fast.FORMULATIONS, or "auto" (jdp.training.formulation)
    batchnorm: str | None = None  # for models with BatchNorm: "sync" (default) or "per-replica" (jdp.models)
    precision: str = "float32"  # "bf16": bfloat16 forward/backward, float32 params, loss, gradients (jdp.models.precision)
    # the optimizer: which, on how many micro-batches, and where its state lives
    optimizer: "str | optax.GradientTransformation" = "sgd"  # "sgd" (the lesson's), "momentum", "adamw", or your own optax optimizer
    momentum: float | None = None  # for "momentum": the trace's decay; None: 0.9
    weight_decay: float | None = None  # sgd/momentum: L2 (None: none); adamw: decoupled (None: 1e-4)
    accumulate: int = 1  # micro-batches per device per step, gradients summed before the one allreduce
    shard_optimizer: bool = False  # ZeRO: optimizer state and reduced gradients split over the devices
    # communication: values that carry their own settings (a name is looked up in its registry)
    allreduce: str | Allreduce = "psum"  # a registered name (jdp.allreduce_names()) or a strategy value, e.g. jdp.get_allreduce("ring", fuse=True)
    sync: str | sync_lib.Sync = "every-step"  # a registered name (jdp.sync_names()) or a sync value, e.g. jdp.DiLoCo(every=16)
    # execution: how the step is mapped over the devices and grouped into calls
    backend: str = "pmap"  # "pmap" or "shard_map" (jdp.parallel.layout)
    steps_per_call: int | str = "auto"  # train steps per compiled call; "auto": from the measured step time
    model_impl: dataclasses.InitVar[str | None] = None  # the earlier name of `formulation`, still accepted

    def __post_init__(self, model_impl: str | None) -> None:
        if model_impl is not None:
            if self.formulation not in ("fast", model_impl):
                raise ConfigError(Arg("model_impl", model_impl), " is the earlier name of ", Arg("formulation"),
                                  f", which is `{self.formulation}`; pass ", Arg("formulation"), " alone.")
            object.__setattr__(self, "formulation", model_impl)
        formulation.check(self.formulation)
        for name in ("batch_size", "epochs", "accumulate"):
            check_positive(name, getattr(self, name))
        if self.steps_per_call != AUTO:
            if not isinstance(self.steps_per_call, int):
                raise ConfigError(Arg("steps_per_call"), f" must be a positive integer or `{AUTO}`, "
                                  f"got `{self.steps_per_call}`.")
            check_positive("steps_per_call", self.steps_per_call)
        if self.warmup_steps < 0:
            raise ConfigError(Arg("warmup_steps"), f" must be >= 0, got {self.warmup_steps}.")
        if not self.lr > 0:
            raise ConfigError(Arg("lr"), f" must be positive, got {self.lr}.")
        if self.eval_on not in EVAL_ON:
            raise ConfigError(Arg("eval_on"), f" must be one of {', '.join(EVAL_ON)}, got `{self.eval_on}`.")
        check_backend(self.backend)
        object.__setattr__(self, "_components", _build(self))  # the only time they are built
        model, sync = self.build_model(), self.build_sync()
        if model.per_replica_state and self.backend != "pmap":
            raise ConfigError(
                Arg("batchnorm", "per-replica"), " keeps different statistics on each device, which ",
                Arg("backend", "shard_map"), " cannot hold in its replicated `P()` layout. Use ",
                Arg("backend", "pmap"), " or ", Arg("batchnorm", "sync"), "."
            )
        check_strategy(self.strategy(), self.backend, self.shard_optimizer)
        if sync.local:
            refused = {"shard_optimizer": ((False,), "keeps one slice of identical params per device"),
                       "steps_per_call": ((1, AUTO), "runs several steps in one call, with no sync between them")}
            for name, (fine, why) in refused.items():
                if getattr(self, name) not in fine:
                    raise ConfigError(Arg(name, getattr(self, name)), f" {why}; ", Arg("sync", sync.name),
                                      " keeps different params on each device between syncs. Drop ", Arg(name),
                                      " or use ", Arg("sync", "every-step"), ".")
            sync.reducer(self.strategy())  # refuses a strategy this sync cannot sum with
            if model.stateful:
                raise ConfigError(Arg("sync", sync.name), " averages params only; ", Arg("model", _name(self.model)),
                                  " carries state besides them (BatchNorm statistics, an adapted model's dropout key), "
                                  "which a local mode does not sync yet. Use ", Arg("sync", "every-step"),
                                  ", or a model without state.")

    def build_optimizer(self) -> "optax.GradientTransformation":
        """The optax optimizer of `optimizer`, `momentum`, `weight_decay`, on the lr schedule; or `optimizer`
        itself, an optax optimizer of the caller's (which carries its own learning rate and schedule)."""
        return self._components.optimizer

    def build_model(self) -> Model:
        """`model` itself, or the registered model of that name built with `formulation` and `batchnorm`;
        computing in `precision`. `formulation="auto"` builds `fast` here: `jdp.train` settles it first
        (`jdp.training.formulation.settle`)."""
        return self._components.model

    def build_sync(self) -> sync_lib.Sync:
        """When the replicas meet and what they make of it: `sync`, or the registered sync of that name."""
        return self._components.sync

    def strategy(self) -> Allreduce:
        """The allreduce strategy: `allreduce`, or the registered strategy of that name."""
        return self._components.strategy

    def check_fits(self, train_images: int, device_count: int) -> None:
        """Raises ConfigError if the batch cannot be split over the devices or exceeds the train set."""
        check_divisible(self.batch_size, device_count)
        if self.batch_size % (device_count * self.accumulate):
            raise ConfigError(
                Arg("batch_size", self.batch_size), f" does not split into {device_count} devices × ",
                Arg("accumulate", self.accumulate),
                f" equal micro-batches; use a multiple of {device_count * self.accumulate}."
            )
        if self.batch_size > train_images:
            raise ConfigError(Arg("batch_size", self.batch_size), f" exceeds the {train_images} training images.")

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON values: a `Model` object is recorded by its name, the strategy by its name (which
        spells its wrappers: `ring+bfloat16-wire+fused`), the sync by its name, H (`sync_every`) and the settings
        of the registered syncs (None where it has none), an optax optimizer of the caller's as `optimizers.OWN`."""
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        return {**values, "model": _name(self.model), "allreduce": self.strategy().name,
                "optimizer": self.optimizer if isinstance(self.optimizer, str) else optimizers.OWN,
                **sync_lib.recorded(self.build_sync())}

    def __getattr__(self, name: str) -> Any:
        if name == "opt_state":  # moved after 0.1.0; see docs/api.md
            raise AttributeError("`TrainConfig.opt_state(params, k)` is now `jdp.training.build.opt_state_of(config, "
                                 "params, k)`: the state's layout is decided where the run is built.")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


_STRATEGY_VALUE = ("the strategy value carries it: `allreduce=jdp.get_allreduce(NAME, fuse=..., bucket_mb=..., "
                   "compress=..., rank=...)`, or its name with wrappers, e.g. `allreduce=\"ring+bfloat16+fused\"`")
_SYNC_VALUE = "the sync value carries it: `sync=jdp.get_sync(NAME, every=H, ...)`, e.g. `jdp.DiLoCo(every=16, outer_lr=0.7)`"
# `TrainConfig`'s sync fields before the sync value carried them (a run still records them: `sync.recorded`).
SYNC_FIELDS = ("sync_every", "outer_optimizer", "outer_lr", "outer_momentum", "fragments", "sync_delay", "outer_dtype",
               "mixing", "error_feedback")
TrainConfig.__init__ = moved_arguments({  # type: ignore[method-assign]  # moved after 0.1.0
    **dict.fromkeys(resume.STRATEGY_SETTINGS, _STRATEGY_VALUE), **dict.fromkeys(SYNC_FIELDS, _SYNC_VALUE)})(
    TrainConfig.__init__)


class Components(NamedTuple):
    """A config's components, built once when the config is made (`TrainConfig.build_model`, ...)."""

    model: Model
    optimizer: "optax.GradientTransformation"
    strategy: Allreduce
    sync: sync_lib.Sync


def _build(config: TrainConfig) -> Components:
    """Builds `config`'s components from their settings (names are looked up in their registries)."""
    if isinstance(config.model, Model) and config.batchnorm is not None:
        raise ConfigError(Arg("batchnorm"), " selects a built-in model's BatchNorm; your own `Model` defines its own.")
    impl = formulation.DEFAULT if config.formulation == formulation.AUTO else config.formulation
    model = precision.mixed(models.get(config.model, impl=impl, batchnorm=config.batchnorm), config.precision)
    if isinstance(config.optimizer, str):
        optimizer = optimizers.make(config.optimizer, learning_rate(config), momentum=config.momentum,
                                    weight_decay=config.weight_decay)
    else:
        optimizer = optimizers.check_own(config.optimizer, momentum=config.momentum,
                                         weight_decay=config.weight_decay, warmup_steps=config.warmup_steps)
    return Components(model, optimizer, allreduce_lib.get(config.allreduce), sync_lib.get(config.sync))


def learning_rate(config: TrainConfig) -> "float | optax.Schedule":
    """The constant lr, or a linear warmup from 0 to it over `warmup_steps` steps, then constant."""
    if config.warmup_steps == 0:
        return config.lr
    import optax  # here, not at the top: `import jdp` stays light

    return optax.linear_schedule(0.0, config.lr, config.warmup_steps)


def payload_bytes(config: TrainConfig) -> int:
    """Bytes each device hands to the allreduce each time the model is summed (every step, or every sync of a
    local mode): the gradients (or params, or their change), or what a compressing strategy sends instead; for
    a sync sending part of the model in a narrower dtype (Streaming DiLoCo), that part, on average."""
    model = config.build_model()
    grads = jax.eval_shape(lambda: models.trainable(model, model.init(jax.random.key(0))))
    return round(compress_lib.payload_bytes(grads, config.strategy()) * config.build_sync().payload_fraction)


def _name(choice: str | Model | Allreduce | sync_lib.Sync) -> str:
    return choice if isinstance(choice, str) else choice.name


def __getattr__(name: str) -> Any:
    if name == "checkpoint_target":  # moved after 0.1.0; see docs/api.md
        raise AttributeError("`jdp.training.config.checkpoint_target` is now `jdp.training.build.checkpoint_target`, "
                             "beside the state's layout.")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
