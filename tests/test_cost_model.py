"""The α–β–γ cost model (jdp.parallel.cost), its fit (`jdp bench allreduce --fit`) and `jdp predict`."""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.bench import fit, predict
from jdp.cli.main import main
from jdp.parallel import collectives, cost
from jdp.parallel.allreduce import get


def terms(name: str, k: int, leaf_bytes, per_node: int | None = None) -> dict:
    """The levels of the strategy `name` by its own cost (`Allreduce.cost`)."""
    leaves = [leaf_bytes] if isinstance(leaf_bytes, float | int) else leaf_bytes
    return get(name).cost.terms(k, leaves, per_node)


def sent_by(fn, k: int, n: int) -> tuple[int, int]:
    """(messages, float32 bytes) that `fn` passes to lax.ppermute, read from its traced program."""
    jaxpr = jax.make_jaxpr(lambda x: fn(x, "i"), axis_env=[("i", k)])(jnp.zeros(n))
    sends = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "ppermute"]
    return len(sends), sum(4 * math.prod(e.invars[0].aval.shape) for e in sends)


@pytest.mark.parametrize("k", [2, 4, 6, 7, 8])
def test_tree_terms_are_what_the_tree_sends(k):
    n = 840  # divisible by every p here: no padding
    messages, nbytes = sent_by(collectives.tree, k, n)
    t = cost.flat_terms("tree", k, 4 * n)
    assert (t.messages, t.bytes_sent) == (messages, nbytes)


@pytest.mark.parametrize("k", [2, 3, 8])
def test_ring_terms_match_its_docstring_and_its_loop(k):
    n = 4 * 840
    t = cost.flat_terms("ring", k, n)
    assert t.messages == 2 * (k - 1) and t.bytes_sent == pytest.approx(2 * (k - 1) / k * n)
    # each of the two fori_loops sends one chunk of N/k per step, k−1 steps
    jaxpr = jax.make_jaxpr(lambda x: collectives.ring(x, "i"), axis_env=[("i", k)])(jnp.zeros(840))
    text = str(jaxpr)
    assert text.count("ppermute") == 2 and f"f32[{840 // k}]" in text


def test_star_and_hierarchical_terms():
    n = 1000.0
    star = cost.flat_terms("star", 8, n)
    assert (star.messages, star.bytes_sent, star.bytes_reduced) == (14, 14 * n, 7 * n)
    levels = terms("hierarchical", 8, n, per_node=4)  # 2 hosts × 4
    assert levels["intra"] == cost.Terms(6, 2 * 3 / 4 * n, 3 / 4 * n, 2 * (2 * 3 * n))  # 2 node rings
    assert levels["inter"] == cost.Terms(2, 2 * 1 / 2 * n / 4, 1 / 2 * n / 4, 4 * (2 * 1 * n / 4), 4)  # 4 rings of 2
    tree = terms("hierarchical:tree", 16, n, per_node=4)["inter"]
    alone = cost.flat_terms("tree", 4, n / 4)
    assert (tree.messages, tree.bytes_sent, tree.bytes_total) == (alone.messages, alone.bytes_sent, 4 * alone.bytes_total)


def test_wrappers_change_messages_and_bytes():
    leaves = [4000.0] * 8
    per_leaf = terms("ring", 4, leaves)["intra"]
    fused = terms("ring+fused", 4, leaves)["intra"]
    assert per_leaf.messages == 8 * fused.messages and per_leaf.bytes_sent == pytest.approx(fused.bytes_sent)
    buckets = terms("ring+buckets0.01MB", 4, leaves)["intra"]  # 10485.76-byte buckets: 4 of them
    assert buckets.messages == 4 * fused.messages
    wire = terms("ring+bfloat16-wire+fused", 4, leaves)["intra"]
    assert wire.bytes_sent == fused.bytes_sent / 2 and wire.bytes_reduced == fused.bytes_reduced
    cast = terms("ring+bfloat16", 4, leaves)["intra"]
    assert cast.bytes_reduced == per_leaf.bytes_reduced / 2
    across = terms("ring", 16, 1000.0, per_node=8)
    assert across["intra"] == cost.Terms() and across["inter"].messages == 30
    assert get("ring+powersgd1").cost is None and get("ring+bfloat16").cost is not None



