import json
import subprocess
import sys

import jax
import pytest

from jdp.bench import baselines, machine
from jdp.bench import loop as bench_loop
from jdp.bench import train as bench_train
from jdp.cli import main as cli


def test_flops_per_image_is_the_lessons_model():
    assert bench_train.flops_per_image() == pytest.approx(13.5e6, rel=0.01)


def row(k, overhead, images_per_s, vs_1_device):
    return {"devices": k, "overhead": overhead, "images_per_s": images_per_s, "vs_1_device": vs_1_device}


def test_targets_report_misses():
    met = bench_train.check_targets([row(1, 1.05, 4000, 1.0), row(2, 1.08, 3900, 1.02), row(8, 1.2, 3100, 1.29)])
    assert all(t["met"] for t in met.values()) and met["max_k_vs_1_device"]["devices"] == 8
    missed = bench_train.check_targets([row(1, 1.05, 3000, 1.0), row(2, 1.2, 2900, 1.4)])
    assert not any(t["met"] for t in missed.values())
    assert missed["max_overhead_1_2_devices"]["measured"] == 1.2


@pytest.mark.slow
def test_quick_bench_end_to_end(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "jdp", "bench", "train", "--cpu-devices", "2", "--devices", "1", "--dataset", "synthetic",
         "--steps", "2", "--rounds", "1", "--out", str(tmp_path)],
        check=False, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("jdp bench train: LeNet (auto; devices 1: fast), global batch 256")
    assert lines[2].split()[:2] == ["float32", "1"] and lines[3].split()[:2] == ["bf16", "1"]
    assert lines[4].startswith("matmul peak (GFLOP/s): float32 ") and ", bf16 " in lines[4]
    record = json.loads((tmp_path / "bench_train.json").read_text())
    assert [(r["precision"], r["devices"]) for r in record["results"]] == [("float32", 1), ("bf16", 1)]
    for r in record["results"]:
        assert len(r["epoch_s"]) == len(r["floor_s"]) == 1
        assert r["overhead"] == pytest.approx(r["epoch_s"][0] / r["floor_s"][0])
        assert r["overhead_cpu"] == pytest.approx(r["epoch_cpu_s"][0] / r["floor_cpu_s"][0])
        assert r["images_per_s"] == pytest.approx(2 * 256 / r["epoch_s"][0])
        assert 0 < r["fraction_of_peak"] < 1
    assert [r["vs_1_device"] for r in record["results"]] == [1.0, 1.0]
    assert set(record["targets"]) == set(bench_train.TARGETS)
    assert set(record["matmul_peak_flops"]) == {"float32", "bf16"}
    assert min(record["matmul_peak_flops"].values()) > 1e9 and record["machine"]["jax_version"]


def test_bad_precision_list_is_refused_by_name(capsys):
    assert cli.main(["bench", "train", "--dataset", "synthetic", "--precision", "float32,fp8"]) == 2
    assert "`--precision` must be one of float32, bf16, got `fp8`" in capsys.readouterr().err


BASE = baselines.Baseline(machine="test box", cpu="Test CPU", vector_isa="avx2", host_cpus=2, device_kind="cpu",
                          float32_images_per_s={1: 1000.0, 2: 1500.0}, lesson_images_per_s=500.0,
                          measured="today", source="nowhere")


class FakeDevice:
    device_kind = "cpu"


def test_baseline_is_found_by_machine_kind_and_settings(monkeypatch):
    monkeypatch.setattr(baselines, "committed", lambda: (BASE,))
    here = {"cpu": "Test CPU", "vector_isa": "avx2", "host_cpus": 2}
    assert baselines.find(here, FakeDevice(), batch_size=256, formulation="fast") == BASE
    other_isa = {**here, "vector_isa": "avx512_bf16"}  # the same CPU model, other kernels
    assert baselines.find(other_isa, FakeDevice(), batch_size=256, formulation="fast") is None
    assert baselines.find({**here, "host_cpus": 4}, FakeDevice(), batch_size=256, formulation="fast") is None
    assert baselines.find(here, FakeDevice(), batch_size=128, formulation="fast") is None
    assert baselines.find(here, FakeDevice(), batch_size=256, formulation="reference") is None
    assert baselines.find(here, FakeDevice(), batch_size=256, formulation="split-4") == BASE  # jdp's step, rewritten
    assert baselines.ratio(BASE, 2, 3000.0) == 2.0 and baselines.ratio(BASE, 8, 3000.0) is None
    assert baselines.ratio(None, 1, 3000.0) is None


def test_a_kind_known_by_isa_and_cores_alone_has_a_baseline(monkeypatch):
    """Issue 26's Intel AMX kind: its CPU model string is unknown, so any model with that ISA and core count."""
    amx = BASE._replace(cpu=None, vector_isa="amx_bf16")
    named = BASE._replace(cpu="Intel Xeon 1", vector_isa="amx_bf16", machine="named")
    monkeypatch.setattr(baselines, "committed", lambda: (amx, named))
    xeon = {"cpu": "Intel Xeon 2", "vector_isa": "amx_bf16", "host_cpus": 2}
    assert baselines.find(xeon, FakeDevice(), batch_size=256, formulation="auto") == amx
    assert baselines.find({**xeon, "cpu": "Intel Xeon 1"}, FakeDevice(), batch_size=256, formulation="auto") == named
    assert baselines.find({**xeon, "host_cpus": 4}, FakeDevice(), batch_size=256, formulation="auto") is None


