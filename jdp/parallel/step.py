"""The data-parallel train steps, each built once from (loss, optimizer, strategy, devices, backend).

Per device: forward/backward on its shard of the batch (loss summed over the shard), allreduce
the gradients (sum over devices), divide by the FULL batch size, one optax update. Every device
applies the same update to the same params, so the replicas stay identical. Three builders share
that per-device work (`_OnDevice`) and differ in what follows the gradients:

* `make_train_step`: the strategy sums them, every device applies the whole update;
* `make_sharded_step` (ZeRO, Rajbhandari et al. 2020): the strategy's halves, the update between
  them on each device's 1/k slice;
* `make_local_step` (a local sync mode, `jdp.parallel.sync`): no sum; each device steps alone, on
  its own params, until they meet.

`jdp.parallel.layout.map_over_devices` maps the per-device program with either backend; an
"outside" strategy runs between mapped calls.
"""

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

from jdp.errors import Arg, ConfigError, check_positive, moved_arguments
from jdp.models import Model
from jdp.parallel import allreduce as allreduce_lib
from jdp.parallel.buckets import plan
from jdp.parallel.layout import Backend, check_backend, map_over_devices
from jdp.parallel.opt_state import LocalOptimizer, OptState, ReplicatedOptimizer, ShardedOptimizer
from jdp.parallel.strategy import Allreduce
from jdp.runtime.devices import AXIS
from jdp.types import PyTree

if TYPE_CHECKING:
    import optax

LossFn = Callable[[PyTree, jax.Array, jax.Array], jax.Array]
# (params, opt_state, images, labels) -> (params, opt_state, per-device summed loss)
TrainStep = Callable[[PyTree, PyTree, jax.Array, jax.Array], tuple[PyTree, PyTree, jax.Array]]
Segment = Callable[[str, Callable], Callable]

_moved_arguments = moved_arguments({
    "stateful": "pass the `jdp.Model` itself as the loss: its `stateful` says how its loss is called",
    "shard_optimizer": "`jdp.make_sharded_step` builds the sharded (ZeRO) step",
    "sync": "`jdp.make_local_step(loss, opt, devices)`, `opt` a local `jdp.OptState`, builds a local mode's step",
})


@dataclasses.dataclass(frozen=True)
class _OnDevice:
    """What each device computes in every step: its shard's gradient sum, then one optax update.

    A stateful model's variables are {"params", "state"}: only "params" is differentiated and
    updated, "state" is replaced by the loss's new state.
    """

    loss_fn: Callable
    stateful: bool
    optimizer: "optax.GradientTransformation"
    accumulate: int

    @classmethod
    def of(cls, loss: "LossFn | Model", optimizer: "optax.GradientTransformation", accumulate: int) -> "_OnDevice":
        check_positive("accumulate", accumulate)
        if isinstance(loss, Model):
            return cls(loss.loss, loss.stateful, optimizer, accumulate)
        return cls(loss, False, optimizer, accumulate)

    def params_of(self, variables: PyTree) -> PyTree:
        return variables["params"] if self.stateful else variables

    def with_params(self, variables: PyTree, params: PyTree, state: PyTree) -> PyTree:
        return {"params": params, "state": state} if self.stateful else params

    def _micro_grads(self, variables, images, labels):
        if not self.stateful:
            return *jax.value_and_grad(self.loss_fn)(variables, images, labels), None
        (loss, state), grads = jax.value_and_grad(self.loss_fn, has_aux=True)(
            variables["params"], variables["state"], images, labels)
        return loss, grads, state

    def grads(self, variables: PyTree, images: jax.Array, labels: jax.Array) -> tuple[jax.Array, PyTree, PyTree]:
        """(loss, gradient sum over this device's shard, new model state or None)."""
        if self.accumulate > 1:
            return accumulate_grads(self._micro_grads, variables, images, labels, self.accumulate,
                                    stateful=self.stateful)
        return self._micro_grads(variables, images, labels)

    def apply(self, params: PyTree, optimizer_state: PyTree, grad_sums: PyTree, rows: int) -> tuple[PyTree, PyTree]:
        """One update with the mean gradient: `grad_sums` summed over `rows` images."""
        import optax  # here, not at the top: `import jdp` stays light

        grads = jax.tree.map(lambda g: g / rows, grad_sums)
        updates, optimizer_state = self.optimizer.update(grads, optimizer_state, params)
        return optax.apply_updates(params, updates), optimizer_state

    def update(self, variables: PyTree, optimizer_state: PyTree, grad_sums: PyTree, state: PyTree,
               rows: int) -> tuple[PyTree, PyTree]:
        """`apply` on the variables' params; the model's new state beside them."""
        params, optimizer_state = self.apply(self.params_of(variables), optimizer_state, grad_sums, rows)
        return self.with_params(variables, params, state), optimizer_state


