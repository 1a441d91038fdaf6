"""`"method": "eagle2"` configuration: parsing, validation, head detection,
translation into vLLM's SpeculativeConfig, and the start-up paths vLLM uses
(`EngineArgs.create_engine_config`, `LLM(...)`, the `vllm serve` parser)."""
from __future__ import annotations

import json
import math

import pytest

from vllm_eagle_tree.adapter import config as C
from vllm_eagle_tree.core import TreeConfig

E1_CFG = {"architectures": ["EagleLlamaForCausalLM"], "num_hidden_layers": 1}
E3_CFG = {"architectures": ["Eagle3LlamaForCausalLM"], "num_hidden_layers": 1,
          "draft_vocab_size": 4096}


def spec(**kw):
    d = {"method": "eagle2", "model": "HEAD"}
    d.update(kw)
    return d


def parse(head_cfg=E1_CFG, **kw):
    return C.parse_eagle2_config(spec(**kw), head_config=head_cfg)


# ---------------------------------------------------------------------------
# Valid configs -> TreeConfig and vLLM spec dict
# ---------------------------------------------------------------------------
def test_defaults_are_plain_eagle2():
    settings, vllm = parse()
    assert settings.tree == TreeConfig()  # top_k 10, depth 6, 60 nodes, adaptation off
    assert settings.tree == TreeConfig(top_k=10, max_depth=6, num_nodes=60)
    assert not settings.adaptive and settings.head_format == "eagle"
    # N_max = min(60, 10 + 5*100) = 60; scratch = 5*10 = 50; K = 60
    assert (settings.max_verify_nodes, settings.draft_scratch_slots) == (60, 50)
    assert vllm == {"method": "eagle", "model": "HEAD", "num_speculative_tokens": 60}


def test_knobs_map_onto_tree_config():
    settings, vllm = parse(E3_CFG, num_nodes=16, max_depth=4, top_k=4)
    assert settings.tree == TreeConfig(top_k=4, max_depth=4, num_nodes=16)
    assert vllm["method"] == "eagle3" and vllm["num_speculative_tokens"] == 16


@pytest.mark.parametrize("knobs, k, n_max, scratch", [
    (dict(num_nodes=8, max_depth=8, top_k=4), 28, 8, 28),     # scratch dominates
    (dict(num_nodes=60, max_depth=1, top_k=2), 2, 2, 0),      # depth 1: at most top_k nodes
    (dict(num_nodes=1, max_depth=1, top_k=1), 1, 1, 0),
    (dict(num_nodes=500, max_depth=3, top_k=3), 21, 21, 6),   # 3 + 2*9 candidates
    (dict(num_nodes=59, max_depth=6, top_k=10), 59, 59, 50),  # EAGLE reference total_token=60
])
def test_num_speculative_tokens_bound(knobs, k, n_max, scratch):
    settings, vllm = parse(**knobs)
    assert (settings.num_speculative_tokens, settings.max_verify_nodes,
            settings.draft_scratch_slots) == (k, n_max, scratch)
    assert vllm["num_speculative_tokens"] == k
    assert C.speculative_token_bound(settings.tree) == (k, n_max, scratch)
    # K covers a full tree (scheduled as spec tokens) and the draft scratch slots.
    assert k >= settings.tree.max_tree_size - 1
    assert k >= (settings.tree.max_depth - 1) * settings.tree.top_k


def test_adaptive_on_uses_documented_defaults():
    settings, _ = parse(adaptive=True)
    t = settings.tree
    assert settings.adaptive
    assert (t.depth_threshold, t.width_mass, t.min_path_prob, t.batch_num_nodes) == \
        (0.05, 0.95, 0.01, None)


def test_adaptive_thresholds_explicit():
    settings, _ = parse(adaptive=True, depth_threshold=0.1, width_mass=1, min_path_prob=0,
                        batch_num_nodes=96)
    t = settings.tree
    assert (t.depth_threshold, t.width_mass, t.min_path_prob, t.batch_num_nodes) == \
        (0.1, 1.0, 0.0, 96)
    assert isinstance(t.width_mass, float)


