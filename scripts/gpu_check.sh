#!/usr/bin/env bash
# One GPU check of jdp: install jdp with CUDA, check that JAX sees a GPU, then on 1 GPU time the training
# step in float32 and bf16 (jdp bench train), train 10 epochs in each precision (jdp train), train ResNet-18
# with 1 and 8 steps per call, time the loop's host overhead (jdp bench loop), run the lesson's PyTorch code
# on the same GPU when torch sees one, and time the allreduce algorithms (jdp bench allreduce). Every file it
# writes goes under $OUT; $OUT/SUMMARY.md and $OUT/summary.json have the key figures (each run's seconds per
# epoch against the compute floor, and against the lesson's PyTorch code).
#
#   OUT=/path/to/results scripts/gpu_check.sh               # on a machine with an NVIDIA GPU
#   OUT=/path/to/results scripts/gpu_check.sh --no-install  # the same with $PYTHON as it is: no venv, no pip
#   OUT=/tmp/check scripts/gpu_check.sh --dry-run           # the same commands on CPU, tiny sizes, no install
#
# Environment: OUT (required); PYTHON (default python3: makes the venv, or runs jdp with --dry-run and
# --no-install); VENV (use this venv instead of creating $OUT/venv); DATA_DIR (the Fashion-MNIST IDX files;
# default: the first of $JDP_DATA_DIR, shared/data/fashion-mnist, ../shared/data/fashion-mnist that holds
# them, else synthetic data, said in SUMMARY.md).
set -euo pipefail

