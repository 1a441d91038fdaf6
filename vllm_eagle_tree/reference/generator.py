"""Reference EAGLE-2 tree speculative decoding, engine-free (no vLLM import).

The target is a HF ``LlamaForCausalLM`` (its weights, our forward: dense KV,
explicit positions and per-request masks); the draft is an EAGLE-1 or EAGLE-3
head (:class:`vllm_eagle_tree.heads.EagleHead`, numerically vLLM's), its
format read from the head config's ``architectures``. One step, as a vLLM
integration runs it (DESIGN.md sections 2-3)::

    tree   = expand_tree(cfg, root, root_logprobs, step_fn)   # draft: the tree
    logits = target(tree nodes, positions ctx + depth, ancestor mask)  # ONE forward
    result = verify(tree, logits, sampling params)            # lossless walk
    keep the accepted path's target KV; the draft's tree KV was scratch
    root_logprobs = draft(accepted tokens + bonus, target features)    # re-run

Conventions (CONVENTIONS.md and ``scripts/build_pair.py``):

* ``ctx`` = tokens of a request in the target KV cache. The tree root is the
  last committed token (not yet in the cache); node i sits at target
  position ``ctx + depth[i]`` and writes its KV to slot ``ctx + i``.
* Draft input at position p is (token x_{p+1}, feature f_p); its output
  predicts x_{p+2}. So the draft cache holds exactly ``ctx`` entries, the
  last one being the root's step (root token, feature of the token before
  it), whose output is the root distribution. A tree node at depth d
  consumes its token and its *parent's* draft output at draft position
  ``ctx + d - 1`` (the target position minus one), attending to the draft
  context plus its ancestors' scratch slots.
* EAGLE-1 features: the target's final post-norm hidden state. EAGLE-3: the
  residual stream entering the layers ``eagle_aux_hidden_state_layer_ids``
  (id = number of layers applied), concatenated, through ``head.fc``.
* A chain (vLLM's EAGLE, K tokens) is the tree ``top_k=1, max_depth=K,
  num_nodes=K`` (:func:`chain_config`): same code path.

Counting: ``tau`` = tokens a request emits per verify forward it takes part
in (accepted drafted tokens + 1 bonus), before truncation at
``max_new_tokens``/EOS. The first token comes from the prefill forward (as in
vLLM), not from a verify forward, and is not counted in tau.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core import (SAMPLING_EPS, Frontier, TreeBatch, TreeConfig, expand_tree_detailed, verify,
                    walk_trees)
from ..heads import EagleHead

__all__ = ["SamplingParams", "RequestOutput", "GenerationStats", "KVCache", "TargetModel",
           "DraftModel", "DecodeState", "ReferenceGenerator", "chain_config", "load_pair"]

EAGLE1_ARCHITECTURES = ("EagleLlamaForCausalLM", "EAGLEModel", "LlamaForCausalLMEagle")
EAGLE3_ARCHITECTURES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")


def chain_config(k: int) -> TreeConfig:
    """vLLM's EAGLE chain of ``k`` drafted tokens, as a tree (top-1 children)."""
    return TreeConfig(top_k=1, max_depth=k, num_nodes=k)


