import json
import subprocess
import sys

import pytest

from jdp.bench import train as bench_train


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
    assert lines[0].startswith("jdp bench train: LeNet (fast), global batch 256")
    assert lines[2].split()[0] == "1" and lines[3].startswith("matmul peak")
    record = json.loads((tmp_path / "bench_train.json").read_text())
    assert [r["devices"] for r in record["results"]] == [1]
    for r in record["results"]:
        assert len(r["epoch_s"]) == len(r["floor_s"]) == 1
        assert r["overhead"] == pytest.approx(r["epoch_s"][0] / r["floor_s"][0])
        assert r["overhead_cpu"] == pytest.approx(r["epoch_cpu_s"][0] / r["floor_cpu_s"][0])
        assert r["images_per_s"] == pytest.approx(2 * 256 / r["epoch_s"][0])
        assert 0 < r["fraction_of_peak"] < 1
    assert record["results"][0]["vs_1_device"] == 1.0
    assert set(record["targets"]) == set(bench_train.TARGETS)
    assert record["matmul_peak_flops"] > 1e9 and record["machine"]["jax_version"]
