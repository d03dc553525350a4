"""`jdp` on the command line: argparse in, calls into the library, one-line errors out (exit 2).

The library's errors name its Python arguments (`accumulate=5`); `main` prints them as the flags
of the command that ran (`--accumulate 5`, see `jdp.cli.errors`). Choices come from the library's
constants, and `jdp train`'s flags are `TrainConfig`'s fields, so the two cannot drift apart.
"""

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jdp.cli.errors import in_flags, option_flags
from jdp.errors import Arg, ConfigError, JdpError, ProcessLostError
from jdp.flags import (
    OneLineErrorParser,
    add_backend_flag,
    add_compress_flags,
    add_device_flags,
    add_job_flags,
    add_optimizer_flags,
    add_steps_per_call_flag,
    check_out_dir,
    load_plugins,
    setup_devices,
)
from jdp.runtime.faults import in_job

if TYPE_CHECKING:
    import jax

    from jdp.data import Dataset
    from jdp.training.checkpoint import Checkpoints
    from jdp.training.config import TrainConfig
    from jdp.training.hooks import EpochRecord, Hooks


def build_parser() -> argparse.ArgumentParser:
    """The `jdp` parser: one subparser per command, each built by its own function below."""
    parser = OneLineErrorParser(
        prog="jdp", description="Data-parallel training of the lesson's LeNet in functional JAX."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_train_parser(commands)
    _add_bench_parser(commands)
    from jdp.bench import predict
    from jdp.cli import compare

    compare.add_parser(commands)
    predict.add_parser(commands)
    _add_launch_parser(commands)
    return parser


def _add_train_parser(commands: argparse._SubParsersAction) -> None:
    """`jdp train`: its flags in the order `--help` lists them."""
    train = commands.add_parser(
        "train", help="train a model (LeNet by default) data-parallel and report test accuracy per epoch",
        description="Train the lesson's LeNet (or --model) data-parallel: replicate params, split each batch "
        "over the devices, allreduce gradients, SGD with the full batch size.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_device_flags(train)
    _add_step_flags(train)
    _add_data_and_model_flags(train)
    _add_record_flags(train)
    add_backend_flag(train)
    add_optimizer_flags(train)
    _add_sync_flags(train)
    add_job_flags(train)
    train.add_argument("--collective-timeout", type=float, default=None, metavar="SECONDS",
                       help="multi-process: end every process (exit status 75) when no step finished for SECONDS, "
                       "naming the processes that did not arrive (default: 20x the slowest step seen, 60 to 600 s; "
                       "docs/faults.md)")
    train.set_defaults(run=run_train)


def _add_step_flags(train: argparse.ArgumentParser) -> None:
    """`jdp train`'s batch, learning rate, epochs and how the gradients are allreduced."""
    from jdp.parallel.allreduce import names as allreduce_names

    train.add_argument("--batch-size", type=int, default=256, help="global batch, split over the devices")
    train.add_argument("--lr", type=float, default=0.2, help="SGD learning rate (on the full-batch mean gradient)")
    train.add_argument("--epochs", type=int, default=10)
    train.add_argument("--warmup-steps", type=int, default=0, help="linear lr warmup from 0 over this many steps")
    train.add_argument("--allreduce", default="psum",
                       help=f"gradient allreduce strategy: {', '.join(allreduce_names())}, "
                       "hierarchical[:tree|psum][:HxL] (H hosts × L local devices; default one host per process), "
                       "or one a --plugin registered")
    train.add_argument("--fuse", action="store_true",
                       help="allreduce the gradients raveled into one buffer per dtype instead of one per leaf")
    train.add_argument("--bucket-mb", type=float, default=None, metavar="M",
                       help="with --fuse: buckets of at most M MB (like DDP's bucket_cap_mb) instead of one buffer")
    add_compress_flags(train)


def _add_data_and_model_flags(train: argparse.ArgumentParser) -> None:
    """`jdp train`'s dataset, evaluation, output, model, its formulation and precision."""
    from jdp.data import DATASETS
    from jdp.models import BATCHNORM
    from jdp.models.lenet_fast import FORMULATIONS
    from jdp.models.precision import PRECISIONS
    from jdp.parallel.evaluate import EVAL_ON

    train.add_argument("--dataset", default="fashion_mnist", choices=DATASETS)
    train.add_argument("--data-dir", default=None,
                       help="folder with the four IDX files (default: $JDP_DATA_DIR, ../shared/data/fashion-mnist, "
                       "~/.cache/jdp/fashion-mnist, else download); for --dataset tfds, the tfds data_dir")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--eval-on", default="all", choices=EVAL_ON,
                       help="evaluate split over all devices (psum of counts) or on the first device only")
    train.add_argument("--out", default=None, help="write history.json and accuracy.png here")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    train.add_argument("--model", default="lenet",
                       help="lenet (the from-scratch LeNet), lenet_flax (its Flax version), resnet18 (the lesson's "
                       "ResNet-18 for 28x28, Flax), a model a --plugin registered, or module:factory (a module or "
                       ".py file and its function returning a jdp.Model, e.g. my_models.py:make_cnn)")
    train.add_argument("--batchnorm", default=None, choices=BATCHNORM,
                       help="resnet18: BatchNorm statistics synchronised over all devices (the global batch's), or "
                       "over each device's shard; resnet18 uses sync when it is not given; with --model "
                       "module:factory, passed to the factory as batchnorm=")
    train.add_argument("--formulation", "--model-impl", default="auto", choices=["auto", *FORMULATIONS],
                       help="--model lenet's formulation, the same math written for speed: auto (the fastest "
                       "measured for this machine kind and device count, else fast; a resumed run keeps its "
                       "checkpoint's), fast, split-2/split-4 (each device's batch in independent chunks), phase-matmul "
                       "(conv1 as one matmul; and its splits), or reference (the lesson's); --model-impl is its earlier name (docs/performance.md)")
    add_steps_per_call_flag(train, "train steps per compiled call (S > 1 needs a collective allreduce strategy); "
                            "auto: 1, then, from the second epoch, enough for a call of about 4 ms (at most 16) "
                            "where steps are that short and the step allows it; the grouping changes no result "
                            "(docs/performance.md)")
    train.add_argument("--precision", default="float32", choices=list(PRECISIONS),
                       help="compute dtype of the forward and backward passes; params, optimizer state, loss, "
                       "gradients and their allreduce stay float32 (docs/performance.md)")


def _add_record_flags(train: argparse.ArgumentParser) -> None:
    """`jdp train`'s checkpoints, replica checks, TensorBoard scalars and profiler traces."""
    train.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                       help="save params, optimizer and data-order state here (atomically; the last two kept)")
    train.add_argument("--checkpoint-every", type=int, default=None, metavar="STEPS",
                       help="save every STEPS steps (default: at the end of every epoch)")
    train.add_argument("--resume", action="store_true",
                       help="continue from the newest intact checkpoint in --checkpoint-dir")
    train.add_argument("--check-replicas", type=int, default=None, metavar="N",
                       help="every N steps, stop unless all replicas are bit-identical")
    train.add_argument("--tensorboard", default=None, metavar="DIR",
                       help="write TensorBoard scalars to DIR: per-step loss and lr, per-epoch accuracy, loss, step "
                       "time and allreduce bytes, the config as text and hparams (docs/hooks.md)")
    train.add_argument("--profile", default=None, metavar="DIR",
                       help="write a jax.profiler trace of --profile-steps to DIR (Perfetto, TensorBoard) and print "
                       "where each step's time goes: compute, communication, host")
    train.add_argument("--profile-steps", default=None, metavar="A:B",
                       help="with --profile: the steps to trace, counted from 1 (default: 3:12, cut to the run's "
                       "length; the first steps compile)")


