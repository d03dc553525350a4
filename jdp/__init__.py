"""jdp: data-parallel training from scratch in functional JAX.

The public API. The lesson's names (`replicate`, `split_batch`, a step that allreduces the
gradients) and the extension points: your own `Model`, your own `Allreduce` (checked by
`jdp.testing.check_allreduce`), your own `Sync`, through the same training loop, guards and checkpoints.
Everything not listed in `__all__` is an implementation detail.
"""

from importlib.metadata import PackageNotFoundError, version

from jdp.data import Dataset, Split
from jdp.data import load as load_dataset
from jdp.data import synthetic as synthetic_dataset
from jdp.errors import Arg, ConfigError, DataError, DeviceError, JdpError, ProcessLostError, TrainingError
from jdp.models import Model, summed_cross_entropy
from jdp.models import get as get_model
from jdp.models import names as model_names
from jdp.models import register as register_model
from jdp.models.adapters import from_equinox, from_linen, from_nnx
from jdp.parallel.allreduce import get as get_allreduce
from jdp.parallel.allreduce import names as allreduce_names
from jdp.parallel.allreduce import register as register_allreduce
from jdp.parallel.buckets import fused
from jdp.parallel.compress import low_precision, powersgd
from jdp.parallel.cost import Cost, Terms
from jdp.parallel.evaluate import make_evaluator
from jdp.parallel.layout import map_over_devices, replicate, split_batch, unreplicate
from jdp.parallel.opt_state import LocalOptimizer, OptState, ReplicatedOptimizer, ShardedOptimizer
from jdp.parallel.opt_state import init_sharded as init_sharded_opt_state
from jdp.parallel.step import make_local_step, make_sharded_step, make_train_step
from jdp.parallel.strategy import Allreduce
from jdp.parallel.streaming import StreamingDiLoCo, streaming_diloco
from jdp.parallel.sync import DiLoCo, Sync
from jdp.parallel.sync import get as get_sync
from jdp.parallel.sync import names as sync_names
from jdp.parallel.sync import register as register_sync
from jdp.runtime.devices import AXIS, select_devices, simulate_cpu_devices
from jdp.runtime.devices import describe as describe_devices
from jdp.runtime.xla_flags import enable as enable_xla_flags
from jdp.training.checkpoint import Checkpoints
from jdp.training.config import TrainConfig
from jdp.training.guards import Guards
from jdp.training.hooks import EpochRecord, Hooks
from jdp.training.loop import train
from jdp.training.optimizers import make as make_optimizer

try:
    __version__ = version("jdp")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0.0.0+unknown"

# Imported on first use (PEP 562), so that `import jdp` loads neither matplotlib nor the test helpers.
_LAZY = ("plot", "testing")


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f"jdp.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'jdp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})

__all__ = [
    "AXIS",
    "Allreduce",
    "Arg",
    "Checkpoints",
    "ConfigError",
    "Cost",
    "DataError",
    "Dataset",
    "DiLoCo",
    "DeviceError",
    "EpochRecord",
    "Guards",
    "Hooks",
    "JdpError",
    "LocalOptimizer",
    "Model",
    "OptState",
    "StreamingDiLoCo",
    "ProcessLostError",
    "ReplicatedOptimizer",
    "ShardedOptimizer",
    "Split",
    "Sync",
    "TrainConfig",
    "Terms",
    "TrainingError",
    "__version__",
    "allreduce_names",
    "describe_devices",
    "enable_xla_flags",
    "from_equinox",
    "from_linen",
    "from_nnx",
    "fused",
    "get_allreduce",
    "get_model",
    "get_sync",
    "init_sharded_opt_state",
    "load_dataset",
    "low_precision",
    "make_evaluator",
    "make_local_step",
    "make_optimizer",
    "make_sharded_step",
    "make_train_step",
    "map_over_devices",
    "model_names",
    "plot",
    "powersgd",
    "register_allreduce",
    "register_model",
    "register_sync",
    "replicate",
    "select_devices",
    "simulate_cpu_devices",
    "split_batch",
    "streaming_diloco",
    "sync_names",
    "synthetic_dataset",
    "testing",
    "summed_cross_entropy",
    "train",
    "unreplicate",
]
