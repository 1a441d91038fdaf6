"""The engine-free reference generator: greedy identity with transformers,
tau counting, seeded sampling and the sampled distribution.

Model pair: ``$VLLM_EAGLE_TREE_PAIR`` (a folder with target/, eagle1-head/,
eagle3-head/) if set, else the bundled assets once built
(assets/build_metrics.json exists); otherwise the module is skipped. Untrained
heads accept ~nothing, so an *oracle* draft (the target itself, run as a
draft, shifted by EAGLE's convention) also runs every test that needs
accepted tokens: greedy identity must hold with long accepted paths too.
"""
import json
import os
from pathlib import Path

import pytest
import torch

from vllm_eagle_tree import assets
from vllm_eagle_tree.core import TreeConfig
from vllm_eagle_tree.reference import (DraftModel, ReferenceGenerator, SamplingParams,
                                       TargetModel, chain_config)

NUM_PROMPTS = 32
NEW_TOKENS = 24


def _pair_dirs():
    env = os.environ.get("VLLM_EAGLE_TREE_PAIR")
    if env:
        root = Path(env)
        return root / "target", root / "eagle1-head", root / "eagle3-head", False
    if (assets.ASSETS / "build_metrics.json").exists():
        return assets.TARGET, assets.EAGLE1_HEAD, assets.EAGLE3_HEAD, True
    return None


PAIR = _pair_dirs()
pytestmark = pytest.mark.skipif(PAIR is None, reason="no trained pair in assets/ yet "
                                "(set VLLM_EAGLE_TREE_PAIR to a pair folder)")
TRAINED = PAIR is not None and PAIR[3]


class OracleDraft(DraftModel):
    """The target used as its own draft, in the draft's KV/position convention.

    Draft slot s holds token x_{s+1}; the oracle runs the target on it at
    target position s+1, so it sees the context minus x_0: nearly always the
    target's own argmax, i.e. long accepted paths.
    """

    def __init__(self, target: TargetModel):
        self.target = target
        self.eagle3 = False
        self.aux_layer_ids = ()
        self.token_map = None
        self.hidden_size = target.hidden_size

    name = "oracle"

    def new_cache(self, batch, capacity):
        return self.target.new_cache(batch, capacity)

    def features(self, final, aux):
        return final

    def first_hidden(self, features):
        return features

    def forward(self, cache, tokens, hidden, positions, ctx, block, offsets=None):
        return self.target.forward(cache, tokens, positions + 1, ctx, block, offsets)[0]

    def logprobs(self, out):
        return self.target.logits(out).log_softmax(-1)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny ops on a busy 2-core machine run far faster on one thread.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target():
    return TargetModel.from_pretrained(PAIR[0])


@pytest.fixture(scope="module")
def drafts(target):
    return {"eagle1": DraftModel.from_pretrained(PAIR[1], target),
            "eagle3": DraftModel.from_pretrained(PAIR[2], target),
            "oracle": OracleDraft(target)}


@pytest.fixture(scope="module")
def prompt_ids():
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(PAIR[0]))
    texts = json.loads(assets.PROMPTS.read_text())[:NUM_PROMPTS]
    assert len(texts) == NUM_PROMPTS
    return [tok(t)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def hf_greedy(target, prompt_ids):
    """transformers' greedy generate, EOS ignored, one prompt at a time."""
    out = []
    for ids in prompt_ids:
        seq = target.hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 eos_token_id=None, pad_token_id=0)
        out.append(seq[0, len(ids):].tolist())
        assert len(out[-1]) == NEW_TOKENS
    return out


def run(target, draft, prompts, cfg, batch, params):
    gen = ReferenceGenerator(target, draft, cfg)
    outs, total = [], None
    for i in range(0, len(prompts), batch):
        o, st = gen.generate(prompts[i:i + batch], params)
        outs += o
        total = st if total is None else total + st
    return outs, total


PLAIN = TreeConfig(top_k=8, max_depth=5, num_nodes=32)
ADAPTIVE = TreeConfig(top_k=8, max_depth=5, num_nodes=32, depth_threshold=0.05,
                      width_mass=0.9, min_path_prob=0.001, batch_num_nodes=96)
CASES = {
    "eagle1-tree-b1": ("eagle1", PLAIN, 1),
    "eagle1-adaptive-b8": ("eagle1", ADAPTIVE, 8),
    "eagle3-tree-b8": ("eagle3", PLAIN, 8),
    "eagle3-adaptive-b1": ("eagle3", ADAPTIVE, 1),
    "eagle1-chain4-b8": ("eagle1", chain_config(4), 8),
    "eagle3-chain3-b8": ("eagle3", chain_config(3), 8),
    "oracle-tree-b8": ("oracle", PLAIN, 8),
    "oracle-adaptive-b8": ("oracle", ADAPTIVE, 8),
    "oracle-eagle-ref-b8": ("oracle", TreeConfig.from_reference(60, 5, 10), 8),
    "oracle-chain5-b8": ("oracle", chain_config(5), 8),
}


