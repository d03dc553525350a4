"""`--formulation auto`: a pure choice from the table, recorded in history.json and the checkpoints, kept on resume;
the split formulations' gradients are checked against the reference in tests/test_fast.py."""

import json

import jax
import jax.numpy as jnp
import pytest

from jdp.cli import main as cli
from jdp.errors import ConfigError, DataError
from jdp.models import lenet_fast
from jdp.runtime import machine_kind
from jdp.runtime.machine_kind import MachineKind
from jdp.training import checkpoint, formulation
from jdp.training.config import TrainConfig
from jdp.training.formulation import Entry

BOX = MachineKind("Test CPU 9000", "avx512_bf16", 2, "cpu")
OTHER_MODEL = BOX._replace(cpu="Test CPU 9001")
TABLE = (Entry(BOX, 1, "split-4", "measured here"), Entry(BOX, 2, "split-2", "measured here"),
         Entry(MachineKind(None, "avx512_bf16", 2, "cpu"), 1, "split-2", "any model with this ISA"))


def test_auto_is_a_pure_function_of_kind_device_count_and_table(monkeypatch):
    monkeypatch.setattr(formulation, "committed", lambda: TABLE)
    for _ in range(2):  # the same answer every time
        assert formulation.resolve("auto", BOX, 1).formulation == "split-4"
    assert formulation.resolve("auto", BOX, 2).formulation == "split-2"
    assert formulation.resolve("auto", OTHER_MODEL, 1).formulation == "split-2"  # matched by ISA and cores alone
    unknown = [BOX._replace(vector_isa="avx2"), BOX._replace(host_cpus=4), BOX._replace(device_kind="NVIDIA H200")]
    for kind in unknown:
        choice = formulation.resolve("auto", kind, 1)
        assert choice.formulation == "fast" and choice.source.startswith("default: no measurement")
    assert formulation.resolve("auto", BOX, 8).formulation == "fast"  # a device count nobody measured
    assert formulation.resolve("reference", BOX, 1) == ("reference", "reference", "given")  # a name is itself
    cache = [Entry(BOX, 1, "fast", "my own run")]
    assert formulation.resolve("auto", BOX, 1, cache).formulation == "fast"  # the user's cache first
    assert formulation.resolve("auto", BOX, 2, cache).formulation == "split-2"


def test_committed_entries_name_trained_formulations_and_their_source():
    for entry in formulation.committed():
        assert entry.formulation in lenet_fast.FORMULATIONS and entry.source
    amx = MachineKind("Intel(R) Xeon(R) whatever", "amx_bf16", 2, "cpu")
    assert formulation.resolve("auto", amx, 1).formulation == "split-4"  # issue 26's measurement


def test_committed_tables_are_data_files_read_from_the_checkout(tmp_path, monkeypatch):
    from jdp.runtime import measurements

    assert (measurements.RESULTS / formulation.COMMITTED_TABLE).is_file() and len(formulation.committed()) >= 4
    monkeypatch.setattr(measurements, "RESULTS", tmp_path)  # an install without experiments/: no committed table
    assert measurements.read(formulation.COMMITTED_TABLE, "entries") == []
    (tmp_path / "formulations").mkdir()
    (tmp_path / formulation.COMMITTED_TABLE).write_text('{"entries": {"not": "a list"}}')
    with pytest.raises(DataError, match="holds no list under `entries`"):
        measurements.read(formulation.COMMITTED_TABLE, "entries")


def test_cache_round_trip_replaces_an_entry_of_the_same_kind(tmp_path, monkeypatch):
    monkeypatch.setenv(formulation.CACHE_ENV, str(tmp_path))
    assert formulation.read_cache() == []
    formulation.write_entry(Entry(BOX, 1, "split-2", "first"))
    formulation.write_entry(Entry(OTHER_MODEL, 1, "fast", "other"))
    formulation.write_entry(Entry(BOX, 1, "split-4", "second"))
    assert formulation.read_cache() == [Entry(BOX, 1, "split-4", "second"), Entry(OTHER_MODEL, 1, "fast", "other")]
    (tmp_path / formulation.CACHE_FILE).write_text('{"entries": [{"cpu": "x"}]}')
    with pytest.raises(DataError, match="is not a formulation table"):
        formulation.read_cache()


def test_a_bad_formulation_is_refused_by_name():
    with pytest.raises(ConfigError, match="`formulation` must be auto or one of reference, fast, split-2, split-4"):
        TrainConfig(formulation="split-3")
    assert TrainConfig(model_impl="reference").formulation == "reference"  # the earlier name still works