# The settings of the built-in sync algorithms that `jdp train` takes as flags (`--outer-lr`, ...), passed to `get_sync`.
SYNC_SETTINGS = ("outer_optimizer", "outer_lr", "outer_momentum", "fragments", "sync_delay", "mixing", "outer_dtype",
                 "error_feedback")


def _add_sync_flags(train: argparse.ArgumentParser) -> None:
    """`jdp train`'s group of flags for when the replicas meet, and a straggler to simulate."""
    from jdp.parallel.compress import WIRE_DTYPES
    from jdp.parallel.sync import DEFAULT_EVERY, DILOCO_OUTER, OUTER_OPTIMIZERS
    from jdp.parallel.sync import names as sync_names

    sync = train.add_argument_group("when the replicas meet (docs/sync.md)")
    sync.add_argument("--sync", default="every-step", metavar="|".join(sync_names()),
                      help="every-step: allreduce the gradients every step (the lesson's); local-sgd: each device "
                      "steps alone, params averaged every --sync-every steps; diloco: the same, the averaged "
                      "parameter change fed to an outer Nesterov optimizer; streaming-diloco: DiLoCo a fragment at a "
                      "time (--fragments, --sync-delay, --outer-dtype); or one a --plugin registered")
    sync.add_argument("--sync-every", type=int, default=None, metavar="H",
                      help=f"local modes: steps between syncs (default {DEFAULT_EVERY}, or the one a --plugin's "
                      "sync sets)")
    sync.add_argument("--outer-optimizer", default=None, choices=OUTER_OPTIMIZERS,
                      help="diloco, streaming-diloco: the outer optimizer on the averaged parameter change (default "
                      "nesterov)")
    sync.add_argument("--outer-lr", type=float, default=None,
                      help=f"diloco: the outer lr (default {DILOCO_OUTER['lr']}, Douillard et al. 2023)")
    sync.add_argument("--outer-momentum", type=float, default=None,
                      help=f"diloco: the outer momentum (default {DILOCO_OUTER['momentum']} with nesterov, none "
                      "with sgd)")
    sync.add_argument("--fragments", type=int, default=None, metavar="F",
                      help="streaming-diloco: parts of the model synced in turn, one every H/F steps (default 4)")
    sync.add_argument("--sync-delay", type=int, default=None, metavar="TAU",
                      help="streaming-diloco: steps between a fragment's send and its merge into the local params "
                      "(default 0: replaced at once)")
    sync.add_argument("--mixing", type=float, default=None, metavar="A",
                      help="streaming-diloco with --sync-delay: a late fragment merges as A·local + (1 − A)·outer "
                      "(default 0.5, the paper's)")
    sync.add_argument("--outer-dtype", default=None, choices=WIRE_DTYPES,
                      help="streaming-diloco: the outer gradients on the wire (default float32: the run's "
                      "--allreduce; else quantized, all-gathered and added in float32)")
    sync.add_argument("--error-feedback", action="store_true", default=None,
                      help="streaming-diloco with --outer-dtype bf16|fp8|int8: each device keeps what quantizing "
                      "lost of its outer gradient and adds it to the next one")
    sync.add_argument("--simulate-straggler", default=None, metavar="PROCESS:SECONDS[:EVERY]",
                      help="multi-process: process PROCESS sleeps SECONDS before every EVERY-th step (default every "
                      "step); every process times its steps and syncs, and the run reports them per process")