def test_reference_target_forward_matches_hf(target, prompt_ids):
    """Our dense-KV forward (batched, right-padded) equals HF's logits."""
    from vllm_eagle_tree.reference.generator import causal_block
    ids = prompt_ids[:3]
    cache = target.new_cache(3, 512)
    T = max(map(len, ids))
    tokens = torch.tensor([x + [0] * (T - len(x)) for x in ids])
    final, _ = target.forward(cache, tokens, torch.arange(T).expand(3, T),
                              torch.zeros(3, dtype=torch.int64), causal_block(3, T))
    logits = target.logits(final)
    for b, x in enumerate(ids):
        with torch.no_grad():
            ref = target.hf(torch.tensor([x])).logits[0].float()
        torch.testing.assert_close(logits[b, :len(x)], ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("case", list(CASES))
def test_reference_greedy_identity(case, target, drafts, prompt_ids, hf_greedy):
    head, cfg, batch = CASES[case]
    outs, st = run(target, drafts[head], prompt_ids, cfg, batch,
                   SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    mismatched = [i for i, (o, r) in enumerate(zip(outs, hf_greedy)) if o.output_ids != r]
    assert not mismatched, f"{case}: {len(mismatched)} prompts differ from HF greedy, e.g. #{mismatched[0]}"
    assert all(o.finish_reason == "length" for o in outs)
    assert st.prefill_tokens + st.emitted == NUM_PROMPTS * NEW_TOKENS
    assert st.verify_forwards >= 1 and st.tau >= 1.0
    if head == "oracle":  # accepted paths were exercised (adaptive rules may
        assert st.accepted > 0, st  # prune an untrained target's flat drafts)
        if cfg.min_path_prob == 0:
            assert st.tau > 2.0, st
    if cfg.top_k == 1:  # a chain drafts exactly K nodes per step
        assert st.drafted_nodes == cfg.num_nodes * st.request_steps


@pytest.mark.skipif(not TRAINED, reason="needs the trained bundled heads (assets/build_metrics.json)")
@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_reference_tau_trained_heads(head, target, drafts, prompt_ids):
    _, st = run(target, drafts[head], prompt_ids[:8], PLAIN, 8,
                SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    assert st.tau > 1.5, st  # measured ~2.5 (eagle1) and ~2.8 (eagle3)


@pytest.mark.parametrize("head", ["eagle1", "oracle"])
def test_reference_chain_k1_tau(head, target, drafts, prompt_ids):
    outs, st = run(target, drafts[head], prompt_ids[:8], chain_config(1), 8,
                   SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    steps = sum(o.num_steps for o in outs)
    accepted = sum(o.num_accepted for o in outs)
    assert steps == st.request_steps and accepted == st.accepted
    assert st.drafted_nodes == steps  # one drafted token per step
    assert st.tau == pytest.approx(1 + accepted / steps)
    assert 1.0 <= st.tau <= 2.0
    # every verify step emits accepted + 1 tokens (only the last may be cut)
    assert st.emitted <= accepted + steps
    if head == "oracle":
        assert st.tau > 1.5


def test_reference_eos_and_length(target, drafts, prompt_ids, hf_greedy):
    """EOS stops a request (the EOS token is emitted); other requests run on."""
    prompts = prompt_ids[:4]
    eos = hf_greedy[0][5]  # pretend a token the greedy output of prompt 0 emits is EOS
    saved = target.eos_token_ids
    target.eos_token_ids = {eos}
    try:
        outs, _ = ReferenceGenerator(target, drafts["oracle"], PLAIN).generate(
            prompts, [SamplingParams(max_new_tokens=NEW_TOKENS),
                      SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True),
                      SamplingParams(max_new_tokens=7),
                      SamplingParams(max_new_tokens=1)])
    finally:
        target.eos_token_ids = saved
    cut = hf_greedy[0].index(eos) + 1
    assert outs[0].output_ids == hf_greedy[0][:cut] and outs[0].finish_reason == "stop"
    assert outs[1].output_ids == hf_greedy[1]
    ref2 = hf_greedy[2][:7]
    if eos in ref2:
        ref2 = ref2[:ref2.index(eos) + 1]
    assert outs[2].output_ids == ref2
    assert outs[3].output_ids == hf_greedy[3][:1] and outs[3].num_steps == 0


@pytest.mark.parametrize("head", ["eagle1", "oracle"])
def test_reference_sampled_reproducible(head, target, drafts, prompt_ids, hf_greedy):
    prompts = prompt_ids[:4]
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_new_tokens=16, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=12, max_new_tokens=16, ignore_eos=True),
              SamplingParams(max_new_tokens=16, ignore_eos=True),  # greedy in a sampled batch
              SamplingParams(temperature=1.0, seed=13, max_new_tokens=16, ignore_eos=True)]
    gen = ReferenceGenerator(target, drafts[head], PLAIN)
    a, _ = gen.generate(prompts, params)
    b, _ = gen.generate(prompts, params)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]
    assert a[2].output_ids == hf_greedy[2][:16]
    # A seeded request's output does not depend on its batch mates.
    alone, _ = gen.generate(prompts[:1], params[:1])
    assert alone[0].output_ids == a[0].output_ids
    other, _ = gen.generate(prompts[:1], [SamplingParams(temperature=0.8, top_p=0.95, seed=99,
                                                         max_new_tokens=16, ignore_eos=True)])
    assert other[0].output_ids != a[0].output_ids


