"""``"method": "eagle2"``: EAGLE-2 dynamic draft trees in vLLM's speculative config.

Usage (the same dict both ways)::

    vllm serve TARGET --speculative-config \\
        '{"method": "eagle2", "model": "HEAD", "num_nodes": 60, "max_depth": 6, "top_k": 10}'

    LLM(model=TARGET, speculative_config={"method": "eagle2", "model": HEAD, ...})

Keys accepted with ``"method": "eagle2"`` (``-`` and ``_`` are interchangeable,
as everywhere in vLLM's speculative config):

==================  =========================  ==========================================
key                 allowed values (default)   meaning
==================  =========================  ==========================================
``model``           path or hub id (required)  the EAGLE-1 or EAGLE-3 draft head; its
                                               format is read from its ``config.json``
``num_nodes``       int >= 1 (60)              node budget N: drafted nodes per request
                                               and step, the root excluded (EAGLE
                                               reference ``total_token - 1``)
``max_depth``       int >= 1 (6)               deepest drafted node (EAGLE reference
                                               ``depth + 1``)
``top_k``           int >= 1 (10)              branching factor of the draft tree:
                                               children proposed per node and frontier
                                               width per depth (not a sampling top-k)
``adaptive``        true / false (false)       switch for the confidence-driven
                                               adaptation below; false = plain EAGLE-2
``depth_threshold`` float in [0, 1] (0.05)     adaptive only: a request stops deepening
                                               once its best frontier path has draft
                                               probability < this (0 = rule off)
``width_mass``      float in (0, 1] (0.95)     adaptive only: a node keeps its smallest
                                               set of top children holding this much
                                               draft mass (1 = rule off)
``min_path_prob``   float in [0, 1] (0.01)     adaptive only: nodes whose path
                                               probability is < this are dropped
                                               (0 = rule off)
``batch_num_nodes`` int >= 1 or null (null)    adaptive only: one node budget shared by
                                               the whole batch (each request still capped
                                               at ``num_nodes``); null = off
``goodput``         true / false (false)       adaptive only: each step draft the shape
                                               (none, a chain of K, the tree) with the
                                               best measured tokens per second, and
                                               verify the tree nodes that maximise
                                               expected tokens per second from live
                                               step timings and calibrated acceptance
                                               (core/budget.py); under tensor
                                               parallelism every rank learns rank 0's
                                               timings, so all ranks pick alike
==================  =========================  ==========================================

plus these vLLM ``SpeculativeConfig`` fields, passed through unchanged:
``draft_tensor_parallel_size``, ``quantization``, ``revision``,
``code_revision``, ``max_model_len``, ``enforce_eager``.

The adaptive defaults (0.05 / 0.95 / 0.01, batch budget off) are the
"adaptive on" settings of ``scripts/bench_tau.py``. A threshold given while
``adaptive`` is false is an error (it would be silently ignored otherwise).

Any other key, and any bad value, stops start-up with a ``ValueError`` that
names the key and what is allowed. ``num_speculative_tokens`` in particular is
not a user knob with eagle2: it is derived from the tree (see below).

Head format: from ``architectures`` in the head's ``config.json``:
``Eagle3*`` / ``*Eagle3`` -> EAGLE-3; ``Eagle*ForCausalLM`` (not Eagle3) ->
EAGLE-1; a speculators-format config by its ``speculators_model_type``; a
plain ``*ForCausalLM`` head (the published ``yuhuili/EAGLE-*`` format) is
EAGLE-3 if it carries EAGLE-3 fields (``draft_vocab_size``,
``eagle_aux_hidden_state_layer_ids``, ``target_hidden_size``) and EAGLE-1 if it
has exactly one decoder layer; anything else is refused.

Translation into what vLLM 0.32 accepts (vLLM's ``SpeculativeConfig.method``
is a closed ``Literal`` and the class forbids extra keys):

* ``method`` -> ``"eagle"`` (EAGLE-1 head) or ``"eagle3"`` (EAGLE-3 head), so
  that vLLM loads the head with its own EAGLE model classes, shares embeddings
  / lm_head, makes the target emit EAGLE-3 auxiliary hidden states and gives
  the draft layers KV cache in the target's KV cache group.
* ``num_speculative_tokens`` -> ``K = max(N_max, S)`` where
  ``N_max = min(num_nodes, top_k + (max_depth - 1) * top_k**2)`` (the largest
  tree, root excluded; the scheduler schedules ``1 + N_max`` query tokens per
  request) and ``S = (max_depth - 1) * top_k`` (draft-side scratch slots the
  expander writes past the accepted context). vLLM uses K for (a) the KV
  lookahead reserved per request and step (``VllmConfig.num_lookahead_tokens``
  = K for EAGLE, ``scheduler.py`` ``allocate_slots(...,
  num_lookahead_tokens)``), which must cover the S draft scratch slots; (b)
  buffers sized ``[max_num_reqs, K]`` and ``1 + K`` query rows per decode
  request in the model runner (``uniform_decode_query_len``, CUDA-graph
  sizes on GPU), which must cover a full tree of ``1 + N_max`` nodes; (c) the
  per-position spec-decode counters (``SpecDecodingStats.new(K)``), whose
  accepted-per-position entries become accepted-per-depth (depth <= N_max).
  A tree whose K does not fit below the target's ``max_model_len`` is an
  error naming ``num_nodes`` (or ``max_depth``).
* The tree settings travel to every worker in
  ``VllmConfig.additional_config["vllm_eagle_tree"]`` (a JSON-able dict; the
  VllmConfig is pickled to the engine core and workers, and its hash covers
  additional_config). :meth:`Eagle2Settings.from_vllm_config` reads it back.
* Async scheduling is switched off (an explicit ``--async-scheduling`` is an
  error): with it vLLM schedules K placeholder draft tokens per request before
  the drafts exist, which cannot describe a variable-size tree.

Finally :func:`install_tree_runner` is called: **the single gate**.
:func:`tree_runner_worker_cls` returns the platform's tree worker class (CPU
today) and the gate sets ``parallel_config.worker_cls``; on a platform without
one it refuses to start (an eagle2 config must never run vLLM's chain
silently).

Any other method goes to vLLM's own ``create_speculative_config`` untouched.
"""
from __future__ import annotations