def _add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """`jdp bench` and its benchmarks, each a module of `jdp.bench`."""
    bench = commands.add_parser("bench", help="benchmarks that print ratios measured side by side in one run")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    from jdp.bench import allreduce, formulations, loop, memory, step
    from jdp.bench import train as train_bench

    for module in (allreduce, step, train_bench, loop, memory, formulations):  # each benchmark adds its own subcommand
        module.add_parser(benchmarks)


def _add_launch_parser(commands: argparse._SubParsersAction) -> None:
    """`jdp launch`: P processes on loopback, or one on each host of an emulated cluster."""
    launch = commands.add_parser(
        "launch", help="run a multi-process job on this machine, over loopback or an emulated cluster",
        description="Start P processes of COMMAND on 127.0.0.1, each with its own --process-id, "
        "forward their output prefixed [pI], and stop them all as soon as one fails. With --hosts H --nic RATE "
        "(as root): one process on each of H emulated hosts, network namespaces whose NICs are shaped to RATE "
        "each way and joined by a switch (docs/cluster.md).",
        usage="jdp launch (--num-processes P | --hosts H --nic RATE [--cores-per-host C] [--delay MS] [--realtime] "
        "[--min-hosts M]) "
        "[--cpu-devices-per-process N] [--timeout S] [--max-restarts N] [--inject SPEC ...] -- jdp train ...",
    )
    launch.add_argument("--num-processes", type=int, default=None, help="processes to start (on loopback)")
    launch.add_argument("--cpu-devices-per-process", "--devices-per-host", type=int, default=1,
                        help="CPU devices each process (each emulated host) simulates")
    cluster = launch.add_argument_group("an emulated cluster, as root (docs/cluster.md)")
    cluster.add_argument("--hosts", type=int, default=None, metavar="H",
                         help="run one process on each of H emulated hosts (network namespaces behind a switch)")
    cluster.add_argument("--nic", default=None, metavar="RATE",
                         help="with --hosts: each host's NIC rate, each way, in tc's units (100mbit, 1gbit)")
    cluster.add_argument("--cores-per-host", type=int, default=None, metavar="C",
                         help="with --hosts: CPU cores each host's process is pinned to (default: the cores shared "
                         "out evenly, at least one each)")
    cluster.add_argument("--delay", type=float, default=None, metavar="MS",
                         help="with --hosts: one-way latency added at each NIC (needs the kernel's netem)")
    cluster.add_argument("--realtime", action="store_true", default=None,
                         help="with --hosts: run each host's process under the real-time round-robin scheduler "
                         "(chrt --rr), so that its threads, sharing the host's cores, hand off at once as on a host "
                         "with cores to spare: a small message costs tens of microseconds instead of the time-sharing "
                         "scheduler's ticks, milliseconds (docs/cluster.md)")
    launch.add_argument("--timeout", type=float, default=None, help="stop the job after this many seconds")
    launch.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="when a process fails, stop the job and start all processes again with --resume from "
                        "the newest complete checkpoint, up to N times (the command needs --checkpoint-dir)")
    cluster.add_argument("--min-hosts", type=int, default=None, metavar="M",
                         help="with --hosts and --max-restarts: restart without the hosts that do not answer, "
                         "as long as M hosts do (default: restart on every host)")
    launch.add_argument("--inject", action="append", default=[], metavar="SPEC",
                        help="make a fault at a training step, once (repeatable): kill:HOST@STEP, "
                        "stop:HOST@STEP:SECONDS, and with --hosts cut:HOST@STEP[:SECONDS] (no SECONDS: for good), "
                        "slow:HOST@STEP:RATE (docs/faults.md)")
    launch.add_argument("job", nargs=argparse.REMAINDER, help="-- and the command, e.g. -- jdp train --epochs 1")
    launch.set_defaults(run=run_launch)


