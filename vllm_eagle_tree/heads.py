"""EAGLE draft heads in plain PyTorch, numerically the same as vLLM 0.32's.

These modules train the bundled heads (``scripts/build_pair.py``) and run
them in the engine-free reference generator. Their parameter names are the
published checkpoint names that vLLM loads, and their forward passes follow
vLLM's ``EagleLlamaForCausalLM`` (``model_executor/models/llama_eagle.py``)
and ``Eagle3LlamaForCausalLM`` (``llama_eagle3.py``) step for step:

EAGLE-1 (input: token embedding e and the target's final, post-norm
feature f)::

    x = fc([e, f]);  r = x + attn(x)          # layer 0 has no input norm
    out = r + mlp(post_attention_layernorm(r))
    logits = lm_head(out)  (the target's lm_head, no final norm)
    next feature = out

EAGLE-3 (input: e and g = fc([aux_1, aux_2, aux_3]) on the first step, the
previous step's pre-norm output afterwards)::

    x = [input_layernorm(e), hidden_norm(g)];  r = g + attn(x)
    out = r + mlp(post_attention_layernorm(r))
    logits = lm_head(norm(out));  next hidden = out

Attention is the draft's own causal attention. ``attn_bias`` lets callers
pass any additive mask (tree masks, training-time-test masks).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * weight.float()).to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """Neox-style rotary tables for integer ``positions`` (any shape)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq.to(positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [..., T, heads, D]; cos/sin [..., T, D]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[..., None, :] + rotated.float() * sin[..., None, :]).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg, in_dim: int):
        super().__init__()
        H = cfg.hidden_size
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or H // self.n_heads
        self.theta = getattr(cfg, "rope_theta", None) or (cfg.rope_parameters or {}).get("rope_theta", 10000.0)
        self.q_proj = nn.Linear(in_dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=False)

    def qkv(self, x, positions):
        """Rotated q, k and v for ``x [B, T, in]`` at ``positions [B, T]``."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attend(self, q, k, v, attn_bias):
        """q [B,Tq,h,D], k/v [B,Tk,kv,D], attn_bias [B or 1, Tq, Tk] additive."""
        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) / math.sqrt(self.head_dim)
        scores = scores + attn_bias[:, None].float()
        probs = scores.softmax(-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float()).to(q.dtype)
        return self.o_proj(out.reshape(*out.shape[:2], -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, cfg, in_dim: int, eagle3: bool):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        if eagle3:
            self.input_layernorm = RMSNorm(H, eps)
            self.hidden_norm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg, in_dim)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(cfg)


def causal_bias(T: int, device=None) -> torch.Tensor:
    m = torch.full((T, T), float("-inf"), device=device).triu(1)
    return m[None]


class EagleHead(nn.Module):
    """EAGLE-1 (``eagle3=False``) or EAGLE-3 (``eagle3=True``) draft head.

    ``embed`` (and for EAGLE-1 ``lm_head``) are the target's, passed in and
    not part of this module's state dict, as vLLM shares them.
    """

    def __init__(self, cfg, eagle3: bool, num_aux: int = 3):
        super().__init__()
        H = cfg.hidden_size
        self.cfg = cfg
        self.eagle3 = eagle3
        if eagle3:
            self.fc = nn.Linear(num_aux * H, H, bias=False)
            self.midlayer = _Layer(cfg, 2 * H, eagle3=True)
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.lm_head = nn.Linear(H, cfg.vocab_size, bias=False)
        else:
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.layers = nn.ModuleList([_Layer(cfg, H, eagle3=False)])

    @property
    def layer(self) -> _Layer:
        return self.midlayer if self.eagle3 else self.layers[0]

    def first_hidden(self, target_feature: torch.Tensor) -> torch.Tensor:
        """What the first draft step consumes: EAGLE-3 combines the aux states."""
        return self.fc(target_feature) if self.eagle3 else target_feature

    def layer_input(self, embeds: torch.Tensor, hidden: torch.Tensor):
        """(attention input, residual) for one draft step."""
        L = self.layer
        if self.eagle3:
            x = torch.cat([L.input_layernorm(embeds), L.hidden_norm(hidden)], dim=-1)
            return x, hidden
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        return x, x

    def finish(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        L = self.layer
        r = attn_out + residual
        return r + L.mlp(L.post_attention_layernorm(r))

    def logits(self, out: torch.Tensor, target_lm_head: torch.Tensor) -> torch.Tensor:
        if self.eagle3:
            return self.lm_head(self.norm(out))
        return out @ target_lm_head.t()

    def forward(self, embeds, hidden, positions, attn_bias=None):
        """One draft step over a sequence: returns (out, k, v) with out the
        pre-norm output (next step's hidden) and k/v this step's keys/values."""
        x, residual = self.layer_input(embeds, hidden)
        q, k, v = self.layer.self_attn.qkv(x, positions)
        if attn_bias is None:
            attn_bias = causal_bias(x.shape[1], x.device)
        out = self.finish(self.layer.self_attn.attend(q, k, v, attn_bias), residual)
        return out, k, v
