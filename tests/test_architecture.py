"""docs/architecture.md's recipes run as written: every ```python block, in order, in one namespace."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import jdp
from jdp.bench import fit, predict
from jdp.bench.predict import CLUSTERS
from jdp.cli.main import main
from jdp.training.build import checkpoint_target
from test_imports import LAYERS, ROOT, import_graph

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
BLOCKS = re.findall(r"^### (.+?)$.*?^```python\n(.*?)^```$", DOC.read_text(), re.S | re.M)
# The layer table: (layer, [modules]) per row, e.g. ("4.2", ["jdp.parallel.collectives", "jdp.parallel.transfers"])
TABLE = [(layer, re.findall(r"`(jdp[\w.]*)`", modules))
         for layer, modules in re.findall(r"^\| ([\d.]+) \| (.+?) \|", DOC.read_text(), re.M)]


def sublayer_problems(table: list[tuple[str, list[str]]], graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """How jdp.parallel's modules break the table's sub-layers 4.0–4.8: a module in no row, or one importing a
    module of a higher sub-layer."""
    order = {module: float(layer) for layer, modules in table if layer.startswith("4.") for module in modules}
    problems = [f"{m} is in no 4.x row of docs/architecture.md's table" for m in sorted(graph)
                if m.startswith("jdp.parallel.") and m not in order]
    for module, targets in sorted(graph.items()):
        for target, line in targets:
            if module in order and target in order and order[target] > order[module]:
                problems.append(f"{module}:{line} (layer {order[module]}) imports {target} (layer {order[target]})")
    return problems


def test_every_recipe_has_a_program():
    assert [title for title, _ in BLOCKS] == ["A new allreduce strategy", "A new model",
                                              "A new optimizer, or a new optimizer-state variant",
                                              "A new sync algorithm"]


@pytest.mark.parametrize("title,code", BLOCKS, ids=[title for title, _ in BLOCKS])
def test_recipe_runs(title, code, registry_restored):
    exec(compile(code, f"{DOC.name}: {title}", "exec"), {"devices": jax.devices()[:8]})


@pytest.fixture
def registry_restored():
    """The registries of allreduce strategies and sync algorithms as they were before the test."""
    from jdp.parallel import allreduce, sync

    saved = [(registry, dict(registry)) for registry in (allreduce._STRATEGIES, sync._SYNCS)]
    yield
    for registry, entries in saved:
        registry.clear()
        registry.update(entries)


@pytest.fixture
def gather_sum_plugin(tmp_path, monkeypatch, registry_restored):
    """The allreduce recipe saved as the plugin file `gather_sum.py`, importable."""
    code = dict(BLOCKS)["A new allreduce strategy"]
    (tmp_path / "gather_sum.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("gather_sum", None)


def test_allreduce_recipe_is_exact_and_predicted_by_its_own_cost(gather_sum_plugin, capsys):
    import gather_sum

    from jdp.testing import check_allreduce

    check_allreduce(gather_sum.strategy, device_counts=(1, 2, 3), sgd_steps=1)  # sums, halves, SGD (and sharded)
    out = gather_sum_plugin / "p"
    assert main(["predict", "--plugin", "gather_sum", "--strategies", "gather_sum", "ring", "--grad-bytes", "1e8",
                 "--compute-ms-per-image", "1", "--network", "pcie4-10gbe", "--devices", "8,64", "--out", str(out)]) == 0
    assert "skipping" not in capsys.readouterr().out
    rows = json.loads((out / "predict.json").read_text())["rows"]
    intra = CLUSTERS["pcie4-10gbe"].intra  # 8 devices: one node, k − 1 messages of N on its PCIe
    assert rows[0]["strategies"]["gather_sum"]["allreduce_ms"] == pytest.approx(7 * (intra.alpha + 1e8 * intra.beta) * 1e3)
    assert rows[1]["strategies"]["gather_sum"]["allreduce_ms"] > rows[1]["strategies"]["ring"]["allreduce_ms"]
    timed = [{"algorithm": "gather_sum", "devices": k, "size_bytes": size, "time_us": (k - 1) * (20 + size / 1e3)}
             for k in (2, 3, 4) for size in (4096, 1 << 20)]  # α = 20 µs, β = 1 ns/B, by its own cost
    record = fit.fit_all(timed, held_out=4)
    assert record["algorithms"]["gather_sum"]["alpha_s"] == pytest.approx(2e-5)
    assert record["held_out"]["worst_relative_error"] < 1e-9
    assert predict.allreduce_seconds("gather_sum+fused", 4, [4096.0], record) == pytest.approx(3 * (20 + 4.096) * 1e-6)


@pytest.mark.slow
def test_allreduce_recipe_trains_from_the_cli(gather_sum_plugin):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(gather_sum_plugin), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "jdp", "train", "--plugin", "gather_sum", "--allreduce", "gather_sum",
                           "--shard-optimizer", "--cpu-devices", "2", "--dataset", "synthetic", "--epochs", "1",
                           "--no-progress", "--check-replicas", "1"], cwd=gather_sum_plugin, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert re.search(r"^test acc: \d\.\d\d, ", done.stdout, re.M), done.stdout


@pytest.fixture
def ema_average_plugin(tmp_path, monkeypatch, registry_restored):
    """The sync recipe saved as the plugin file `ema_average.py`, importable."""
    (tmp_path / "ema_average.py").write_text(dict(BLOCKS)["A new sync algorithm"])
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("ema_average", None)


def max_difference(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in
               zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_sync_recipe_is_exact_at_h1(ema_average_plugin, devices):
    """H = 1, plain SGD: the replicas follow every-step training (the same losses); with decay 0 the
    model returned, the EMA, is its params too; with decay 0.9 it lags them. The EMA is checkpointed."""
    import ema_average

    small = jdp.synthetic_dataset(jax.random.key(0), 256, 32)
    config = jdp.TrainConfig(batch_size=32, lr=0.1, epochs=1)  # 8 steps
    every_step, every_history = jdp.train(config, small, devices[:4])
    for decay, close in ((0.0, True), (0.9, False)):
        synced = dataclasses.replace(config, sync=jdp.get_sync(ema_average.ema_average(decay), every=1))
        params, history = jdp.train(synced, small, devices[:4], guards=jdp.Guards(check_replicas=1))
        assert history[0].syncs == 8
        assert history[0].train_loss == pytest.approx(every_history[0].train_loss, rel=1e-6)
        assert (max_difference(params, every_step) < 1e-6) is close  # rounding only; the EMA lags by ~1e-2
    assert "ema-average" in jdp.sync_names()
    target = checkpoint_target(dataclasses.replace(config, sync="ema-average"), device_count=4)
    assert jax.tree.map(np.shape, target["opt_state"]["outer"]["ema"]) == jax.tree.map(np.shape, every_step)


@pytest.mark.slow
def test_sync_recipe_trains_from_the_cli_exact_at_h1(ema_average_plugin):
    """`jdp train --plugin ema_average --sync ema-average --sync-every 1` and every-step training: the same
    losses, a sync after every step, identical replicas after each."""
    path = [str(ema_average_plugin), os.environ.get("PYTHONPATH")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
    flags = ["--cpu-devices", "2", "--dataset", "synthetic", "--epochs", "1", "--no-progress", "--check-replicas", "1"]
    runs = {"ema": ["--plugin", "ema_average", "--sync", "ema-average", "--sync-every", "1"], "every": []}
    procs = {name: subprocess.Popen([sys.executable, "-m", "jdp", "train", *flags, *extra, "--out", name],
                                    cwd=ema_average_plugin, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True) for name, extra in runs.items()}
    for proc in procs.values():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
        assert re.search(r"^test acc: \d\.\d\d, ", out, re.M), out
    ema, every = (json.loads((ema_average_plugin / name / "history.json").read_text()) for name in ("ema", "every"))
    assert ema["config"]["sync"] == "ema-average" and ema["epochs"][0]["syncs"] == every["epochs"][0]["syncs"]
    assert ema["epochs"][0]["train_loss"] == pytest.approx(every["epochs"][0]["train_loss"], rel=1e-6)


def test_the_table_lists_the_layers_the_import_test_enforces():
    rows = {int(float(layer)): set() for layer, _ in TABLE}
    for layer, modules in TABLE:
        rows[int(float(layer))] |= {"jdp.parallel" if m.startswith("jdp.parallel.") else m for m in modules}
    assert rows == {layer: set(names) for layer, names in LAYERS if layer in rows}


def test_modules_of_jdp_parallel_import_only_their_sublayer_or_lower():
    _, graph = import_graph(ROOT / "jdp")
    assert sublayer_problems(TABLE, graph) == []


def test_the_sublayer_check_catches_an_import_against_the_order():
    _, graph = import_graph(ROOT / "jdp")
    planted = {**graph, "jdp.parallel.cost": [("jdp.parallel.step", 3)], "jdp.parallel.zero": []}
    assert sublayer_problems(TABLE, planted) == [
        "jdp.parallel.zero is in no 4.x row of docs/architecture.md's table",
        "jdp.parallel.cost:3 (layer 4.0) imports jdp.parallel.step (layer 4.7)"]


def placement_comparisons(root: Path) -> list[str]:
    """The files with `x.where == "inside"`-style comparisons (a strategy's placement read as a string)."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                    isinstance(side, ast.Attribute) and side.attr == "where" for side in (node.left, *node.comparators)):
                found.append(str(path.relative_to(root.parent)))
    return sorted(set(found))


def test_a_strategy_placement_is_read_from_its_owner_only(tmp_path):
    """Wrappers and steps ask the strategy (`inside`, `lead`, `local`, `wrapped`), never compare its `where`."""
    assert placement_comparisons(ROOT / "jdp") == ["jdp/parallel/strategy.py"]
    (tmp_path / "jdp").mkdir()
    (tmp_path / "jdp" / "wrapper.py").write_text('def f(s):\n    return 1 if s.where == "inside" else 2\n')
    assert placement_comparisons(tmp_path / "jdp") == ["jdp/wrapper.py"]  # the check sees one


def test_a_config_builds_its_components_once_for_a_whole_run(monkeypatch, tmp_path, devices):
    """`jdp.train` with checkpoints, the run's bytes (payload_bytes) and the checkpoint's layout reuse the
    components built when the config was made: each registry is asked once (a named model, optimizer,
    strategy and sync: each built from its settings)."""
    from jdp import models
    from jdp.parallel import allreduce, sync
    from jdp.training import config as config_lib
    from jdp.training import optimizers

    calls = {"model": 0, "optimizer": 0, "strategy": 0, "sync": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for module, function, name in ((models, "get", "model"), (optimizers, "make", "optimizer"),
                                   (allreduce, "get", "strategy"), (sync, "get", "sync")):
        monkeypatch.setattr(module, function, counted(name, getattr(module, function)))
    config = jdp.TrainConfig(batch_size=32, epochs=1, model="lenet", optimizer="momentum", allreduce="psum",
                             sync="every-step", formulation="fast")
    jdp.train(config, jdp.synthetic_dataset(jax.random.key(0), 64, 32), devices[:2],
              checkpoints=jdp.Checkpoints(tmp_path))
    config_lib.payload_bytes(config)
    checkpoint_target(config, 2)
    assert calls == {"model": 1, "optimizer": 1, "strategy": 1, "sync": 1}


def oversized_functions(root: Path, most_lines: int = 80, most_parameters: int = 7) -> list[str]:
    """The functions under `root` longer than `most_lines` or taking more than `most_parameters` (self and cls
    not counted), as "path:line name (lines, parameters)"."""
    import ast

    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [p.arg for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None]
                parameters = len([n for n in names if n not in ("self", "cls")])
                lines = node.end_lineno - node.lineno + 1
                if lines > most_lines or parameters > most_parameters:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines}, {parameters})")
    return found


def test_no_function_is_over_80_lines_or_7_parameters(tmp_path):
    assert oversized_functions(ROOT / "jdp") == []
    (tmp_path / "jdp").mkdir()
    (tmp_path / "jdp" / "long.py").write_text("def f(a, b, c, d, e, f, g, h):\n    return a\n")
    assert oversized_functions(tmp_path / "jdp") == ["jdp/long.py:1 f (2, 8)"]  # the check sees one