@pytest.mark.parametrize("name, k", [("psum", 2), ("hierarchical:psum:2x2", 4)])
def test_a_steps_psums_are_priced_once_because_xla_combines_them(name, k, devices):
    """XLA's all-reduce combiner merges the psums of a step's leaves into one all-reduce (the outer level's,
    for hierarchical:psum), so their cost prices the leaves as one buffer there; jdp's own ppermutes stay one
    per leaf. If XLA stopped combining, the compiled step would hold one all-reduce per leaf and this fails."""
    import optax

    from jdp import models
    from jdp.parallel.layout import replicate, split_batch
    from jdp.parallel.step import make_train_step

    model, optimizer, devices = models.get("lenet"), optax.sgd(0.1), devices[:k]
    params = model.init(jax.random.key(0))
    step = make_train_step(model.loss, optimizer, name, devices)
    batch = split_batch(np.zeros((2 * k, 1, 28, 28), np.float32), np.zeros(2 * k, np.int32), devices)
    hlo = step.lower(replicate(params, devices), replicate(optimizer.init(params), devices), *batch).compile().as_text()
    assert hlo.count(" all-reduce(") == 1
    leaves = predict.gradient_leaf_bytes("lenet")
    per_node = None if name == "psum" else 2
    as_leaves, as_one = terms(name, k, leaves, per_node), terms("hierarchical:ring:2x2" if per_node else "ring",
                                                               k, [sum(leaves)], per_node)
    combined = "inter" if per_node else "intra"
    assert as_leaves[combined].messages == as_one[combined].messages  # once, not once per leaf
    assert as_leaves[combined].bytes_sent == pytest.approx(as_one[combined].bytes_sent)
    assert terms(name.replace("psum", "ring"), k, leaves, per_node)[combined].messages == len(leaves) * as_one[combined].messages

def test_nnls_keeps_coefficients_non_negative():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    x = fit.nnls(a, np.array([1.0, -1.0, 0.0]))
    assert np.all(x >= 0) and x[1] == 0 and x[0] == pytest.approx(0.5)


def synthetic_rows(alpha: float, beta: float, counts=(2, 4, 6, 8), algorithms=("ring", "tree", "manual")) -> list[dict]:
    rows = []
    for name in algorithms:
        for k in counts:
            for size in (4096, 65536, 1 << 20, 1 << 24):
                m, b, _ = fit.features({"algorithm": name, "devices": k, "size_bytes": size})
                rows.append({"algorithm": name, "devices": k, "size_bytes": size, "time_us": (m * alpha + b * beta) * 1e6})
    return rows


def test_fit_recovers_known_alpha_beta_and_predicts_the_held_out_count():
    rows = synthetic_rows(5e-6, 1 / 2e9) + [{"algorithm": "gather_sum", "devices": 2, "size_bytes": 4, "time_us": 1.0}]
    said = []
    record = fit.fit_all(rows, held_out=6, say=said.append)
    assert said == ["fit: skipping `gather_sum`: no cost for it (`jdp.Allreduce.cost`; a plugin's strategy needs its `--plugin`)"]
    for name in ("ring", "tree", "manual"):
        f = record["algorithms"][name]
        assert f["alpha_s"] == pytest.approx(5e-6, rel=1e-9) and f["beta_s_per_byte"] == pytest.approx(5e-10, rel=1e-9)
        assert not f["gamma_fitted"] and f["gamma_s_per_byte"] == 0.0
        assert max(abs(r["relative_error"]) for r in f["residuals"]) < 1e-9
    assert record["held_out"]["devices"] == 6 and record["held_out"]["worst_relative_error"] < 1e-9


