"""eagle2 with tensor parallelism 2 on vLLM's Ray executor
(``distributed_executor_backend="ray"``), both implementations vLLM 0.32 has:
``RayExecutorV2`` (the default, VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1: Ray actors
running vLLM's WorkerProc busy loop over shared-memory message queues) and the
legacy ``RayDistributedExecutor`` (=0: Ray compiled graph calling the model
runner's execute_model/sample_tokens directly).

vLLM 0.32 refuses Ray on its CPU platform: ``CpuPlatform.ray_device_key`` is
empty, so ``initialize_ray_cluster`` (v1/executor/ray_utils.py) raises
``current platform cpu does not support ray``, and so would the Ray workers'
``get_node_and_physical_gpu_ids``. The test-only adjustment is a platform
plugin (entry-point group ``vllm.platform_plugins``) that this test writes into
tmp_path and puts on PYTHONPATH: vLLM then resolves ``current_platform`` to
``CpuRayPlatform``, vLLM's CpuPlatform with ``ray_device_key = "GPU"``, in
every process that asks for the platform: the driver, the EngineCore and each
Ray worker (they inherit PYTHONPATH from the raylet, which the driver starts).
The driver starts a private local Ray instance with ``num_gpus=2``: Ray "GPUs"
are only scheduling tokens here (one per TP rank, as vLLM places its workers
on a GPU host); no process touches a GPU. Ray's own "CPU" resource cannot be
the device key: vLLM would pass ``resources={"CPU": 1}`` to ``ray.remote``
(Ray rejects it) and look the key up in ``get_accelerator_ids()`` (accelerators
only); a custom resource name fails that look-up too.

Checks: greedy output identical to TP=2 without speculation on the same Ray
executor (same process layout and per-rank thread count, so speculation is the
only difference), both ranks' tree counters identical and non-zero, and the
plugin registered inside both Ray worker processes (whose multiprocessing name
is "MainProcess", like the driver's: they are told apart by pid and process
title, "ray::RayWorkerProc..." or "ray::RayWorkerWrapper...").
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import ray  # noqa: E402,F401  (extra "test": a missing ray must fail, not skip)

from vllm_eagle_tree import assets
from vllm_eagle_tree.plugin import REGISTRY_ENV

PLATFORM_PKG = "eagle_tree_ray_cpu"

PLATFORM_INIT = textwrap.dedent('''
    """Test-only vLLM platform plugin: the CPU platform, schedulable on Ray."""


    def activate() -> str:
        return "eagle_tree_ray_cpu.platform.CpuRayPlatform"
''')

PLATFORM_CLS = textwrap.dedent('''
    from vllm.platforms.cpu import CpuPlatform


    class CpuRayPlatform(CpuPlatform):
        # vLLM 0.32 reads this in initialize_ray_cluster / _init_workers_ray
        # (placement-group bundles {"GPU": 1}, actors with num_gpus=1) and in
        # RayWorkerWrapper.get_node_and_physical_gpu_ids (the actor's Ray GPU
        # ids). Empty on CpuPlatform, which is what makes vLLM refuse Ray.
        ray_device_key = "GPU"
''')

DIST_INFO_METADATA = f"Metadata-Version: 2.1\nName: {PLATFORM_PKG}\nVersion: 0.0.0\n"
DIST_INFO_ENTRY_POINTS = f"[vllm.platform_plugins]\nray_cpu = {PLATFORM_PKG}:activate\n"

SCRIPT = textwrap.dedent("""
    import json, os, sys

    import ray


    def whoami(obj):
        # Runs inside each Ray worker (LLM.collective_rpc with a callable): obj is
        # the vLLM worker (RayExecutorV2) or its RayWorkerWrapper (legacy executor).
        import os
        import ray
        from vllm.platforms import current_platform
        worker = getattr(obj, "worker", None) or obj
        return {"pid": os.getpid(), "actor_id": ray.get_runtime_context().get_actor_id(),
                "worker": type(worker).__name__, "title": cmdline(os.getpid()),
                "platform": type(current_platform).__name__}


    def cmdline(pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\\0", b" ").decode().strip()


    if __name__ == "__main__":
        model, prompts_path, spec, temp_dir = sys.argv[1:5]
        spec = json.loads(spec)
        ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, _temp_dir=temp_dir,
                 object_store_memory=100 * 2**20, log_to_driver=True)
        # The EngineCore is a separate process that calls ray.init() itself:
        # point it at this instance (else it would start its own).
        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        from vllm import LLM, SamplingParams
        from vllm.platforms import current_platform
        try:
            llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512,
                      tensor_parallel_size=2, distributed_executor_backend="ray",
                      speculative_config=spec, seed=0)
            prompts = json.loads(open(prompts_path).read())
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24,
                                                        ignore_eos=True), use_tqdm=False)
            stats = llm.collective_rpc("eagle2_stats") if spec else None
            workers = llm.collective_rpc(whoami)
            # Each registering process, with its process title while still alive.
            registry = [ln.split(" ", 1) + [cmdline(int(ln.split(" ", 1)[0]))]
                        for ln in open(os.environ["EAGLE_TREE_REGISTRY_FILE"]).read().splitlines()]
            print("RESULT " + json.dumps({
                "ids": [list(o.outputs[0].token_ids) for o in outs], "stats": stats,
                "workers": workers, "registry": registry, "driver_pid": os.getpid(),
                "driver_platform": type(current_platform).__name__}), flush=True)
            llm.llm_engine.engine_core.shutdown()
            del llm
        finally:
            ray.shutdown()
