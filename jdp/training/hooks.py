"""What a caller sees of a run as it goes: each epoch's record, and the hooks and instruments it passes to `train`.

Side effects (printing, progress bars, files) are the caller's; `train` calls the hooks.
"""

import dataclasses
from collections.abc import Callable, Iterable

import jax
import numpy as np

from jdp.errors import Arg, ConfigError
from jdp.parallel.feeders import AUTO
from jdp.training.config import TrainConfig
from jdp.training.keeper import Keeper
from jdp.training.profile import Profiler, check_window
from jdp.training.stragglers import Stopwatch


@dataclasses.dataclass(frozen=True)
class EpochRecord:
    epoch: int
    train_loss: float  # mean per-image loss over the epoch's steps
    test_acc: float
    seconds: float  # wall time of the epoch's training loop only
    syncs: int | None = None  # allreduces of the model since the run began: every step, or a local mode's syncs
    process_step_s: list[float] | None = None  # with several processes: each one's seconds per step, in process order
    steps_per_call: int = 1  # the epoch's train steps per compiled call (`steps_per_call="auto"` chooses it)


@dataclasses.dataclass(frozen=True)
class Hooks:
    """What a caller sees of a run as it goes, and the instruments it runs with; side effects are theirs.

    Attributes:
      on_epoch: called with each epoch's record as soon as it is known.
      on_steps: called before `on_epoch` with the number (from 1) of the epoch's first step run here
        and each such step's mean per-image loss (e.g. `jdp.training.tensorboard.TensorBoardWriter.steps`).
        With several processes, pass it on every process: the losses are gathered from all of them.
      progress: wraps each epoch's batch iterator (e.g. a progress bar); gets the step count.
      profile: traces its steps and measures their breakdown (`profile.breakdown` after the run).
      stopwatch: delays the straggler's process before its steps and times every step and sync to
        completion (`stopwatch.report()` after the run; see `jdp.training.stragglers`).
    """

    on_epoch: Callable[[EpochRecord], None] = lambda record: None
    on_steps: Callable[[int, np.ndarray], None] | None = None
    progress: Callable[[Iterable, int], Iterable] = lambda batches, total: batches
    profile: Profiler | None = None
    stopwatch: Stopwatch | None = None

    def check(self, config: TrainConfig, steps: int) -> None:
        """Raises ConfigError for a profile window beyond the run's `steps`, or a stopwatch it cannot run with."""
        if self.profile is not None:
            check_window(self.profile.first, self.profile.last, steps)
        if self.stopwatch is not None:
            self.stopwatch.straggler.check(jax.process_count())
            if config.steps_per_call not in (1, AUTO):
                raise ConfigError(Arg("steps_per_call", config.steps_per_call), " runs several steps in one call; a "
                                  "simulated straggler delays and times each step: use ", Arg("steps_per_call", 1), ".")

    def after_call(self, keeper: Keeper) -> Callable[[int, tuple], None]:
        """What runs after each compiled call: the keeper's guards and checkpoints, then the profile's marks."""
        if self.profile is None:
            return keeper.after_call

        def after_call(steps, carry):
            keeper.after_call(steps, carry)
            self.profile.at(keeper.step, carry[:2])

        return after_call