die() { echo "gpu_check.sh: $*" >&2; exit 1; }
absolute() { case "$1" in /*) echo "$1" ;; *) echo "$PWD/$1" ;; esac; }

DRY_RUN=0
INSTALL=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --no-install) INSTALL=0 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$arg' (use --dry-run, --no-install, --help)" >&2; exit 2 ;;
  esac
done
if [[ -z "${OUT:-}" ]]; then
  echo "gpu_check.sh: set OUT to the folder that receives the results, e.g. OUT=/tmp/gpu-check $0" >&2
  exit 2
fi

# Paths given by the caller are relative to the caller's folder; the defaults to the repository root.
OUT="$(absolute "$OUT")"
[[ -n "${DATA_DIR:-}" ]] && DATA_DIR="$(absolute "$DATA_DIR")"
[[ -n "${JDP_DATA_DIR:-}" ]] && JDP_DATA_DIR="$(absolute "$JDP_DATA_DIR")"
[[ -n "${VENV:-}" ]] && VENV="$(absolute "$VENV")"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

has_idx_files() {
  local f
  for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
    [[ -f "$1/$f" ]] || return 1
  done
}
if [[ -n "${DATA_DIR:-}" ]]; then
  has_idx_files "$DATA_DIR" || die "DATA_DIR=$DATA_DIR does not hold the four Fashion-MNIST IDX files"
else
  DATA_DIR=""
  for candidate in "${JDP_DATA_DIR:-}" shared/data/fashion-mnist ../shared/data/fashion-mnist; do
    if [[ -n "$candidate" ]] && has_idx_files "$candidate"; then DATA_DIR="$(cd "$candidate" && pwd)"; break; fi
  done
fi
if [[ $DRY_RUN == 1 ]]; then DATA=(--dataset synthetic); DATA_NOTE="synthetic (dry run)"
elif [[ -n "$DATA_DIR" ]]; then DATA=(--data-dir "$DATA_DIR"); DATA_NOTE="Fashion-MNIST from $DATA_DIR"
else DATA=(--dataset synthetic); DATA_NOTE="synthetic: no Fashion-MNIST IDX files found (not Fashion-MNIST's accuracies)"; fi

if [[ $DRY_RUN == 1 ]]; then
  # The real run's commands and flags on 1 simulated CPU device, with tiny sizes.
  export JAX_PLATFORMS=cpu
  PY="${PYTHON:-python3}"
  DEVICES=(--cpu-devices 1 --devices 1)
  BENCH_TRAIN=("${DATA[@]}" --steps 2 --rounds 1)
  TRAIN=("${DATA[@]}" --epochs 2)
  BIG=("${DATA[@]}" --epochs 2 --model lenet_flax)  # ResNet-18 takes minutes on a CPU: its commands, a smaller model
  BIG_NAME=lenet_flax
  BIG_STEPS_PER_CALL=2
  LOOP=(--cpu-devices 1 --steps 50 --rounds 1)
  ALLREDUCE=(--cpu-devices 1 --sizes 4KiB..16KiB --repeats 1)
else
  if [[ $INSTALL == 1 ]]; then
    VENV="${VENV:-$OUT/venv}"
    if [[ ! -x "$VENV/bin/python" ]]; then
      "${PYTHON:-python3}" -m venv "$VENV" || die "could not create a venv at $VENV"
    fi
    echo "== pip install -e '.[cuda12]' into $VENV" | tee "$OUT/install.log"
    "$VENV/bin/python" -m pip install -e '.[cuda12]' >> "$OUT/install.log" 2>&1 \
      || die "pip install -e '.[cuda12]' failed (see $OUT/install.log; without network, try --no-install)"
    PY="$VENV/bin/python"
  else
    PY="${PYTHON:-python3}"
  fi
  { echo "gpu: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 1)"
    nvidia-smi || echo "nvidia-smi failed (exit status $?)"; } > "$OUT/nvidia-smi.txt" 2>&1
  "$PY" -c 'import jax; print(jax.devices())' > "$OUT/jax-devices.txt" 2>&1 \
    || die "$PY cannot import jax (see $OUT/jax-devices.txt)"
  cat "$OUT/jax-devices.txt"
  backend="$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null)" || backend="?"
  [[ "$backend" == gpu ]] \
    || die "JAX does not see a GPU: its backend is '$backend' (see $OUT/jax-devices.txt, $OUT/nvidia-smi.txt)"
  DEVICES=(--devices 1)
  BENCH_TRAIN=("${DATA[@]}")
  TRAIN=("${DATA[@]}" --epochs 10)
  BIG=("${DATA[@]}" --epochs 3 --model resnet18)
  BIG_NAME=resnet18
  BIG_STEPS_PER_CALL=8
  LOOP=(--devices 1)
  ALLREDUCE=(--sizes 4KiB..256MiB)
fi
JDP=("$PY" -m jdp)

run() {  # run NAME CMD...: the command's output on the terminal and in $OUT/NAME.log
  local name="$1"; shift
  echo "== $name: $*" | tee "$OUT/$name.log"
  if ! "$@" 2>&1 | tee -a "$OUT/$name.log"; then die "$name failed (see $OUT/$name.log)"; fi
}

run bench-train "${JDP[@]}" bench train "${DEVICES[@]}" "${BENCH_TRAIN[@]}" --precision float32,bf16 \
  --out "$OUT/bench-train"
for precision in float32 bf16; do
  run "train-$precision" "${JDP[@]}" train "${DEVICES[@]}" "${TRAIN[@]}" --precision "$precision" --no-progress \
    --out "$OUT/train-$precision"
done
for steps_per_call in 1 "$BIG_STEPS_PER_CALL"; do
  run "train-$BIG_NAME-s$steps_per_call" "${JDP[@]}" train "${DEVICES[@]}" "${BIG[@]}" \
    --steps-per-call "$steps_per_call" --no-progress --out "$OUT/train-$BIG_NAME-s$steps_per_call"
done
run bench-loop "${JDP[@]}" bench loop "${LOOP[@]}" --out "$OUT/bench-loop"
# The lesson's PyTorch code on the same GPU: when torch sees one and the real data is here.
rm -f "$OUT/lesson-pytorch.json"
if [[ $DRY_RUN == 1 ]]; then LESSON_NOTE="not run: dry run"
elif [[ -z "$DATA_DIR" ]]; then LESSON_NOTE="not run: no Fashion-MNIST IDX files"
elif ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  LESSON_NOTE="not run: torch is not importable by $PY or sees no GPU"
else
  run lesson-pytorch "$PY" scripts/lesson_pytorch.py --device cuda --data-dir "$DATA_DIR" --epochs 5 \
    --out "$OUT/lesson-pytorch.json"
  LESSON_NOTE="run: lesson-pytorch.log"
fi
run bench-allreduce "${JDP[@]}" bench allreduce "${ALLREDUCE[@]}" --out "$OUT/bench-allreduce"

"$PY" - "$OUT" "$DRY_RUN" "$DATA_NOTE" "$LESSON_NOTE" "$BIG_NAME" "$BIG_STEPS_PER_CALL" > "$OUT/SUMMARY.md" <<'EOF' || die "could not write $OUT/SUMMARY.md"
import datetime, json, pathlib, sys

out, dry_run, data_note, lesson_note = pathlib.Path(sys.argv[1]), sys.argv[2] == "1", sys.argv[3], sys.argv[4]
big, big_steps = sys.argv[5], sys.argv[6]
bench = json.loads((out / "bench-train" / "bench_train.json").read_text())
smi = out / "nvidia-smi.txt"
smi_lines = smi.read_text().splitlines() if smi.exists() else []
gpu = next((line[5:] for line in smi_lines if line.startswith("gpu: ")), None)
print(f"# jdp GPU check{' (dry run on CPU: the commands, not the figures)' if dry_run else ''}\n")
print(f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
print(f"- device: {bench['device_kind']}" + (f" (nvidia-smi: {gpu})" if gpu else ""))
print(f"- JAX {bench['machine']['jax_version']}, Python {bench['machine']['python']}")
print(f"- data: {data_note}\n")
print("## jdp bench train, 1 device\n\n```")
for line in (out / "bench-train.log").read_text().splitlines():
    if not line.startswith(("==", "wrote ")):
        print(line)
summary = {"date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "dry_run": dry_run,
           "device_kind": bench["device_kind"], "gpu": gpu, "jax": bench["machine"]["jax_version"], "data": data_note}
floor_per_image = {r["precision"]: 1 / r["floor_images_per_s"] for r in bench["results"] if r["devices"] == 1}


def images_per_epoch(config):
    """The images one epoch of `jdp train` trains on: full batches of Fashion-MNIST's 60,000, or the synthetic set."""
    import inspect
    from jdp import data
    n = 60000 if config["dataset"] == "fashion_mnist" else inspect.signature(data.synthetic).parameters["n_train"].default
    return n // config["batch_size"] * config["batch_size"]


def seconds_per_epoch(name):
    """(epoch 1's seconds, the mean of the later epochs' or None, final test accuracy) of a `jdp train` run."""
    epochs = json.loads((out / name / "history.json").read_text())["epochs"]
    later = [e["seconds"] for e in epochs[1:]]
    return epochs[0]["seconds"], (sum(later) / len(later) if later else None), epochs[-1]["test_acc"]


def figure(value, form="{:.2f}"):
    return "-" if value is None else form.format(value)


lesson = json.loads((out / "lesson-pytorch.json").read_text()) if (out / "lesson-pytorch.json").exists() else None
lesson_s = min(lesson["seconds"][1:] or lesson["seconds"]) if lesson else None
summary["lesson_pytorch"] = {"note": lesson_note, "seconds_per_epoch": lesson_s}
print("```\n\n## jdp train, 1 device\n")
print("| run | epochs | final test acc | epoch 1 s (compiles) | sec/epoch (mean of the others) | / compute floor "
      "| lesson's PyTorch / jdp |")
print("|---|---:|---:|---:|---:|---:|---:|")
runs = {}
for name, precision in (("train-float32", "float32"), ("train-bf16", "bf16"), (f"train-{big}-s1", None),
                        (f"train-{big}-s{big_steps}", None)):
    first, later, acc = seconds_per_epoch(name)
    config = json.loads((out / name / "history.json").read_text())["config"]
    floor = floor_per_image[precision] * images_per_epoch(config) if precision else None
    vs_floor = later / floor if floor and later else None
    vs_lesson = lesson_s / later if lesson_s and precision == "float32" and later else None
    runs[name] = {"first_epoch_s": first, "seconds_per_epoch": later, "test_acc": acc, "floor_seconds": floor,
                  "vs_floor": vs_floor, "lesson_over_jdp": vs_lesson}
    print(f"| {name} | {len(json.loads((out / name / 'history.json').read_text())['epochs'])} | {acc:.4f} | "
          f"{first:.2f} | {figure(later)} | {figure(vs_floor, '{:.2f}x')} | {figure(vs_lesson, '{:.2f}x')} |")
summary["train"] = runs
one, several = runs[f"train-{big}-s1"]["seconds_per_epoch"], runs[f"train-{big}-s{big_steps}"]["seconds_per_epoch"]
if one and several:
    summary[f"{big}_s1_over_s{big_steps}"] = one / several
    print(f"\n{big}: 1 step per call / {big_steps}: {one / several:.2f}x (target <= 1.3x)")
print(f"\nThe lesson's PyTorch code on this GPU: {lesson_note}"
      + (f", best later epoch {lesson_s:.2f} s" if lesson_s else ""))
loop = json.loads((out / "bench-loop" / "bench_loop.json").read_text())["results"][0]
summary["bench_loop"] = {"seconds_per_step": loop["seconds_per_step"], "train_vs_bare": loop["train_vs_bare"]}
print(f"\n## jdp bench loop ({loop['model']}, 1 device)\n\njdp train {loop['seconds_per_step']['train_s'] * 1e6:.1f} us "
      f"per step, a bare loop {loop['seconds_per_step']['bare_s'] * 1e6:.1f} us: {loop['train_vs_bare']:.2f}x "
      f"(target <= {loop['target_train_vs_bare']}x)")
allreduce = json.loads((out / "bench-allreduce" / "allreduce.json").read_text())
largest = max(r["size_bytes"] for r in allreduce["results"])
rows = [r for r in allreduce["results"] if r["size_bytes"] == largest]
print(f"\n## jdp bench allreduce, {rows[0]['devices']} device(s), {largest} bytes per device\n")
print("| algorithm | time (us) | algbw (GB/s) | busbw (GB/s) | #wrong |\n|---|---:|---:|---:|---:|")
for r in rows:
    print(f"| {r['algorithm']} | {r['time_us']:.1f} | {r['algbw_gbps']:.3f} | {r['busbw_gbps']:.3f} | {r['wrong']} |")
print("\nEvery size: `bench-allreduce.log`, `bench-allreduce/allreduce.json`. The key figures: `summary.json`.")
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
EOF
echo "wrote $OUT/SUMMARY.md"
