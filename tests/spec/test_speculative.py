"""Drafter + Verifier on the tiny target (reference ops, fp32): greedy speculative output equals plain greedy output
token for token, for chains and trees, with forced acceptance patterns mixed per sequence; the JetBlock state after
speculative rounds equals the state after prefilling the same tokens."""

import dataclasses

import pytest
import torch

import jetserve.model.jet_block as jet_block
from jetserve import envs
from jetserve.checkpoint import make_checkpoint
from jetserve.model.forward_batch import KVMetadata
from jetserve.model.loader import load_model
from jetserve.model.static_cache import StaticCache
from jetserve.ops.backend import set_backend
from jetserve.spec.drafter import Drafter, DraftKV
from jetserve.spec.eagle3 import load_draft_model, make_draft_checkpoint
from jetserve.spec.tree import DraftTree, ancestor_mask
from jetserve.spec.verifier import SamplingRows, Verifier

MAX_TOKENS = 96
PAGE = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir = make_checkpoint("tiny", tmp_path_factory.mktemp("target"), seed=0)
    target = load_model(target_dir, dtype="float32")
    draft_dir = make_draft_checkpoint(target_dir, tmp_path_factory.mktemp("draft"), seed=2, draft_vocab_size=200)
    return target, load_draft_model(draft_dir, target)


def _prompts(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 259, (n,), generator=gen).tolist() for n in lengths]


def _jet_states(model, slot):
    return [
        t[slot].clone()
        for layer in model.model.layers
        if layer.kind == "jet"
        for t in (layer.self_attn.conv_state, layer.self_attn.recurrent_state)
    ]


def _plain_greedy(target, prompts, num_tokens):
    """Greedy continuation of each prompt, one sequence at a time: num_tokens tokens after the prompt."""
    outputs = []
    for prompt in prompts:
        cache = StaticCache(target, 1, MAX_TOKENS, PAGE)
        logits = target.compute_logits(target(cache.batch([0], [prompt])))
        out = [int(logits[-1].argmax())]
        while len(out) < num_tokens:
            out.append(int(target.compute_logits(target(cache.batch([0], [[out[-1]]])))[-1].argmax()))
        outputs.append(out)
    return outputs