def test_bench_allreduce_fit_writes_fit_json(tmp_path, capsys):
    runs = []
    for k in (2, 4, 8):
        path = tmp_path / f"k{k}.json"
        path.write_text(json.dumps({"benchmark": "allreduce", "cpu": "test", "load_average": ["1.0"] * 3,
                                    "results": synthetic_rows(2e-5, 1e-9, counts=(k,))}))
        runs.append(str(path))
    assert main(["bench", "allreduce", "--fit", *runs, "--hold-out", "4", "--out", str(tmp_path / "fit")]) == 0
    printed = capsys.readouterr().out
    assert "held out: 4 devices, fitted on [2, 8]" in printed and "ring" in printed
    record = json.loads((tmp_path / "fit" / "fit.json").read_text())
    assert set(record["algorithms"]) == {"ring", "tree", "manual"}
    assert {"alpha_s", "beta_s_per_byte", "gamma_s_per_byte", "residuals"} <= set(record["algorithms"]["ring"])
    assert record["held_out"]["median_relative_error"] < 1e-9 and len(record["load_average_per_run"]) == 3
    assert (tmp_path / "fit" / "fit.png").stat().st_size > 1000
    assert main(["bench", "allreduce", "--fit", *runs, "--hold-out", "16"]) == 2


def test_predict_cli_prints_table_and_writes_figure(tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["predict", "--grad-bytes", "1e8", "--compute-ms-per-image", "1", "--network", "pcie4-10gbe",
                 "--devices", "8,64", "--strategies", "ring+fused", "hierarchical+fused", "ring+powersgd1",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipping `ring+powersgd1`" in printed and "*" in printed
    record = json.loads((out / "predict.json").read_text())
    at64 = record["rows"][1]
    assert at64["best"] == "hierarchical+fused"  # one 10 GbE NIC per node: the flat ring crosses it with all N
    assert at64["strategies"]["ring+fused"]["efficiency"] < at64["strategies"]["hierarchical+fused"]["efficiency"]
    assert (out / "predict.png").stat().st_size > 1000
    assert main(["predict", "--grad-bytes", "1e8", "--network", "nowhere"]) == 2


def test_nvlink4_preset_predicts_nccl_ring_bus_bandwidth():
    """Calibration against a measurement the preset was not derived from.

    Source: NCCL maintainer Sylvain Jeaugey, https://github.com/NVIDIA/nccl-tests/issues/212 (2024-05-06),
    8×H100 (NVLink 4, NVSwitch): "With the protocol overhead (~20%) NCCL can get an effective NVLink
    bandwidth of 370GB/s, which you can observe as "BusBw" ... when running with `NCCL_ALGO=RING`."
    The preset comes from the datasheet's 900 GB/s (450 GB/s per direction) and NCCL's hwLat.
    """
    published_busbw = 370e9
    k, size = 8, 8 * 2**30  # nccl-tests' largest default size, where bandwidth dominates
    t = predict.allreduce_seconds("ring", k, [size], predict.CLUSTERS["nvlink4-ib-ndr"])
    predicted_busbw = size / t * 2 * (k - 1) / k
    assert abs(predicted_busbw / published_busbw - 1) <= 0.25, predicted_busbw / 1e9


def test_on_a_shared_host_every_flat_algorithm_moves_the_same_bytes_and_the_fit_recovers_them():
    k, n = 6, 1000.0
    assert {cost.flat_terms(a, k, n).bytes_total for a in ("star", "ring", "tree")} == {2 * (k - 1) * n}
    rows = []
    for k in (2, 3, 4):
        for size in (4096, 1 << 20, 1 << 24):
            m, b, r = fit.features({"algorithm": "ring", "devices": k, "size_bytes": size}, shared=True)
            assert b == 2 * (k - 1) * size and r == 0
            rows.append({"algorithm": "ring", "devices": k, "size_bytes": size, "time_us": (m * 3e-5 + b * 1e-9) * 1e6})
    f = fit.fit_all(rows, shared=True)["algorithms"]["ring"]
    assert f["shared"] and f["alpha_s"] == pytest.approx(3e-5) and f["beta_s_per_byte"] == pytest.approx(1e-9)
    link = cost.Link(f["alpha_s"], f["beta_s_per_byte"], shared=True)
    assert cost.seconds(terms("ring", 3, 1 << 20), link, link) * 1e6 == pytest.approx(rows[4]["time_us"])


def test_predict_reads_compute_time_from_bench_train(tmp_path, capsys):
    train = tmp_path / "bench_train.json"
    train.write_text(json.dumps({"results": [{"precision": "float32", "devices": 1, "images_per_s": 500.0},
                                             {"precision": "float32", "devices": 2, "images_per_s": 900.0}]}))
    out = tmp_path / "p"
    assert main(["predict", "--model", "lenet", "--train-json", str(train), "--batch-per-device", "10",
                 "--network", "nvlink4-ib-ndr", "--devices", "8", "--out", str(out)]) == 0
    record = json.loads((out / "predict.json").read_text())
    assert record["compute_ms"] == pytest.approx(20.0) and record["gradient_bytes"] == 4 * 129_068  # LeNet's params
    assert main(["predict", "--model", "lenet", "--compute-ms-per-image", "1", "--train-json", str(train)]) == 2


def test_ib_ndr_preset_predicts_nccl_ring_bandwidth_per_nic():
    """Calibration of the InfiniBand NDR preset (from its 400 Gb/s line rate) against a published rate.

    Source: NVIDIA's David Addison (AddyLaddy), https://github.com/NVIDIA/nccl-tests/issues/290
    (2025-03-03), on H100 nodes over InfiniBand with NCCL_ALGO=RING: "For NDR @ 400Gbps you
    should see 46-48GB/s per NIC." Modelled: 2 nodes, one GPU and one NDR NIC each, an 8 GiB ring.
    """
    published_per_nic = 47e9  # the middle of 46-48 GB/s
    two_nodes = predict.Cluster(1, predict.LINKS["nvlink4"], predict.LINKS["ib-ndr"], 1, "1 GPU + 1 NDR NIC per node")
    k, size = 2, 8 * 2**30
    t = predict.allreduce_seconds("ring", k, [size], two_nodes)
    predicted_busbw = size / t * 2 * (k - 1) / k
    assert abs(predicted_busbw / published_per_nic - 1) <= 0.25, predicted_busbw / 1e9


def test_fit_reads_hierarchical_rows_by_their_hosts_and_skips_them_without():
    rows = []
    for k, hosts in ((4, 2), (8, 2), (8, 4)):
        for size in (4096, 1 << 20, 1 << 24):
            row = {"algorithm": "hierarchical:tree", "devices": k, "hosts": hosts, "size_bytes": size}
            m, b, _ = fit.features(row)
            rows.append({**row, "time_us": (m * 2e-5 + b * 1e-9) * 1e6})
    f = fit.fit_all(rows)["algorithms"]["hierarchical:tree"]
    assert f["alpha_s"] == pytest.approx(2e-5) and f["beta_s_per_byte"] == pytest.approx(1e-9)
    said = []
    assert fit.fit_all([{k: v for k, v in r.items() if k != "hosts"} for r in rows], say=said.append)["algorithms"] == {}
    assert said == ["fit: skipping `hierarchical:tree`: its rows do not say how many hosts (`hosts`) its devices are on"]
    named = {"algorithm": "hierarchical:tree:2x4", "devices": 8, "size_bytes": 1 << 20}  # as `bench allreduce` names it
    assert fit.features(named) == fit.features({**named, "algorithm": "hierarchical:tree", "hosts": 2})
    assert fit.features(named) != fit.features({**named, "algorithm": "hierarchical:tree", "hosts": 4})
    grouped = [{**r, "algorithm": f"hierarchical:tree:{r['hosts']}x{r['devices'] // r['hosts']}"} for r in rows]
    assert fit.fit_all(grouped)["algorithms"]["hierarchical:tree"]["alpha_s"] == pytest.approx(2e-5)


def test_hierarchical_bf16_wire_halves_only_the_bytes_across_hosts():
    plain = terms("hierarchical", 8, 1000.0, per_node=4)
    wire = terms("hierarchical+bfloat16-wire", 8, 1000.0, per_node=4)
    assert wire["intra"] == plain["intra"] and wire["inter"].bytes_sent == plain["inter"].bytes_sent / 2
    cast = terms("hierarchical+bfloat16", 8, 1000.0, per_node=4)
    assert cast["intra"].bytes_sent == plain["intra"].bytes_sent / 2