def test_adaptive_false_is_plain_eagle2():
    settings, _ = parse(adaptive=False)
    assert settings.tree == TreeConfig()


def test_hyphenated_keys_and_passthrough():
    settings, vllm = parse(**{"num-nodes": 12, "max-depth": 3, "top-k": 2,
                              "draft-tensor-parallel-size": 1, "max_model_len": 512,
                              "enforce_eager": True, "revision": "main"})
    assert settings.tree == TreeConfig(top_k=2, max_depth=3, num_nodes=12)
    # N_max = min(12, 2 + 2*4) = 10 candidates; scratch 2*2 = 4
    assert vllm == {"method": "eagle", "model": "HEAD", "num_speculative_tokens": 10,
                    "draft_tensor_parallel_size": 1, "max_model_len": 512,
                    "enforce_eager": True, "revision": "main"}


def test_settings_roundtrip_is_json():
    settings, _ = parse(E3_CFG, adaptive=True, batch_num_nodes=40, top_k=3)
    d = settings.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert C.Eagle2Settings.from_dict(json.loads(json.dumps(d))) == settings


# ---------------------------------------------------------------------------
# Bad keys / values: a ValueError naming the key and what is allowed
# ---------------------------------------------------------------------------
BAD = [
    # (extra keys, offending key, fragment of "what is allowed")
    (dict(topk=3), "topk", 'did you mean "top_k"'),
    (dict(depth=3), "depth", "Allowed keys"),
    (dict(num_speculative_tokens=5), "num_speculative_tokens", "num_nodes, max_depth, top_k"),
    (dict(parallel_drafting=True), "parallel_drafting", "Allowed keys"),
    (dict(prompt_lookup_max=3), "prompt_lookup_max", "not supported with eagle2"),
    (dict(attention_backend="CPU_ATTN"), "attention_backend", "Allowed keys"),
    (dict(top_k=0), "top_k", "integer >= 1"),
    (dict(top_k=True), "top_k", "integer >= 1"),
    (dict(top_k=2.0), "top_k", "integer >= 1"),
    (dict(top_k="4"), "top_k", "integer >= 1"),
    (dict(max_depth=0), "max_depth", "integer >= 1"),
    (dict(max_depth=None), "max_depth", "integer >= 1"),
    (dict(num_nodes=0), "num_nodes", "integer >= 1"),
    (dict(num_nodes=-5), "num_nodes", "integer >= 1"),
    (dict(adaptive="yes"), "adaptive", "true or false"),
    (dict(adaptive=1), "adaptive", "true or false"),
    (dict(depth_threshold=0.1), "depth_threshold", '"adaptive": true'),
    (dict(width_mass=0.9), "width_mass", '"adaptive": true'),
    (dict(min_path_prob=0.01), "min_path_prob", '"adaptive": true'),
    (dict(batch_num_nodes=64), "batch_num_nodes", '"adaptive": true'),
    (dict(adaptive=True, depth_threshold=1.5), "depth_threshold", "[0, 1]"),
    (dict(adaptive=True, depth_threshold=-0.1), "depth_threshold", "[0, 1]"),
    (dict(adaptive=True, depth_threshold=math.nan), "depth_threshold", "[0, 1]"),
    (dict(adaptive=True, width_mass=0.0), "width_mass", "(0, 1]"),
    (dict(adaptive=True, width_mass=1.01), "width_mass", "(0, 1]"),
    (dict(adaptive=True, min_path_prob=math.inf), "min_path_prob", "[0, 1]"),
    (dict(adaptive=True, min_path_prob="0.1"), "min_path_prob", "[0, 1]"),
    (dict(adaptive=True, batch_num_nodes=0), "batch_num_nodes", "integer >= 1 or null"),
    (dict(adaptive=True, batch_num_nodes=1.5), "batch_num_nodes", "integer >= 1 or null"),
    (dict(model=None), "model", "is required"),
    (dict(model=""), "model", "path or hub id"),
    (dict(model=3), "model", "path or hub id"),
    ({"top_k": 2, "top-k": 3}, "top_k", "given twice"),
]