import difflib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from vllm_eagle_tree.core.expander import TreeConfig

__all__ = [
    "METHOD", "ADDITIONAL_CONFIG_KEY", "ADAPTIVE_DEFAULTS", "TREE_DEFAULTS", "PASSTHROUGH_KEYS",
    "Eagle2Settings", "Eagle2RunnerUnavailable", "parse_eagle2_config", "detect_head_format",
    "load_head_config", "speculative_token_bound", "is_eagle2_request",
    "wrap_create_speculative_config", "install_tree_runner", "tree_runner_worker_cls",
]

METHOD = "eagle2"
"""The user-facing speculative method name this plugin adds."""

ADDITIONAL_CONFIG_KEY = "vllm_eagle_tree"
"""Key of the tree settings in ``VllmConfig.additional_config``."""

TREE_DEFAULTS: dict[str, int] = {"num_nodes": 60, "max_depth": 6, "top_k": 10}
"""Plain EAGLE-2 knobs and their defaults (those of ``core.TreeConfig``)."""

ADAPTIVE_DEFAULTS: dict[str, Any] = {
    "depth_threshold": 0.05, "width_mass": 0.95, "min_path_prob": 0.01, "batch_num_nodes": None,
}
"""Adaptation thresholds used when ``"adaptive": true`` and a key is not given."""

PASSTHROUGH_KEYS: tuple[str, ...] = (
    "draft_tensor_parallel_size", "quantization", "revision", "code_revision",
    "max_model_len", "enforce_eager",
)
"""vLLM SpeculativeConfig fields accepted with eagle2 and passed through unchanged."""

_ALLOWED = ("method", "model", *TREE_DEFAULTS, "adaptive", *ADAPTIVE_DEFAULTS, "goodput",
            *PASSTHROUGH_KEYS)

