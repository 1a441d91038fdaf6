#!/usr/bin/env python
"""GPU checks and benchmarks of vllm-eagle-tree's Triton kernels.

Runs on a CUDA machine with torch and triton only (no vLLM, no network, no
pip install of this repository): the kernels are imported from this
checkout (the repository root goes on sys.path and ``triton_kernels/`` is
mapped to ``vllm_eagle_tree.triton_kernels``, as setup.py does).

  (a) correctness: ``pytest tests/kernels`` natively (TRITON_INTERPRET=0, in
      a subprocess, when pytest is installed) plus this script's own checks
      of every kernel against its reference on benchmark-like shapes;
  (b) timing: tree attention vs its reference, torch SDPA with a dense mask
      and FlashInfer's custom-mask paged prefill (when importable), on
      Llama-3-8B layer verify shapes (32 q heads, 8 kv heads, head_dim 128,
      bf16, block size 16; batch 1/16/64, context 512/2k/8k, 16/32/64
      nodes); tree sampling (draw + walk) and KV compaction vs their
      references. Prints achieved bandwidth (bytes of K/V/Q/O touched) and
      TFLOP/s and writes everything as JSON to --out.

Usage:  python scripts/gpu_kernels_bench.py [--out results/gpu_kernels.json]
        python scripts/gpu_kernels_bench.py --device cpu --quick   # smoke test of this script
                                                                    # (Triton interpreter, tiny shapes)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = "vllm_eagle_tree.triton_kernels"
_PLUGIN_ENV = "VET_BENCH_AS_PYTEST_PLUGIN"


def install_alias() -> None:
    """Make ``vllm_eagle_tree.triton_kernels`` importable from this checkout."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    if PKG in sys.modules:
        return
    import vllm_eagle_tree  # the checkout's package (pure Python, no vLLM import)

    spec = importlib.util.spec_from_file_location(
        PKG, REPO / "triton_kernels" / "__init__.py",
        submodule_search_locations=[str(REPO / "triton_kernels")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[PKG] = mod
    spec.loader.exec_module(mod)
    vllm_eagle_tree.triton_kernels = mod


# Loaded with `pytest -p gpu_kernels_bench`: map the package before conftest runs.
if os.environ.get(_PLUGIN_ENV) == "1":
    install_alias()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/gpu_kernels.json", help="JSON output path")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu = smoke-test this script in the Triton interpreter (tiny shapes)")
    p.add_argument("--skip-tests", action="store_true", help="skip pytest tests/kernels")
    p.add_argument("--tests-only", action="store_true", help="only run the correctness part")
    p.add_argument("--pytest-timeout", type=int, default=300, help="seconds for the pytest run")
    p.add_argument("--quick", action="store_true", help="a few shapes only")
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--contexts", default="512,2048,8192")
    p.add_argument("--nodes", default="16,32,64")
    p.add_argument("--vocab", type=int, default=128256, help="sampling vocabulary (Llama-3)")
    p.add_argument("--sample-nodes", type=int, default=32, help="tree nodes per request (sampling)")
    p.add_argument("--layers", type=int, default=32, help="layers for KV compaction")
    p.add_argument("--sweep", choices=["none", "some", "all"], default="some",
                   help="attention tile-config sweep: none, a few representative shapes, every shape")
    p.add_argument("--rep-ms", type=int, default=30, help="timing budget per measurement (ms)")
    p.add_argument("--no-reference", action="store_true", help="do not time the PyTorch references")
    p.add_argument("--time-budget", type=float, default=420.0,
                   help="seconds; later sections are skipped once exceeded")
    return p.parse_args(argv)


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


class Bench:
    def __init__(self, args):
        self.args = args
        self.t0 = time.time()
        self.results: dict = {"args": vars(args), "sections": {}}
        self.out = Path(args.out)
        if not self.out.is_absolute():
            self.out = REPO / self.out

    # ------------------------------------------------------------- plumbing
    def elapsed(self) -> float:
        return time.time() - self.t0

    def over_budget(self) -> bool:
        return self.elapsed() > self.args.time_budget

    def save(self):
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        self.out.write_text(json.dumps(self.results, indent=1, default=str))

    def section(self, name, fn):
        if self.over_budget():
            print(f"[{name}] skipped: time budget exceeded ({self.elapsed():.0f}s)", flush=True)
            self.results["sections"][name] = {"skipped": "time budget"}
            return
        print(f"\n=== {name} ({self.elapsed():.0f}s) ===", flush=True)
        t = time.time()
        try:
            self.results["sections"][name] = {"result": fn(), "seconds": round(time.time() - t, 1)}
        except Exception as exc:  # keep going: one broken section must not lose the others
            traceback.print_exc()
            self.results["sections"][name] = {"error": f"{type(exc).__name__}: {exc}",
                                              "seconds": round(time.time() - t, 1)}
        self.save()

    def sync(self):
        if self.dev.type == "cuda":
            self.torch.cuda.synchronize()

    def timeit(self, fn, rep_ms: int | None = None) -> float:
        """Milliseconds per call (triton.testing.do_bench on CUDA)."""
        rep_ms = rep_ms or self.args.rep_ms
        if self.dev.type == "cuda":
            from triton.testing import do_bench
            return float(do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms))
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    def time_slow(self, fn, reps: int = 3) -> float:
        """Milliseconds per call for slow host-driven code (references)."""
        fn()
        self.sync()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        self.sync()
        return (time.perf_counter() - t) * 1e3 / reps

    # ----------------------------------------------------------------- setup
    def setup(self):
        import torch
        import triton

        self.torch = torch
        install_alias()
        import vllm_eagle_tree.triton_kernels as tk
        from vllm_eagle_tree.triton_kernels import kv_compaction, tree_attention, tree_sampling

        self.tk, self.ta, self.ts, self.kc = tk, tree_attention, tree_sampling, kv_compaction
        self.dev = torch.device(self.args.device)
        info = {"torch": torch.__version__, "triton": triton.__version__,
                "python": platform.python_version(), "device": str(self.dev),
                "kernels_from": str(Path(tk.__file__).parent)}
        self.peak_bw = None
        if self.dev.type == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("no CUDA device (use --device cpu for a smoke test)")
            name = torch.cuda.get_device_name()
            props = torch.cuda.get_device_properties(0)
            info.update(gpu=name, sms=props.multi_processor_count,
                        memory_gb=round(props.total_memory / 2**30, 1))
            for key, bw in (("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.0e12)):
                if key in name:
                    self.peak_bw = bw
            info["peak_hbm_bytes_per_s"] = self.peak_bw
        try:
            import flashinfer  # noqa: F401
            info["flashinfer"] = getattr(flashinfer, "__version__", "?")
        except Exception as exc:
            info["flashinfer"] = f"unavailable ({type(exc).__name__})"
        self.results["env"] = info
        print(json.dumps(info, indent=1), flush=True)

    # ------------------------------------------------------------- (a) tests
    def run_pytest(self):
        if importlib.util.find_spec("pytest") is None:
            return {"skipped": "pytest not installed"}
        env = dict(os.environ)
        env["TRITON_INTERPRET"] = "1" if self.dev.type == "cpu" else "0"
        env[_PLUGIN_ENV] = "1"
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "scripts"), str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "gpu_kernels_bench",
               "-p", "no:cacheprovider"]
        if self.args.quick:
            cmd += ["-m", "not slow"]
        t = time.time()
        try:
            proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                  timeout=self.args.pytest_timeout)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"")
            out = out.decode() if isinstance(out, bytes) else out
            print(out[-4000:])
            return {"returncode": None, "timeout_s": self.args.pytest_timeout, "tail": out[-4000:]}
        out = proc.stdout + proc.stderr
        print(out[-6000:], flush=True)
        summary = [ln for ln in out.splitlines() if (" passed" in ln or " failed" in ln
                                                    or " error" in ln) and " in " in ln]
        return {"returncode": proc.returncode, "summary": summary[-1] if summary else None,
                "seconds": round(time.time() - t, 1), "tail": out[-3000:]}

    def own_checks(self):
        torch = self.torch
        res = {}
        # attention, bf16 Llama layer, ragged trees, against the fp32 reference
        shapes = ((3, 700, 37), (1, 3000, 16)) if self.dev.type == "cuda" else ((2, 40, 5),)
        for b_, ctx, n in shapes:
            a = self.make_attention(b_, ctx, n, ragged=True)
            out = self.ta.tree_attention_triton(**a["args"])
            ref = self.ta.tree_attention_ref(**a["args"], out=torch.empty(
                out.shape, dtype=torch.float32, device=self.dev))
            err = (out.float() - ref).abs().max().item()
            res[f"attention_b{b_}_ctx{ctx}_n{n}_max_abs_err"] = err
            assert err < 3e-2, f"attention error {err}"
        # sampling: exact draws against the reference (same Philox numbers)
        s = self.make_sampling(5, self.args.vocab, 6 if self.dev.type == "cuda" else 2, mixed=True)
        d_k = self.ts.tree_draw_tokens_triton(**s["draw_args"])
        d_r = self.ts.tree_draw_tokens_ref(**s["draw_args"])
        mism = int((d_k != d_r).sum())
        res["sampling_draw_mismatches"] = mism
        res["sampling_rows"] = int(d_k.numel())
        v_k = self.ts.tree_walk_triton(d_k, s["tree"])
        v_r = self.ts.tree_walk_ref(d_k, s["tree"])
        res["walk_equal"] = bool(torch.equal(v_k.accepted_nodes, v_r.accepted_nodes)
                                 and torch.equal(v_k.bonus_token, v_r.bonus_token))
        # compaction: bit-exact
        c = self.make_compaction(4, 2, ctx=100, hkv=8 if self.dev.type == "cuda" else 2)
        exp_k = [x.clone() for x in c["keys"]]
        exp_v = [x.clone() for x in c["vals"]]
        self.kc.compact_kv_ref((exp_k, exp_v), *c["meta"])
        self.kc.compact_kv_triton(c["table"], *c["meta"])
        res["compaction_exact"] = all(torch.equal(x.view(torch.int16), y.view(torch.int16))
                                      for x, y in zip(c["keys"] + c["vals"], exp_k + exp_v))
        print(json.dumps(res, indent=1), flush=True)
        if mism or not res["walk_equal"] or not res["compaction_exact"]:
            raise AssertionError(f"kernel/reference mismatch: {res}")
        return res

    # -------------------------------------------------------------- builders
    def random_trees(self, sizes, vocab, gen):
        from vllm_eagle_tree.core.tree import TreeBatch
        torch = self.torch
        parents, tokens = [], []
        for n in sizes:
            par = [-1]
            for i in range(1, n):  # EAGLE-like: mostly shallow-wide near the root, some chains
                par.append(i - 1 if torch.rand((), generator=gen) < 0.3
                           else int(torch.randint(0, i, (), generator=gen)))
            parents.append(par)
            tokens.append(torch.randperm(vocab, generator=gen)[:n].tolist())
        return TreeBatch.from_parents(parents, tokens)

    def make_attention(self, B, ctx, n, ragged=False, hq=32, hkv=8, d=128, page=16, seed=0):
        torch = self.torch
        gen = torch.Generator().manual_seed(seed)
        sizes = ([int(torch.randint(1, n + 1, (), generator=gen)) for _ in range(B)]
                 if ragged else [n] * B)
        ctxs = ([int(torch.randint(0, ctx + 1, (), generator=gen)) for _ in range(B)]
                if ragged else [ctx] * B)
        tree = self.random_trees(sizes, 1000, gen)
        seq = [c + s for c, s in zip(ctxs, sizes)]
        nblk = [-(-x // page) for x in seq]
        num_blocks = sum(nblk) + 1
        perm = torch.randperm(num_blocks, generator=gen)
        bt = torch.zeros(B, max(nblk), dtype=torch.int32)
        k = 0
        for b, m in enumerate(nblk):
            bt[b, :m] = perm[k:k + m].int()
            k += m
        dt = torch.bfloat16
        kcache = torch.randn(num_blocks, page, hkv, d, device=self.dev, dtype=dt)
        vcache = torch.randn(num_blocks, page, hkv, d, device=self.dev, dtype=dt)
        total = sum(sizes)
        q = torch.randn(total, hq, d, device=self.dev, dtype=dt)
        args = dict(q=q, key_cache=kcache, value_cache=vcache, block_table=bt.to(self.dev),
                    seq_lens=torch.tensor(seq, dtype=torch.int32, device=self.dev),
                    cu_q_lens=tree.cu_nodes.to(self.dev),
                    tree_mask=tree.packed_mask().to(self.dev), sm_scale=1.0 / math.sqrt(d))
        el = 2
        kv_bytes = sum(seq) * hkv * d * el * 2
        qo_bytes = total * hq * d * el * 2
        meta_bytes = args["tree_mask"].numel() * 4 + bt.numel() * 4
        flops = 4 * sum(s * L for s, L in zip(sizes, seq)) * hq * d
        return dict(args=args, tree=tree, sizes=sizes, ctxs=ctxs, seq=seq, bt=bt,
                    bytes=kv_bytes + qo_bytes + meta_bytes, flops=flops,
                    hints=dict(max_q_len=max(sizes), max_seq_len=max(seq)))

    def make_sampling(self, B, vocab, nodes, mixed=False, mode="plain", seed=0):
        torch = self.torch
        gen = torch.Generator().manual_seed(seed)
        tree = self.random_trees([nodes] * B, vocab, gen).to(self.dev)
        T = B * nodes
        logits = (torch.randn(T, vocab, device=self.dev) * 3).to(torch.bfloat16)
        if mixed:
            kinds = ["greedy", "plain", "topk", "topp", "topk_topp"]
            modes = [kinds[b % len(kinds)] for b in range(B)]
        else:
            modes = [mode] * B
        temp = torch.tensor([0.0 if m == "greedy" else 0.8 for m in modes])
        top_k = torch.tensor([50 if "topk" in m else 0 for m in modes])
        top_p = torch.tensor([0.9 if "topp" in m else 1.0 for m in modes])
        draw_args = dict(logits=logits, cu_nodes=tree.cu_nodes, temperature=temp.to(self.dev),
                         top_k=top_k.to(self.dev), top_p=top_p.to(self.dev),
                         seeds=torch.arange(B, device=self.dev) * 7919 + 1,
                         offsets=torch.full((B,), 12345, device=self.dev))
        return dict(tree=tree, draw_args=draw_args, T=T)

    def make_compaction(self, B, layers, ctx=512, hkv=8, d=128, page=16, depth=6, n=32, seed=0):
        torch = self.torch
        gen = torch.Generator().manual_seed(seed)
        seq = ctx + n
        nblk = -(-seq // page)
        num_blocks = B * nblk + 1
        bt = torch.randperm(num_blocks, generator=gen)[: B * nblk].view(B, nblk).int()
        keys = [torch.randn(num_blocks, page, hkv, d, device=self.dev, dtype=torch.bfloat16)
                for _ in range(layers)]
        vals = [torch.randn(num_blocks, page, hkv, d, device=self.dev, dtype=torch.bfloat16)
                for _ in range(layers)]
        an = torch.stack([torch.sort(torch.randperm(n - 1, generator=gen)[:depth] + 1).values
                          for _ in range(B)])
        na = torch.full((B,), depth)
        meta = (bt.to(self.dev), torch.full((B,), ctx, dtype=torch.int32, device=self.dev),
                na.to(self.dev), an.to(self.dev))
        table = self.kc.KVCacheTable(keys, vals)
        moved = B * depth * 2 * layers * hkv * d * 2 * 2  # read + write
        return dict(keys=keys, vals=vals, meta=meta, table=table, bytes=moved)

    # ---------------------------------------------------------- (b) timing
    def _rates(self, entry, ms, nbytes, flops=None):
        entry["ms"] = round(ms, 4)
        entry["GBps"] = round(nbytes / (ms * 1e-3) / 1e9, 1)
        if self.peak_bw:
            entry["frac_peak_bw"] = round(nbytes / (ms * 1e-3) / self.peak_bw, 3)
        if flops is not None:
            entry["TFLOPs"] = round(flops / (ms * 1e-3) / 1e12, 2)
        return entry

    def _sdpa_inputs(self, a):
        torch = self.torch
        args = a["args"]
        B, n, L = len(a["sizes"]), max(a["sizes"]), max(a["seq"])
        hq, d = args["q"].shape[1], args["q"].shape[2]
        page, hkv = args["key_cache"].shape[1], args["key_cache"].shape[2]
        slots = torch.arange(L, device=self.dev)
        pages = args["block_table"].long()[:, (slots // page).clamp(max=args["block_table"].shape[1] - 1)]
        k = args["key_cache"][pages, slots % page].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, L, D]
        v = args["value_cache"][pages, slots % page].permute(0, 2, 1, 3).contiguous()
        q = args["q"].view(B, n, hq, d).transpose(1, 2)                              # equal sizes
        mask = torch.zeros(B, 1, n, L, dtype=torch.bool, device=self.dev)
        from vllm_eagle_tree.triton_kernels.tree_attention import unpack_tree_mask
        for b in range(B):
            ctx = a["seq"][b] - a["sizes"][b]
            mask[b, 0, :, :ctx] = True
            mask[b, 0, :, ctx:a["seq"][b]] = unpack_tree_mask(
                args["tree_mask"][b * n:(b + 1) * n], a["sizes"][b])
        return q, k, v, mask, hq // hkv

    def _flashinfer_runner(self, a):
        import flashinfer
        torch = self.torch
        args = a["args"]
        B = len(a["sizes"])
        page = args["key_cache"].shape[1]
        nblk = [-(-s // page) for s in a["seq"]]
        indptr = torch.tensor([0] + list(torch.tensor(nblk).cumsum(0)), dtype=torch.int32,
                              device=self.dev)
        indices = torch.cat([a["bt"][b, :nblk[b]] for b in range(B)]).to(self.dev)
        last = torch.tensor([s - (m - 1) * page for s, m in zip(a["seq"], nblk)],
                            dtype=torch.int32, device=self.dev)
        from vllm_eagle_tree.triton_kernels.tree_attention import unpack_tree_mask
        masks = []
        off = 0
        for b in range(B):
            n, ctx = a["sizes"][b], a["ctxs"][b]
            m = torch.ones(n, a["seq"][b], dtype=torch.bool, device=self.dev)
            m[:, ctx:] = unpack_tree_mask(args["tree_mask"][off:off + n], n)
            masks.append(m.flatten())
            off += n
        ws = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=self.dev)
        w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        hq, d = args["q"].shape[1], args["q"].shape[2]
        hkv = args["key_cache"].shape[2]
        w.plan(args["cu_q_lens"], indptr, indices, last, hq, hkv, d, page,
               custom_mask=torch.cat(masks), q_data_type=args["q"].dtype,
               sm_scale=args["sm_scale"])
        kv = (args["key_cache"], args["value_cache"])
        return lambda: w.run(args["q"], kv)

    def attention(self):
        torch = self.torch
        rows = []
        shapes = [(b, c, n) for b in _ints(self.args.batches) for c in _ints(self.args.contexts)
                  for n in _ints(self.args.nodes)]
        if self.args.quick:
            shapes = shapes[:: max(1, len(shapes) // 4)]
        for B, ctx, n in shapes:
            if self.over_budget():
                rows.append({"B": B, "ctx": ctx, "nodes": n, "skipped": "time budget"})
                continue
            a = self.make_attention(B, ctx, n)
            e = {"B": B, "ctx": ctx, "nodes": n, "bytes": a["bytes"], "flops": a["flops"]}
            out = torch.empty_like(a["args"]["q"])
            try:
                fn = lambda: self.ta.tree_attention_triton(**a["args"], out=out, **a["hints"])  # noqa: E731
                e["triton"] = self._rates({}, self.timeit(fn), a["bytes"], a["flops"])
            except Exception as exc:
                e["triton"] = {"error": f"{type(exc).__name__}: {exc}"}
            if not self.args.no_reference and B * ctx <= 64 * 8192:
                try:
                    fn = lambda: self.ta.tree_attention_ref(**a["args"])  # noqa: E731
                    e["reference"] = self._rates({}, self.time_slow(fn, 2), a["bytes"], a["flops"])
                except Exception as exc:
                    e["reference"] = {"error": f"{type(exc).__name__}: {exc}"}
            try:
                q, k, v, mask, group = self._sdpa_inputs(a)
                F = torch.nn.functional
                try:
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
                    fn = lambda: F.scaled_dot_product_attention(  # noqa: E731
                        q, k, v, attn_mask=mask, scale=a["args"]["sm_scale"], enable_gqa=True)
                except TypeError:  # torch < 2.5: no enable_gqa
                    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
                    fn = lambda: F.scaled_dot_product_attention(  # noqa: E731
                        q, k, v, attn_mask=mask, scale=a["args"]["sm_scale"])
                e["sdpa_dense_mask"] = self._rates({"note": "K/V pre-gathered, gather not timed"},
                                                   self.timeit(fn), a["bytes"], a["flops"])
                del q, k, v, mask
            except Exception as exc:
                e["sdpa_dense_mask"] = {"error": f"{type(exc).__name__}: {exc}"}
            if self.dev.type == "cuda" and "unavailable" not in str(self.results["env"]["flashinfer"]):
                try:
                    fn = self._flashinfer_runner(a)
                    fi_out = fn()
                    err = (fi_out.float() - out.float()).abs().max().item()
                    e["flashinfer"] = self._rates({"max_abs_diff_vs_triton": err}, self.timeit(fn),
                                                  a["bytes"], a["flops"])
                except Exception as exc:
                    e["flashinfer"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            rows.append(e)
            t = e.get("triton", {})
            print(f"B={B:3d} ctx={ctx:5d} n={n:3d}  triton {t.get('ms', float('nan')):8.3f} ms "
                  f"{t.get('GBps', 0):7.1f} GB/s ({t.get('frac_peak_bw', 0):.0%}) "
                  f"{t.get('TFLOPs', 0):6.1f} TF/s | sdpa {e.get('sdpa_dense_mask', {}).get('ms', float('nan')):8.3f} ms"
                  f" | flashinfer {e.get('flashinfer', {}).get('ms', float('nan')):8.3f} ms"
                  f" | ref {e.get('reference', {}).get('ms', float('nan')):8.2f} ms", flush=True)
            del a, out
            if self.dev.type == "cuda":
                torch.cuda.empty_cache()
        return rows

    def attention_sweep(self):
        if self.args.sweep == "none":
            return {"skipped": True}
        if self.args.sweep == "all":
            shapes = [(b, c, n) for b in _ints(self.args.batches) for c in _ints(self.args.contexts)
                      for n in _ints(self.args.nodes)]
        else:
            shapes = [(64, 2048, 16), (64, 2048, 32), (64, 2048, 64), (16, 2048, 32), (1, 8192, 32)]
        if self.dev.type == "cpu":
            shapes = [(2, 40, 8)]
        configs = [dict(BLOCK_NODES=16, BLOCK_N=64, num_warps=4, num_stages=2),
                   dict(BLOCK_NODES=16, BLOCK_N=64, num_warps=4, num_stages=3),
                   dict(BLOCK_NODES=16, BLOCK_N=32, num_warps=4, num_stages=3),
                   dict(BLOCK_NODES=32, BLOCK_N=32, num_warps=8, num_stages=2),
                   dict(BLOCK_NODES=32, BLOCK_N=64, num_warps=8, num_stages=2),
                   dict(BLOCK_NODES=32, BLOCK_N=32, num_warps=8, num_stages=3)]
        rows = []
        for B, ctx, n in shapes:
            if self.over_budget():
                break
            a = self.make_attention(B, ctx, n)
            out = self.torch.empty_like(a["args"]["q"])
            splits = [None] + ([1, 4, 8, 16] if B == 1 else [])
            for cfg in configs:
                for sp in splits:
                    e = {"B": B, "ctx": ctx, "nodes": n, "config": cfg, "num_splits": sp}
                    try:
                        fn = lambda: self.ta.tree_attention_triton(  # noqa: E731
                            **a["args"], out=out, config=cfg, num_splits=sp, **a["hints"])
                        self._rates(e, self.timeit(fn), a["bytes"], a["flops"])
                    except Exception as exc:
                        e["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    rows.append(e)
            best = min((r for r in rows if r.get("B") == B and r.get("ctx") == ctx
                        and r.get("nodes") == n and "ms" in r), key=lambda r: r["ms"], default=None)
            if best:
                print(f"best B={B} ctx={ctx} n={n}: {best['ms']:.3f} ms {best['GBps']} GB/s "
                      f"{best.get('TFLOPs')} TF/s {best['config']} splits={best['num_splits']}",
                      flush=True)
        return rows

    def sampling(self):
        torch = self.torch
        rows = []
        V = self.args.vocab
        for B in _ints(self.args.batches):
            for mode in ("greedy", "plain", "topk", "topp", "topk_topp"):
                if self.over_budget():
                    break
                s = self.make_sampling(B, V, self.args.sample_nodes, mode=mode)
                logit_bytes = s["T"] * V * 2
                e = {"B": B, "rows": s["T"], "vocab": V, "mode": mode}
                fn = lambda: self.ts.tree_verify_triton(  # noqa: E731
                    s["draw_args"]["logits"], s["tree"],
                    **{k: v for k, v in s["draw_args"].items() if k not in ("logits", "cu_nodes")},
                    max_depth=self.args.sample_nodes - 1, max_nodes=self.args.sample_nodes)
                try:
                    self._rates(e, self.timeit(fn), logit_bytes)
                    e["note"] = "GBps = logits bytes read once / time (the kernel makes several passes)"
                except Exception as exc:
                    e["error"] = f"{type(exc).__name__}: {exc}"
                if not self.args.no_reference and s["T"] * V <= 600e6:
                    try:
                        fr = lambda: self.ts.tree_verify_ref(  # noqa: E731
                            s["draw_args"]["logits"], s["tree"],
                            **{k: v for k, v in s["draw_args"].items() if k not in ("logits", "cu_nodes")})
                        e["reference_ms"] = round(self.time_slow(fr, 1), 3)
                    except Exception as exc:
                        e["reference_error"] = f"{type(exc).__name__}: {exc}"
                rows.append(e)
                print(f"B={B:3d} rows={s['T']:5d} V={V} {mode:10s} triton {e.get('ms', float('nan')):8.3f} ms"
                      f" ({e.get('GBps', 0):.0f} GB/s once-read) | ref {e.get('reference_ms', float('nan')):9.2f} ms",
                      flush=True)
                del s
        return rows

    def compaction(self):
        rows = []
        for B in _ints(self.args.batches):
            if self.over_budget():
                break
            c = self.make_compaction(B, self.args.layers)
            e = {"B": B, "layers": self.args.layers, "depth": 6, "bytes": c["bytes"]}
            try:
                self._rates(e, self.timeit(lambda: self.kc.compact_kv_triton(c["table"], *c["meta"])),
                            c["bytes"])
            except Exception as exc:
                e["error"] = f"{type(exc).__name__}: {exc}"
            if not self.args.no_reference:
                e["reference_ms"] = round(self.time_slow(
                    lambda: self.kc.compact_kv_ref((c["keys"], c["vals"]), *c["meta"]), 2), 3)
            rows.append(e)
            print(f"B={B:3d} layers={self.args.layers} triton {e.get('ms', float('nan')):8.4f} ms "
                  f"{e.get('GBps', 0):7.1f} GB/s | ref {e.get('reference_ms', float('nan')):8.2f} ms",
                  flush=True)
            del c
        return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        # Smoke test of this script: tiny shapes in Triton's interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
        if args.batches == "1,16,64":
            args.batches = "1,2"
        if args.contexts == "512,2048,8192":
            args.contexts = "40"
        if args.nodes == "16,32,64":
            args.nodes = "5"
        args.vocab = min(args.vocab, 1000)
        args.sample_nodes = min(args.sample_nodes, 4)
        args.layers = min(args.layers, 2)
    else:
        os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported
    bench = Bench(args)
    bench.setup()
    if not args.skip_tests:
        bench.section("pytest_tests_kernels", bench.run_pytest)
    bench.section("own_checks", bench.own_checks)
    if not args.tests_only:
        bench.section("attention", bench.attention)
        bench.section("attention_sweep", bench.attention_sweep)
        bench.section("sampling", bench.sampling)
        bench.section("compaction", bench.compaction)
    bench.save()
    print(f"\nwrote {bench.out} ({bench.elapsed():.0f}s)")
    failed = [k for k, v in bench.results["sections"].items() if "error" in v]
    tests = bench.results["sections"].get("pytest_tests_kernels", {}).get("result", {})
    if isinstance(tests, dict) and tests.get("returncode") not in (0, None):
        failed.append("pytest_tests_kernels")
    if failed:
        print("FAILED sections:", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