@pytest.mark.parametrize("extra, key, allowed", BAD, ids=[f"{k}-{i}" for i, (_, k, _) in
                                                         enumerate(BAD)])
def test_bad_key_or_value_names_the_key(extra, key, allowed):
    with pytest.raises(ValueError) as info:
        parse(**extra)
    msg = str(info.value)
    assert f'speculative_config["{key}"]' in msg, msg
    assert allowed in msg, msg


def test_missing_model_names_the_key():
    with pytest.raises(ValueError, match=r'speculative_config\["model"\].*is required'):
        C.parse_eagle2_config({"method": "eagle2"}, head_config=E1_CFG)


def test_unknown_key_lists_every_allowed_key():
    with pytest.raises(ValueError) as info:
        parse(bogus=1)
    for key in ("model", "num_nodes", "max_depth", "top_k", "adaptive", "depth_threshold",
                "width_mass", "min_path_prob", "batch_num_nodes", *C.PASSTHROUGH_KEYS):
        assert f'"{key}"' in str(info.value)


# ---------------------------------------------------------------------------
# Head format detection (from config.json)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, fmt", [
    ({"architectures": ["EagleLlamaForCausalLM"]}, "eagle"),
    ({"architectures": ["EagleLlama4ForCausalLM"]}, "eagle"),
    ({"architectures": ["EagleMiniCPMForCausalLM"]}, "eagle"),
    ({"architectures": ["Eagle3LlamaForCausalLM"]}, "eagle3"),
    ({"architectures": ["LlamaForCausalLMEagle3"]}, "eagle3"),  # yuhuili/EAGLE3-*
    ({"architectures": ["Eagle3Qwen3ForCausalLM"]}, "eagle3"),
    # published EAGLE-1 heads (yuhuili/EAGLE-*): the target's architecture, one layer
    ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}, "eagle"),
    # plain architecture but EAGLE-3 fields
    ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
      "draft_vocab_size": 32000}, "eagle3"),
    ({"architectures": ["LlamaForCausalLM"], "eagle_aux_hidden_state_layer_ids": [1, 2]},
     "eagle3"),
    ({"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"]}, "eagle3"),
])
def test_head_format_detection(cfg, fmt):
    assert C.detect_head_format(cfg) == fmt


@pytest.mark.parametrize("cfg", [
    {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4},   # a target, not a head
    {"architectures": ["Eagle2_5_VLForConditionalGeneration"]},        # NVIDIA Eagle VLM
    {"architectures": ["MedusaModel"]},
    {"architectures": []},
    {},
])
def test_head_format_refused(cfg):
    with pytest.raises(ValueError, match=r'speculative_config\["model"\].*EAGLE-1 or an EAGLE-3'):
        C.detect_head_format(cfg)


def test_head_config_read_from_folder(tmp_path):
    (tmp_path / "e3").mkdir()
    (tmp_path / "e3" / "config.json").write_text(json.dumps(E3_CFG))
    settings, vllm = C.parse_eagle2_config(spec(model=str(tmp_path / "e3")))
    assert settings.head_format == "eagle3" and vllm["method"] == "eagle3"
    assert settings.head_architectures == ("Eagle3LlamaForCausalLM",)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r'speculative_config\["model"\].*no config.json'):
        C.parse_eagle2_config(spec(model=str(tmp_path / "empty")))


def test_bundled_heads_detected(pair):
    _, e1, e3 = pair
    assert C.parse_eagle2_config(spec(model=e1))[0].head_format == "eagle"
    assert C.parse_eagle2_config(spec(model=e3))[0].head_format == "eagle3"