def test_a_resumed_auto_run_takes_the_checkpoints_formulation(tmp_path, monkeypatch):
    """Whatever the table and the machine say now; a run that does not resume takes the table's."""
    monkeypatch.setattr(formulation, "this_kind", lambda device_kind: BOX)
    monkeypatch.setattr(formulation, "committed", lambda: TABLE)
    auto, devices = TrainConfig(formulation="auto"), jax.devices()[:1]
    checkpoint.save(tmp_path, 8, {"x": jnp.zeros(2)}, {"run": {"config": {**auto.to_dict(), "formulation": "split-2"}}})
    assert formulation.settle(auto, devices, tmp_path, resume=True) == (
        TrainConfig(formulation="split-2"), ("split-2", "auto", "the checkpoint resumed"))
    assert formulation.settle(auto, devices, tmp_path, resume=False)[0].formulation == "split-4"  # TABLE's
    assert formulation.settle(auto, devices, tmp_path / "empty", resume=True)[0].formulation == "split-4"
    old = {k: v for k, v in auto.to_dict().items() if k != "formulation"}
    checkpoint.save(tmp_path, 9, {"x": jnp.zeros(2)}, {"run": {"config": {**old, "model_impl": "reference"}}})
    assert formulation.settle(auto, devices, tmp_path, resume=True)[0].formulation == "reference"  # before the rename
    explicit = TrainConfig(formulation="fast")
    assert formulation.settle(explicit, devices, tmp_path, resume=True)[0] is explicit  # a name is kept, with a note


@pytest.mark.slow
def test_auto_is_recorded_and_a_resume_keeps_the_checkpoints_choice(tmp_path, monkeypatch, capsys):
    """`jdp train`: 1 epoch of 8 steps on 1 device under a table choosing split-2; then the table says split-4 and
    the machine is another kind: the resumed run keeps split-2, in history.json and in its checkpoints."""
    monkeypatch.setenv(formulation.CACHE_ENV, str(tmp_path / "cache"))  # no user table
    monkeypatch.setattr(formulation, "this_kind", lambda device_kind: BOX)
    monkeypatch.setattr(formulation, "committed", lambda: (Entry(BOX, 1, "split-2", "test table"),))
    args = ["train", "--dataset", "synthetic", "--devices", "1", "--batch-size", "256", "--no-progress",
            "--checkpoint-dir", str(tmp_path / "ckpt")]
    assert cli.main([*args, "--epochs", "1", "--out", str(tmp_path / "first")]) == 0
    assert "formulation: split-2 (committed table: test table)\n" in capsys.readouterr().out  # said as it starts
    first = json.loads((tmp_path / "first" / "history.json").read_text())
    assert first["config"]["formulation"] == "split-2"
    assert first["formulation"] == {"formulation": "split-2", "requested": "auto",
                                    "source": "committed table: test table"}
    assert checkpoint.latest_info(tmp_path / "ckpt")["run"]["config"]["formulation"] == "split-2"

    monkeypatch.setattr(formulation, "this_kind", lambda device_kind: OTHER_MODEL)
    monkeypatch.setattr(formulation, "committed", lambda: (Entry(OTHER_MODEL, 1, "split-4", "changed"),))
    assert cli.main([*args, "--epochs", "2", "--resume", "--out", str(tmp_path / "resumed")]) == 0
    assert "formulation: split-2 (the checkpoint resumed)\n" in capsys.readouterr().out
    resumed = json.loads((tmp_path / "resumed" / "history.json").read_text())
    assert resumed["formulation"] == {"formulation": "split-2", "requested": "auto", "source": "the checkpoint resumed"}
    assert [e["epoch"] for e in resumed["epochs"]] == [1, 2]
    assert checkpoint.latest_info(tmp_path / "ckpt")["run"]["config"]["formulation"] == "split-2"


def test_machine_kind_matches_a_known_kind_by_isa_and_cores_when_its_model_is_unknown():
    wildcard = BOX._replace(cpu=None)
    assert machine_kind.matches(wildcard, BOX) and machine_kind.matches(BOX, BOX)
    assert not machine_kind.matches(BOX, OTHER_MODEL) and not machine_kind.matches(wildcard, BOX._replace(host_cpus=4))
    assert machine_kind.best_match([wildcard, BOX], lambda k: k, BOX) == BOX  # the model-named kind first