@pytest.mark.parametrize("head", ["eagle1", "oracle"])
def test_reference_sampled_distribution(head, target, drafts, prompt_ids):
    """Temperature 1, top-k 3: the first two emitted tokens (the prefill's
    sample, then the first verify step's) over many seeds follow the target's
    joint distribution (chi-square)."""
    stats = pytest.importorskip("scipy.stats")
    prompt = prompt_ids[1][:16]
    n = 400
    params = [SamplingParams(temperature=1.0, top_k=3, seed=1000 + s, max_new_tokens=2, ignore_eos=True)
              for s in range(n)]
    cfg = TreeConfig(top_k=3, max_depth=3, num_nodes=8)
    outs, st = ReferenceGenerator(target, drafts[head], cfg).generate([prompt] * n, params)
    assert st.verify_forwards == 1

    def top3(ids):
        with torch.no_grad():
            logits = target.hf(torch.tensor([ids])).logits[0, -1].double()
        top = torch.topk(logits, 3)
        return top.indices.tolist(), torch.softmax(top.values, -1).tolist()

    expected = {}
    t1, p1 = top3(prompt)
    for a, pa in zip(t1, p1):
        t2, p2 = top3(prompt + [a])
        for b, pb in zip(t2, p2):
            expected[(a, b)] = pa * pb
    counts = {}
    for o in outs:
        key = tuple(o.output_ids)
        assert key in expected, f"token pair {key} outside the target's top-3 support"
        counts[key] = counts.get(key, 0) + 1
    # Merge categories with small expected counts into one bin.
    keys = sorted(expected, key=expected.get, reverse=True)
    big = [k for k in keys if expected[k] * n >= 5]
    small = [k for k in keys if k not in big]
    obs = [counts.get(k, 0) for k in big]
    exp = [expected[k] * n for k in big]
    if small:
        obs.append(sum(counts.get(k, 0) for k in small))
        exp.append(sum(expected[k] for k in small) * n)
    p = stats.chisquare(obs, exp).pvalue
    assert p > 1e-3, (p, obs, exp)
    if head == "oracle":  # the second token came through an accepted tree node
        assert st.accepted > n // 2


@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
def test_reference_draft_convention_matches_training(head, target, drafts, prompt_ids, monkeypatch):
    """The draft's chain distributions equal the training-time-test forward
    of scripts/build_pair.py (ttt_forward) on the same tokens: same draft
    positions (x_{p+1} at p), features and attention."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "build_pair", Path(__file__).resolve().parents[2] / "scripts" / "build_pair.py")
    bp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bp)

    draft = drafts[head]
    calls = []
    real = draft.logprobs
    monkeypatch.setattr(draft, "logprobs", lambda out: calls.append(real(out)) or calls[-1])
    gen = ReferenceGenerator(target, draft)
    prompt = prompt_ids[2][:40]
    state = gen.start([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
    gen.step(state, chain_config(3))
    # calls: [prompt pass root, depth-1 step, depth-2 step, re-run root]
    root, d1, d2 = calls[0][0], calls[1][0, 0], calls[2][0, 0]
    y1, y2 = int(root.argmax()), int(d1.argmax())
    seq = torch.tensor([prompt + state.outputs[0].output_ids[:1] + [y1, y2]])
    L = len(prompt)
    with torch.no_grad():
        fpost, faux, _ = bp.target_features(target.hf, seq)
        if head == "eagle3":
            assert list(draft.aux_layer_ids) == list(bp.AUX_LAYER_IDS)
        logits, _ = bp.ttt_forward(draft.head, target.embed_weight, target.lm_head_weight, seq,
                                   faux if head == "eagle3" else fpost, 3)
    for k, ours in enumerate((root, d1, d2)):
        ref = logits[k][0, L - 1].float().log_softmax(-1)
        torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4, msg=f"draft step {k + 1}")
