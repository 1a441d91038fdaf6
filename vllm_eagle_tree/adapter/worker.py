"""Worker classes that run eagle2 (selected through ``parallel_config.worker_cls``
by ``adapter.config.install_tree_runner``; docs/INTEGRATION.md, step 2)."""
from __future__ import annotations

import torch
from vllm.v1.worker.cpu_worker import CPUWorker

__all__ = ["TreeCPUWorker"]


class TreeCPUWorker(CPUWorker):
    """vLLM 0.32 ``CPUWorker`` whose model runner drafts and verifies trees.

    ``CPUWorker.init_device`` builds its ``CPUModelRunner`` inline (no factory
    method), so the runner is replaced right after it, before the model is
    loaded (the first runner holds only buffers).
    """

    def init_device(self):
        from vllm_eagle_tree.plugin import register_tree_attention_backend

        from .runner import TreeCPUModelRunner

        if self.use_v2_model_runner:
            raise NotImplementedError(
                '"method": "eagle2" runs on vLLM\'s V1 model runner; unset '
                "VLLM_USE_V2_MODEL_RUNNER")
        register_tree_attention_backend()
        super().init_device()
        self.model_runner = TreeCPUModelRunner(self.vllm_config, torch.device("cpu"))

    def compile_or_warm_up_model(self):
        # With "goodput": time a few dummy forward passes (attention included)
        # so that the planner starts with a measured verify-cost model, then
        # let vLLM reset the random seed as usual.
        if getattr(self.model_runner, "tree_planner", None) is not None:
            self.model_runner.probe_verify_cost()
        return super().compile_or_warm_up_model()

    def eagle2_stats(self) -> dict:
        """The runner's tree counters (``LLM.collective_rpc("eagle2_stats")``):
        verify steps, tree requests, drafted nodes, drafted and accepted
        nodes per depth. Cumulative since start-up."""
        import copy

        runner = self.model_runner
        stats = copy.deepcopy(runner.tree_stats)
        planner = getattr(runner, "tree_planner", None)
        if planner is not None:
            plan = planner.last_plan
            stats["goodput"] = {
                "verify_seconds_a": planner.verify_cost.a, "verify_seconds_per_row": planner.verify_cost.b,
                "draft_seconds": planner.draft_seconds, "steps_timed": planner.steps_timed,
                "tree_step_overhead_seconds": planner.tree_overhead,
                "acceptance_by_depth_and_value": planner.calibration.table(),
                "arm_tokens_per_second": self.model_runner.tree_bandit.summary(),
                "arm_windows": self.model_runner.tree_bandit.window_counts(),
                "forward_seconds_a": planner.forward_cost.line.a,
                "forward_seconds_per_row": planner.forward_cost.line.b,
                "forward_speed": planner.forward_cost.speed,
                "forward_shape": planner.forward_cost.profile(),
                "arm": self.model_runner.tree_bandit.current,
                "request_speeds": list(self.model_runner.tree_bandit.speeds),
                "last_plan": None if plan is None else vars(plan).copy(),
            }
        return stats