# vLLM keys that a user might reasonably try with eagle2, and why they are refused.
_REFUSED_WHY = {
    "num_speculative_tokens": "eagle2 derives it from the tree (num_nodes, max_depth, top_k); "
                              "set those instead",
    "parallel_drafting": "eagle2 drafts a tree, not a parallel chain",
    "draft_sample_method": "eagle2 drafts deterministic top-k children and verifies losslessly",
    "rejection_sample_method": "eagle2 verifies trees with its own lossless tree sampler",
    "num_speculative_tokens_per_batch_size": "use \"adaptive\": true with \"batch_num_nodes\" "
                                             "for batch-dependent tree budgets",
    "disable_padded_drafter_batch": "the eagle2 tree runner does its own draft batching",
    "attention_backend": "the eagle2 tree runner picks the draft attention itself",
    "kv_cache_dtype": "a separate draft KV cache dtype is not supported by eagle2 yet",
    "tensor_parallel_size": "use \"draft_tensor_parallel_size\"",
}

# EAGLE-3-only fields of a head config (published EAGLE-3 heads carry at least one).
_EAGLE3_FIELDS = ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "target_hidden_size")
_EAGLE3_ARCH = re.compile(r"^(Eagle3\w+|\w+Eagle3)$")
_EAGLE1_ARCH = re.compile(r"^Eagle(?!3)\w*ForCausalLM$|^EagleDeepSeekMTPModel$")
_PLAIN_LM_ARCH = re.compile(r"^\w+ForCausalLM$")


class Eagle2RunnerUnavailable(NotImplementedError):
    """An eagle2 config was valid, but no tree runner is installed to run it."""


# ---------------------------------------------------------------------------
# Settings carried to the workers
# ---------------------------------------------------------------------------
def speculative_token_bound(tree: TreeConfig) -> tuple[int, int, int]:
    """``(K, N_max, S)``: the ``num_speculative_tokens`` vLLM gets for ``tree``.

    ``N_max`` = most drafted nodes a tree can have (root excluded),
    ``S`` = draft scratch slots written past the accepted context while the
    tree is expanded (``(max_depth - 1) * top_k``), ``K = max(N_max, S, 1)``.
    """
    n_max = tree.max_tree_size - 1
    scratch = (tree.max_depth - 1) * tree.top_k
    return max(n_max, scratch, 1), n_max, scratch


