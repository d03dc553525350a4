"""The run keeper: where a training run is, its guards after every call, and its checkpoints."""

import logging
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jdp.errors import Arg, ConfigError
from jdp.parallel import tally
from jdp.parallel.tally import Tally
from jdp.runtime.faults import JobWatch
from jdp.training.checkpoint import Checkpoints, path_for, restore_latest, save
from jdp.training.resume import check_resumable, check_same_state
from jdp.types import PyTree

log = logging.getLogger(__name__)


class Keeper:
    """Where a training run is, its guards after every call, and the checkpoints saved of it.

    `train` reports each compiled call (`after_call`) and each finished epoch (`end_epoch`). The
    position (step, epoch, batches of it done) and each device's running loss of the epoch are what a
    resumed run needs to continue exactly: the losses are summed on the devices (`jdp.parallel.tally`)
    and saved per device, so a resumed run sums them in the same order as an uninterrupted one.

    Checkpoints are saved every `every` steps (at the first call boundary at or after each multiple)
    and after the last epoch; without `every`, after every epoch. With several processes, a
    checkpoint is written only once every process reached it with its guards passed (`job.all_reached`),
    and only process 0 writes it.

    Args:
      checkpoints: where and how often to save (`jdp.Checkpoints`), or None to save nothing.
      described: `describe_run` of this run (stored with each checkpoint), or None without checkpoints.
      steps_per_epoch: batches per epoch.
      watch: the guards to run after every call (see `jdp.training.guards.Watch`).
      host_copy: (params, opt_state) on the devices -> their host forms (e.g. `jdp.unreplicate` and
        `jdp.OptState.to_host`).
      data_key: the key data of the run's data-order PRNG key (saved with every checkpoint).
      job: the multi-process job's watch (`jdp.runtime.faults.JobWatch`), told of every step and checkpoint.
    """

    def __init__(self, checkpoints: Checkpoints | None, *, described: dict[str, Any] | None, steps_per_epoch: int,
                 watch: Any, host_copy: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]], data_key: np.ndarray,
                 job: JobWatch) -> None:
        self.directory = None if checkpoints is None else checkpoints.checkpoint_dir
        self.every = None if checkpoints is None else checkpoints.checkpoint_every
        self.described, self.steps_per_epoch, self.watch, self.data_key = described, steps_per_epoch, watch, data_key
        self.job = job
        self._host_copy = host_copy
        self.step, self.epoch, self.batches_done = 0, 1, 0
        self.history: list[dict[str, Any]] = []
        self._resumed_loss: list[float] | float = 0.0  # the epoch's loss so far when resumed: per device, or a sum
        self._start: Tally | None = None  # the host form the epoch started with (`start_epoch`)
        self._tally: Tally | None = None  # the newest, on the devices
        self._saved_at = 0

    def resume(self, target: PyTree, epochs: int) -> PyTree:
        """Restores the newest intact checkpoint into `target`'s structure, or returns `target` if none.

        Raises:
          ConfigError: if the checkpoint belongs to another run (see `check_resumable`) or ends
            after `epochs`.
          DataError: if no checkpoint is intact.
        """
        found = restore_latest(self.directory, target, check=lambda info: check_same_state(info["run"], self.described))
        if found is None:
            log.info("no checkpoint in %s yet: starting at step 0", self.directory)
            return target
        notes = check_resumable(found.info["run"], self.described)
        position = found.info["position"]
        self.step, self.epoch, self.batches_done = position["step"], position["epoch"], position["batches_done"]
        self._resumed_loss, self.history = position.get("loss_rows", position["loss_sum"]), found.info["history"]
        self._saved_at, self.watch.last_good, self.data_key = self.step, found.path, found.arrays["data_key"]
        self.job.step, self.job.checkpoint = self.step, str(found.path)
        if epochs < self.epoch - (self.batches_done == 0):
            raise ConfigError(
                Arg("epochs", epochs), f" ends before {found.path} (step {self.step}, epoch {self.epoch}): pass ",
                Arg("epochs", self.epoch - (self.batches_done == 0)), " or more."
            )
        for note in notes:
            log.info(note)
        log.info("resuming from %s (step %d, epoch %d, %d of %d batches done)",
                 found.path, self.step, self.epoch, self.batches_done, self.steps_per_epoch)
        return found.arrays

    def start_epoch(self, device_count: int, leaves: int) -> Tally:
        """The host form of the tally to start this epoch (or the rest of a resumed one) with."""
        loss = self._resumed_loss
        if not isinstance(loss, list) or len(loss) != device_count:  # saved by an older jdp, or on another device count
            loss = [float(np.sum(loss, dtype=np.float32))] + [0.0] * (device_count - 1)
        self._resumed_loss, self._tally = 0.0, None
        self._start = tally.start(self.step, loss, leaves)
        return self._start

    def after_call(self, steps: int, carry: tuple[PyTree, PyTree, Tally]) -> None:
        """Counts a call of `steps` steps, runs the guards, and saves if a checkpoint is due mid-epoch."""
        params, opt_state, self._tally = carry
        self.step, self.batches_done = self.step + steps, self.batches_done + steps
        self.watch.after_call(self.step - steps + 1, self.step, params, opt_state, self._tally)
        self.job.beat(self.step)
        if self.every is not None and self.batches_done < self.steps_per_epoch and self._due():
            self._save((params, opt_state))

    def device_losses(self) -> np.ndarray:
        """Each device's summed loss of the current epoch's steps so far (waits for them; a collective with
        several processes)."""
        return self._start.loss if self._tally is None else tally.losses_of_all(self._tally)

    def epoch_loss(self) -> np.float32:
        """The summed loss of the current epoch's steps so far (waits for them)."""
        return np.sum(self.device_losses(), dtype=np.float32)

    def end_epoch(self, state: tuple[PyTree, PyTree], record: dict[str, Any], last: bool) -> None:
        """Records a finished epoch; saves if a checkpoint is due or it was the `last`."""
        self.watch.flush(state[0])
        self.history.append(record)
        self.epoch, self.batches_done = self.epoch + 1, 0
        self._tally, self._start = None, self._start._replace(loss=np.zeros_like(self._start.loss))
        self.job.beat(self.step)
        if self.every is None or last or self._due():
            self._save(state)

    def _due(self) -> bool:
        return self.step // self.every > self._saved_at // self.every

    def _save(self, state: tuple[PyTree, PyTree]) -> None:
        if self.directory is None:
            return
        params, opt_state = state
        self.watch.flush(params)  # never save a non-finite value
        params, opt_state = self._host_copy(params, opt_state)
        arrays = {"params": params, "opt_state": opt_state, "data_key": self.data_key}
        losses = self.device_losses()
        info = {
            "position": {"step": self.step, "epoch": self.epoch, "batches_done": self.batches_done,
                         "loss_sum": float(np.sum(losses, dtype=np.float32)), "loss_rows": [float(x) for x in losses]},
            "history": self.history,
            "run": self.described,
        }
        self.job.all_reached(self.step)
        if jax.process_index() == 0:
            save(self.directory, self.step, arrays, info)
        self.watch.last_good, self._saved_at = path_for(self.directory, self.step), self.step
        self.job.checkpoint = str(self.watch.last_good)
