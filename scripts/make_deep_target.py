#!/usr/bin/env python
"""Build the cost-realistic target: the bundled target plus identity layers.

On a GPU with a 7B+ target, a one-layer EAGLE head costs a few percent of a
target forward and the target dominates a decode step. The bundled 4-layer
target is so small that on this CPU a step is dominated by vLLM's per-step
overhead instead. This script appends `--extra-layers` decoder layers whose
residual branches are exactly zero (o_proj and down_proj are zero matrices;
q/k/v/gate/up are random so the layers cost a real forward): the deep model
computes bit-for-bit the same outputs as the bundled target, at the forward
cost of a model `--extra-layers` deeper. The bundled heads work unchanged
(EAGLE-3's auxiliary layer ids 1, 2, 4 are layers of the original target).

    .venv/bin/python scripts/make_deep_target.py            # -> build/deep-target
    .venv/bin/python scripts/make_deep_target.py --measure-json assets/cost_ratio.json

It is built on demand (deterministic, a few seconds) rather than committed,
since its zero-filled weights would exceed the 40 MB asset budget.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
from vllm_eagle_tree import assets  # noqa: E402

DEFAULT_EXTRA_LAYERS = 60


def build(out: Path, extra_layers: int) -> Path:
    src = assets.TARGET
    cfg = json.loads((src / "config.json").read_text())
    stamp = out / "deep_target.json"
    want = {"extra_layers": extra_layers,
            "source_mtime": (src / "model.safetensors").stat().st_mtime}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    state = load_file(str(src / "model.safetensors"))
    n0 = cfg["num_hidden_layers"]
    H, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    nq, nkv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).float()

    for i in range(n0, n0 + extra_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = torch.ones(H)
        state[p + "post_attention_layernorm.weight"] = torch.ones(H)
        state[p + "self_attn.q_proj.weight"] = rnd(nq, H)
        state[p + "self_attn.k_proj.weight"] = rnd(nkv, H)
        state[p + "self_attn.v_proj.weight"] = rnd(nkv, H)
        state[p + "self_attn.o_proj.weight"] = torch.zeros(H, nq)    # residual branch = 0
        state[p + "mlp.gate_proj.weight"] = rnd(inter, H)
        state[p + "mlp.up_proj.weight"] = rnd(inter, H)
        state[p + "mlp.down_proj.weight"] = torch.zeros(H, inter)   # residual branch = 0
    cfg["num_hidden_layers"] = n0 + extra_layers
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)
    stamp.write_text(json.dumps(want))
    return out


@torch.no_grad()
def measure(deep: Path, context: int = 256, reps: int = 30) -> dict:
    """Time one decode step (1 token, KV cache of `context` tokens) of the
    bundled target, the deep target and each head, in PyTorch on this CPU."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from vllm_eagle_tree.heads import EagleHead

    def bench(fn):
        for _ in range(3):
            fn()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t) / reps * 1e3

    res = {}
    for name, path in (("target", assets.TARGET), ("deep_target", deep)):
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        x = torch.randint(0, m.config.vocab_size, (1, context))
        cache = DynamicCache()
        m(input_ids=x, past_key_values=cache, use_cache=True)
        one = torch.randint(0, m.config.vocab_size, (1, 1))

        def step():
            m(input_ids=one, past_key_values=cache, use_cache=True)
            cache.crop(context)
        res[name + "_ms"] = round(bench(step), 3)
    from transformers import LlamaConfig
    tcfg = LlamaConfig.from_pretrained(assets.TARGET)
    emb = torch.randn(tcfg.vocab_size, tcfg.hidden_size)
    for name, eagle3 in (("eagle1_head", False), ("eagle3_head", True)):
        head = EagleHead(tcfg, eagle3=eagle3).eval()
        H = tcfg.hidden_size
        e, h = torch.randn(1, context + 1, H), torch.randn(1, context + 1, H)
        pos = torch.arange(context + 1)[None]

        def step():  # one query token over a context of keys, plus lm_head
            x, res_ = head.layer_input(e[:, -1:], h[:, -1:])
            q, k, v = head.layer.self_attn.qkv(x, pos[:, -1:])
            kk = torch.randn(1, context + 1, k.shape[2], k.shape[3])
            out = head.finish(head.layer.self_attn.attend(q, kk, kk, torch.zeros(1, 1, context + 1)), res_)
            head.logits(out, emb)
        res[name + "_ms"] = round(bench(step), 3)
    for t in ("target", "deep_target"):
        for h in ("eagle1_head", "eagle3_head"):
            res[f"ratio_{h}_to_{t}"] = round(res[h + "_ms"] / res[t + "_ms"], 4)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extra-layers", type=int, default=DEFAULT_EXTRA_LAYERS)
    ap.add_argument("--out", default=str(assets.DEEP_TARGET))
    ap.add_argument("--measure", action="store_true", help="time draft and target decode steps")
    ap.add_argument("--measure-json", help="with --measure: also write the figures to this JSON file")
    args = ap.parse_args()
    t = time.time()
    out = build(Path(args.out), args.extra_layers)
    print(f"deep target ({args.extra_layers} identity layers) at {out} in {time.time() - t:.1f}s")
    if args.measure or args.measure_json:
        res = dict(measure(out), context=256, extra_layers=args.extra_layers)
        print(json.dumps(res, indent=2))
        if args.measure_json:
            Path(args.measure_json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
