"""Helpers for tests that run vLLM engines (imported as a plain module:
pytest puts tests/ on sys.path; the repository root must NOT be on it,
or `triton_kernels/` would shadow the top-level name vLLM probes)."""
import gc


def make_llm(**kwargs):
    """An in-process LLM on the bundled target, greedy-reproducible settings."""
    from vllm import LLM

    from vllm_eagle_tree import assets

    opts = dict(model=str(assets.TARGET), dtype="float32", enforce_eager=True,
                max_model_len=1024, disable_log_stats=False, seed=0)
    opts.update(kwargs)
    return LLM(**opts)


def free_llm(llm):
    del llm
    gc.collect()


def greedy_token_ids(llm, prompts, max_tokens):
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def check_kv_only_first_pass(worker):
    """Worker-side check of ``TreeDrafter._write_kv`` (run with
    ``llm.collective_rpc``), on three blocks at the end of the head's KV
    cache whose contents are restored afterwards:

    1. the draft KV it writes for a batch of rows equals, exactly, what the
       head's whole forward (``_run``) writes for the same rows;
    2. a first pass split into KV-only rows plus each request's last row
       (``draft``, rows >= KV_ONLY_MIN_ROWS) drafts the same chains as one
       forward over every row, with the same cache contents and path values
       up to float rounding.

    Returns the number of cache values compared (> 0)."""
    import torch

    from vllm_eagle_tree.adapter import proposer as P
    from vllm_eagle_tree.adapter.attention import TreeAttention

    drafter = worker.model_runner.tree_drafter
    layer = drafter._kv_layer
    assert layer is not None, "the bundled heads are one-layer EAGLE heads"
    kv = layer.self_attn.attn.kv_cache
    bs = drafter.block_size
    blocks = [kv.shape[0] - 3, kv.shape[0] - 2, kv.shape[0] - 1]
    saved = kv[blocks].clone()
    sizes = [5, min(40, bs)]  # two requests, positions 0..n-1 from position 0
    block_table = torch.tensor([[blocks[0], blocks[0]], [blocks[1], blocks[2]]], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    n = sum(sizes)
    vocab = drafter.model.model.embed_tokens.weight.shape[0]
    tokens = torch.randint(0, vocab, (n,), generator=g)
    positions = torch.cat([torch.arange(k) for k in sizes])
    slots = torch.cat([block_table[i, 0].long() * bs + torch.arange(k) for i, k in enumerate(sizes)])
    if drafter.is_eagle3:
        aux = [torch.randn(n, drafter.model.model.fc.input_size // 3, generator=g)
               for _ in range(3)]
        hidden, feats = None, drafter.model.combine_hidden_states(torch.cat(aux, -1))
    else:
        aux, hidden = None, torch.randn(n, drafter.model.model.fc.input_size // 2, generator=g)
        feats = hidden
    try:
        # 1. KV-only rows against the whole forward, same rows
        kv[blocks] = 0
        cu = [0, sizes[0], n]
        attn = TreeAttention(rows=torch.arange(n), cu_q_lens=torch.tensor(cu, dtype=torch.int32),
                             seq_lens=torch.tensor(sizes, dtype=torch.int32),
                             tree_lens=torch.tensor(sizes, dtype=torch.int32),
                             tree_mask=P.chain_mask(max(sizes))[[j for k in sizes for j in range(k)]],
                             block_table=block_table)
        with torch.inference_mode():
            drafter._run(tokens, positions, feats, slots, attn)
            full = kv[blocks].clone()
            kv[blocks] = 0
            drafter._write_kv(tokens, positions, feats, slots)
            kv_only = kv[blocks].clone()
        assert full.abs().sum() > 0
        assert torch.equal(full, kv_only), "KV-only rows differ from the head's forward"

        # 2. draft() split (KV-only rows + last rows) against one forward
        def first_pass(min_rows):
            kv[blocks] = 0
            P.KV_ONLY_MIN_ROWS = min_rows
            reqs = [P.FirstPassRows(batch_index=i, src_rows=list(range(cu[i], cu[i + 1])),
                                    next_tokens=tokens[cu[i]:cu[i + 1]].tolist(), context_len=0,
                                    slots=slots[cu[i]:cu[i + 1]].tolist(), grow_tree=True)
                    for i in range(2)]
            target_hidden = hidden if hidden is not None else torch.zeros(n, 1)
            out = drafter.draft(reqs, target_hidden, aux, block_table, arm="chain-3")
            return out, kv[blocks].clone()

        saved_min = P.KV_ONLY_MIN_ROWS
        try:
            one, kv_one = first_pass(10 ** 9)
            split, kv_split = first_pass(1)
        finally:
            P.KV_ONLY_MIN_ROWS = saved_min
        assert [t[1] for t in one] == [t[1] for t in split], "split first pass drafts differ"
        torch.testing.assert_close(torch.tensor([t[2] for t in split]),
                                   torch.tensor([t[2] for t in one]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(kv_split, kv_one, atol=1e-5, rtol=1e-5)
        return int(full.ne(0).sum())
    finally:
        kv[blocks] = saved


def record_attention_dispatch(worker):
    """Worker-side hook (``llm.collective_rpc``): log, per target forward,
    (rows needing tree attention, target layers whose attention impl takes
    the tree dispatch, target layers with our impl). Returns the target's
    number of layers."""
    from vllm_eagle_tree.adapter.attention import TreeCPUAttentionImpl

    runner = worker.model_runner
    impls = runner._target_attn_impls
    log = runner._test_dispatch = []
    inner = runner._model_forward

    def forward(*args, **kwargs):
        step = runner._tree_step
        rows = sum(len(step.trees[b][0]) for b in step.masked)
        on = sum(getattr(i.forward, "__func__", None) is TreeCPUAttentionImpl.forward
                 for i in impls)
        log.append((rows, on, len(impls)))
        return inner(*args, **kwargs)

    runner._model_forward = forward
    return runner.model_config.hf_config.num_hidden_layers


def attention_dispatch_log(worker):
    return list(worker.model_runner._test_dispatch)


def check_attention_dispatch(log, layers, need_tree_rows=False):
    """Every target layer has our impl, and takes the tree dispatch exactly in
    the forwards with tree rows (vLLM's own forward in the others)."""
    assert log and all(n == layers for _, _, n in log), (layers, log[:3])
    assert all(on == (layers if rows else 0) for rows, on, _ in log), log
    assert any(not rows for rows, _, _ in log), "no forward without tree rows"
    if need_tree_rows:
        assert any(rows for rows, _, _ in log), "no forward with tree rows"