def run_train(args: argparse.Namespace) -> int:
    """`jdp train`: every flag checked before any work, then the run, its summary lines and `--out`'s files."""
    from jdp import data, plot
    from jdp.runtime.devices import describe
    from jdp.training import checkpoint, formulation
    from jdp.parallel.allreduce import get as get_allreduce
    from jdp.parallel.sync import get as get_sync
    from jdp.training.config import TrainConfig, payload_bytes
    from jdp.training.hooks import Hooks
    from jdp.training.profile import Profiler, default_window, format_heaviest, parse_steps, trace_directory
    from jdp.training.stragglers import Stopwatch, Straggler, format_report

    load_plugins(args.plugin)

    components = {"allreduce": get_allreduce(args.allreduce, fuse=args.fuse, bucket_mb=args.bucket_mb,
                                             compress=args.compress, rank=args.powersgd_rank),
                  "sync": get_sync(args.sync, args.sync_every, **{name: getattr(args, name) for name in SYNC_SETTINGS})}
    config = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                            if f.name not in components}, **components)
    out = check_out_dir(args.out)
    checkpoints = checkpoint.check_options(args.checkpoint_dir, args.checkpoint_every, args.resume)
    window = None if args.profile_steps is None else parse_steps(args.profile_steps)
    stopwatch = None if args.simulate_straggler is None else Stopwatch(Straggler.parse(args.simulate_straggler))
    devices = setup_devices(args)
    dataset = data.load(args.dataset, args.data_dir, seed=args.seed)
    first, last = window or default_window(len(dataset.train.labels) // config.batch_size * config.epochs)
    import jax

    profiler = None if args.profile is None else Profiler(
        trace_directory(args.profile, jax.process_index(), jax.process_count()), first, last,
        sum(d.process_index == jax.process_index() for d in devices), config.strategy())
    config, choice = formulation.settle(config, devices, args.checkpoint_dir, args.resume)
    settings = {k: v for k, v in vars(args).items() if k not in ("run", "command")}  # as history.json's config
    settings["formulation"] = choice.formulation  # what ran, not "auto"
    if choice.requested != choice.formulation and args.model == "lenet" and jax.process_index() == 0:
        print(f"formulation: {choice.formulation} ({choice.source})", flush=True)
    history = _train_and_log(args, config, (dataset, devices), settings, checkpoints,
                             Hooks(profile=profiler, stopwatch=stopwatch))
    stragglers = None if stopwatch is None else stopwatch.report()  # a collective: before process 0 alone writes
    if stragglers is not None and jax.process_index() == 0:
        print(format_report(stragglers), flush=True)
    test_acc = [r.test_acc for r in history]
    sec_per_epoch = sum(r.seconds for r in history) / len(history)
    print(f"test acc: {test_acc[-1]:.2f}, {sec_per_epoch:.1f} sec/epoch on [{', '.join(describe(devices))}]")
    if profiler is not None and profiler.breakdown is not None:
        size = profiler.trace.stat().st_size / 2**20
        print(f"profile of steps {first}-{last}: {profiler.breakdown.line()}\n"
              f"trace: {profiler.trace} ({size:.1f} MB): open it at https://ui.perfetto.dev, or run "
              f"`tensorboard --logdir {args.profile}` (Profile tab)")
        if profiler.ops_ms:
            print(f"heaviest ops (ms/step per device): {format_heaviest(profiler.ops_ms)}")
    if out is not None and jax.process_index() == 0:  # one writer per multi-process job
        payload, steps = payload_bytes(config), len(dataset.train.labels) // config.batch_size * len(history)
        record = {
            "config": settings,
            "devices": describe(devices),
            "jax_version": jax.__version__,
            "epochs": [{**_epoch_fields(r), "bytes_sent": None if r.syncs is None else r.syncs * payload}
                       for r in history],  # bytes_sent: by each device, since the run began
            "allreduce_payload_bytes": payload,  # per device per allreduce: every step, or every sync
            "bytes_per_sync": payload,
            "bytes_per_step": None if history[-1].syncs is None else history[-1].syncs * payload / steps,
            "formulation": choice.to_json(),  # what --formulation asked for, what ran, and why
            **({} if stragglers is None else {"stragglers": stragglers}),
        }
        (out / "history.json").write_text(json.dumps(record, indent=2) + "\n")
        title = f"{args.model}, {args.allreduce}, {len(devices)} device(s), batch {args.batch_size}, lr {args.lr}"
        plot.save(plot.accuracy_per_epoch(test_acc, title=title), out / "accuracy.png")
        print(f"wrote {out / 'history.json'} and {out / 'accuracy.png'}")
    return 0


def _train_and_log(args: argparse.Namespace, config: "TrainConfig", on: "tuple[Dataset, Sequence[jax.Device]]",
                   settings: dict, checkpoints: "Checkpoints | None", hooks: "Hooks") -> "list[EpochRecord]":
    """`train` on (dataset, devices) with what the flags ask for around it: progress bars, epoch lines,
    TensorBoard scalars, beside the `hooks` given (profile, stopwatch).

    A lost process ends this one with a line that names this command's flags, not `train`'s arguments.
    """
    import jax
    from tqdm import tqdm

    from jdp.runtime.faults import end_process
    from jdp.training.config import learning_rate, payload_bytes
    from jdp.training.guards import Guards
    from jdp.training.loop import train

    def progress(batches, total):
        quiet = args.no_progress or not sys.stderr.isatty()  # in a log: only the epoch lines below
        return tqdm(batches, total=total, unit="step", leave=False, disable=quiet, file=sys.stderr)

    board = None
    if args.tensorboard is not None and jax.process_index() == 0:  # one writer per multi-process job
        from jdp.training.tensorboard import TensorBoardWriter

        board = TensorBoardWriter(args.tensorboard, settings, learning_rate(config), payload_bytes(config))
    # every process reads the step losses (a collective with several processes); process 0 writes them
    on_steps = None if args.tensorboard is None else board.steps if board is not None else lambda first, losses: None

    def on_epoch(record):
        print(f"epoch {record.epoch:3d}  train loss {record.train_loss:.4f}  "
              f"test acc {record.test_acc:.4f}  {record.seconds:.1f} s", flush=True)
        if board is not None:
            board.epoch(record)

    def on_lost(error):  # a lost process: one line in this command's flags, then the exit of jdp.runtime.faults
        end_process(in_flags(error, option_flags(build_parser(), args)))

    try:
        hooks = dataclasses.replace(hooks, on_epoch=on_epoch, progress=progress, on_steps=on_steps)
        guards = Guards(args.check_replicas, args.collective_timeout, on_lost)
        _, history = train(config, *on, checkpoints=checkpoints, hooks=hooks, guards=guards)
    except ProcessLostError as e:
        on_lost(e)
    finally:
        if board is not None:
            board.close()
    return history


def _epoch_fields(record: "EpochRecord") -> dict:
    """An epoch's record for history.json: each process's step time only where the job had several."""
    fields = dataclasses.asdict(record)
    if fields["process_step_s"] is None:
        del fields["process_step_s"]
    return fields


def run_launch(args: argparse.Namespace) -> int:
    from jdp.runtime import cluster, inject
    from jdp.runtime.launch import Job, launch

    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    if not job:
        raise ConfigError("`jdp launch` needs a command after `--`, e.g. `jdp launch --num-processes 2 -- jdp train`.")
    plan = None
    if args.hosts is None:
        extra = [name for name in ("nic", "cores_per_host", "delay", "realtime", "min_hosts")
                 if getattr(args, name) is not None]
        if extra:
            raise ConfigError(Arg(extra[0]), " describes an emulated cluster: add ", Arg("hosts", "H"), ".")
        if args.num_processes is None:
            raise ConfigError("`jdp launch` needs ", Arg("num_processes", "P"), " (loopback) or ", Arg("hosts", "H"),
                              " (an emulated cluster).")
    else:
        if args.nic is None:
            raise ConfigError(Arg("hosts", args.hosts), " needs ", Arg("nic", "RATE"), ", each NIC's rate, e.g. ",
                              Arg("nic", "100mbit"), ".")
        if args.num_processes not in (None, args.hosts):
            raise ConfigError(Arg("num_processes", args.num_processes), " and ", Arg("hosts", args.hosts),
                              ": one process per host; drop ", Arg("num_processes"), ".")
        plan = dataclasses.replace(cluster.plan(args.hosts, cluster.parse_rate(args.nic),
                                                cores_per_host=args.cores_per_host, delay_ms=args.delay),
                                   realtime=bool(args.realtime))
        cluster.check_privileges(plan.realtime)
    faults = tuple(inject.parse(spec) for spec in args.inject)
    return launch(Job(job, args.num_processes or args.hosts, args.cpu_devices_per_process, cluster=plan,
                      faults=faults, min_hosts=args.min_hosts), timeout=args.timeout, max_restarts=args.max_restarts)


class _ToStderr(logging.StreamHandler):
    """A handler on whatever `sys.stderr` is when it writes (a multi-process job reopens it, see `setup_devices`)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    log = logging.getLogger("jdp")
    notes, level = _ToStderr(), log.level
    log.addHandler(notes)  # jdp's notes (resuming, a skipped damaged checkpoint) go to stderr
    log.setLevel(logging.INFO)
    try:
        return args.run(args)
    except JdpError as e:  # the library names Python arguments; here they are this command's flags
        print(f"jdp: error: {in_flags(e, option_flags(parser, args))}", file=sys.stderr)
        if in_job():  # the job's shutdown would wait for the processes still training
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        return 2
    finally:
        log.removeHandler(notes)
        log.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