@_moved_arguments
def make_train_step(loss: "LossFn | Model", optimizer: "optax.GradientTransformation", allreduce: Allreduce | str,
                    devices: Sequence[jax.Device], backend: Backend = "pmap", *, accumulate: int = 1,
                    segment: Segment = lambda name, fn: fn) -> TrainStep:
    """Builds the data-parallel train step, mapped once over `devices` by `backend`.

    Both backends run the same per-device program (the strategy is the one and only sum of the
    gradients); they differ in how arrays are laid out (see `jdp.parallel.layout`):

    * ``pmap``: params/opt_state (k, ...) with a leading device axis, batch (k, B/k, ...).
    * ``shard_map``: params/opt_state replicated with `P()`, batch (B, ...) sharded with `P('data')`.

    With either, `devices` may span several processes.

    Args:
      loss: (params, images, labels) -> loss summed over the images; or a `jdp.Model`, whose loss a
        stateful model calls with its state: the step's params are then {"params", "state"}.
      optimizer: applied to the mean gradient of the full batch.
      allreduce: how the per-device gradient sums are added up: a strategy or a registered name.
      devices: the devices the step runs on (the mesh, in order).
      backend: "pmap" or "shard_map".
      accumulate: N micro-batches per device: each device's shard is cut into N equal parts whose
        gradients are summed one after another (`accumulate_grads`) before the one allreduce.
      segment: `segment(kind, fn) -> fn` wraps each call of an "outside" strategy's step, kind
        "compute" or "communication" (e.g. to time them, `jdp.training.profile.Profiler.segment`).

    The optimizer state is that of `jdp.parallel.opt_state.OptState`: replicated, with a stateful
    strategy's per-device state beside the optimizer's (`pmap` only).

    Returns:
      step(params, opt_state, images, labels) -> (params, opt_state, losses): inputs placed with
      `jdp.replicate` / `jdp.split_batch` for `backend`, losses the per-device sums, shape (k,).
      params and opt_state are donated: do not reuse the arrays passed in.

    Raises:
      ConfigError: for an unknown backend, a strategy this step cannot run (see `check_strategy`), or
        a shard that does not split into `accumulate` equal parts (when traced).
    """
    check_backend(backend)
    strategy = allreduce_lib.get(allreduce)
    check_strategy(strategy, backend)
    check_reach(strategy, devices)
    opt = OptState(ReplicatedOptimizer(optimizer), len(devices), strategy)
    return _summed_step(_OnDevice.of(loss, optimizer, accumulate), opt, devices, backend, segment)


def _summed_step(device: _OnDevice, opt: OptState, devices: Sequence[jax.Device], backend: Backend,
                 segment: Segment) -> TrainStep:
    """`make_train_step`'s step, for `opt` (replicated, its strategy checked)."""
    strategy, k = opt.strategy, len(devices)
    if strategy.inside:

        def local_step(variables, opt_state, images, labels):
            optimizer_state, kept = opt.optimizer_and_strategy(opt_state)
            loss, grads, state = device.grads(variables, images, labels)
            grads, kept = strategy.reduce(grads, kept, AXIS)  # the one reduction over the devices
            variables, optimizer_state = device.update(variables, optimizer_state, grads, state, images.shape[0] * k)
            return variables, opt.join(optimizer_state, kept), loss

        return map_over_devices(local_step, devices, backend, ("replicated", opt.kind, "batch", "batch"),
                                ("replicated", opt.kind, "per_device"), donate=(0, 1))

    p_grads = segment("compute", map_over_devices(device.grads, devices, backend, ("replicated", "batch", "batch"),
                                                  ("per_device", "per_device", "replicated")))
    p_update = segment("compute", map_over_devices(
        lambda v, o, g, s, x: device.update(v, o, g, s, x.shape[0] * k), devices, backend,
        ("replicated", opt.optimizer_kind, "per_device", "replicated", "batch"),
        ("replicated", opt.optimizer_kind), donate=(0, 1)))
    reduce = segment("communication", strategy.reduce)

    def step(variables, opt_state, images, labels):
        optimizer_state, kept = opt.optimizer_and_strategy(opt_state)
        loss, grads, state = p_grads(variables, images, labels)  # per-device gradients leave the device step
        grads, kept = reduce(grads, kept)  # explicit transfers between devices
        variables, optimizer_state = p_update(variables, optimizer_state, grads, state, images)
        return variables, opt.join(optimizer_state, kept), loss

    return step