@dataclass(frozen=True)
class Eagle2Settings:
    """Everything the tree runner needs, as parsed at start-up.

    Attributes:
        tree:               the expander's knobs.
        adaptive:           the user's ``adaptive`` switch (False: plain EAGLE-2).
        head_model:         the head's path or hub id.
        head_format:        ``"eagle"`` (EAGLE-1) or ``"eagle3"``: also the
                            method vLLM was given.
        head_architectures: ``architectures`` from the head's config.json.
        num_speculative_tokens: K given to vLLM (see :func:`speculative_token_bound`).
        max_verify_nodes:   N_max, most drafted nodes verified per request and step.
        draft_scratch_slots: S, draft slots written past the context while drafting.
    """

    tree: TreeConfig
    adaptive: bool
    head_model: str
    head_format: str
    head_architectures: tuple[str, ...]
    num_speculative_tokens: int
    max_verify_nodes: int
    draft_scratch_slots: int
    goodput: bool = False

    @property
    def vllm_method(self) -> str:
        return self.head_format

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (``VllmConfig.compute_hash`` json-dumps it)."""
        t = self.tree
        return {
            "method": METHOD,
            "tree": {"top_k": t.top_k, "max_depth": t.max_depth, "num_nodes": t.num_nodes,
                     "depth_threshold": t.depth_threshold, "width_mass": t.width_mass,
                     "min_path_prob": t.min_path_prob, "batch_num_nodes": t.batch_num_nodes},
            "adaptive": self.adaptive,
            "head_model": self.head_model,
            "head_format": self.head_format,
            "head_architectures": list(self.head_architectures),
            "num_speculative_tokens": self.num_speculative_tokens,
            "max_verify_nodes": self.max_verify_nodes,
            "draft_scratch_slots": self.draft_scratch_slots,
            "goodput": self.goodput,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Eagle2Settings":
        if d.get("method") != METHOD:
            raise ValueError(f"not eagle2 tree settings: {dict(d)!r}")
        return cls(tree=TreeConfig(**d["tree"]), adaptive=bool(d["adaptive"]),
                   head_model=d["head_model"], head_format=d["head_format"],
                   head_architectures=tuple(d["head_architectures"]),
                   num_speculative_tokens=int(d["num_speculative_tokens"]),
                   max_verify_nodes=int(d["max_verify_nodes"]),
                   draft_scratch_slots=int(d["draft_scratch_slots"]),
                   goodput=bool(d.get("goodput", False)))

    @classmethod
    def from_vllm_config(cls, vllm_config) -> "Eagle2Settings | None":
        """The settings an engine was started with, or None if it is not eagle2.

        Works in any vLLM process (the VllmConfig carries them)."""
        extra = getattr(vllm_config, "additional_config", None)
        if not isinstance(extra, Mapping) or ADDITIONAL_CONFIG_KEY not in extra:
            return None
        settings = cls.from_dict(extra[ADDITIONAL_CONFIG_KEY])
        spec = vllm_config.speculative_config
        if spec is None or spec.method != settings.head_format \
                or spec.num_speculative_tokens != settings.num_speculative_tokens:
            raise ValueError(
                f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] does not match the speculative "
                f"config ({spec!r}); it is written by vllm-eagle-tree from "
                f"speculative_config and must not be set by hand")
        return settings


# ---------------------------------------------------------------------------
# Parsing and validation
# ---------------------------------------------------------------------------
def _key_error(key: str, what: str) -> ValueError:
    return ValueError(f'speculative_config["{key}"] with "method": "{METHOD}": {what}')


def _allowed_list() -> str:
    return ", ".join(f'"{k}"' for k in _ALLOWED)


def _vllm_spec_fields() -> frozenset[str]:
    try:
        import dataclasses

        from vllm.config import SpeculativeConfig

        return frozenset(f.name for f in dataclasses.fields(SpeculativeConfig))
    except Exception:  # vLLM missing or changed: the message is just less specific
        return frozenset()


def _refuse_key(key: str) -> ValueError:
    if key in _REFUSED_WHY:
        why = _REFUSED_WHY[key]
    elif key in _vllm_spec_fields():
        why = "this vLLM speculative-decoding option is not supported with eagle2"
    else:
        why = "unknown key"
        close = difflib.get_close_matches(key, _ALLOWED, n=1)
        if close:
            why += f' (did you mean "{close[0]}"?)'
    return _key_error(key, f"not accepted: {why}. Allowed keys: {_allowed_list()}")


def _get_int(cfg: Mapping[str, Any], key: str, lo: int, default: int | None,
             nullable: bool = False) -> int | None:
    v = cfg.get(key, default)
    if v is None and nullable:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        null = " or null" if nullable else ""
        raise _key_error(key, f"must be an integer >= {lo}{null}, got {v!r}")
    return v


def _get_float(cfg: Mapping[str, Any], key: str, lo: float, hi: float, default: float,
               lo_open: bool = False) -> float:
    v = cfg.get(key, default)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok:
        ok = (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise _key_error(key, f"must be a number in {rng}, got {v!r}")
    return float(v)


def load_head_config(model: str, revision: str | None = None) -> dict[str, Any]:
    """The head's ``config.json`` as a dict (local folder, or hub id via transformers)."""
    if not isinstance(model, str) or not model:
        raise _key_error("model", f"must be the path or hub id of an EAGLE head, got {model!r}")
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise _key_error("model", f"{model!r} has no config.json; expected an EAGLE-1 or "
                                      f"EAGLE-3 head folder")
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError) as exc:
            raise _key_error("model", f"cannot read {path}: {exc}") from exc
    try:
        from transformers import PretrainedConfig

        cfg, _ = PretrainedConfig.get_config_dict(model, revision=revision)
        return cfg
    except Exception as exc:
        raise _key_error("model", f"cannot load the config of {model!r} (not a local folder; "
                                  f"as a hub id: {exc})") from exc


