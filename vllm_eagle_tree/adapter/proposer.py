"""Tree drafting with vLLM's own EAGLE head (docs/INTEGRATION.md, step 9).

:class:`TreeDrafter` wraps the ``EagleProposer`` vLLM built for the head
(``method`` eagle/eagle3): it reuses its loaded model (vLLM's EAGLE classes,
embeddings/lm_head shared with the target, EAGLE-3 ``combine_hidden_states``
and reduced-vocabulary ``compute_logits``) and only replaces how the head is
driven:

1. **First pass** over each request's newly committed tokens: the accepted
   path (root + accepted nodes, already compacted to ``ctx..ctx+acc``) after
   a tree step, or all scheduled tokens after a prefill chunk / plain decode.
   Inputs are shifted by one as in vLLM's chain (token at ``p+1`` with the
   target feature at ``p``), draft KV lands in the same slots as the target's,
   attention is causal over the draft context.
2. **Expansion** with ``core.expand_tree``: each ``step_fn`` call runs the head
   once on the ``B*k`` frontier nodes, writing their draft KV to scratch slots
   past the committed context (``R + (depth-1)*k + j``) and attending to the
   context plus their own ancestors' scratch slots.

Draft position of a token = its target position - 1 (CONVENTIONS.md): the
root (the step's bonus token) drafts at ``R - 1``, a depth-d node at
``R + d - 1``, where ``R`` = committed tokens with KV after this step.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, replace

import torch
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention.attention import unified_kv_cache_update

from ..core import TreeConfig, expand_tree
from ..core.budget import chain_length
from ..core.tree import pack_bits
from .attention import TreeAttention, TreeOnlyMetadata

__all__ = ["FirstPassRows", "PendingRows", "TreeDrafter", "chain_mask", "full_mask",
           "KV_ONLY_MIN_ROWS"]


KV_ONLY_MIN_ROWS = 16
"""A first pass writes the KV of the rows whose outputs nobody reads (all
but each growing request's last row) without running the head's layer on
them (``TreeDrafter._write_kv``) once there are at least this many; below
that, one forward over every row costs less than two calls. (Measured on
the 2-core dev machine with ``scripts/bench_kv_only.py``, bundled EAGLE-3
head, 100 keys of context: the
head's forward takes 0.47 ms + 21 us a row, the KV-only rows 0.18 ms + 4 us
a row, so splitting pays from ~11 rows.)"""


@functools.lru_cache(maxsize=64)
def chain_mask(n: int) -> torch.Tensor:
    """int32 [n, ceil(n/32)]: packed causal mask of n consecutive rows
    (cached: the same few sizes every step; callers copy it, never write it)."""
    return pack_bits(torch.ones(n, n, dtype=torch.bool).tril())


@functools.lru_cache(maxsize=256)
def full_mask(rows: int, n: int) -> torch.Tensor:
    """int32 [rows, ceil(n/32)]: every row sees all n trailing keys (a chain
    node's ancestors; cached and read only, as :func:`chain_mask`)."""
    return pack_bits(torch.ones(rows, n, dtype=torch.bool))


@dataclass
class FirstPassRows:
    """One request's first-pass input, in target-batch terms.

    Attributes:
        batch_index: the request's row in the persistent batch (block table row).
        src_rows:    target query rows whose features feed the draft (m+1 of them).
        next_tokens: the m+1 draft input tokens (shifted by one).
        context_len: ``ctx``: draft positions/slots are ``ctx + 0..m``.
        slots:       the m+1 physical slots of those positions.
        grow_tree:   whether to expand a tree after the first pass.
        pending:     rows of earlier steps whose first pass was skipped (the
                     planner chose no speculation), run first: their target
                     features [g, F], next tokens and slots (``context_len``
                     then counts from the first of them).
    """

    batch_index: int
    src_rows: list[int]
    next_tokens: list[int]
    context_len: int
    slots: list[int]
    grow_tree: bool
    pending: "PendingRows | None" = None

    @property
    def tokens(self) -> list[int]:
        """Draft input tokens of every row the first pass runs, held-back ones first."""
        return (self.pending.next_tokens if self.pending else []) + self.next_tokens

    @property
    def all_slots(self) -> list[int]:
        """Slots of those rows."""
        return self.slots if self.pending is None else self.pending.slots + self.slots


class PendingRows:
    """A request's first-pass rows held back while the shape bandit skips
    drafting: target features (``TreeDrafter.features``) of positions
    ``start..start+g-1``, the tokens that follow them and their slots, kept
    as per-step chunks (joined once, when they run)."""

    def __init__(self, start: int):
        self.start = start
        self._features: list[torch.Tensor] = []
        self.next_tokens: list[int] = []
        self.slots: list[int] = []

    def extend(self, features: torch.Tensor, next_tokens: list[int], slots: list[int]):
        self._features.append(features)
        self.next_tokens.extend(next_tokens)
        self.slots.extend(slots)

    @property
    def features(self) -> torch.Tensor:
        return torch.cat(self._features)

    def __len__(self) -> int:
        return len(self.next_tokens)

    @property
    def end(self) -> int:
        return self.start + len(self.next_tokens)


class TreeDrafter:
    """Drafts EAGLE-2 trees with the head vLLM loaded (module docstring)."""

    def __init__(self, proposer, vllm_config, tree_config: TreeConfig, block_size: int,
                 planner=None):
        self.proposer = proposer  # vLLM's EagleProposer; its .model is the head
        self.vllm_config = vllm_config
        self.tree = tree_config
        self.planner = planner  # core.budget.GoodputPlanner or None
        self.block_size = block_size
        self.is_eagle3 = proposer.method == "eagle3"
        self.chain_fast_path = True  # chain arms without expand_tree (_draft_chain)
        self.layer_names: list[str] = sorted(proposer._draft_attn_layer_names)
        if not self.layer_names:
            raise RuntimeError("eagle2: the EAGLE head has no attention layer")

    @property
    def model(self):
        return self.proposer.model

    @functools.cached_property
    def _kv_layer(self):
        """The head's decoder layer when a row's draft KV can be written
        without running the layer (:meth:`_write_kv`): vLLM 0.32's
        ``EagleLlamaForCausalLM`` / ``Eagle3LlamaForCausalLM`` with one layer
        (the published EAGLE-1/EAGLE-3 heads). None for any other head: its
        rows then go through the whole forward."""
        model = self.model
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if type(model).__name__ not in ("EagleLlamaForCausalLM", "Eagle3LlamaForCausalLM") \
                or layers is None or len(layers) != 1:
            return None
        attn = getattr(layers[0], "self_attn", None)
        if not all(hasattr(attn, a) for a in ("qkv_proj", "rotary_emb", "attn", "q_size",
                                                "kv_size")):
            return None
        if not self.is_eagle3 and not hasattr(inner, "fc"):
            return None
        return layers[0]

    # ------------------------------------------------------------------ model
    def _run(self, tokens, positions, hidden, slots, attn: TreeAttention):
        """One head forward; returns (hidden for logits, hidden fed to the next step)."""
        meta = TreeOnlyMetadata(attn)
        with set_forward_context({name: meta for name in self.layer_names}, self.vllm_config,
                                 num_tokens=tokens.numel(),
                                 slot_mapping={name: slots for name in self.layer_names}):
            # vLLM's C++ ops index these densely: pass contiguous tensors only.
            ret = self.model(input_ids=tokens.contiguous(), positions=positions.contiguous(),
                             hidden_states=hidden.contiguous())
        if isinstance(ret, tuple):
            return ret[0], ret[1]
        return ret, ret

    def _write_kv(self, tokens, positions, hidden, slots) -> None:
        """Write the draft KV of rows whose outputs are not needed, without
        running the rest of the head. In a one-layer head a row's key and
        value depend only on its own token, feature and position (attention
        mixes rows only after K/V are written), so for every row but a
        request's last one the first pass needs just what the layer's own
        forward computes before attention (vLLM 0.32 ``llama_eagle3`` /
        ``llama_eagle`` + ``LlamaAttention.forward``, the same modules), then
        vLLM's KV writer: the same values, without the attention, output
        projection and MLP (a test holds the cache contents equal)."""
        layer = self._kv_layer
        inner = self.model.model
        embeds = inner.embed_tokens(tokens.contiguous())
        if self.is_eagle3:  # Eagle3 LlamaDecoderLayer.forward, layer 0
            h, _ = layer._residual_norm(hidden_states=hidden.contiguous())
            x = torch.cat([layer.input_layernorm(embeds), h], dim=-1)
        else:  # EAGLE-1 LlamaModel.forward: fc, then layer 0 (input norm disabled)
            x = layer.input_layernorm(inner.fc(torch.cat((embeds, hidden), dim=-1)))
        attn = layer.self_attn
        qkv, _ = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        _, k = attn.rotary_emb(positions.contiguous(), q, k)
        layer_attn = attn.attn
        name = layer_attn.layer_name
        with set_forward_context(None, self.vllm_config, num_tokens=tokens.numel(),
                                 slot_mapping={name: slots}):
            unified_kv_cache_update(k.reshape(-1, layer_attn.num_kv_heads, layer_attn.head_size),
                                    v.reshape(-1, layer_attn.num_kv_heads, layer_attn.head_size_v),
                                    name)

    @torch.inference_mode()
    def write_held(self, held_by_request: dict[str, PendingRows]) -> bool:
        """Write the draft KV of held-back first-pass rows of requests that
        left the batch (no outputs needed, no attention: :meth:`_write_kv`,
        which needs neither their block tables nor their context). Heads
        without the KV-only path leave them unwritten (returns False): their
        forward would need the request's whole block table."""
        if self._kv_layer is None or not held_by_request:
            return False
        held = list(held_by_request.values())
        raw = torch.cat([p.features for p in held])
        dev = raw.device
        self.write_rows(
            raw,
            torch.tensor([t for p in held for t in p.next_tokens], dtype=torch.long, device=dev),
            torch.tensor([p.start + j for p in held for j in range(len(p))], dtype=torch.long,
                         device=dev),
            torch.tensor([x for p in held for x in p.slots], dtype=torch.long, device=dev))
        return True

    @torch.inference_mode()
    def write_rows(self, raw_features: torch.Tensor, tokens: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor) -> None:
        """First-pass rows that nobody drafts from (held plain steps, and
        :meth:`write_held`'s rows), written KV only in one call
        (:meth:`_write_kv`): their target features (:meth:`features`), the
        draft input ``tokens`` that follow them, their draft ``positions``
        and physical ``slots``. Heads without the KV-only path must not get
        here (the runner holds their rows as ``PendingRows`` instead)."""
        feats = self.model.combine_hidden_states(raw_features) if self.is_eagle3 \
            else raw_features
        self._write_kv(tokens, positions, feats, slots)

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.model.compute_logits(hidden)
        return torch.log_softmax(logits.float(), dim=-1)

    def _slots(self, block_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Physical slots of logical ``positions [B, n]`` for block-table rows [B, M]."""
        bs = self.block_size
        blocks = torch.gather(block_rows.long(), 1, positions // bs)
        return (blocks * bs + positions % bs).reshape(-1)

    def features(self, target_hidden: torch.Tensor, aux_hidden: list[torch.Tensor] | None,
                 rows: torch.Tensor | slice, copy: bool = False) -> torch.Tensor:
        """The target features of ``rows`` (indices, or a slice) that feed the
        head (EAGLE-3: the auxiliary layers' states side by side, before
        ``combine_hidden_states``); ``copy``: never a view of the step's buffers."""
        if self.is_eagle3:
            assert aux_hidden is not None
            return torch.cat([h[rows] for h in aux_hidden], -1)
        return target_hidden[rows].clone() if copy else target_hidden[rows]

    # ------------------------------------------------------------------ draft
    @torch.inference_mode()
    def draft(self, reqs: list[FirstPassRows], target_hidden: torch.Tensor,
              aux_hidden: list[torch.Tensor] | None, block_table: torch.Tensor,
              req_ids: list[str] | None = None, arm: str | None = None,
              ) -> list[tuple[list[int], list[int], list[float]] | None]:
        """Run the first pass for ``reqs`` and grow trees where ``grow_tree``.

        ``block_table`` holds the persistent batch's block-table rows. Returns
        per request ``(parents, tokens, path values)`` of its tree (root
        included) or None.
        """
        if not reqs:
            return []
        device = target_hidden.device
        src = torch.tensor([r for q in reqs for r in q.src_rows], dtype=torch.long, device=device)
        raw = self.features(target_hidden, aux_hidden, src)
        if any(q.pending is not None for q in reqs):
            parts, at = [], 0
            for q in reqs:
                if q.pending is not None:
                    parts.append(q.pending.features)
                parts.append(raw[at:at + len(q.src_rows)])
                at += len(q.src_rows)
            raw = torch.cat(parts)
        feats = self.model.combine_hidden_states(raw) if self.is_eagle3 else raw
        sizes = [len(q.tokens) for q in reqs]
        tokens = torch.tensor([t for q in reqs for t in q.tokens], dtype=torch.long, device=device)
        positions = torch.tensor([q.context_len + j for q, n in zip(reqs, sizes)
                                  for j in range(n)], dtype=torch.long, device=device)
        slots = torch.tensor([x for q in reqs for x in q.all_slots], dtype=torch.long,
                             device=device)
        rows_bt = block_table[[q.batch_index for q in reqs]]
        cu_list = [0, *itertools.accumulate(sizes)]
        seq_lens = [q.context_len + n for q, n in zip(reqs, sizes)]
        grow = [i for i, q in enumerate(reqs) if q.grow_tree]
        out: list[tuple[list[int], list[int], list[float]] | None] = [None] * len(reqs)
        last_rows = torch.tensor([cu_list[i + 1] - 1 for i in grow], dtype=torch.long)
        if self._kv_layer is not None and (not grow
                                           or cu_list[-1] - len(grow) >= KV_ONLY_MIN_ROWS):
            # only the growing requests' last rows need the head's output (with
            # none growing, KV only is cheaper at any number of rows)
            kv_rows = torch.ones(cu_list[-1], dtype=torch.bool)
            kv_rows[last_rows] = False
            self._write_kv(tokens[kv_rows], positions[kv_rows], feats[kv_rows], slots[kv_rows])
            if not grow:
                return out
            G = len(grow)
            attn = TreeAttention(
                rows=torch.arange(G), cu_q_lens=torch.arange(G + 1, dtype=torch.int32),
                seq_lens=torch.tensor([seq_lens[i] for i in grow], dtype=torch.int32),
                tree_lens=torch.ones(G, dtype=torch.int32), tree_mask=full_mask(G, 1),
                block_table=rows_bt[grow])
            last_h, next_h = self._run(tokens[last_rows], positions[last_rows],
                                       feats[last_rows], slots[last_rows], attn)
        else:
            # causal within each request: its j-th row is row j of the largest causal mask
            mask = chain_mask(max(sizes))[[j for n in sizes for j in range(n)]]
            attn = TreeAttention(
                rows=torch.arange(cu_list[-1], device=device),
                cu_q_lens=torch.tensor(cu_list, dtype=torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                tree_lens=torch.tensor(sizes, dtype=torch.int32), tree_mask=mask,
                block_table=rows_bt)
            last_h, next_h = self._run(tokens, positions, feats, slots, attn)
            if not grow:
                return out
            last_h, next_h = last_h[last_rows], next_h[last_rows]
        root_logprobs = self._logprobs(last_h)
        root_hidden = next_h
        root_tokens = torch.tensor([reqs[i].next_tokens[-1] for i in grow], dtype=torch.long)
        # R: committed tokens with KV once this step is done (the root drafts at R-1).
        commit = torch.tensor([reqs[i].context_len + sizes[i] for i in grow], dtype=torch.long)
        grow_bt = rows_bt[grow]
        K = chain_length(arm)
        if K is not None and self.chain_fast_path:
            # the bandit's chain arm: the head's greedy chain of K tokens
            parents, toks, vals = self._draft_chain(K, root_tokens, root_logprobs, root_hidden,
                                                    commit, grow_bt)
            for j, i in enumerate(grow):
                out[i] = (parents, toks[j], vals[j])
            return out
        state = {"hidden": root_hidden.unsqueeze(1)}  # [B, k_prev, H] of the last frontier
        # the fused attention op's arguments that stay the same at every depth
        # (TreeAttention.with_op_args: a dozen tensor ops less per depth)
        fixed: dict[int, tuple[torch.Tensor, ...]] = {}

        def step_fn(frontier) -> torch.Tensor:
            B, kk = frontier.tokens.shape
            d = frontier.depth
            if kk not in fixed:
                rows = torch.arange(B * kk)
                fixed[kk] = (rows, torch.arange(B + 1, dtype=torch.int32) * kk,
                             rows // kk, grow_bt.to(torch.int32).contiguous(),
                             commit.long().contiguous())
            rows, cu, row_req, bt32, context = fixed[kk]
            parent_h = torch.gather(
                state["hidden"], 1,
                frontier.parent.unsqueeze(-1).expand(B, kk, state["hidden"].shape[-1]))
            pos = (commit.unsqueeze(1) + (d - 1)).repeat(1, kk)  # draft position R + d - 1
            scratch = commit.unsqueeze(1) + frontier.slots.unsqueeze(0)  # logical slot
            slot = self._slots(grow_bt, scratch)
            mask = pack_bits(frontier.ancestor_mask.reshape(B * kk, -1))
            tree_lens = torch.full((B,), d * kk, dtype=torch.int64)
            attn = TreeAttention.with_op_args(
                rows=rows, cu_q_lens=cu, seq_lens=(context + d * kk).to(torch.int32),
                tree_lens=tree_lens.to(torch.int32), tree_mask=mask, block_table=grow_bt,
                op_args=(rows, bt32, row_req, context, tree_lens, mask))
            lh, nh = self._run(frontier.tokens.reshape(-1), pos.reshape(-1),
                               parent_h.reshape(B * kk, -1), slot, attn)
            state["hidden"] = nh.reshape(B, kk, -1)
            return self._logprobs(lh).reshape(B, kk, -1)

        cfg = self.tree
        chain = K is not None
        if chain:  # the same chain through expand_tree (chain_fast_path off: tests)
            cfg = replace(cfg, top_k=1, max_depth=K, num_nodes=K, batch_num_nodes=None,
                          depth_threshold=0.0, width_mass=1.0, min_path_prob=0.0)
        elif self.planner is not None:
            cfg = replace(cfg, max_depth=self.planner.draft_depth(cfg.max_depth))
        tree = expand_tree(cfg, root_tokens, root_logprobs, step_fn,
                           context_len=commit.to(torch.int32))
        if self.planner is not None and not chain:
            tree = self.planner.prune(tree, other_rows=len(reqs) - len(grow),
                                      req_ids=None if req_ids is None else [req_ids[i] for i in grow])
        cu_n = tree.cu_nodes.tolist()
        parents = tree.parent.tolist()
        toks = tree.token.tolist()
        vals = tree.value.tolist()
        for j, i in enumerate(grow):
            a, b = cu_n[j], cu_n[j + 1]
            out[i] = (parents[a:b], toks[a:b], vals[a:b])
        return out

    def _draft_chain(self, K: int, root_tokens: torch.Tensor, logprobs: torch.Tensor,
                     hidden: torch.Tensor, commit: torch.Tensor, block_rows: torch.Tensor):
        """Each request's greedy chain of ``K`` drafted tokens: what
        ``expand_tree`` grows with ``top_k=1`` and no pruning (same tokens, path
        values, draft positions and scratch slots ``R + d - 1``; a test holds
        them equal), in ``K - 1`` head forwards without its candidate
        bookkeeping. ``logprobs`` [B, V]: the head's at the roots (NaN is
        not masked to -inf here, unlike ``expand_tree``). Returns (parents, tokens
        [B][K+1], values [B][K+1])."""
        B = root_tokens.numel()
        value = torch.zeros(B)
        tokens, values = [root_tokens.long()], [value]
        if K > 1:
            # Every depth's attention arguments and slots at once, [K-1, B]
            # rows (contiguous per depth): a depth-d node (d < K) drafts at
            # position, and scratch slot, R + d - 1 and sees the d keys R-1 ..
            # R + d - 2 (its root's and its ancestors'); per depth this was a
            # dozen small tensor ops, ~0.1 ms at batch 1.
            depth = torch.arange(1, K).unsqueeze(1)  # [K-1, 1]
            pos = (commit.unsqueeze(0) + depth - 1).contiguous()  # [K-1, B]
            slots = self._slots(block_rows, pos.t().contiguous()).reshape(B, K - 1).t().contiguous()
            seq_lens = (commit.unsqueeze(0) + depth).to(torch.int32)
            tree_lens = depth.expand(K - 1, B).contiguous()
            tree_lens32 = tree_lens.to(torch.int32)
            rows, cu = torch.arange(B), torch.arange(B + 1, dtype=torch.int32)
            bt32 = block_rows.to(torch.int32).contiguous()
            context = commit.long().contiguous()  # keys before the tree: seq_lens - tree_lens
        for d in range(1, K + 1):
            # the most likely child (max: the first of equal maxima; topk(1) is slower on CPU)
            best, tok = logprobs.max(-1)
            value = value + best.clamp(max=0.0)
            tokens.append(tok)
            values.append(value)
            if d == K:
                break
            mask = full_mask(B, d)
            attn = TreeAttention.with_op_args(
                rows=rows, cu_q_lens=cu, seq_lens=seq_lens[d - 1], tree_lens=tree_lens32[d - 1],
                tree_mask=mask, block_table=block_rows,
                op_args=(rows, bt32, rows, context, tree_lens[d - 1], mask))
            lh, hidden = self._run(tok, pos[d - 1], hidden, slots[d - 1], attn)
            logprobs = self._logprobs(lh)
        return ([-1] + list(range(K)), torch.stack(tokens, 1).tolist(),
                torch.stack(values, 1).tolist())


def tree_from_cache(cached: tuple[list[int], list[int], list[float]] | None, drafts: list[int],
                    root_token: int) -> tuple[list[int], list[int], list[float] | None]:
    """The tree the scheduler sent back: ``(parents, tokens, path values)`` of
    the cached tree's first ``len(drafts) + 1`` nodes (the scheduler only
    truncates, so this is a prefix of what was proposed). If the tokens do not
    match the cache (e.g. placeholder drafts of a resumed request), the drafts
    verify as a chain of their own, which is still lossless; its path values
    are unknown (None)."""
    n = len(drafts) + 1
    if cached is not None:
        parents, tokens, values = cached
        if len(parents) >= n and tokens[1:n] == list(drafts):
            return parents[:n], [root_token] + list(drafts), values[:n]
    if any(t < 0 for t in drafts):
        return [-1], [root_token], None  # placeholders: no tree, just the root
    return [-1] + list(range(n - 1)), [root_token] + list(drafts), None