@_moved_arguments
def make_sharded_step(loss: "LossFn | Model", optimizer: "optax.GradientTransformation", allreduce: Allreduce | str,
                      devices: Sequence[jax.Device], backend: Backend = "pmap", *, accumulate: int = 1,
                      segment: Segment = lambda name, fn: fn) -> TrainStep:
    """`make_train_step` with the optimizer state sharded over the devices (ZeRO-2).

    The gradients are raveled into one buffer per dtype, zero-padded to k equal slices
    (`jdp.parallel.buckets.Flat`); the strategy's first half (`reduce_scatter`) gives device i the
    sum of slice i only, device i updates slice i of the params with its slice of the optimizer
    state, and the second half (`all_gather`) gathers the new slices. Elementwise optimizers only
    (SGD, momentum, AdamW); the padding's gradient, state and params stay zero. Arguments and result
    as `make_train_step`'s; `opt_state` comes from `jdp.init_sharded_opt_state`.

    Raises:
      ConfigError: as `make_train_step`, and for a strategy without halves (`check_strategy`).
    """
    check_backend(backend)
    strategy = allreduce_lib.get(allreduce)
    check_strategy(strategy, backend, shard_optimizer=True)
    check_reach(strategy, devices)
    opt = OptState(ShardedOptimizer(optimizer, None, len(devices)), len(devices), strategy)
    return _sharded_step(_OnDevice.of(loss, optimizer, accumulate), opt, devices, backend, segment)


def _sharded_step(device: _OnDevice, opt: OptState, devices: Sequence[jax.Device], backend: Backend,
                  segment: Segment) -> TrainStep:
    """`make_sharded_step`'s step, for `opt` (sharded, its strategy checked)."""
    strategy, k = opt.strategy, len(devices)

    def update_slice(variables, optimizer_state, grad_slices, local_batch):
        """Slice i of the params, updated with this device's state and summed gradient slice."""
        params = device.params_of(variables)
        return device.apply(plan(params, k).slices(params, lax.axis_index(AXIS)), optimizer_state, grad_slices,
                            local_batch * k)

    def assemble(variables, gathered, state):
        params = device.params_of(variables)
        return device.with_params(variables, plan(params, k).unflatten(gathered), state)

    if strategy.inside:

        def local_step(variables, optimizer_state, images, labels):
            loss, grads, state = device.grads(variables, images, labels)
            reduced = [strategy.reduce_scatter(b, AXIS) for b in plan(grads, k).flatten(grads)]  # my slice's sum
            mine, optimizer_state = update_slice(variables, optimizer_state, reduced, images.shape[0])
            gathered = [strategy.all_gather(m, AXIS) for m in mine]  # every slice, everywhere
            return assemble(variables, gathered, state), optimizer_state, loss

        return map_over_devices(local_step, devices, backend, ("replicated", opt.kind, "batch", "batch"),
                                ("replicated", opt.kind, "per_device"), donate=(0, 1))

    def local_buffers(variables, images, labels):
        loss, grads, state = device.grads(variables, images, labels)
        return loss, plan(grads, k).flatten(grads), state

    p_buffers = segment("compute", map_over_devices(local_buffers, devices, backend, ("replicated", "batch", "batch"),
                                                    ("per_device", "per_device", "replicated")))
    p_update = segment("compute", map_over_devices(
        lambda v, o, g, x: update_slice(v, o, g, x.shape[0]), devices, backend,
        ("replicated", opt.kind, "per_device", "batch"), ("per_device", opt.kind), donate=(1,)))
    p_assemble = segment("compute", map_over_devices(lambda v, g, s: (assemble(v, g, s),), devices, backend,
                                                     ("replicated", "per_device", "replicated"), ("replicated",),
                                                     donate=(0,)))
    reduce_scatter = segment("communication", lambda buffers: [strategy.reduce_scatter(b) for b in buffers])
    all_gather = segment("communication", lambda slices: [strategy.all_gather(m) for m in slices])

    def step(variables, optimizer_state, images, labels):
        loss, buffers, state = p_buffers(variables, images, labels)
        mine, optimizer_state = p_update(variables, optimizer_state, reduce_scatter(buffers), images)
        (variables,) = p_assemble(variables, all_gather(mine), state)
        return variables, optimizer_state, loss

    return step


