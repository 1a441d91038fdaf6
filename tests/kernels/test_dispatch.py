"""The dispatch layer and the vLLM-dispatcher CPU fallbacks."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import vllm_eagle_tree.triton_kernels as tk
from vllm_eagle_tree.triton_kernels import dispatch


def test_backend_env(monkeypatch):
    monkeypatch.delenv("VLLM_EAGLE_TREE_KERNELS", raising=False)
    assert dispatch.kernel_backend() == "auto"
    assert not dispatch.use_triton(torch.zeros(1))  # CPU tensor -> reference
    monkeypatch.setenv("VLLM_EAGLE_TREE_KERNELS", "reference")
    assert not dispatch.use_triton(torch.zeros(1))
    monkeypatch.setenv("VLLM_EAGLE_TREE_KERNELS", "triton")
    assert dispatch.use_triton(torch.zeros(1))
    monkeypatch.setenv("VLLM_EAGLE_TREE_KERNELS", "bogus")
    with pytest.raises(ValueError):
        dispatch.kernel_backend()


def test_public_api():
    for name in tk.__all__:
        assert hasattr(tk, name), name
    # Submodules stay reachable (no function shadows a module name).
    import vllm_eagle_tree.triton_kernels.tree_attention as m
    assert hasattr(m, "_tree_attn_fwd_kernel")


def test_forced_triton_on_cpu_runs_interpreter(monkeypatch, interpret):
    if not interpret:
        pytest.skip("CPU tensors run Triton only in the interpreter")
    monkeypatch.setenv("VLLM_EAGLE_TREE_KERNELS", "triton")
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=gen)
    args = (torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0.7]), torch.tensor([5]),
            torch.tensor([0.9]), torch.tensor([1]), torch.tensor([2]))
    assert torch.equal(tk.tree_draw_tokens(logits, *args),
                       tk.tree_draw_tokens_ref(logits, *args))


_FALLBACK_SCRIPT = textwrap.dedent(r"""
    import math, torch
    from vllm_eagle_tree.core.tree import TreeBatch
    from vllm_eagle_tree.core.verification import walk_trees
    import vllm_eagle_tree.triton_kernels as tk
    from vllm_eagle_tree.triton_kernels import tree_attention as ta, tree_sampling as ts, kv_compaction as kc

    assert tk.register_cpu_fallbacks() is True
    assert tk.register_cpu_fallbacks() is True  # idempotent
    assert type(ta._tree_attn_fwd_kernel).__name__ == "KernelOverride"

    g = torch.Generator().manual_seed(0)
    tree = TreeBatch.from_parents([[-1, 0, 0, 1], [-1, 0]], [[5, 6, 7, 8], [1, 2]], context_len=[3, 0])
    seq = torch.tensor([7, 2], dtype=torch.int32)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    kc_ = torch.randn(4, 4, 2, 64, generator=g)
    vc_ = torch.randn(4, 4, 2, 64, generator=g)
    q = torch.randn(6, 4, 64, generator=g)
    ref = ta.tree_attention_ref(q, kc_, vc_, bt, seq, tree.cu_nodes, tree.packed_mask(), 0.125)
    for splits in (1, 2):
        out = ta.tree_attention_triton(q, kc_, vc_, bt, seq, tree.cu_nodes, tree.packed_mask(),
                                       0.125, num_splits=splits)
        torch.testing.assert_close(out, ref)

    logits = torch.randn(6, 50, generator=g)
    args = (tree.cu_nodes, torch.tensor([0.8, 0.0]), torch.tensor([10, 0]), torch.tensor([0.9, 1.0]),
            torch.tensor([3, 4]), torch.tensor([1, 1]))
    draws = ts.tree_draw_tokens_triton(logits, *args)
    assert torch.equal(draws, ts.tree_draw_tokens_ref(logits, *args))
    draws[0] = 6  # root -> node 2 (token 7)
    res = ts.tree_walk_triton(draws, tree)
    exp = walk_trees(draws, tree)
    assert torch.equal(res.accepted_nodes, exp.accepted_nodes) and res.num_accepted[0] >= 1
    assert torch.equal(res.bonus_token, exp.bonus_token)

    keys = [torch.randn(4, 4, 2, 8, generator=g) for _ in range(2)]
    vals = [torch.randn(4, 4, 2, 8, generator=g) for _ in range(2)]
    ek, ev = [k.clone() for k in keys], [v.clone() for v in vals]
    na, an = torch.tensor([2, 0]), torch.tensor([[1, 3], [-1, -1]])
    kc.compact_kv_ref((ek, ev), bt, tree.context_len, na, an)
    table = kc.KVCacheTable(keys, vals)
    kc.compact_kv_triton(table, bt, tree.context_len, na, an)
    assert all(torch.equal(a, b) for a, b in zip(keys + vals, ek + ev))
    print("FALLBACKS_OK")
""")


def test_register_cpu_fallbacks_subprocess(interpret):
    """Through vLLM's dispatcher, real (non-interpreted) kernel launches on CPU
    tensors run the references. Runs in a fresh process without
    TRITON_INTERPRET: the registration rebinds module attributes for good."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    if not interpret or torch.cuda.is_available():
        pytest.skip("the fallbacks are for machines without a Triton GPU backend")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("VLLM_EAGLE_TREE_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "FALLBACKS_OK" in proc.stdout, proc.stdout + proc.stderr
