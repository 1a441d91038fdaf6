#!/usr/bin/env python
"""Rebuild the bundled model pair in assets/ from local text only.

    .venv/bin/python scripts/build_pair.py            # about 50 min on 2 cores

Stages (each prints progress):
  1. corpus     Python source files shipped with the interpreter (its stdlib,
                tests excluded), split into train / held-out by file-name hash
  2. tokenizer  byte-level BPE (HF `tokenizers`), vocab 4096
  3. target     Llama-architecture model trained from scratch on the corpus
  4. self-data  text the target itself generates from corpus prompts
                (half greedy, half sampled at temperature 0.8)
  5. features   the target's final (post-norm) features and EAGLE-3's
                auxiliary residual-stream states on that text
  6. heads      an EAGLE-1 and an EAGLE-3 head trained on those features with
                training-time test (each step k consumes step k-1's output,
                attending as vLLM's chain drafting does)
  7. evaluation held-out loss of the target, top-1 agreement of each head
                with the target's greedy next token; written to
                assets/build_metrics.json and assets/MODEL_CARD.md

Seeds are fixed. Outputs are written in the formats vLLM 0.32 loads directly:
  assets/target       LlamaForCausalLM + tokenizer
  assets/eagle1-head  EagleLlamaForCausalLM (shares embed/lm_head with target)
  assets/eagle3-head  Eagle3LlamaForCausalLM (own lm_head, full vocab)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
from vllm_eagle_tree.heads import EagleHead  # noqa: E402

EOS = "<|endoftext|>"
AUX_LAYER_IDS = [1, 2, 4]  # residual stream after 1, 2 and 4 target layers
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------- corpus

def corpus_files():
    std = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(std.rglob("*.py")):
        rel = p.relative_to(std).as_posix()
        parts = rel.split("/")
        if parts[0] in ("site-packages", "test", "idlelib", "lib2to3") or "tests" in parts:
            continue
        files.append((rel, p))
    train, held = [], []
    for rel, p in files:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (held if zlib.crc32(rel.encode()) % 20 == 0 else train).append(text)
    return train, held


def train_tokenizer(texts, vocab_size, out_dir: Path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    tok = ByteLevelBPETokenizer(add_prefix_space=False)
    tok.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                            special_tokens=[EOS], show_progress=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok._tokenizer, bos_token=EOS,
                                   eos_token=EOS, unk_token=EOS, pad_token=EOS)
    # A plain template so the chat-completions API works on the bundled pair.
    fast.chat_template = (
        "{% for m in messages %}# {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}# assistant:\n{% endif %}")
    fast.model_max_length = 1024
    fast.save_pretrained(out_dir)
    return fast


def encode(tok, texts) -> torch.Tensor:
    eos = tok.convert_tokens_to_ids(EOS)
    ids = []
    for t in texts:
        ids.extend(tok(t)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------- target

def target_config(vocab_size, args):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 128, head_dim=64, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, torch_dtype="float32",
        architectures=["LlamaForCausalLM"])


def batches(data: torch.Tensor, seq, bs, gen):
    while True:
        idx = torch.randint(0, len(data) - seq - 1, (bs,), generator=gen)
        yield torch.stack([data[i:i + seq] for i in idx])


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))


def train_target(model, train_ids, args):
    gen = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    it = batches(train_ids, args.seq, args.batch, gen)
    model.train()
    t = time.time()
    for step in range(args.target_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.target_steps, args.lr, 50)
        x = next(it)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == args.target_steps - 1:
            rate = (step + 1) * x.numel() / (time.time() - t)
            eta = (args.target_steps - step - 1) * x.numel() / rate
            log(f"target step {step + 1}/{args.target_steps} loss {loss.item():.3f} "
                f"({rate:.0f} tok/s, eta {eta / 60:.1f} min)")
    model.eval()


@torch.no_grad()
def eval_target_loss(model, ids, seq=512, bs=8):
    n = (len(ids) - 1) // seq
    total, count = 0.0, 0
    for i in range(0, n, bs):
        x = torch.stack([ids[j * seq:(j + 1) * seq + 1] for j in range(i, min(n, i + bs))])
        logits = model(input_ids=x[:, :-1]).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
        count += x[:, 1:].numel()
    return total / count


@torch.no_grad()
def generate(model, prompts: torch.Tensor, new_tokens: int, temperature: float, gen) -> torch.Tensor:
    """Plain KV-cache loop (no EOS stop): greedy if temperature == 0."""
    out = model(input_ids=prompts, use_cache=True)
    past, seq = out.past_key_values, [prompts]
    logits = out.logits[:, -1].float()
    for _ in range(new_tokens):
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial((logits / temperature).softmax(-1), 1, generator=gen)[:, 0]
        seq.append(nxt[:, None])
        out = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1].float()
    return torch.cat(seq, dim=1)


@torch.no_grad()
def target_features(model, x: torch.Tensor):
    """(final post-norm feature [B,T,H], concatenated aux states [B,T,3H],
    target logits [B,T,V]) exactly as vLLM's Llama returns them."""
    aux = {}
    hooks = [model.model.layers[i - 1].register_forward_hook(
        lambda m, inp, out, i=i: aux.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in AUX_LAYER_IDS]
    try:
        h = model.model(input_ids=x).last_hidden_state
    finally:
        for hk in hooks:
            hk.remove()
    return h, torch.cat([aux[i] for i in AUX_LAYER_IDS], dim=-1), h @ model.lm_head.weight.t()


# ---------------------------------------------------------------- heads

def ttt_forward(head, embed_w, lm_w, x, feat, steps):
    """Run ``steps`` draft steps over whole sequences the way vLLM's chain
    drafting sees them. Step k at index t consumes token x[t+k] and the
    previous step's output (the target feature on step 1), sits at position
    t+k-1, and attends to step-1 keys at positions <= t plus its own chain's
    keys at index t. Returns per-step logits [B, T, V] (valid t <= T-1-k)."""
    B, T = x.shape
    dev = x.device
    pos0 = torch.arange(T, device=dev)[None].expand(B, T)
    hidden = head.first_hidden(feat)
    causal = torch.full((T, T), float("-inf"), device=dev).triu(1)
    diag = torch.full((T, T), float("-inf"), device=dev)
    diag.fill_diagonal_(0.0)
    ks, vs, logits = [], [], []
    for k in range(1, steps + 1):
        tok = torch.cat([x[:, k:], x[:, -1:].expand(B, k)], dim=1)  # x[t+k], padded
        emb = F.embedding(tok, embed_w)
        inp, residual = head.layer_input(emb, hidden)
        q, kk, vv = head.layer.self_attn.qkv(inp, pos0 + (k - 1))
        ks.append(kk)
        vs.append(vv)
        bias = torch.cat([causal] + [diag] * (k - 1), dim=1)[None]
        attn = head.layer.self_attn.attend(q, torch.cat(ks, 1), torch.cat(vs, 1), bias)
        hidden = head.finish(attn, residual)
        logits.append(head.logits(hidden, lm_w))
        if k == 1 and not head.eagle3:
            first_out = hidden
    return logits, (first_out if not head.eagle3 else None)


def head_loss(head, embed_w, lm_w, x, fpost, faux, tlogits, steps, weights, reg_weight=1.0):
    B, T = x.shape
    feat = faux if head.eagle3 else fpost
    logits, out1 = ttt_forward(head, embed_w, lm_w, x, feat, steps)
    total, stats = 0.0, {}
    for k, lg in enumerate(logits, start=1):
        n = T - 1 - k  # valid indices t < n predict the target distribution at t+k
        p = tlogits[:, k:k + n].float().softmax(-1)
        logq = lg[:, :n].float().log_softmax(-1)
        ce = -(p * logq).sum(-1).mean()
        total = total + weights[k - 1] * ce
        stats[f"ce{k}"] = ce.item()
        stats[f"acc{k}"] = (lg[:, :n].argmax(-1) == tlogits[:, k:k + n].argmax(-1)).float().mean().item()
    if out1 is not None:  # EAGLE-1 also regresses the next target feature
        reg = F.smooth_l1_loss(out1[:, :T - 2], fpost[:, 1:T - 1])
        total = total + reg_weight * reg
        stats["reg"] = reg.item()
    return total, stats


def train_head(head, target, data, args, name):
    embed_w = target.model.embed_tokens.weight.detach()
    lm_w = target.lm_head.weight.detach()
    opt = torch.optim.AdamW(head.parameters(), lr=args.head_lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(2)
    bs = args.head_batch
    n_steps = args.head_epochs * (len(data) // bs)
    weights = [0.8 ** i for i in range(args.ttt_steps)]
    t = time.time()
    step = 0
    for epoch in range(args.head_epochs):
        order = torch.randperm(len(data), generator=gen)
        for i in range(0, len(data) - bs + 1, bs):
            x = data[order[i:i + bs]]
            fpost, faux, tlogits = target_features(target, x)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, n_steps, args.head_lr, 20)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.head_autocast):
                loss, st = head_loss(head, embed_w, lm_w, x, fpost, faux, tlogits, args.ttt_steps,
                                     weights, args.reg_weight)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0 or step == n_steps:
                rate = step * x.numel() / (time.time() - t)
                eta = (n_steps - step) * x.numel() / rate
                acc = " ".join(f"acc{k}={st[f'acc{k}']:.2f}" for k in range(1, args.ttt_steps + 1))
                log(f"{name} step {step}/{n_steps} loss {loss.item():.3f} {acc} "
                    f"({rate:.0f} tok/s, eta {eta / 60:.1f} min)")
    head.eval()


@torch.no_grad()
def head_agreement(head, target, x, steps):
    """Top-1 agreement of the head with the target's greedy next token, per
    draft step (step 1 uses the target's features; step k>1 the head's own)."""
    embed_w = target.model.embed_tokens.weight
    fpost, faux, tlogits = target_features(target, x)
    logits, _ = ttt_forward(head, embed_w, target.lm_head.weight, x,
                            faux if head.eagle3 else fpost, steps)
    T = x.shape[1]
    out = []
    for k, lg in enumerate(logits, start=1):
        n = T - 1 - k
        out.append((lg[:, :n].argmax(-1) == tlogits[:, k:k + n].argmax(-1)).float().mean().item())
    return out


def save_head(head, cfg_dict, out_dir: Path, eagle3: bool):
    from safetensors.torch import save_file
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg_dict)
    cfg["num_hidden_layers"] = 1
    if eagle3:
        cfg["architectures"] = ["Eagle3LlamaForCausalLM"]
        cfg["draft_vocab_size"] = cfg["vocab_size"]
        cfg["target_hidden_size"] = cfg["hidden_size"]
        cfg["eagle_aux_hidden_state_layer_ids"] = AUX_LAYER_IDS
        cfg["tie_word_embeddings"] = False
    else:
        cfg["architectures"] = ["EagleLlamaForCausalLM"]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    state = {k: v.detach().float().contiguous() for k, v in head.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "assets"))
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--target-steps", type=int, default=700)
    ap.add_argument("--self-seqs", type=int, default=1024, help="self-generated sequences")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--head-batch", type=int, default=16)
    ap.add_argument("--head-epochs", type=int, default=1)
    ap.add_argument("--head-lr", type=float, default=2e-3)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--reg-weight", type=float, default=1.0,
                    help="EAGLE-1 feature-regression loss weight (classification weight is 1)")
    ap.add_argument("--head-autocast", action="store_true", help="train the heads with bf16 autocast")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--heads-only", action="store_true",
                    help="keep assets/target (and its metrics); regenerate data, retrain both heads")
    args = ap.parse_args()

    torch.manual_seed(0)
    random.seed(0)
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    tdir, h1dir, h3dir = out / "target", out / "eagle1-head", out / "eagle3-head"
    for d in ((h1dir, h3dir) if args.heads_only else (tdir, h1dir, h3dir)):
        if d.exists():
            shutil.rmtree(d)
    tdir.mkdir(parents=True, exist_ok=True)

    log("1/7 corpus: Python stdlib source files")
    train_txt, held_txt = corpus_files()
    log(f"    {len(train_txt)} train files ({sum(map(len, train_txt)) / 1e6:.1f} MB), "
        f"{len(held_txt)} held-out files ({sum(map(len, held_txt)) / 1e6:.1f} MB)")

    from transformers import AutoTokenizer, LlamaForCausalLM
    if args.heads_only:
        log("2-3/7 --heads-only: reusing the tokenizer and target in " + str(tdir))
        tok = AutoTokenizer.from_pretrained(tdir)
        target = LlamaForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
        cfg = target.config
        prev = json.loads((out / "build_metrics.json").read_text())["target"]
        target_minutes = prev["train_minutes"]
    else:
        log(f"2/7 tokenizer: byte-level BPE, vocab {args.vocab}")
        tok = train_tokenizer(train_txt, args.vocab, tdir)
    train_ids, held_ids = encode(tok, train_txt), encode(tok, held_txt)
    log(f"    {len(train_ids) / 1e6:.2f}M train tokens, {len(held_ids) / 1e6:.2f}M held-out tokens")
    if not args.heads_only:
        cfg = target_config(len(tok), args)
        target = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in target.parameters())
    if not args.heads_only:
        log(f"3/7 target: Llama {args.layers} layers, hidden {args.hidden}, {n_params / 1e6:.2f}M params, "
            f"{args.target_steps} steps x {args.batch}x{args.seq} tokens")
        t = time.time()
        train_target(target, train_ids, args)
        target_minutes = (time.time() - t) / 60
    held_loss = eval_target_loss(target, held_ids[:200_000])
    log(f"    held-out loss {held_loss:.3f} nats/token (ppl {math.exp(held_loss):.1f})")
    if not args.heads_only:
        target.save_pretrained(tdir, safe_serialization=True)
        tok.save_pretrained(tdir)

    log(f"4/7 self-generated data: {args.self_seqs} x {args.seq} tokens")
    gen = torch.Generator().manual_seed(3)
    t = time.time()
    chunks = []
    gb = 64
    for i in range(0, args.self_seqs, gb):
        starts = torch.randint(0, len(train_ids) - args.prompt_len, (gb,), generator=gen)
        prompts = torch.stack([train_ids[s:s + args.prompt_len] for s in starts])
        temp = 0.0 if (i // gb) % 2 == 0 else 0.8
        chunks.append(generate(target, prompts, args.seq - args.prompt_len, temp, gen))
        log(f"    generated {i + gb}/{args.self_seqs} (temperature {temp})")
    self_data = torch.cat(chunks)[: args.self_seqs]
    gen_minutes = (time.time() - t) / 60

    # Held-out evaluation text: real held-out files, and the target's own
    # greedy continuations of held-out prompts.
    seq = args.seq
    n_eval = min(32, (len(held_ids) - 1) // seq)
    held_real = torch.stack([held_ids[j * seq:(j + 1) * seq] for j in range(n_eval)])
    starts = torch.randint(0, len(held_ids) - args.prompt_len, (32,), generator=gen)
    held_gen = generate(target, torch.stack([held_ids[s:s + args.prompt_len] for s in starts]),
                        seq - args.prompt_len, 0.0, gen)

    metrics = {"corpus": {"train_files": len(train_txt), "heldout_files": len(held_txt),
                          "train_tokens": len(train_ids), "heldout_tokens": len(held_ids)},
               "target": {"params": n_params, "layers": args.layers, "hidden": args.hidden,
                          "vocab": len(tok), "steps": args.target_steps,
                          "tokens_seen": args.target_steps * args.batch * args.seq,
                          "train_minutes": round(target_minutes, 1),
                          "heads_only_rebuild": args.heads_only,
                          "heldout_loss": round(held_loss, 4)},
               "self_data": {"sequences": args.self_seqs, "tokens": self_data.numel(),
                             "minutes": round(gen_minutes, 1)},
               "heads": {}}
    cfg_dict = json.loads((tdir / "config.json").read_text())
    for name, eagle3, hdir in (("eagle1", False, h1dir), ("eagle3", True, h3dir)):
        torch.manual_seed(10 + eagle3)
        head = EagleHead(cfg, eagle3=eagle3, num_aux=len(AUX_LAYER_IDS))
        if eagle3:  # start the draft's own lm_head from the target's
            head.lm_head.weight.data.copy_(target.lm_head.weight.data)
        hp = sum(p.numel() for p in head.parameters())
        log(f"{'5-6' if not eagle3 else '6'}/7 {name} head: {hp / 1e6:.2f}M params, "
            f"{args.ttt_steps}-step training-time test")
        t = time.time()
        train_head(head, target, self_data, args, name)
        minutes = (time.time() - t) / 60
        agree_real = head_agreement(head, target, held_real, args.ttt_steps)
        agree_gen = head_agreement(head, target, held_gen, args.ttt_steps)
        log(f"    {name}: top-1 agreement per step, held-out real text {[round(a, 3) for a in agree_real]}, "
            f"held-out target-generated text {[round(a, 3) for a in agree_gen]}")
        save_head(head, cfg_dict, hdir, eagle3)
        metrics["heads"][name] = {"params": hp, "train_minutes": round(minutes, 1),
                                  "top1_agreement_heldout_real": [round(a, 4) for a in agree_real],
                                  "top1_agreement_heldout_generated": [round(a, 4) for a in agree_gen]}

    log("7/7 sample and metrics")
    prompt = "def fibonacci(n):\n"
    ids = torch.tensor([tok(prompt)["input_ids"]])
    sample = tok.decode(generate(target, ids, 96, 0.0, gen)[0])
    metrics["greedy_sample"] = sample
    metrics["total_minutes"] = round((time.time() - T0) / 60 + (target_minutes if args.heads_only else 0), 1)
    metrics["sizes_mb"] = {d.name: round(sum(f.stat().st_size for f in d.iterdir()) / 1e6, 2)
                           for d in (tdir, h1dir, h3dir)}
    (out / "build_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    print(sample)
    log(f"done in {metrics['total_minutes']} min; sizes {metrics['sizes_mb']}")


if __name__ == "__main__":
    main()