def test_target_is_not_a_head(pair):
    target, _, _ = pair
    with pytest.raises(ValueError, match=r'speculative_config\["model"\]'):
        C.parse_eagle2_config(spec(model=target))


# ---------------------------------------------------------------------------
# Through vLLM: EngineArgs.create_speculative_config / create_engine_config
# ---------------------------------------------------------------------------
@pytest.fixture
def runner_available(monkeypatch):
    """Pretend the tree runner exists (the gate returns vLLM's CPU worker)."""
    calls = []

    def fake(settings):
        calls.append(settings)
        return "vllm.v1.worker.cpu_worker.CPUWorker"

    monkeypatch.setattr(C, "tree_runner_worker_cls", fake)
    return calls


def engine_args(target, **kw):
    from vllm.engine.arg_utils import EngineArgs

    opts = dict(model=target, dtype="float32", max_model_len=512, enforce_eager=True, seed=0)
    opts.update(kw)
    return EngineArgs(**opts)


@pytest.fixture(scope="module")
def target_configs(pair):
    """Target ModelConfig + ParallelConfig, built once (cheap direct calls)."""
    from vllm.config import ParallelConfig

    ea = engine_args(pair[0])
    return ea.create_model_config(), ParallelConfig()


def test_plugin_wraps_create_speculative_config(pair):
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs

    engine_args(pair[0])  # EngineArgs.__post_init__ loads the plugins
    fn = EngineArgs.create_speculative_config
    assert getattr(fn, "_vllm_eagle_tree_wrapped", False)
    assert AsyncEngineArgs.create_speculative_config is fn
    assert C.wrap_create_speculative_config(fn) is fn  # idempotent


def _summary(cfg):
    sc = cfg.speculative_config
    return dict(method=sc.method, k=sc.num_speculative_tokens, model=sc.model,
                draft_arch=sc.draft_model_config.architectures,
                draft_len=sc.draft_model_config.max_model_len,
                lookahead=cfg.num_lookahead_tokens, extra=dict(cfg.additional_config),
                worker=cfg.parallel_config.worker_cls,
                async_sched=cfg.scheduler_config.async_scheduling,
                batched=cfg.scheduler_config.max_num_batched_tokens,
                hash=cfg.compute_hash())


@pytest.mark.parametrize("head", [1, 2], ids=["eagle", "eagle3"])
def test_other_methods_untouched(pair, monkeypatch, head):
    """A plain eagle/eagle3 config builds the same VllmConfig with and without the plugin."""
    from vllm.engine.arg_utils import EngineArgs

    method = "eagle" if head == 1 else "eagle3"
    sc = {"method": method, "model": pair[head], "num_speculative_tokens": 3}
    engine_args(pair[0])
    with_plugin = _summary(engine_args(pair[0], speculative_config=dict(sc))
                           .create_engine_config())
    monkeypatch.setattr(EngineArgs, "create_speculative_config",
                        EngineArgs.create_speculative_config.__wrapped__)
    without = _summary(engine_args(pair[0], speculative_config=dict(sc)).create_engine_config())
    assert with_plugin == without
    assert with_plugin["method"] == method and with_plugin["k"] == 3
    assert C.ADDITIONAL_CONFIG_KEY not in with_plugin["extra"]


def test_no_speculation_untouched(target_configs):
    mc, pc = target_configs
    assert engine_args(mc.model).create_speculative_config(mc, pc) is None


