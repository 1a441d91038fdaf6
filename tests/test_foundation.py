"""Foundation: the plugin loads in every vLLM process, vLLM loads the bundled
pair, and vLLM's own EAGLE chain on each bundled head is lossless."""
import importlib.metadata as md
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from vllm_eagle_tree import assets
from vllm_eagle_tree.plugin import UnsupportedVLLMVersion, check_vllm_version

from vllm_helpers import free_llm, greedy_token_ids, make_llm

ASSET_LIMIT_MB = 40


def test_entry_point_is_declared():
    eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "vllm_eagle_tree"]
    assert len(eps) == 1
    assert eps[0].value == "vllm_eagle_tree.plugin:register"
    assert eps[0].load().__module__ == "vllm_eagle_tree.plugin"


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.7"])
def test_supported_versions_pass(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.32.0", "garbage"])
def test_unsupported_versions_fail_clearly(version):
    with pytest.raises(UnsupportedVLLMVersion, match="vLLM 0.32.x"):
        check_vllm_version(version)


def test_triton_kernels_not_top_level():
    """vLLM probes a top-level `triton_kernels` for OpenAI's MoE kernels
    (vllm/utils/import_utils.py has_triton_kernels): ours must only be
    importable as vllm_eagle_tree.triton_kernels, also in the test process."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("triton_kernels")
    assert spec is None or not Path(spec.origin).resolve().is_relative_to(assets.ROOT), spec
    ours = importlib.util.find_spec("vllm_eagle_tree.triton_kernels")
    assert Path(ours.origin).resolve() == assets.ROOT / "triton_kernels" / "__init__.py"


def test_scripts_do_not_expose_triton_kernels():
    """Loading a script the README runs must not make the repo's
    triton_kernels/ importable as a top-level module."""
    for script in ("demo.py", "bench_baseline.py", "bench_paired.py", "bench_tau.py", "build_pair.py",
                   "make_deep_target.py", "profile_steps.py"):
        code = (f"import runpy, importlib.util; runpy.run_path({str(assets.ROOT / 'scripts' / script)!r}, "
                "run_name='not_main'); print(importlib.util.find_spec('triton_kernels'))")
        out = subprocess.run([sys.executable, "-P", "-c", code], cwd=assets.ROOT,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip().splitlines()[-1] == "None", (script, out.stdout)


REGISTRY_SCRIPT = textwrap.dedent("""
    import os, sys
    from vllm import LLM, SamplingParams
    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
                  tensor_parallel_size=2, distributed_executor_backend="mp")
        out = llm.generate(["def f(x):"], SamplingParams(temperature=0, max_tokens=4))
        print("GENERATED", len(out[0].outputs[0].token_ids))
""")


LOGGING_SCRIPT = textwrap.dedent("""
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    configure_logging(LoggingConfig())  # as vLLM's engine, core and workers do at start
    from vllm_eagle_tree import plugin
    from vllm_eagle_tree.adapter import cpu_tree_attention, runner
    for module in (plugin, runner, cpu_tree_attention):
        module.logger.info("eagle-tree line from %s", module.__name__)
""")


def test_plugin_logs_through_vllms_logging():
    """The plugin's INFO lines (e.g. the goodput probe's result) come out
    where vLLM's do, in its format, at vLLM's default level: the plugin's
    loggers are children of vLLM's ``vllm`` logger. (A logger of its own
    has no handler: its INFO lines were dropped.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LOGGING")}
    out = subprocess.run([sys.executable, "-P", "-c", LOGGING_SCRIPT], cwd=assets.ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if "eagle-tree line from" in ln]
    assert len(lines) == 3, out.stdout[-2000:] + out.stderr[-2000:]
    for line, module in zip(lines, ("plugin", "runner", "cpu_tree_attention")):
        # vLLM's format: (process) level date time [file:line] message
        assert "INFO" in line.split(), line
        assert "[<string>:" in line, line
        assert line.endswith(f"vllm_eagle_tree.{'adapter.' if module != 'plugin' else ''}{module}")


@pytest.mark.slow
def test_register_runs_in_every_vllm_process(tmp_path):
    """Main process, EngineCore and each TP worker (mp executor) register."""
    record = tmp_path / "registered.txt"
    script = tmp_path / "run.py"
    script.write_text(REGISTRY_SCRIPT)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", EAGLE_TREE_REGISTRY_FILE=str(record),
               VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, str(script), str(assets.TARGET)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "GENERATED 4" in proc.stdout
    lines = [ln.split(" ", 1) for ln in record.read_text().splitlines()]
    pids = {int(p) for p, _ in lines}
    names = {n for _, n in lines}
    # main + engine core + 2 workers, each a distinct process
    assert len(pids) >= 4, lines
    assert "MainProcess" in names, names
    assert any("EngineCore" in n for n in names), names
    assert sum(1 for n in names if "Worker" in n) >= 2, names


def test_assets_within_size_limit():
    total = sum(f.stat().st_size for f in assets.ASSETS.rglob("*") if f.is_file())
    assert total <= ASSET_LIMIT_MB * 1e6, f"assets/ is {total / 1e6:.1f} MB"
    for d in (assets.TARGET, assets.EAGLE1_HEAD, assets.EAGLE3_HEAD):
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"], d


def test_vllm_matches_transformers_greedy():
    """vLLM loads the bundled target and computes what transformers computes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = assets.heldout_prompts(8)
    llm = make_llm()
    got = greedy_token_ids(llm, prompts, 24)
    free_llm(llm)
    tok = AutoTokenizer.from_pretrained(assets.TARGET)
    model = AutoModelForCausalLM.from_pretrained(assets.TARGET, dtype=torch.float32).eval()
    for prompt, ids in zip(prompts, got):
        x = torch.tensor([tok(prompt)["input_ids"]])
        with torch.no_grad():
            ref = model.generate(x, max_new_tokens=24, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, x.shape[1]:].tolist()
        assert ids == ref


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_vllm_eagle_chain_is_lossless(method, vanilla_greedy):
    """vLLM's own EAGLE chain with each bundled head = non-speculative greedy."""
    prompts = assets.heldout_prompts(48)
    want = vanilla_greedy(prompts, 48)
    llm = make_llm(speculative_config={"method": method, "model": str(assets.HEADS[method]),
                                       "num_speculative_tokens": 3})
    from vllm_eagle_tree.metrics import spec_counters

    got = greedy_token_ids(llm, prompts, 48)
    counters = spec_counters(llm)
    free_llm(llm)
    mismatches = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    assert not mismatches, f"{len(mismatches)} of {len(prompts)} prompts differ: {mismatches[:8]}"
    # The head must actually be used and accepted (a broken head accepts 0).
    assert counters.drafts > 0 and counters.accepted_tokens > 0


def test_deep_target_computes_the_bundled_target(tmp_path, vanilla_greedy):
    """The cost-realistic target (identity layers appended) gives bit-identical
    greedy output to the bundled target in vLLM."""
    sys.path.insert(0, str(assets.ROOT / "scripts"))
    from make_deep_target import build

    deep = build(tmp_path / "deep", extra_layers=8)
    prompts = assets.heldout_prompts(8)
    want = vanilla_greedy(prompts, 32)
    llm = make_llm(model=str(deep))
    got = greedy_token_ids(llm, prompts, 32)
    free_llm(llm)
    assert got == want
