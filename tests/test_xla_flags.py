import json
import os
import subprocess
import sys

from jdp.runtime import xla_flags


def test_supported_matches_whole_nul_terminated_names(tmp_path):
    lib = tmp_path / "libfake.so"
    lib.write_bytes(b"\x7fELF...xla_cpu_a\0junk xla_cpu_bb_c\0")
    names = {"xla_cpu_a", "xla_cpu_b", "xla_cpu_bb_c", "xla_cpu_bb"}
    assert xla_flags.supported(names, [lib]) == {"xla_cpu_a", "xla_cpu_bb_c"}


def test_a_made_up_flag_is_not_supported_by_the_installed_jaxlib():
    assert xla_flags.supported({"xla_cpu_no_such_flag_jdp"}) == set()


SCRIPT = """
import json, os, sys
from jdp.runtime import xla_flags
results = {}
os.environ["XLA_FLAGS"] = "--xla_cpu_experimental_onednn_custom_call=false"
results["user_flag_kept"] = [xla_flags.enable(), os.environ["XLA_FLAGS"]]
os.environ["XLA_FLAGS"] = ""
results["disabled"] = [xla_flags.enable(disabled=True), os.environ["XLA_FLAGS"]]
os.environ["JDP_NO_XLA_FLAGS"] = "1"
results["env_disabled"] = [xla_flags.enable(), os.environ["XLA_FLAGS"]]
del os.environ["JDP_NO_XLA_FLAGS"]
results["enabled"] = [xla_flags.enable(), os.environ["XLA_FLAGS"]]
import jax
jax.numpy.ones(3).block_until_ready()  # XLA parses the flags here; an unknown name would abort
results["too_late"] = [xla_flags.enable(), os.environ["XLA_FLAGS"]]
print(json.dumps(results))
"""


def test_enable_sets_supported_flags_once_and_can_be_turned_off():
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", xla_flags.DISABLE_ENV)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    usable = xla_flags.supported(xla_flags.PERFORMANCE_FLAGS)
    expected = [f"--{name}={value}" for name, value in xla_flags.PERFORMANCE_FLAGS.items() if name in usable]
    assert results["enabled"] == [expected, " ".join(expected)]
    assert results["disabled"] == results["env_disabled"] == [[], ""]
    added, flags = results["user_flag_kept"]
    assert "--xla_cpu_experimental_onednn_custom_call=false" in flags
    assert not any("onednn" in flag for flag in added)  # the user's choice wins
    assert results["too_late"] == [[], " ".join(expected)]