@pytest.mark.parametrize("head", [1, 2], ids=["eagle1-head", "eagle3-head"])
def test_eagle2_translates_into_vllm_spec_config(pair, target_configs, runner_available, head):
    from vllm.config import ParallelConfig

    mc, _ = target_configs
    pc = ParallelConfig()
    user = {"method": "eagle2", "model": pair[head], "num_nodes": 16, "max_depth": 4,
            "top_k": 4}
    ea = engine_args(pair[0], speculative_config=dict(user))
    sc = ea.create_speculative_config(mc, pc)
    fmt = "eagle" if head == 1 else "eagle3"
    assert sc.method == fmt and sc.num_speculative_tokens == 16
    assert sc.draft_model_config.architectures == [
        "EagleLlamaForCausalLM" if head == 1 else "Eagle3LlamaForCausalLM"]
    stored = ea.additional_config[C.ADDITIONAL_CONFIG_KEY]
    settings = C.Eagle2Settings.from_dict(stored)
    assert settings.tree == TreeConfig(top_k=4, max_depth=4, num_nodes=16)
    assert settings.head_format == fmt and settings.num_speculative_tokens == 16
    assert pc.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert ea.async_scheduling is False
    assert ea.speculative_config == user  # the user's dict is restored
    assert len(runner_available) == 1


def test_eagle2_end_to_end_engine_config(pair, runner_available):
    """create_engine_config, as LLM(...) and vllm serve use it; twice (re-entrant)."""
    ea = engine_args(pair[0], speculative_config={
        "method": "eagle2", "model": pair[1], "num-nodes": 24, "max_depth": 5, "top_k": 3,
        "adaptive": True, "width_mass": 0.9})
    cfg = ea.create_engine_config()
    settings = C.Eagle2Settings.from_vllm_config(cfg)
    assert settings.tree == TreeConfig(top_k=3, max_depth=5, num_nodes=24, depth_threshold=0.05,
                                       width_mass=0.9, min_path_prob=0.01)
    assert cfg.speculative_config.method == "eagle"
    # K = max(min(24, 3 + 4*9), 4*3) = 24: lookahead and per-position counters sized K
    assert cfg.speculative_config.num_speculative_tokens == 24
    assert cfg.num_lookahead_tokens == 24
    assert cfg.parallel_config.worker_cls == "vllm.v1.worker.cpu_worker.CPUWorker"
    assert cfg.scheduler_config.async_scheduling is False
    again = ea.create_engine_config()
    assert C.Eagle2Settings.from_vllm_config(again) == settings
    assert len(runner_available) == 2
    plain = engine_args(pair[0]).create_engine_config()
    assert C.Eagle2Settings.from_vllm_config(plain) is None


@pytest.fixture
def no_tree_runner_here(monkeypatch):
    """Pretend to be a platform without a tree runner (e.g. CUDA today)."""
    monkeypatch.setattr(C, "current_platform_name", lambda: "cuda")


def test_cpu_platform_gets_the_tree_worker(pair, target_configs):
    from vllm.config import ParallelConfig

    mc, _ = target_configs
    pc = ParallelConfig()
    ea = engine_args(pair[0], speculative_config={"method": "eagle2", "model": pair[1]})
    ea.create_speculative_config(mc, pc)
    assert pc.worker_cls == "vllm_eagle_tree.adapter.worker.TreeCPUWorker"


def test_eagle2_refuses_to_start_without_tree_runner(pair, target_configs, no_tree_runner_here):
    """Honesty: a valid eagle2 config never runs vLLM's chain silently."""
    from vllm.config import ParallelConfig

    mc, _ = target_configs
    pc = ParallelConfig()
    ea = engine_args(pair[0], speculative_config={"method": "eagle2", "model": pair[1]})
    for _ in range(2):  # also on a second attempt with the same EngineArgs
        with pytest.raises(C.Eagle2RunnerUnavailable, match="runs trees on the CPU platform only"):
            ea.create_speculative_config(mc, pc)
    assert pc.worker_cls == "auto"
    assert C.ADDITIONAL_CONFIG_KEY not in (ea.additional_config or {})