def test_the_intel_amx_kind_has_issue_26s_baseline():
    found = baselines.find({"cpu": "Intel(R) Xeon(R)", "vector_isa": "amx_bf16", "host_cpus": 2}, FakeDevice(),
                           batch_size=256, formulation="auto")
    assert found.float32_images_per_s == {1: 9558.0, 2: 12311.0} and found.lesson_images_per_s == 6548.0


def test_vector_isa_names_the_widest_instructions_the_cpu_reports():
    assert machine.vector_isa("fpu sse2 avx2 fma".split()) == "avx2"
    assert machine.vector_isa("avx2 avx512f avx512bw avx512_bf16 avx512_vnni".split()) == "avx512_bf16"
    assert machine.vector_isa("avx2 avx512f avx512bw".split()) == "avx512f"
    assert machine.vector_isa(["sse2"]) == "other" and machine.vector_isa([]) == "unknown"
    assert machine.machine()["vector_isa"] in ("amx_bf16", "avx512_bf16", "avx512f", "avx2", "other", "unknown")


def test_rounds_time_every_device_count_and_precision_in_turn(monkeypatch):
    """All configurations are prepared first, then each round visits each one: drift biases them alike."""
    visits = []

    def fake_prepare(devices, split, *, precision_name, **settings):
        def timed_round(r):
            visits.append((r, len(devices), precision_name))
            return {"floor_s": 1.0, "epoch_s": 1.0 + 0.1 * r, "floor_cpu_s": 1.0, "epoch_cpu_s": 1.0}
        return timed_round

    monkeypatch.setattr(bench_train, "prepare", fake_prepare)
    monkeypatch.setattr(bench_train, "matmul_peak", lambda device, precision_name: 1e11)
    record = bench_train.bench_train(jax.devices()[:2], None, timing=bench_train.Timing(steps=4, rounds=2),
                                     precisions=("float32", "bf16"), baseline=BASE)
    assert visits == [(r, k, name) for r in range(2) for k in (1, 2) for name in ("float32", "bf16")]
    first = record["results"][0]
    assert (first["devices"], first["precision"], first["epoch_s"]) == (1, "float32", [1.0, 1.1])
    assert first["overhead"] == 1.0 and first["images_per_s"] == 4 * 256 / 1.0
    per_image = bench_train.flops_per_image()  # twice the baseline's lesson (500 img/s) against the 100 GFLOP/s peak:
    assert first["twice_lesson_fraction_of_peak"] == pytest.approx(2 * 500.0 * per_image / 1e11)


def test_table_shows_each_precision_and_the_ratios():
    def result(name, k, images_per_s, vs_base):
        return {"precision": name, "devices": k, "epoch_s": [1.0], "floor_s": [1.0], "overhead": 1.0,
                "overhead_cpu": 1.0, "images_per_s": images_per_s, "floor_images_per_s": images_per_s,
                "sec_per_epoch": 60000 / images_per_s, "achieved_flops": 1e9, "fraction_of_peak": 0.5,
                "vs_1_device": 1.0, "vs_baseline": vs_base, "vs_lesson": images_per_s / 500.0, "formulation": "split-2",
                "twice_lesson_fraction_of_peak": 2 * 500.0 * 13.5e6 / {"float32": 1e11, "bf16": 2e11}[name]}

    record = {"results": [result("float32", 1, 1000.0, 1.0), result("bf16", 1, 2000.0, 2.0)],
              "matmul_peak_flops": {"float32": 1e11, "bf16": 2e11}, "flops_per_image": 13.5e6,
              "baseline": BASE._asdict(), "targets": {}}
    lines = bench_train.format_table(record, "header").splitlines()
    assert lines[2].split()[:2] == ["float32", "1"] and lines[2].split()[-3:] == ["1.00x", "2.00x", "split-2"]
    assert lines[3].split()[:2] == ["bf16", "1"] and lines[3].split()[-3:] == ["2.00x", "4.00x", "split-2"]
    assert "float32 100.0, bf16 200.0" in lines[4] and "test box" in lines[5] and "(500 img/s)" in lines[5]
    assert lines[2].split()[11] == "13.5%" and lines[3].split()[11] == "6.8%"  # 2x lesson: 2 * 500 * 13.5 MFLOP / peak


def test_the_loop_bench_times_train_and_a_bare_loop_in_each_round(devices):
    record = bench_loop.bench_loop(devices[:1], batch_size=16, steps=20, rounds=2, hidden=8)
    assert record["model"] == "tiny-mlp-8" and record["devices"] == 1
    assert {name: len(times) for name, times in record["rounds"].items()} == {"train_s": 2, "bare_s": 2, "windowed_s": 2,
                                                                              "runner_s": 2}
    best = record["seconds_per_step"]
    assert best == {name: min(times) for name, times in record["rounds"].items()} and min(best.values()) > 0
    assert record["train_vs_bare"] == pytest.approx(best["train_s"] / best["bare_s"])
    assert record["train_vs_runner"] * record["runner_vs_bare"] == pytest.approx(record["train_vs_bare"])
    json.dumps(record)  # what --out writes
    table = bench_loop.format_table([record], "header")
    assert table.splitlines()[2].split()[0] == "1" and "target train/bare <= 1.3" in table