def make_local_step(loss: "LossFn | Model", opt: OptState, devices: Sequence[jax.Device], backend: Backend = "pmap",
                    *, accumulate: int = 1) -> TrainStep:
    """The step of a local sync mode (`jdp.parallel.sync`): no allreduce; each device updates its own params.

    Each device applies the mean gradient of its own shard with its own optimizer state to its own
    `per_device` params; `jdp.parallel.sync.make_sync` makes them meet. `opt` is the run's optimizer
    state (`OptState(LocalOptimizer(optimizer, k), k, ...)`), which also holds what the syncs keep (the sync's own state,
    e.g. DiLoCo's global params; a stateful strategy's), untouched here. Arguments and result otherwise
    as `make_train_step`'s.

    Raises:
      ConfigError: for an `opt` that is not local (every step: use `make_train_step`), as `make_train_step`.
    """
    device = _OnDevice.of(loss, opt.optimizer, accumulate)
    check_backend(backend)
    if not isinstance(opt.placement, LocalOptimizer):
        raise ConfigError("`make_local_step` steps each device alone, which its `opt` does not keep "
                          "(`OptState(LocalOptimizer(optimizer, k), k)`); a step that sums the gradients is "
                          "`make_train_step`'s.")

    def own_step(variables, opt_state, images, labels):
        optimizer_state, kept = opt.optimizer_and_strategy(opt_state)
        loss, grads, state = device.grads(variables, images, labels)
        variables, optimizer_state = device.update(variables, optimizer_state, grads, state, images.shape[0])
        return variables, opt.join(optimizer_state, kept, opt.sync_state(opt_state)), loss

    return map_over_devices(own_step, devices, backend, ("per_device", opt.kind, "batch", "batch"),
                            ("per_device", opt.kind, "per_device"), donate=(0, 1))


def make_step(loss: "LossFn | Model", opt: OptState, devices: Sequence[jax.Device], backend: Backend = "pmap", *,
              accumulate: int = 1, segment: Segment = lambda name, fn: fn) -> TrainStep:
    """The train step that keeps the optimizer state `opt` (a run's, `jdp.training.build.build_run`): a local
    mode's (`make_local_step`), the sharded one (`make_sharded_step`) or the lesson's (`make_train_step`), with
    `opt`'s strategy, whose settings the caller has checked (`check_strategy`); its reach over `devices` is
    checked here (`check_reach`). `segment`: as `make_train_step`'s; a local step has no outside calls to wrap."""
    check_reach(opt.strategy, devices)
    if isinstance(opt.placement, LocalOptimizer):
        return make_local_step(loss, opt, devices, backend, accumulate=accumulate)
    build = _sharded_step if isinstance(opt.placement, ShardedOptimizer) else _summed_step
    return build(_OnDevice.of(loss, opt.optimizer, accumulate), opt, devices, backend, segment)


def check_strategy(strategy: Allreduce, backend: Backend, shard_optimizer: bool = False) -> None:
    """Raises ConfigError unless the train step can run `strategy` with `backend` (the settings' part;
    `check_reach` is the devices').

    A stateful strategy keeps per-device state, which `shard_map`'s replicated `P()` step does not hold;
    the sharded optimizer needs a strategy's halves, and carries no per-device strategy state.
    """
    if strategy.stateful and backend != "pmap":
        raise ConfigError(
            f"`{strategy.name}` keeps different state on each device, which ", Arg("backend", backend),
            " cannot hold in its replicated `P()` layout. Use ", Arg("backend", "pmap"), "."
        )
    if shard_optimizer and (not strategy.has_halves or strategy.stateful):
        halves = ", ".join(allreduce_lib.names(halves=True))
        raise ConfigError(
            Arg("shard_optimizer", True), " splits the allreduce into a reduce-scatter and an all-gather, which ",
            Arg("allreduce", strategy.name), f" does not provide; use one of: {halves}, "
            "or give your strategy `reduce_scatter` and `all_gather` (see `jdp.Allreduce`)."
        )