def test_llm_refuses_eagle2_without_tree_runner(pair, no_tree_runner_here):
    from vllm import LLM

    with pytest.raises(C.Eagle2RunnerUnavailable, match='"method": "eagle" for vLLM'):
        LLM(model=pair[0], dtype="float32", max_model_len=512, enforce_eager=True,
            speculative_config={"method": "eagle2", "model": pair[1], "top_k": 4})


def test_llm_bad_key_names_it(pair):
    from vllm import LLM

    with pytest.raises(ValueError, match=r'speculative_config\["num_nodes"\].*integer >= 1'):
        LLM(model=pair[0], dtype="float32", max_model_len=512, enforce_eager=True,
            speculative_config={"method": "eagle2", "model": pair[1], "num_nodes": 0})


def test_spec_flags_merge_like_vllm(pair, target_configs, runner_available):
    from vllm.config import ParallelConfig

    mc, _ = target_configs
    ea = engine_args(pair[0], spec_method="eagle2", spec_model=pair[2],
                     speculative_config={"top_k": 2, "max_depth": 2, "num_nodes": 4})
    sc = ea.create_speculative_config(mc, ParallelConfig())
    assert sc.method == "eagle3" and sc.num_speculative_tokens == 4
    assert ea.spec_method == "eagle2" and ea.spec_model == pair[2]  # restored
    with pytest.raises(ValueError, match="mutually exclusive"):
        engine_args(pair[0], spec_method="eagle2",
                    speculative_config={"method": "eagle2", "model": pair[1]}
                    ).create_speculative_config(mc, ParallelConfig())
    with pytest.raises(ValueError, match=r'\["num_speculative_tokens"\]'):
        engine_args(pair[0], spec_tokens=4,
                    speculative_config={"method": "eagle2", "model": pair[1]}
                    ).create_speculative_config(mc, ParallelConfig())


def test_eagle2_refuses_async_scheduling_and_foreign_worker(pair, target_configs,
                                                            runner_available):
    from vllm.config import ParallelConfig

    mc, _ = target_configs
    user = {"method": "eagle2", "model": pair[1]}
    with pytest.raises(ValueError, match="async scheduling"):
        engine_args(pair[0], async_scheduling=True, speculative_config=dict(user)
                    ).create_speculative_config(mc, ParallelConfig())
    pc = ParallelConfig(worker_cls="my.own.Worker")
    with pytest.raises(ValueError, match="--worker-cls 'my.own.Worker'"):
        engine_args(pair[0], speculative_config=dict(user)).create_speculative_config(mc, pc)


def test_additional_config_kept_and_guarded(pair, target_configs, runner_available):
    from vllm.config import ParallelConfig

    mc, _ = target_configs
    user = {"method": "eagle2", "model": pair[1], "top_k": 2}
    ea = engine_args(pair[0], speculative_config=dict(user), additional_config={"other": 1})
    ea.create_speculative_config(mc, ParallelConfig())
    assert ea.additional_config["other"] == 1 and C.ADDITIONAL_CONFIG_KEY in ea.additional_config
    forged = engine_args(pair[0], speculative_config=dict(user),
                         additional_config={C.ADDITIONAL_CONFIG_KEY: {"method": "eagle2"}})
    with pytest.raises(ValueError, match="do not set it by hand"):
        forged.create_speculative_config(mc, ParallelConfig())


def test_tree_must_fit_max_model_len(pair, runner_available):
    from vllm.config import ParallelConfig

    ea = engine_args(pair[0], max_model_len=64)
    mc = ea.create_model_config()
    for knobs, key in ((dict(num_nodes=64, max_depth=8, top_k=8), "num_nodes"),
                       (dict(num_nodes=4, max_depth=20, top_k=4), "max_depth")):
        with pytest.raises(ValueError, match=rf'\["{key}"\].*max_model_len=64'):
            engine_args(pair[0], max_model_len=64, speculative_config={
                "method": "eagle2", "model": pair[1], **knobs}
            ).create_speculative_config(mc, ParallelConfig())