@dataclass
class SamplingParams:
    """Per-request sampling (vLLM semantics, see core.apply_sampling_params).

    temperature < 1e-5 is greedy; top_k <= 0 and top_p = 1.0 are off; seed
    gives the request its own torch.Generator (None: the default RNG).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 32
    ignore_eos: bool = False


@dataclass
class RequestOutput:
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "length" or "stop"
    num_steps: int = 0       # verify forwards this request took part in
    num_accepted: int = 0    # drafted tokens accepted
    num_drafted: int = 0     # drafted nodes verified (root excluded)

    @property
    def tau(self) -> float:
        return 1.0 + self.num_accepted / self.num_steps if self.num_steps else 1.0


@dataclass
class GenerationStats:
    """Counters of one :meth:`ReferenceGenerator.generate` call (summable)."""

    target_forwards: int = 0   # batched target forwards: prefill + verify
    verify_forwards: int = 0   # batched verify forwards
    draft_forwards: int = 0    # batched draft-head forwards (tree steps + re-runs)
    request_steps: int = 0     # sum over requests of verify forwards taken part in
    accepted: int = 0          # drafted tokens accepted, all requests
    drafted_nodes: int = 0     # drafted nodes verified, all requests
    emitted: int = 0           # tokens output by verify steps (after truncation)
    prefill_tokens: int = 0    # tokens output by the prefill forward

    @property
    def tau(self) -> float:
        """Tokens per verify forward per request: 1 + accepted / steps."""
        return (self.accepted + self.request_steps) / self.request_steps if self.request_steps else 1.0

    @property
    def drafted_per_step(self) -> float:
        return self.drafted_nodes / self.request_steps if self.request_steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafted nodes per drafted node."""
        return self.accepted / self.drafted_nodes if self.drafted_nodes else 0.0

    def __add__(self, other: "GenerationStats") -> "GenerationStats":
        return GenerationStats(*(getattr(self, f) + getattr(other, f)
                                 for f in self.__dataclass_fields__))

    def as_dict(self) -> dict:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d.update(tau=self.tau, drafted_per_step=self.drafted_per_step,
                 acceptance_rate=self.acceptance_rate)
        return d


# ----------------------------------------------------------------- KV cache

class KVCache:
    """Dense KV for a batch: per layer, k and v ``[B, capacity, kv_heads, head_dim]``.

    Slot s of request b holds that request's token at logical slot s (no
    paging). Committed lengths are tracked by the generator (``ctx``); slots
    past them are scratch that the next write overwrites.
    """

    def __init__(self, num_layers: int, batch: int, capacity: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device=None):
        shape = (batch, capacity, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v ``[B, T, kv, D]`` into ``slots [B, T]``."""
        if int(slots.max()) >= self.capacity:
            raise ValueError(f"KV slot {int(slots.max())} beyond capacity {self.capacity}")
        idx = slots[:, :, None, None].expand_as(k)
        self.k[layer].scatter_(1, idx, k.to(self.k[layer].dtype))
        self.v[layer].scatter_(1, idx, v.to(self.v[layer].dtype))

    def ensure(self, capacity: int) -> None:
        """Grow to at least ``capacity`` slots (zero padding)."""
        extra = capacity - self.capacity
        if extra > 0:
            pad = lambda t: torch.cat([t, t.new_zeros(t.shape[0], extra, *t.shape[2:])], 1)  # noqa: E731
            self.k, self.v = [pad(t) for t in self.k], [pad(t) for t in self.v]

    def read(self, layer: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][:, :width], self.v[layer][:, :width]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src [B, n]`` to ``dst [B, n]`` (all reads before writes)."""
        for cache in (self.k, self.v):
            for layer, t in enumerate(cache):
                g = src[:, :, None, None].expand(-1, -1, *t.shape[2:])
                t.scatter_(1, dst[:, :, None, None].expand_as(g), torch.gather(t, 1, g))

    def select(self, rows: torch.Tensor) -> None:
        """Keep only requests ``rows`` (finished requests leave the batch)."""
        self.k = [t[rows] for t in self.k]
        self.v = [t[rows] for t in self.v]


def visibility(ctx: torch.Tensor, block: torch.Tensor, width: int) -> torch.Tensor:
    """bool ``[B, T, width]``: which KV slots each query token attends to.

    Slot s of request b is visible to its query t iff ``s < ctx[b]`` (the
    committed context) or ``s = ctx[b] + j`` with ``block[b, t, j]`` (the
    block of slots this forward writes: a causal sequence, a verify tree with
    its ancestor mask, or the draft's tree scratch).
    """
    B, T, W = block.shape
    rel = torch.arange(width, device=block.device)[None, :] - ctx[:, None]  # [B, width]
    in_block = (rel >= 0) & (rel < W)
    idx = rel.clamp(0, max(W - 1, 0))[:, None, :].expand(B, T, width)
    return (rel < 0)[:, None, :] | (torch.gather(block, 2, idx) & in_block[:, None, :])


def causal_block(B: int, T: int, device=None) -> torch.Tensor:
    return torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)


# ------------------------------------------------------------------- target