def detect_head_format(head_config: Mapping[str, Any], model: str = "the head") -> str:
    """``"eagle"`` (EAGLE-1) or ``"eagle3"`` from a head's config dict (module docstring)."""
    sm_type = head_config.get("speculators_model_type")
    if sm_type in ("eagle", "eagle3"):
        return sm_type
    archs = head_config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    if any(isinstance(a, str) and _EAGLE3_ARCH.match(a) for a in archs):
        return "eagle3"
    if any(isinstance(a, str) and _EAGLE1_ARCH.match(a) for a in archs):
        return "eagle"
    if archs and all(isinstance(a, str) and _PLAIN_LM_ARCH.match(a) for a in archs):
        if any(head_config.get(f) is not None for f in _EAGLE3_FIELDS):
            return "eagle3"
        if head_config.get("num_hidden_layers") == 1:
            return "eagle"
    raise _key_error(
        "model",
        f"cannot tell whether {model} is an EAGLE-1 or an EAGLE-3 head from its config.json "
        f"(architectures={list(archs)!r}, num_hidden_layers="
        f"{head_config.get('num_hidden_layers')!r}). Expected architectures like "
        f"Eagle3LlamaForCausalLM / LlamaForCausalLMEagle3 (EAGLE-3), EagleLlamaForCausalLM "
        f"(EAGLE-1), or a one-layer *ForCausalLM head (published EAGLE-1 format)")


def _normalise_keys(cfg: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        if not isinstance(k, str):
            raise ValueError(f"speculative_config keys must be strings, got {k!r}")
        nk = k.replace("-", "_")
        if nk in out:
            raise _key_error(nk, f"given twice (as {nk!r} and {k!r})")
        out[nk] = v
    return out


def parse_eagle2_config(
    spec: Mapping[str, Any],
    head_config: Mapping[str, Any] | None = None,
) -> tuple[Eagle2Settings, dict[str, Any]]:
    """Validate an eagle2 speculative-config dict and translate it.

    Args:
        spec:        the user's dict (``"method": "eagle2"``).
        head_config: the head's config dict; read from ``spec["model"]`` when None.

    Returns:
        ``(settings, vllm_spec)``: the tree settings, and the dict to build
        vLLM's ``SpeculativeConfig`` from (method eagle/eagle3, the head,
        ``num_speculative_tokens`` = K, pass-through keys).

    Raises:
        ValueError naming the offending key and what is allowed.
    """
    cfg = _normalise_keys(spec)
    if cfg.get("method") != METHOD:
        raise _key_error("method", f'must be "{METHOD}" here, got {cfg.get("method")!r}')
    for key in cfg:
        if key not in _ALLOWED:
            raise _refuse_key(key)
    if "model" not in cfg or cfg["model"] is None:
        raise _key_error("model", "is required: the path or hub id of the EAGLE-1 or EAGLE-3 "
                                  "draft head")
    model = cfg["model"]
    if not isinstance(model, str) or not model:
        raise _key_error("model", f"must be the path or hub id of an EAGLE head, got {model!r}")

    top_k = _get_int(cfg, "top_k", 1, TREE_DEFAULTS["top_k"])
    max_depth = _get_int(cfg, "max_depth", 1, TREE_DEFAULTS["max_depth"])
    num_nodes = _get_int(cfg, "num_nodes", 1, TREE_DEFAULTS["num_nodes"])
    adaptive = cfg.get("adaptive", False)
    if not isinstance(adaptive, bool):
        raise _key_error("adaptive", f"must be true or false, got {adaptive!r}")
    if adaptive:
        knobs = dict(
            depth_threshold=_get_float(cfg, "depth_threshold", 0.0, 1.0,
                                       ADAPTIVE_DEFAULTS["depth_threshold"]),
            width_mass=_get_float(cfg, "width_mass", 0.0, 1.0, ADAPTIVE_DEFAULTS["width_mass"],
                                  lo_open=True),
            min_path_prob=_get_float(cfg, "min_path_prob", 0.0, 1.0,
                                     ADAPTIVE_DEFAULTS["min_path_prob"]),
            batch_num_nodes=_get_int(cfg, "batch_num_nodes", 1,
                                     ADAPTIVE_DEFAULTS["batch_num_nodes"], nullable=True),
        )
    else:
        for key in ADAPTIVE_DEFAULTS:
            if key in cfg:
                raise _key_error(key, 'is an adaptation threshold and needs "adaptive": true '
                                      '(with "adaptive": false the tree is plain EAGLE-2)')
        knobs = {}
    goodput = cfg.get("goodput", False)
    if not isinstance(goodput, bool):
        raise _key_error("goodput", f"must be true or false, got {goodput!r}")
    if goodput and not adaptive:
        raise _key_error("goodput", 'needs "adaptive": true (it sizes adaptive trees)')
    tree = TreeConfig(top_k=top_k, max_depth=max_depth, num_nodes=num_nodes, **knobs)

    if head_config is None:
        head_config = load_head_config(model, cfg.get("revision"))
    head_format = detect_head_format(head_config, repr(model))
    archs = head_config.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]

    k, n_max, scratch = speculative_token_bound(tree)
    settings = Eagle2Settings(
        tree=tree, adaptive=adaptive, head_model=model, head_format=head_format,
        head_architectures=tuple(str(a) for a in archs), num_speculative_tokens=k,
        max_verify_nodes=n_max, draft_scratch_slots=scratch, goodput=goodput)
    vllm_spec = {"method": head_format, "model": model, "num_speculative_tokens": k}
    vllm_spec.update({key: cfg[key] for key in PASSTHROUGH_KEYS if key in cfg})
    return settings, vllm_spec