def check_reach(strategy: Allreduce | None, devices: Sequence[jax.Device]) -> None:
    """Raises ConfigError unless `strategy` reaches all of `devices`: an "outside" strategy copies with
    `jax.device_put`, which reaches this process's devices only (None, a step with no allreduce, reaches any)."""
    if strategy is not None and not strategy.inside and any(d.process_index != jax.process_index() for d in devices):
        inside = ", ".join(allreduce_lib.names("inside"))
        raise ConfigError(
            Arg("allreduce", strategy.name), " copies buffers between devices with `jax.device_put`, which only "
            f"reaches this process's devices, but the step spans {jax.process_count()} processes. "
            f"Use a collective strategy instead: {inside}."
        )


# Whether XLA keeps one micro-batch's activations when unrolled micro-batches are ordered by
# `lax.optimization_barrier` (docs/optimizers.md has the measurement).
BARRIER_ORDERS_MICRO_BATCHES = jax.__version_info__ >= (0, 12)


def accumulate_grads(grads_fn: Callable, variables: PyTree, images: jax.Array, labels: jax.Array,
                     micro_batches: int, *, stateful: bool = False) -> tuple[jax.Array, PyTree, PyTree]:
    """Sums `grads_fn` over `micro_batches` equal parts of a device's shard, one part after another.

    The loss is a sum, so the summed gradients of the parts are the gradient of the whole shard: the
    allreduce and the update that follow are those of one step on the whole batch. Only one part's
    activations are alive at a time: the parts are unrolled, each read through `lax.optimization_barrier`
    with the running sum, so XLA cannot start part t before part t−1's gradients exist (a `lax.scan` would
    bound memory too, but XLA's CPU convolutions run far slower inside a loop). Where XLA does not keep
    that order (`BARRIER_ORDERS_MICRO_BATCHES` false: JAX before 0.12), the parts run in a `lax.scan`.
    A stateful model's state (BatchNorm statistics) is threaded from each part to the next, as N steps would.

    Args:
      grads_fn: (variables, images, labels) -> (summed loss, gradients, new state or None).
      variables: the params, or {"params", "state"} if `stateful`.
      images, labels: this device's shard, n rows.
      micro_batches: N, which must divide n.

    Returns:
      (loss summed over the shard, gradients summed over the shard, the last part's state or None).

    Raises:
      ConfigError: if n does not split into `micro_batches` equal parts.
    """
    n = images.shape[0]
    if n % micro_batches:
        raise ConfigError(
            Arg("accumulate", micro_batches), f" cuts each device's {n} rows into {micro_batches} equal micro-batches, "
            f"which {n} does not allow: use a ", Arg("batch_size"),
            f" that is a multiple of devices × {micro_batches}."
        )
    parts = jax.tree.map(lambda a: a.reshape(micro_batches, n // micro_batches, *a.shape[1:]), (images, labels))

    def add_part(carry, part):
        loss_sum, grad_sum, variables = carry
        loss, grads, state = grads_fn(variables, *part)
        variables = {**variables, "state": state} if stateful else variables
        return loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), variables  # 0 + g is g exactly

    zeros = jax.tree.map(jnp.zeros_like, variables["params"] if stateful else variables)
    carry = (jnp.zeros((), jnp.float32), zeros, variables)
    if BARRIER_ORDERS_MICRO_BATCHES:
        for t in range(micro_batches):  # unrolled
            part = jax.tree.map(lambda a: a[t], parts)
            # part t is read only once part t−1's gradients exist
            grad_sum, part = lax.optimization_barrier((carry[1], part))
            carry = add_part((carry[0], grad_sum, carry[2]), part)
    else:
        carry, _ = lax.scan(lambda carry, part: (add_part(carry, part), None), carry, parts)
    loss, grads, variables = carry
    return loss, grads, variables["state"] if stateful else None