class TargetModel:
    """A HF LlamaForCausalLM run with our own dense KV cache and masks.

    Uses the HF modules (norms, projections, MLP, rotary tables) layer by
    layer, so the arithmetic is HF's; only the KV cache and the attention
    mask (per request, arbitrary) are ours.
    """

    def __init__(self, hf_model):
        self.hf = hf_model.eval()
        cfg = hf_model.config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        eos = getattr(hf_model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = cfg.eos_token_id
        self.eos_token_ids = set() if eos is None else set(eos if isinstance(eos, (list, tuple)) else [eos])

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32) -> "TargetModel":
        from transformers import LlamaForCausalLM
        return cls(LlamaForCausalLM.from_pretrained(str(path), dtype=dtype))

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.hf.model.embed_tokens.weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.hf.lm_head.weight

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        return KVCache(self.num_layers, batch, capacity, self.kv_heads, self.head_dim,
                       self.embed_weight.dtype, self.embed_weight.device)

    @torch.no_grad()
    def forward(self, cache: KVCache, tokens, positions, ctx, block, offsets=None,
                aux_layer_ids: Sequence[int] = ()):
        """Run ``tokens [B, T]`` at ``positions [B, T]``.

        Token t of request b writes its KV to slot ``ctx[b] + offsets[b, t]``
        (default t) and attends per :func:`visibility` with ``block [B, T, W]``.
        Returns (final post-norm hidden [B, T, H], aux [B, T, len(ids) * H]
        or None): aux concatenates the residual stream after ``id`` layers for
        each id in ``aux_layer_ids``. Logits: :meth:`logits` of the hidden.
        """
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        m = self.hf.model
        B, T = tokens.shape
        if offsets is None:
            offsets = torch.arange(T, device=tokens.device).expand(B, T)
        slots = ctx[:, None] + offsets
        width = max(int(ctx.max()), int(slots.max()) + 1)
        mask = visibility(ctx, block, width)[:, None]  # [B, 1, T, width]
        rep = self.num_heads // self.kv_heads
        h = m.embed_tokens(tokens)
        cos, sin = m.rotary_emb(h, positions)
        aux = {}
        for i, layer in enumerate(m.layers):
            if i in aux_layer_ids:
                aux[i] = h
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            cache.write(i, slots, k.transpose(1, 2), v.transpose(1, 2))
            K, V = cache.read(i, width)
            K = K.transpose(1, 2).repeat_interleave(rep, dim=1)
            V = V.transpose(1, 2).repeat_interleave(rep, dim=1)
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, scale=attn.scaling)
            h = h + attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if self.num_layers in aux_layer_ids:
            aux[self.num_layers] = h
        aux_cat = torch.cat([aux[i] for i in aux_layer_ids], dim=-1) if aux_layer_ids else None
        return m.norm(h), aux_cat

    @torch.no_grad()
    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states (any leading shape)."""
        return self.hf.lm_head(final).float()


# -------------------------------------------------------------------- draft

class DraftModel:
    """An EAGLE-1 or EAGLE-3 head in vLLM's checkpoint format, bound to a target."""

    def __init__(self, head: EagleHead, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor | None,
                 aux_layer_ids: Sequence[int] = (), token_map: torch.Tensor | None = None):
        self.head = head.eval()
        self.eagle3 = head.eagle3
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight  # the target's (EAGLE-1); EAGLE-3 has its own
        self.aux_layer_ids = tuple(aux_layer_ids)
        self.token_map = token_map  # draft vocab index -> token id (EAGLE-3 d2t), or None
        self.hidden_size = head.cfg.hidden_size

    @classmethod
    def from_pretrained(cls, path, target: TargetModel) -> "DraftModel":
        from safetensors.torch import load_file
        from transformers import LlamaConfig

        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        arch = (raw.get("architectures") or ["?"])[0]
        if arch in EAGLE3_ARCHITECTURES:
            eagle3 = True
        elif arch in EAGLE1_ARCHITECTURES:
            eagle3 = False
        else:
            raise ValueError(f"{path}: unknown draft architecture {arch!r}; expected one of "
                             f"{EAGLE1_ARCHITECTURES + EAGLE3_ARCHITECTURES}")
        cfg = LlamaConfig.from_pretrained(str(path))
        state = load_file(str(path / "model.safetensors"))
        embed = state.pop("embed_tokens.weight", None)
        embed = target.embed_weight if embed is None else embed
        d2t = state.pop("d2t", None)
        state.pop("t2d", None)
        H = cfg.hidden_size
        if eagle3:
            aux_ids = raw.get("eagle_aux_hidden_state_layer_ids")
            if not aux_ids:  # vLLM's default for EAGLE-3 targets
                n = target.num_layers
                aux_ids = [2, n // 2, n - 3]
            head = EagleHead(cfg, eagle3=True, num_aux=state["fc.weight"].shape[1] // H)
            draft_vocab = state["lm_head.weight"].shape[0]
            if draft_vocab != head.lm_head.out_features:
                head.lm_head = nn.Linear(H, draft_vocab, bias=False)
            lm_head = None
        else:
            aux_ids = []
            head = EagleHead(cfg, eagle3=False)
            if "fc.bias" in state:  # the published EAGLE-1 heads carry one
                head.fc = nn.Linear(2 * H, H, bias=True)
            lm_head = state.pop("lm_head.weight", None)
            lm_head = target.lm_head_weight if lm_head is None else lm_head
        head.load_state_dict(state, strict=True)
        head.to(target.embed_weight.dtype)
        token_map = None
        if d2t is not None:
            token_map = torch.arange(d2t.numel(), dtype=torch.int64) + d2t.long()
        return cls(head, embed, lm_head, aux_ids, token_map)

    @property
    def name(self) -> str:
        return "eagle3" if self.eagle3 else "eagle1"

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        attn = self.head.layer.self_attn
        return KVCache(1, batch, capacity, attn.n_kv, attn.head_dim,
                       self.embed_weight.dtype, self.embed_weight.device)

    def features(self, final: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """The target feature this head consumes (before :meth:`first_hidden`)."""
        return aux if self.eagle3 else final

    def first_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """The hidden input of a draft step on target features (EAGLE-3: fc)."""
        return self.head.first_hidden(features)

    @torch.no_grad()
    def forward(self, cache: KVCache, tokens, hidden, positions, ctx, block, offsets=None):
        """One draft step over ``tokens [B, T]`` with input hidden ``[B, T, H]``.

        KV slots and attention as in :meth:`TargetModel.forward`. Returns the
        output hidden ``[B, T, H]`` (the next step's input hidden); its
        distribution is :meth:`logprobs`.
        """
        B, T = tokens.shape
        if offsets is None:
            offsets = torch.arange(T, device=tokens.device).expand(B, T)
        slots = ctx[:, None] + offsets
        width = max(int(ctx.max()), int(slots.max()) + 1)
        bias = torch.zeros(B, T, width, dtype=torch.float32, device=tokens.device)
        bias.masked_fill_(~visibility(ctx, block, width), float("-inf"))
        head, attn = self.head, self.head.layer.self_attn
        x, residual = head.layer_input(F.embedding(tokens, self.embed_weight), hidden)
        q, k, v = attn.qkv(x, positions)
        cache.write(0, slots, k, v)
        K, V = cache.read(0, width)
        return head.finish(attn.attend(q, K, V, bias), residual)

    @torch.no_grad()
    def logprobs(self, out: torch.Tensor) -> torch.Tensor:
        """float32 log-probs over the draft vocabulary of output hiddens."""
        return self.head.logits(out, self.lm_head_weight).float().log_softmax(-1)


def load_pair(target_path=None, head_path=None, head: str = "eagle1",
              dtype: torch.dtype = torch.float32) -> tuple[TargetModel, DraftModel]:
    """Load a target and a head; defaults: the bundled pair (``vllm_eagle_tree.assets``)."""
    from .. import assets
    target = TargetModel.from_pretrained(target_path or assets.TARGET, dtype)
    if head_path is None:
        head_path = {"eagle1": assets.EAGLE1_HEAD, "eagle": assets.EAGLE1_HEAD,
                     "eagle3": assets.EAGLE3_HEAD}[head]
    return target, DraftModel.from_pretrained(head_path, target)


# ---------------------------------------------------------------- generator

@dataclass
class DecodeState:
    """A batch between two steps: what an engine keeps per running request.

    Row i of every tensor belongs to request ``active[i]`` (an index into
    ``outputs``); finished requests leave the rows (:meth:`keep`).
    """

    outputs: list[RequestOutput]   # every request, in input order
    params: list[SamplingParams]
    active: list[int]
    target_cache: KVCache
    draft_cache: KVCache
    ctx: torch.Tensor              # int64 [n]: tokens in the target (and draft) KV cache
    root: torch.Tensor             # int64 [n]: last committed token, not yet in the caches
    root_logprobs: torch.Tensor    # [n, V_draft]: the draft's distribution after the root
    root_hidden: torch.Tensor      # [n, H]: the draft's output at the root
    temperature: torch.Tensor      # float32 [n]
    top_k: torch.Tensor            # int64 [n]
    top_p: torch.Tensor            # float32 [n]
    generators: list               # torch.Generator or None per row
    stats: GenerationStats = field(default_factory=GenerationStats)

    @property
    def done(self) -> bool:
        return not self.active

    def keep(self, rows: list[int]) -> None:
        idx = torch.tensor(rows, dtype=torch.int64)
        self.target_cache.select(idx)
        self.draft_cache.select(idx)
        for name in ("ctx", "root", "root_logprobs", "root_hidden", "temperature", "top_k", "top_p"):
            setattr(self, name, getattr(self, name)[idx])
        self.generators = [self.generators[i] for i in rows]
        self.active = [self.active[i] for i in rows]

    def drop_finished(self) -> None:
        rows = [i for i, b in enumerate(self.active) if self.outputs[b].finish_reason is None]
        if len(rows) < len(self.active):
            self.keep(rows)

    def clone(self) -> "DecodeState":
        """An independent copy (to run several tree configs from one prefill)."""
        def copy_gen(g):
            if g is None:
                return None
            c = torch.Generator()
            c.set_state(g.get_state())
            return c

        def copy_cache(c: KVCache) -> KVCache:
            new = KVCache.__new__(KVCache)
            new.k, new.v = [t.clone() for t in c.k], [t.clone() for t in c.v]
            return new

        return DecodeState(
            outputs=copy.deepcopy(self.outputs), params=list(self.params), active=list(self.active),
            target_cache=copy_cache(self.target_cache), draft_cache=copy_cache(self.draft_cache),
            ctx=self.ctx.clone(), root=self.root.clone(), root_logprobs=self.root_logprobs.clone(),
            root_hidden=self.root_hidden.clone(), temperature=self.temperature.clone(),
            top_k=self.top_k.clone(), top_p=self.top_p.clone(),
            generators=[copy_gen(g) for g in self.generators], stats=copy.deepcopy(self.stats))


def _tree_width(cfg: TreeConfig) -> int:
    """KV slots one step may write past ``ctx``: verify tree, draft scratch, re-run."""
    return max(cfg.max_tree_size, (cfg.max_depth - 1) * cfg.top_k, cfg.max_depth + 1)


def _emit(out: RequestOutput, p: SamplingParams, tokens: list[int], eos: set[int]) -> int:
    """Append tokens until max_new_tokens or EOS; returns how many were kept."""
    n = 0
    for t in tokens:
        if out.finish_reason is not None:
            break
        out.output_ids.append(t)
        n += 1
        if not p.ignore_eos and t in eos:
            out.finish_reason = "stop"
        elif len(out.output_ids) >= p.max_new_tokens:
            out.finish_reason = "length"
    return n


class ReferenceGenerator:
    """Speculative decoding with EAGLE-2 draft trees (a chain is a tree).

    ``generate(prompts, params, tree)`` = ``start`` (prefill) then ``step``
    until every request is done. ``tree`` defaults to the generator's.
    """

    def __init__(self, target: TargetModel, draft: DraftModel, tree: TreeConfig | None = None):
        self.target = target
        self.draft = draft
        self.tree = tree or TreeConfig()

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 tree: TreeConfig | None = None) -> tuple[list[RequestOutput], GenerationStats]:
        state = self.start(prompts, params)
        while not state.done:
            self.step(state, tree)
        return state.outputs, state.stats

    # --- helpers -----------------------------------------------------------
    def _draft_extend(self, cache: KVCache, tokens, feats, ctx, lengths):
        """Draft head over a causal run of tokens (prompt or verified tokens).

        Token i of request b is x_{ctx+i+1} with target feature f_{ctx+i}, at
        draft position ``ctx + i``; tokens past ``lengths[b]`` are padding.
        Returns the root's (log-probs [B, V], output hidden [B, H]): the
        draft's step on its last real token.
        """
        B, T = tokens.shape
        positions = ctx[:, None] + torch.arange(T)
        out = self.draft.forward(cache, tokens, self.draft.first_hidden(feats), positions, ctx,
                                 causal_block(B, T))
        root_hidden = out[torch.arange(B), lengths - 1]
        return self.draft.logprobs(root_hidden), root_hidden

    @staticmethod
    def _verify(tree: TreeBatch, logits: torch.Tensor, state: DecodeState):
        if bool((state.temperature < SAMPLING_EPS).all()):
            # All greedy: core.verify's draws are the argmax; skip its noise.
            return walk_trees(logits.argmax(-1), tree)
        return verify(tree, logits, state.temperature, state.top_k, state.top_p, state.generators)

    # --- prefill -----------------------------------------------------------
    @torch.no_grad()
    def start(self, prompts: Sequence[Sequence[int]],
              params: SamplingParams | Sequence[SamplingParams] | None = None) -> DecodeState:
        """Prefill: the target on the prompts, the first token sampled from
        its last logits (as vLLM does, no drafting), then the draft head on
        the prompt with the target's features (its last step gives the first
        root distribution)."""
        target, draft = self.target, self.draft
        B = len(prompts)
        if B == 0:
            raise ValueError("no prompts")
        if params is None:
            params = SamplingParams()
        params = [params] * B if isinstance(params, SamplingParams) else list(params)
        if len(params) != B:
            raise ValueError(f"got {len(params)} SamplingParams for {B} prompts")
        if any(len(p) < 1 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        lens = torch.tensor([len(p) for p in prompts])
        T = int(lens.max())
        capacity = T + max(p.max_new_tokens for p in params) + _tree_width(self.tree) + 2
        state = DecodeState(
            outputs=[RequestOutput(prompt_ids=list(p)) for p in prompts], params=params,
            active=list(range(B)),
            target_cache=target.new_cache(B, capacity), draft_cache=draft.new_cache(B, capacity),
            ctx=lens.clone(), root=None, root_logprobs=None, root_hidden=None,
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            generators=[torch.Generator().manual_seed(p.seed) if p.seed is not None else None
                        for p in params])

        # Target on the prompts (right-padded; padding writes scratch slots).
        tokens = torch.tensor([list(p) + [0] * (T - len(p)) for p in prompts], dtype=torch.int64)
        zero = torch.zeros(B, dtype=torch.int64)
        final, aux = target.forward(state.target_cache, tokens, torch.arange(T).expand(B, T), zero,
                                    causal_block(B, T), aux_layer_ids=draft.aux_layer_ids)
        state.stats.target_forwards += 1
        rows, last = torch.arange(B), lens - 1
        # First token: a root-only tree's bonus token is exactly one draw.
        roots = TreeBatch(torch.arange(B + 1, dtype=torch.int32), tokens[rows, last],
                          torch.full((B,), -1, dtype=torch.int32), torch.zeros(B, dtype=torch.int32),
                          torch.zeros(B), last.to(torch.int32))
        first = self._verify(roots, target.logits(final[rows, last]), state).bonus_token

        # Draft head on the prompt: tokens x_1..x_L, features f_0..f_{L-1}.
        d_tokens = torch.cat([tokens[:, 1:], zero[:, None]], dim=1)
        d_tokens[rows, last] = first
        state.root_logprobs, state.root_hidden = self._draft_extend(
            state.draft_cache, d_tokens, draft.features(final, aux), zero, lens)
        state.stats.draft_forwards += 1
        state.root = first.clone()
        for b in range(B):
            state.stats.prefill_tokens += _emit(state.outputs[b], params[b], [int(first[b])],
                                                target.eos_token_ids)
        state.drop_finished()
        return state

    # --- one speculative step ------------------------------------------------
    @torch.no_grad()
    def step(self, state: DecodeState, tree: TreeConfig | None = None) -> None:
        """Draft a tree per request, verify all nodes in one target forward,
        keep the accepted path, re-run the draft on it, emit."""
        cfg = tree or self.tree
        target, draft, st = self.target, self.draft, state
        n_req = len(st.active)
        need = int(st.ctx.max()) + _tree_width(cfg) + 1
        st.target_cache.ensure(need)
        st.draft_cache.ensure(need)
        ctx = st.ctx

        # 1. Draft the tree. step_fn runs the head on a frontier: the nodes'
        # tokens, their parents' draft outputs as hidden, draft position =
        # target position - 1, the ancestor mask over this tree's scratch
        # slots (ctx + slot) of the draft cache.
        prev_out = st.root_hidden[:, None, :]

        def step_fn(f: Frontier) -> torch.Tensor:
            nonlocal prev_out
            hidden = torch.gather(prev_out, 1, f.parent[..., None].expand(-1, -1, prev_out.shape[-1]))
            prev_out = draft.forward(st.draft_cache, f.tokens, hidden, f.positions - 1, ctx,
                                     f.ancestor_mask, f.slots.expand(n_req, -1))
            return draft.logprobs(prev_out)

        expansion = expand_tree_detailed(cfg, st.root, st.root_logprobs, step_fn, context_len=ctx,
                                         token_map=draft.token_map)
        tree_b = expansion.tree
        st.stats.draft_forwards += expansion.num_steps

        # 2. Verify: ONE target forward over every node (positions ctx + depth,
        # ancestor mask); node i writes its KV to slot ctx + i.
        n = tree_b.max_size
        req, loc = tree_b.request_index, tree_b.local_index
        node_tok = torch.zeros(n_req, n, dtype=torch.int64)
        node_tok[req, loc] = tree_b.token
        node_pos = ctx[:, None].repeat(1, n)
        node_pos[req, loc] = tree_b.positions
        block = tree_b.ancestor_masks() | torch.eye(n, dtype=torch.bool)  # padding rows: self
        final, aux = target.forward(st.target_cache, node_tok, node_pos, ctx, block,
                                    aux_layer_ids=draft.aux_layer_ids)
        st.stats.target_forwards += 1
        st.stats.verify_forwards += 1
        res = self._verify(tree_b, target.logits(final[req, loc]), st)
        m = res.num_accepted

        # 3. Keep the accepted path's target KV: the root and accepted nodes
        # move to slots ctx, ctx+1, ... (source >= destination).
        D1 = res.accepted_nodes.shape[1] + 1
        steps = torch.arange(D1).expand(n_req, D1)
        path = torch.cat([torch.zeros(n_req, 1, dtype=torch.int64), res.accepted_nodes], 1)
        path = torch.where(steps <= m[:, None], path, steps)  # past the path: slots stay
        st.target_cache.move(ctx[:, None] + path, ctx[:, None] + steps)

        # 4. The draft head re-runs on the verified tokens (accepted + bonus)
        # with the target's features at (root, accepted nodes), overwriting
        # its tree scratch; its last output is the next root distribution.
        new_tok = torch.cat([res.accepted_tokens.clamp(min=0),
                             torch.zeros(n_req, 1, dtype=torch.int64)], 1)
        new_tok[torch.arange(n_req), m] = res.bonus_token
        feats = draft.features(final, aux)
        feats = torch.gather(feats, 1, path[..., None].expand(-1, -1, feats.shape[-1]))
        st.root_logprobs, st.root_hidden = self._draft_extend(st.draft_cache, new_tok, feats, ctx, m + 1)
        st.stats.draft_forwards += 1
        st.ctx = ctx + m + 1
        st.root = res.bonus_token.clone()

        # 5. Emit and count.
        sizes = tree_b.sizes.tolist()
        for i, b in enumerate(st.active):
            o = st.outputs[b]
            o.num_steps += 1
            o.num_accepted += int(m[i])
            o.num_drafted += sizes[i] - 1
            st.stats.emitted += _emit(o, st.params[b], res.emitted(i), target.eos_token_ids)
        st.stats.request_steps += n_req
        st.stats.accepted += int(m.sum())
        st.stats.drafted_nodes += sum(sizes) - n_req
        state.drop_finished()