# ---------------------------------------------------------------------------
# The EngineArgs hook (installed by plugin.register)
# ---------------------------------------------------------------------------
def is_eagle2_request(engine_args) -> bool:
    """True iff the EngineArgs ask for ``"method": "eagle2"`` (dict or ``--spec-method``)."""
    spec = engine_args.speculative_config
    if isinstance(spec, Mapping) and spec.get("method") == METHOD:
        return True
    return getattr(engine_args, "spec_method", None) == METHOD


def _merged_user_spec(engine_args) -> dict[str, Any]:
    """The user's dict plus the ``--spec-*`` shortcut flags, as vLLM merges them
    (``EngineArgs.create_speculative_config``), on a copy."""
    spec = dict(engine_args.speculative_config or {})
    for flag, key, attr in (("--spec-method", "method", "spec_method"),
                            ("--spec-model", "model", "spec_model"),
                            ("--spec-tokens", "num_speculative_tokens", "spec_tokens")):
        value = getattr(engine_args, attr, None)
        if value is None:
            continue
        if key in spec:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        spec[key] = value
    return spec


def _with_settings(additional_config, settings: Eagle2Settings) -> dict:
    if not isinstance(additional_config, Mapping):
        raise ValueError(f'"method": "{METHOD}" keeps its tree settings in additional_config, '
                         f"which must then be a dict, got {type(additional_config).__name__}")
    new = settings.to_dict()
    old = additional_config.get(ADDITIONAL_CONFIG_KEY)
    if old is not None and old != new:
        raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] is written by "
                         f"vllm-eagle-tree from speculative_config; do not set it by hand")
    return {**additional_config, ADDITIONAL_CONFIG_KEY: new}


def _check_fits_model_len(settings: Eagle2Settings, max_model_len: int | None) -> None:
    k = settings.num_speculative_tokens
    if max_model_len is None or k < max_model_len:
        return
    key = "num_nodes" if settings.max_verify_nodes >= settings.draft_scratch_slots else "max_depth"
    raise _key_error(key, f"the tree needs num_speculative_tokens={k} (max(num_nodes capped at "
                          f"the candidates, (max_depth - 1) * top_k)), which does not fit "
                          f"max_model_len={max_model_len}; use a smaller tree")


def _check_scheduler_args(engine_args) -> None:
    if getattr(engine_args, "async_scheduling", None):
        raise ValueError(
            f'"method": "{METHOD}" does not support async scheduling (--async-scheduling): '
            f"the tree runner needs each request's tree before it is scheduled. Leave "
            f"async_scheduling unset or false")
    engine_args.async_scheduling = False