def test_passthrough_reaches_vllm(pair, target_configs, runner_available):
    from vllm.config import ParallelConfig

    mc, _ = target_configs
    ea = engine_args(pair[0], speculative_config={
        "method": "eagle2", "model": pair[1], "max_model_len": 256,
        "draft_tensor_parallel_size": 1})
    sc = ea.create_speculative_config(mc, ParallelConfig())
    assert sc.draft_model_config.max_model_len == 256
    assert sc.draft_tensor_parallel_size == 1


def test_vllm_serve_cli_parser(pair, runner_available):
    """`vllm serve TARGET --speculative-config '{...}'` down to the engine config,
    without starting a server (the serve subcommand's own parser)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    sc = {"method": "eagle2", "model": pair[2], "num_nodes": 8, "max_depth": 3, "top_k": 2}
    args = parser.parse_args([pair[0], "--dtype", "float32", "--max-model-len", "512",
                              "--enforce-eager", "--speculative-config", json.dumps(sc)])
    validate_parsed_serve_args(args)
    args.model = args.model_tag  # what ServeSubcommand.cmd does
    cfg = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    settings = C.Eagle2Settings.from_vllm_config(cfg)
    assert settings.tree == TreeConfig(top_k=2, max_depth=3, num_nodes=8)
    assert settings.head_format == "eagle3" and cfg.speculative_config.method == "eagle3"
    # K = max(min(8, 2 + 2*4), 2*2) = 8
    assert cfg.speculative_config.num_speculative_tokens == 8

    bad = parser.parse_args([pair[0], "--speculative-config",
                             json.dumps({**sc, "depth": 3})])
    bad.model = bad.model_tag
    with pytest.raises(ValueError, match=r'speculative_config\["depth"\]'):
        AsyncEngineArgs.from_cli_args(bad).create_engine_config()


def test_gate_message_is_actionable(pair, target_configs, no_tree_runner_here):
    from vllm.config import ParallelConfig

    mc, _ = target_configs
    ea = engine_args(pair[0], speculative_config={
        "method": "eagle2", "model": pair[2], "adaptive": True})
    with pytest.raises(C.Eagle2RunnerUnavailable) as info:
        ea.create_speculative_config(mc, ParallelConfig())
    msg = str(info.value)
    assert "EAGLE-3" in msg and "adaptive" in msg and '"method": "eagle3"' in msg
    assert "never falls back to a chain" in msg


def test_goodput_needs_adaptive_and_a_bool(pair):
    base = {"method": "eagle2", "model": pair[1]}
    with pytest.raises(ValueError, match=r'speculative_config\["goodput"\].*adaptive'):
        C.parse_eagle2_config({**base, "goodput": True})
    with pytest.raises(ValueError, match=r'speculative_config\["goodput"\].*true or false'):
        C.parse_eagle2_config({**base, "adaptive": True, "goodput": "yes"})
    settings, _ = C.parse_eagle2_config({**base, "adaptive": True, "goodput": True})
    assert settings.goodput
    assert C.Eagle2Settings.from_dict(settings.to_dict()) == settings


def test_goodput_accepted_with_tensor_parallelism(pair, target_configs):
    """TP ranks learn rank 0's timings (runner ``_shared``), so goodput runs
    under tensor parallelism (tests/adapter/test_eagle2_tp.py runs it)."""
    from vllm.config import ParallelConfig

    mc, _ = target_configs
    ea = engine_args(pair[0], speculative_config={"method": "eagle2", "model": pair[1],
                                                  "adaptive": True, "goodput": True})
    pc = ParallelConfig(tensor_parallel_size=2)
    ea.create_speculative_config(mc, pc)
    assert C.Eagle2Settings.from_dict(ea.additional_config[C.ADDITIONAL_CONFIG_KEY]).goodput
    assert pc.worker_cls == "vllm_eagle_tree.adapter.worker.TreeCPUWorker"