""")


def _write_platform_plugin(root: Path) -> Path:
    pkg = root / PLATFORM_PKG
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(PLATFORM_INIT)
    (pkg / "platform.py").write_text(PLATFORM_CLS)
    dist = root / f"{PLATFORM_PKG}-0.0.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(DIST_INFO_METADATA)
    (dist / "entry_points.txt").write_text(DIST_INFO_ENTRY_POINTS)
    return root


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _ray_processes(ray_tmp: str, worker_pids=()) -> list[int]:
    """This run's Ray processes still alive: those naming its private temp dir
    (GCS, raylet, agents) and its worker actors (``ray::...`` process titles)."""
    pids = [int(e.name) for e in Path("/proc").iterdir()
            if e.name.isdigit() and ray_tmp in _cmdline(int(e.name))]
    return pids + [p for p in worker_pids if _cmdline(p).startswith("ray::")]


def _run(tmp_path: Path, spec: dict | None, name: str, ray_v2: bool) -> dict:
    run_dir = tmp_path / name
    run_dir.mkdir()
    script = run_dir / "run.py"
    script.write_text(SCRIPT)
    prompts = run_dir / "prompts.json"
    prompts.write_text(json.dumps(assets.heldout_prompts(16)))
    registry = run_dir / "registered.txt"
    plugin_root = _write_platform_plugin(tmp_path / "platform_plugin")
    # Ray puts unix sockets under its temp dir (107-byte path limit): keep it short.
    ray_tmp = tempfile.mkdtemp(prefix="rayt", dir="/tmp")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_KVCACHE_SPACE="1",
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", RAY_USAGE_STATS_ENABLED="0",
               # no token file in ~/.ray; callables in collective_rpc (whoami)
               RAY_AUTH_MODE="disabled", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
               PYTHONPATH=os.pathsep.join(
                   [str(plugin_root)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    env[REGISTRY_ENV] = str(registry)
    env["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] = "1" if ray_v2 else "0"
    for var in ("TRITON_INTERPRET", "VLLM_PLUGINS", "VLLM_TARGET_DEVICE", "RAY_ADDRESS"):
        env.pop(var, None)
    worker_pids: list[int] = []
    started = time.time()
    try:
        proc = subprocess.run([sys.executable, str(script), str(assets.TARGET), str(prompts),
                               json.dumps(spec), ray_tmp], env=env, cwd=run_dir,
                              capture_output=True, text=True, timeout=900)
        (run_dir / "stdout.txt").write_text(proc.stdout)
        (run_dir / "stderr.txt").write_text(proc.stderr)
        assert proc.returncode == 0, proc.stderr[-6000:]
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        out = json.loads(line[len("RESULT "):])
        worker_pids = [w["pid"] for w in out["workers"]]
        # The driver's ray.shutdown() stops the Ray instance it started.
        deadline = time.monotonic() + 30
        while _ray_processes(ray_tmp, worker_pids) and time.monotonic() < deadline:
            time.sleep(0.5)
        out["leftover"] = _ray_processes(ray_tmp, worker_pids)
        return out
    finally:
        for pid in _ray_processes(ray_tmp, worker_pids):  # only this run's Ray processes
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(ray_tmp, ignore_errors=True)
        _remove_cpu_shm_segments(since=started)


def _remove_cpu_shm_segments(since: float) -> None:
    """Unlink the shared-memory segments vLLM's CPU TP communicator created
    during this run (``/dev/shm/<port>-tp:...-cpushm_<rank>``): Ray stops the
    workers before they unlink them, and a later run that draws the same port
    then fails with "create shm in SHMManager failed. errno: 17"."""
    for f in Path("/dev/shm").glob("*-cpushm_*"):
        try:
            if f.stat().st_mtime >= since - 1.0:
                f.unlink()
        except OSError:
            pass


_VANILLA: dict[bool, dict] = {}


def _vanilla(tmp_path_factory, ray_v2: bool) -> dict:
    """TP=2 without speculation on the same Ray executor, run once per executor."""
    if ray_v2 not in _VANILLA:
        _VANILLA[ray_v2] = _run(tmp_path_factory.mktemp("ray_vanilla"), None, "vanilla", ray_v2)
    return _VANILLA[ray_v2]


@pytest.mark.slow
@pytest.mark.parametrize("ray_v2", [True, False], ids=["RayExecutorV2", "RayDistributedExecutor"])
def test_tp2_ray_identical_to_tp2_ray_without_speculation(tmp_path, tmp_path_factory, ray_v2):
    want = _vanilla(tmp_path_factory, ray_v2)
    spec = {"method": "eagle2", "model": str(assets.EAGLE1_HEAD), "num_nodes": 20,
            "max_depth": 5, "top_k": 5}
    got = _run(tmp_path, spec, "eagle2", ray_v2)

    actor_cls = "RayWorkerProc" if ray_v2 else "RayWorkerWrapper"
    for run, worker_cls in ((want, "CPUWorker"), (got, "TreeCPUWorker")):
        assert run["driver_platform"] == "CpuRayPlatform"
        assert not run["leftover"], f"Ray processes left running: {run['leftover']}"
        workers = run["workers"]
        assert len({w["pid"] for w in workers} - {run["driver_pid"]}) == 2, workers
        for w in workers:
            assert w["actor_id"] and w["title"].startswith(f"ray::{actor_cls}"), w
            assert w["platform"] == "CpuRayPlatform" and w["worker"] == worker_cls, w

    # The plugin registered in both Ray workers, besides driver and EngineCore.
    titles = {int(pid): title for pid, _, title in got["registry"]}
    for w in got["workers"]:
        assert titles.get(w["pid"], "").startswith(f"ray::{actor_cls}"), got["registry"]
    assert got["driver_pid"] in titles, got["registry"]
    assert any(name == "EngineCore" for _, name, _ in got["registry"]), got["registry"]
    assert len(titles) == 4, got["registry"]

    assert len(got["ids"]) == len(want["ids"]) == 16
    bad = [i for i, (a, b) in enumerate(zip(got["ids"], want["ids"])) if a != b]
    assert not bad, f"{len(bad)} of {len(want['ids'])} differ, first #{bad[0]}"
    s0, s1 = got["stats"]
    assert s0 == s1, "the two TP ranks verified different trees"
    assert s0["tree_requests"] > 0 and s0["nodes"] > 0, s0
    assert sum(s0["accepted_per_depth"]) > 0, s0


@pytest.mark.slow
def test_tp2_ray_goodput_ranks_learn_and_pick_alike(tmp_path, tmp_path_factory):
    """"goodput" on vLLM's default Ray executor: each rank times its own
    steps, and the runner makes both learn rank 0's timings, so both ranks
    fit the same cost models, run the same shapes and prune the same trees
    (different picks would send their draft forwards' collectives out of
    step). Output identical to TP=2 without speculation."""
    want = _vanilla(tmp_path_factory, True)
    spec = {"method": "eagle2", "model": str(assets.EAGLE1_HEAD), "num_nodes": 8,
            "max_depth": 4, "top_k": 2, "adaptive": True, "goodput": True}
    got = _run(tmp_path, spec, "goodput", True)
    assert not got["leftover"], f"Ray processes left running: {got['leftover']}"
    assert {w["worker"] for w in got["workers"]} == {"TreeCPUWorker"}
    bad = [i for i, (a, b) in enumerate(zip(got["ids"], want["ids"])) if a != b]
    assert len(got["ids"]) == len(want["ids"]) == 16
    assert not bad, f"{len(bad)} of {len(want['ids'])} differ, first #{bad[0]}"
    s0, s1 = got["stats"]
    g0, g1 = s0["goodput"], s1["goodput"]
    assert g0["forward_shape"] and g0["steps_timed"] > 0
    assert g0 == g1, "the two TP ranks' goodput models differ"
    assert s0 == s1, "the two TP ranks verified different trees"
    ran = {a for arms in g0["arm_windows"].values() for a, n in arms.items() if n}
    assert len(ran) > 1 and s0["tree_requests"] > 0, (g0["arm_windows"], s0)