def wrap_create_speculative_config(original: Callable) -> Callable:
    """Wrap vLLM 0.32 ``EngineArgs.create_speculative_config`` for eagle2.

    Non-eagle2 configs call ``original`` with the EngineArgs untouched. For
    eagle2: validate and translate (errors name the key), let ``original``
    build vLLM's SpeculativeConfig from the translated dict (the user's dict is
    restored afterwards, so a second ``create_engine_config`` re-validates),
    put the settings in ``additional_config``, switch async scheduling off,
    then call the gate :func:`install_tree_runner`.
    """
    if getattr(original, "_vllm_eagle_tree_wrapped", False):
        return original

    def create_speculative_config(self, target_model_config, target_parallel_config):
        if not is_eagle2_request(self):
            return original(self, target_model_config, target_parallel_config)
        settings, vllm_spec = parse_eagle2_config(_merged_user_spec(self))
        _check_fits_model_len(settings, getattr(target_model_config, "max_model_len", None))
        _check_scheduler_args(self)
        saved = (self.speculative_config, self.spec_method, self.spec_model, self.spec_tokens)
        try:
            self.speculative_config = vllm_spec
            self.spec_method = self.spec_model = self.spec_tokens = None
            spec_config = original(self, target_model_config, target_parallel_config)
        finally:
            (self.speculative_config, self.spec_method, self.spec_model,
             self.spec_tokens) = saved
        install_tree_runner(target_parallel_config, settings)  # the gate
        self.additional_config = _with_settings(self.additional_config, settings)
        return spec_config

    create_speculative_config.__doc__ = original.__doc__
    create_speculative_config.__wrapped__ = original  # type: ignore[attr-defined]
    create_speculative_config._vllm_eagle_tree_wrapped = True  # type: ignore[attr-defined]
    return create_speculative_config


# ---------------------------------------------------------------------------
# Which worker runs the trees
# ---------------------------------------------------------------------------
TREE_WORKERS = {"cpu": "vllm_eagle_tree.adapter.worker.TreeCPUWorker"}


def current_platform_name() -> str:
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else str(current_platform.device_name)


def tree_runner_worker_cls(settings: Eagle2Settings) -> str:
    """Qualified name of the worker class that runs eagle2 trees on this platform.

    The CPU platform has one (``adapter.worker.TreeCPUWorker``). Elsewhere this
    raises :class:`Eagle2RunnerUnavailable`: an eagle2 config never runs as
    vLLM's chain.
    """
    platform = current_platform_name()
    if platform in TREE_WORKERS:
        return TREE_WORKERS[platform]
    t = settings.tree
    raise Eagle2RunnerUnavailable(
        f'speculative_config "method": "{METHOD}" is valid (head {settings.head_model!r}, '
        f"{'EAGLE-3' if settings.head_format == 'eagle3' else 'EAGLE-1'}; tree top_k={t.top_k}, "
        f"max_depth={t.max_depth}, num_nodes={t.num_nodes}"
        f"{', adaptive' if settings.adaptive else ''}), but this version of vllm-eagle-tree "
        f"runs trees on the CPU platform only (platform here: {platform!r}; the GPU runner "
        f"is not written yet), and eagle2 never falls back to a chain. Use "
        f'"method": "{settings.head_format}" for vLLM\'s EAGLE chain with this head meanwhile.')


def install_tree_runner(parallel_config, settings: Eagle2Settings) -> None:
    """Point vLLM at the tree runner's worker class (``--worker-cls``).

    ``parallel_config`` is the target's ParallelConfig, which the VllmConfig
    built next keeps (the platform only resolves ``worker_cls == "auto"``).
    """
    worker_cls = tree_runner_worker_cls(settings)
    current = getattr(parallel_config, "worker_cls", "auto")
    if current not in ("auto", worker_cls):
        raise ValueError(
            f'"method": "{METHOD}" runs in its own worker class {worker_cls!r}; it cannot be '
            f"combined with --worker-cls {current!r}")
    parallel_config.worker_cls = worker_cls