class SpecHarness:
    """N sequences speculating together: target StaticCache (sequence i in slot i + 1), the draft's cache on the same
    pages, a Drafter and a Verifier."""

    def __init__(self, target, draft, prompts, topk, num_steps, num_draft_tokens):
        self.target, self.draft = target, draft
        self.num_seqs = len(prompts)
        self.cache = StaticCache(target, self.num_seqs, MAX_TOKENS, PAGE)
        attn = draft.midlayer.self_attn
        shape = (1 + self.num_seqs * self.cache.pages_per_seq, PAGE, attn.num_kv_heads, attn.head_dim)
        draft.bind_cache(torch.full(shape, float("nan")), torch.full(shape, float("nan")))
        self.ids = list(range(self.num_seqs))
        self.kv = DraftKV(self.cache.block_tables, PAGE)
        self.drafter = Drafter(draft, topk, num_steps, num_draft_tokens)
        self.verifier = Verifier(target, draft.capture_layers)
        self.state_indices = torch.arange(1, self.num_seqs + 1, dtype=torch.int32)
        # Prefill the prompts, sample the first token, catch the draft up on the prompt.
        fb = dataclasses.replace(self.cache.batch(self.ids, prompts), capture_layers=draft.capture_layers)
        hidden = target(fb)
        last = fb.cu_seqlens[1:].long() - 1
        self.roots = target.compute_logits(hidden[last]).argmax(dim=-1)  # [N]
        self.outputs = [[int(t)] for t in self.roots]
        shifted = torch.cat([torch.tensor(p[1:] + [int(r)]) for p, r in zip(prompts, self.roots, strict=True)])
        self.last_hidden = self.drafter.extend(
            shifted, target.aux_hidden_states, fb.cu_seqlens, torch.zeros(self.num_seqs, dtype=torch.long), self.kv,
            fb.max_seqlen_q,
        )  # fmt: skip

    def kv_metadata(self, stored, rows, seq_ends, state_indices):
        tables = self.cache.block_tables[state_indices.long() - 1]
        pages = self.cache.block_tables[rows - 1, stored // PAGE].long()
        kv = KVMetadata(slot_mapping=pages * PAGE + stored % PAGE, block_tables=tables)
        return kv, kv

    def prefix_lens(self):
        return torch.tensor(self.cache.lengths, dtype=torch.long)

    def step(self, tree=None, sampling=None, is_chain=False):
        """One round: draft (or take `tree`), verify, commit, catch the draft up. Returns (tree, VerifyOutput).
        `is_chain`: the trees are chains (topk = 1), told to the VERIFY batch and the greedy acceptance."""
        drafted = self.drafter.draft_tree(self.last_hidden, self.roots, self.prefix_lens(), self.kv)
        tree = drafted if tree is None else tree
        fb = self.verifier.forward_batch(tree, self.prefix_lens(), self.state_indices, self.kv_metadata, is_chain)
        out = self.verifier.verify(fb, tree, sampling, is_chain=is_chain)
        self.cache.commit(self.ids, out.num_accepted.tolist())
        for seq, row in zip(self.outputs, out.emitted_tokens(tree).tolist(), strict=True):
            seq += [t for t in row if t >= 0]
        self.last_hidden = self.drafter.extend_after_verify(
            tree, out.accepted_nodes, out.num_accepted, out.emitted_tokens(tree), out.aux_hidden_states, self.kv
        )
        self.roots = out.bonus
        return tree, out


@pytest.mark.parametrize("topk, num_steps, num_draft_tokens", [(1, 4, 5), (2, 3, 6)])
def test_drafted_speculation_equals_plain_greedy(models, topk, num_steps, num_draft_tokens):
    target, draft = models
    prompts = _prompts([5, 12, 1], seed=topk)
    expected = _plain_greedy(target, prompts, 14)
    spec = SpecHarness(target, draft, prompts, topk, num_steps, num_draft_tokens)
    kept = []
    while min(len(o) for o in spec.outputs) < 14:
        tree, out = spec.step()
        assert tree.tokens.shape == (3, num_draft_tokens)
        assert bool((out.num_accepted >= 1).all())
        kept.append((len(spec.drafter.constants), len(spec.verifier.constants)))
    assert [o[:14] for o in spec.outputs] == expected
    # the batches' shape constants (`spec.constants`) made in the first round, then served: none made again
    assert len(kept) > 1 and all(k == kept[0] for k in kept) and min(kept[0]) > 0


@pytest.mark.parametrize("topk, num_steps, num_draft_tokens", [(1, 4, 5), (2, 3, 6)])
def test_verify_batch_tells_the_delta_rule_its_trees_are_chains(models, monkeypatch, topk, num_steps, num_draft_tokens):
    """`Verifier.forward_batch(..., is_chain)` reaches every JetBlock's delta-rule verify (whose Triton kernel then
    takes its chain form), and the rounds still equal plain greedy decoding."""
    target, draft = models
    prompts = _prompts([4, 11], seed=5)
    expected = _plain_greedy(target, prompts, 10)
    spec = SpecHarness(target, draft, prompts, topk, num_steps, num_draft_tokens)
    seen = []

    def spy(*args, is_chain=False):
        seen.append(is_chain)
        return real(*args, is_chain=is_chain)

    real = jet_block.gated_delta_rule_verify
    monkeypatch.setattr(jet_block, "gated_delta_rule_verify", spy)
    while min(len(o) for o in spec.outputs) < 10:
        spec.step(is_chain=topk == 1)
    num_jet = sum(layer.kind == "jet" for layer in target.model.layers)
    assert num_jet > 0 and len(seen) % num_jet == 0 and len(seen) > 0
    assert set(seen) == {topk == 1}
    assert [o[:10] for o in spec.outputs] == expected


@pytest.mark.skipif(not envs.triton_interpret(), reason="the Triton variants run here in the interpreter")
@pytest.mark.parametrize("topk, num_steps, num_draft_tokens", [(1, 3, 4), (2, 2, 4)])
def test_draft_rows_through_the_verify_kernel_equal_the_reference(models, topk, num_steps, num_draft_tokens):
    """Draft levels and a catch-up of short rows attend through `attention_verify` with a causal mask
    (`ROWS_VERIFY_MAX_WIDTH`): in the Triton interpreter the drafted tree, the rows' outputs and the draft cache equal
    the reference ops' (the cache's unused pages are NaN)."""
    target, draft = models
    spec = SpecHarness(target, draft, _prompts([5, 9], seed=4), topk, num_steps, num_draft_tokens)
    caches = (draft.midlayer.self_attn.k_cache, draft.midlayer.self_attn.v_cache)
    before = [c.clone() for c in caches]
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 259, (2, 3), generator=gen)
    features = [torch.randn(6, target.config.hidden_size, generator=gen) for _ in draft.capture_layers]
    valid = torch.tensor([3, 1])
    results = []
    for backend in ("reference", "triton"):
        for c, b in zip(caches, before, strict=True):
            c.copy_(b)
        set_backend(backend)
        try:
            tree = spec.drafter.draft_tree(spec.last_hidden, spec.roots, spec.prefix_lens(), spec.kv)
            hidden = spec.drafter.extend_rows(ids, features, spec.prefix_lens(), spec.kv, valid)
        finally:
            set_backend(None)
        results.append((tree, hidden, [c.clone() for c in caches]))
    (want_tree, want, want_caches), (tree, got, got_caches) = results
    assert torch.equal(tree.tokens, want_tree.tokens) and torch.equal(tree.parents, want_tree.parents)
    torch.testing.assert_close(tree.scores, want_tree.scores, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for x, y in zip(got_caches, want_caches, strict=True):
        torch.testing.assert_close(x.nan_to_num(nan=-7.0), y.nan_to_num(nan=-7.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_steps, num_draft_tokens", [(4, 5), (4, 3), (1, 2)])
def test_chain_fast_path_equals_the_general_levels(models, num_steps, num_draft_tokens):
    """topk = 1 drafts through `_draft_chain` (no selection, one reduction per level): the same tree as the general
    path (`_draft_levels`: every level, best candidates kept), field for field, over rounds that accept different
    amounts — including a shape that keeps fewer nodes than it has levels."""
    target, draft = models
    spec = SpecHarness(target, draft, _prompts([9, 30, 2, 17], seed=7), 1, num_steps, num_draft_tokens)
    for _ in range(4):
        args = (spec.last_hidden, spec.roots, spec.prefix_lens(), spec.kv)
        general = spec.drafter._draft_levels(*args)
        chain = spec.drafter.draft_tree(*args)
        assert chain.tokens.shape == (4, num_draft_tokens)
        for f in dataclasses.fields(DraftTree):
            a, b = getattr(chain, f.name), getattr(general, f.name)
            assert a.dtype == b.dtype and a.shape == b.shape, f.name
            if f.name == "scores":
                torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            else:
                assert torch.equal(a, b), f.name
        spec.step()


def _forced_tree(roots, continuation, offsets, num_correct, shape, root_positions, vocab):
    """Trees whose correct path (tokens of the plain greedy continuation) has num_correct[i] drafts.

    shape "chain": T_d = 5, the path is nodes 1..num_correct. shape "tree": parents [-1, 0, 0, 1, 2, 2, 4]; the path
    runs through node 2, then 4, then 6 (siblings 1, 3, 5 hold wrong tokens)."""
    if shape == "chain":
        parents, path = [-1, 0, 1, 2, 3], [1, 2, 3, 4]
    else:
        parents, path = [-1, 0, 0, 1, 2, 2, 4], [2, 4, 6]
    num_nodes = len(parents)
    tokens = []
    for i, root in enumerate(roots.tolist()):
        right = continuation[i][offsets[i] + 1 : offsets[i] + 1 + num_nodes]
        row = [root] + [(right[0] + 7 + j) % vocab for j in range(1, num_nodes)]  # wrong unless set below
        for depth, node in enumerate(path):
            row[node] = right[depth] if depth < num_correct[i] else (right[depth] + 1) % vocab
        tokens.append(row)
    parents_t = torch.tensor([parents] * len(tokens), dtype=torch.int32)
    depths = torch.zeros_like(parents_t)
    for j in range(1, num_nodes):
        depths[:, j] = depths[:, parents[j]] + 1
    return DraftTree(
        tokens=torch.tensor(tokens),
        parents=parents_t,
        depths=depths,
        mask=ancestor_mask(parents_t, num_levels=num_nodes - 1),
        positions=root_positions[:, None] + depths.long(),
        scores=torch.zeros(len(tokens), num_nodes),
    )


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_forced_acceptance_patterns_keep_output_and_state_exact(models, shape):
    """Rounds with 0, all, and mixed per-sequence acceptance (k = 1 right after k ≥ 2 included)."""
    target, draft = models
    vocab = target.config.vocab_size
    prompts = _prompts([9, 3, 20], seed=7)
    expected = _plain_greedy(target, prompts, 32)
    max_correct = 4 if shape == "chain" else 3
    patterns = [[0, max_correct, 2], [max_correct, 0, 1], [1, 1, max_correct], [2, max_correct, 0], [0, 0, 0],
                [max_correct, max_correct, max_correct], [1, 2, 1]]  # fmt: skip
    spec = SpecHarness(target, draft, prompts, topk=2, num_steps=3, num_draft_tokens=6)
    for pattern in patterns:
        offsets = [len(o) - 1 for o in spec.outputs]  # the root is output token `offset`
        tree = _forced_tree(spec.roots, expected, offsets, pattern, shape, spec.prefix_lens(), vocab)
        _, out = spec.step(tree)
        assert out.num_accepted.tolist() == [n + 1 for n in pattern]
    for seq, want in zip(spec.outputs, expected, strict=True):
        assert seq == want[: len(seq)]
    spec_states = [_jet_states(target, i + 1) for i in range(3)]
    lengths, draft_hidden = list(spec.cache.lengths), spec.last_hidden
    for i, prompt in enumerate(prompts):
        tokens = prompt + spec.outputs[i]  # the cache holds all but the newest bonus
        assert len(tokens) == lengths[i] + 1
        # The target's state equals a prefill of the same tokens; the draft caught up as a draft prefill would.
        fresh = SpecHarness(target, draft, [tokens[:-1]], topk=2, num_steps=3, num_draft_tokens=6)
        for a, b in zip(spec_states[i], _jet_states(target, 1), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        assert int(fresh.roots[0]) == tokens[-1]
        torch.testing.assert_close(draft_hidden[i], fresh.last_hidden[0], rtol=1e-4, atol=1e-4)


def test_sampling_rows_with_temperature_zero_match_greedy(models):
    """A verify step through the sampling path with temperature 0 gives the greedy result."""
    target, draft = models
    prompts = _prompts([6, 11], seed=3)
    expected = _plain_greedy(target, prompts, 12)
    spec = SpecHarness(target, draft, prompts, topk=2, num_steps=3, num_draft_tokens=6)
    rows = SamplingRows(
        temperature=torch.zeros(2), top_k=torch.zeros(2, dtype=torch.int32), top_p=torch.ones(2),
        min_p=torch.zeros(2), seeds=torch.tensor([1, 2]), counters=torch.tensor([0, 0]),
    )  # fmt: skip
    while min(len(o) for o in spec.outputs) < 12:
        rows.counters = rows.counters + 1
        spec.step(sampling=rows)
    assert [o[:12] for o in spec.outputs] == expected


def test_drafter_rejects_impossible_tree_sizes(models):
    _, draft = models
    with pytest.raises(ValueError, match="num_draft_tokens"):
        Drafter(draft, topk=2, num_steps=2, num_draft_tokens=8)  # at most 1 + 2 + 4
    with pytest.raises(ValueError, match="topk"):
        Drafter(draft, topk=0, num_steps=2, num_draft_tokens=2)


@pytest.mark.parametrize("sampled", [False, True])
def test_chain_catch_up_takes_the_features_as_they_are(models, sampled):
    """For chains the catch-up skips the gather of the accepted nodes' features (the accepted path is always nodes
    0 .. m-1): the same outputs and the same draft cache as the gathered path, over forced rounds that accept 0, all
    and some drafts per sequence, greedily and by sampling."""
    target, draft = models
    vocab = target.config.vocab_size
    prompts = _prompts([6, 13, 2], seed=3)
    expected = _plain_greedy(target, prompts, 40)
    spec = SpecHarness(target, draft, prompts, 1, 4, 5)
    sampling = None
    if sampled:
        n = spec.num_seqs
        sampling = SamplingRows(temperature=torch.full((n,), 0.8), top_k=torch.zeros(n, dtype=torch.int32),
                                top_p=torch.ones(n), min_p=torch.zeros(n), seeds=torch.arange(n, dtype=torch.int64),
                                counters=torch.zeros(n, dtype=torch.int64))  # fmt: skip
    caches = (draft.midlayer.self_attn.k_cache, draft.midlayer.self_attn.v_cache)
    for pattern in ([0, 4, 2], [4, 0, 1], [1, 1, 4], [2, 4, 0]):
        offsets = [len(o) - 1 for o in spec.outputs]
        tree = _forced_tree(spec.roots, expected, offsets, pattern, "chain", spec.prefix_lens(), vocab)
        fb = spec.verifier.forward_batch(tree, spec.prefix_lens(), spec.state_indices, spec.kv_metadata)
        out = spec.verifier.verify(fb, tree, sampling, is_chain=not sampled)
        if not sampled:
            assert out.num_accepted.tolist() == [n + 1 for n in pattern]
        spec.cache.commit(spec.ids, out.num_accepted.tolist())
        emitted = out.emitted_tokens(tree)
        args = (tree, out.accepted_nodes, out.num_accepted, emitted, out.aux_hidden_states, spec.kv)
        before, results = [c.clone() for c in caches], []
        for is_chain in (False, True):
            for c, b in zip(caches, before, strict=True):
                c.copy_(b)
            hidden = spec.drafter.extend_after_verify(*args, is_chain=is_chain)
            results.append((hidden, [c.clone() for c in caches]))
        (want, want_caches), (got, got_caches) = results
        assert torch.equal(got, want)
        for x, y in zip(got_caches, want_caches, strict=True):
            assert torch.equal(x.nan_to_num(nan=-7.0), y.nan_to_num(nan=-7.0))
        for seq, row in zip(spec.outputs, emitted.tolist(), strict=True):
            seq += [t for t in row if t >= 0]
        spec.last_hidden, spec.roots = got, out.bonus
        if sampled:
            sampling.counters += 1  # the sampled text leaves the greedy one: later drafts are mostly wrong


def test_extend_rows_equals_extend(models):
    """The equal-width catch-up (verify steps, flushes of missed positions), rows holding 4, 2 and 0 valid tokens
    then padding after prefixes of 0, 5 and 3 positions, stores and returns what `extend` does with the valid tokens
    alone: the draft cache alike (NaN exactly where nothing was written), the outputs at each row's last token."""
    target, draft = models
    num_seqs, width = 3, 4
    cache = StaticCache(target, num_seqs, MAX_TOKENS, PAGE)
    kv = DraftKV(cache.block_tables, PAGE)
    attn = draft.midlayer.self_attn
    shape = (1 + num_seqs * cache.pages_per_seq, PAGE, attn.num_kv_heads, attn.head_dim)
    gen = torch.Generator().manual_seed(7)

    def tokens_and_features(n):
        ids = torch.randint(0, 259, (n,), generator=gen)
        return ids, [torch.randn(n, target.config.hidden_size, generator=gen) for _ in draft.capture_layers]

    def cu_of(lens):
        return torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])

    starts, valid = torch.tensor([0, 5, 3]), torch.tensor([4, 2, 0])
    prefix_ids, prefix_features = tokens_and_features(int(starts.sum()))
    ids, features = tokens_and_features(num_seqs * width)
    kept = (torch.arange(width)[None, :] < valid[:, None]).view(-1)  # the valid tokens, row by row
    drafter = Drafter(draft, 1, 3, 4)
    results = []
    for rows in (False, True):
        k_cache, v_cache = torch.full(shape, float("nan")), torch.full(shape, float("nan"))
        draft.bind_cache(k_cache, v_cache)
        drafter.extend(prefix_ids, prefix_features, cu_of(starts), torch.zeros(num_seqs, dtype=torch.long), kv, 5)
        if rows:
            out = drafter.extend_rows(ids.view(num_seqs, width), features, starts, kv, valid)
        else:
            out = drafter.extend(ids[kept], [f[kept] for f in features], cu_of(valid), starts, kv, width)
        results.append((out, k_cache, v_cache))
    (want, k_want, v_want), (got, k_got, v_got) = results
    assert torch.isfinite(got[:2]).all()  # row 2 stored nothing: its output row means nothing
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_got, k_want, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(v_got, v_want, rtol=1e-6, atol=1e-6, equal_nan=True)
    assert not torch.isnan(k_got).all() and torch.isnan(k_got).any()
