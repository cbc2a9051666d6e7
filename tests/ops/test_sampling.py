"""Sampling: greedy, per-request reproducibility on any batch, and the filtered distribution (chi-square)."""

from __future__ import annotations

import pytest
import torch

from jetserve import envs
from jetserve.ops.sampling import reference as ref

# Chi-square critical values at p = 0.001 by degrees of freedom: a correct sampler fails one test in 1000 seeds;
# the noise is a fixed hash, so each test is deterministic.
CHI2_CRITICAL_P001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def rows(n: int, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, seed: int = 7):
    """Per-row sampling parameters for n rows; counters 0..n-1 (n successive draws of one request)."""
    return dict(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k, dtype=torch.int32),
        top_p=torch.full((n,), top_p),
        min_p=torch.full((n,), min_p),
        seeds=torch.full((n,), seed, dtype=torch.int64),
        counters=torch.arange(n, dtype=torch.int64),
    )


def random_logits(n: int, v: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, v, generator=gen) * scale  # [N, V]


def test_greedy_is_argmax_row_by_row() -> None:
    logits = random_logits(6, 50)
    params = rows(6, temperature=0.8)
    params["temperature"][[0, 3, 4]] = 0.0
    tokens = ref.sample(logits, **params)
    assert tokens.dtype == torch.int64 and tokens.shape == (6,)
    assert torch.equal(tokens[[0, 3, 4]], logits[[0, 3, 4]].argmax(dim=-1))


def test_top_k_one_is_greedy() -> None:
    logits = random_logits(64, 100, seed=1)
    tokens = ref.sample(logits, **rows(64, temperature=1.5, top_k=1))
    assert torch.equal(tokens, logits.argmax(dim=-1))


def test_draw_depends_only_on_own_seed_and_counter() -> None:
    logits = random_logits(8, 300, seed=2, scale=1.0)
    params = rows(8, temperature=1.0, top_k=50, top_p=0.9)
    params["seeds"] = torch.tensor([3, 1 << 40, -5, 3, 99, 12345, 7, 0], dtype=torch.int64)
    params["counters"] = torch.tensor([0, 5, 2, 1, 1 << 33, 9, 4, 3], dtype=torch.int64)
    params["top_k"][2] = 0
    params["min_p"][5] = 0.05
    batched = ref.sample(logits, **params)
    for i in range(8):
        alone = ref.sample(logits[i : i + 1], **{name: p[i : i + 1] for name, p in params.items()})
        assert alone.item() == batched[i].item()
    order = torch.tensor([5, 2, 7, 0, 1, 6, 3, 4])
    permuted = ref.sample(logits[order], **{name: p[order] for name, p in params.items()})
    assert torch.equal(permuted, batched[order])
    # Rows 0 and 3 share a seed but not a counter; a different batch composition changes nothing.
    mixed = ref.sample(
        torch.cat([logits[:1], random_logits(3, 300, seed=9)]), **{n: p[[0, 1, 2, 3]] for n, p in params.items()}
    )
    assert mixed[0].item() == batched[0].item()


def test_different_counters_and_seeds_give_different_draws() -> None:
    logits = torch.zeros(200, 1000)  # uniform over 1000 tokens
    by_counter = ref.sample(logits, **rows(200, seed=11))
    assert by_counter.unique().numel() >= 170  # about 181 distinct expected
    params = rows(200)
    params["seeds"] = torch.arange(200, dtype=torch.int64) * 7919
    params["counters"].zero_()
    by_seed = ref.sample(logits, **params)
    assert by_seed.unique().numel() >= 170
    assert not torch.equal(by_seed, by_counter)


def test_uniform_noise_is_uniform_and_open_interval() -> None:
    u = ref.uniform_noise(torch.tensor([1, 2], dtype=torch.int64), torch.tensor([0, 0], dtype=torch.int64), 50_000)
    assert u.shape == (2, 50_000) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    counts = torch.histc(u, bins=16, min=0.0, max=1.0)  # 6250 expected per bin
    chi2 = ((counts - 6250) ** 2 / 6250).sum().item()
    assert chi2 < 37.70  # 15 degrees of freedom, p = 0.001


def filtered_probs(probs: list[float], top_k: int, top_p: float, min_p: float) -> list[float]:
    """The contract, written out for a distribution without ties: top-k, renormalise, top-p, min-p, renormalise."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if 0 < top_k < len(probs) else order
    if top_p < 1.0:
        total = sum(probs[i] for i in kept)
        prefix, mass = [], 0.0
        for i in kept:
            prefix.append(i)
            mass += probs[i] / total
            if mass >= top_p:
                break
        kept = prefix
    kept = [i for i in kept if probs[i] >= min_p * probs[order[0]]]
    total = sum(probs[i] for i in kept)
    return [probs[i] / total if i in kept else 0.0 for i in range(len(probs))]


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, 0, 1.0, 0.0),
        (0.7, 0, 1.0, 0.0),
        (1.0, 5, 1.0, 0.0),
        (1.3, 0, 0.8, 0.0),
        (1.0, 0, 1.0, 0.35),
        (1.0, 6, 0.9, 0.05),
    ],
)
def test_frequencies_match_filtered_distribution(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    num_draws = 4000
    base = torch.tensor([2.0, 0.3, 1.1, -0.4, 0.8, 1.7, -1.2, 0.0])  # V = 8, no ties
    probs = torch.softmax(base.double() / temperature, dim=0).tolist()
    expected = torch.tensor(filtered_probs(probs, top_k, top_p, min_p), dtype=torch.float64)
    tokens = ref.sample(
        base.expand(num_draws, 8).contiguous(),
        **rows(num_draws, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
    )
    counts = torch.bincount(tokens, minlength=8).double()
    assert (counts[expected == 0] == 0).all(), "a filtered token was sampled"
    kept = expected > 0
    chi2 = ((counts[kept] - num_draws * expected[kept]) ** 2 / (num_draws * expected[kept])).sum().item()
    assert chi2 < CHI2_CRITICAL_P001[int(kept.sum()) - 1], (chi2, counts.tolist(), expected.tolist())


def test_top_p_and_min_p_never_sample_filtered_tokens() -> None:
    num_draws, vocab = 3000, 64
    logits = random_logits(1, vocab, seed=4, scale=2.0).expand(num_draws, vocab).contiguous()
    probs = torch.softmax(logits[0], dim=0)
    order = probs.argsort(descending=True)
    for params, allowed in [
        (rows(num_draws, top_p=0.5), order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1]),
        (rows(num_draws, min_p=0.2), (probs >= 0.2 * probs.max()).nonzero().flatten()),
    ]:
        tokens = ref.sample(logits, **params)
        assert set(tokens.unique().tolist()) == set(allowed.tolist())


def test_ties_at_the_top_k_boundary_are_all_kept() -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]]).expand(400, 5).contiguous()
    tokens = ref.sample(logits, **rows(400, top_k=2))
    assert set(tokens.unique().tolist()) == {0, 2, 3}


def test_sample_rejects_bad_shapes() -> None:
    params = rows(3)
    params["top_p"] = torch.ones(2)
    with pytest.raises(ValueError, match="top_p"):
        ref.sample(random_logits(3, 10), **params)


def test_logprobs() -> None:
    logits = random_logits(5, 40, seed=5)
    token_ids = torch.tensor([0, 39, 7, 7, 12])
    expected = torch.log_softmax(logits.double(), dim=-1)
    logprobs = ref.compute_logprobs(logits, token_ids)
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs.double(), expected[torch.arange(5), token_ids], rtol=1e-6, atol=1e-6)
    values, ids = ref.top_logprobs(logits, 3)
    assert torch.equal(ids, logits.argsort(dim=-1, descending=True)[:, :3])
    torch.testing.assert_close(values.double(), expected.gather(1, ids), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="k must be"):
        ref.top_logprobs(logits, 41)


# --- the Triton variant against the reference (the interpreter on the CPU: tiny grids) ---

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def kernels(poisoned_empty):
    """The Triton module, with every new floating-point tensor NaN-filled while a test runs."""
    if DEVICE == "cpu" and not envs.triton_interpret():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from jetserve.ops.sampling import kernels as module

    return module


def mixed_rows(n: int, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Every filter combination across n rows, some greedy, seeds over the whole int64 range."""
    gen = torch.Generator().manual_seed(seed)
    params = rows(n, temperature=0.9)
    params["temperature"] = torch.rand(n, generator=gen) * 1.5 + 0.2
    params["temperature"][torch.rand(n, generator=gen) < 0.15] = 0.0
    params["top_k"] = torch.where(
        torch.rand(n, generator=gen) < 0.5, torch.randint(1, vocab + 2, (n,), generator=gen), 0
    ).int()
    params["top_p"] = torch.where(torch.rand(n, generator=gen) < 0.5, torch.rand(n, generator=gen), 1.0)
    params["min_p"] = torch.where(torch.rand(n, generator=gen) < 0.3, torch.rand(n, generator=gen) * 0.3, 0.0)
    params["seeds"] = torch.randint(-(1 << 62), 1 << 62, (n,), generator=gen)
    params["counters"] = torch.randint(0, 1 << 40, (n,), generator=gen)
    return params


@pytest.mark.parametrize("num_rows, vocab", [(1, 8), (40, 8), (3, 1000), (2, 3000), (5, 1025)])
def test_triton_sample_matches_reference(kernels, num_rows: int, vocab: int) -> None:
    logits = random_logits(num_rows, vocab, seed=vocab, scale=2.0).to(DEVICE)
    params = {name: p.to(DEVICE) for name, p in mixed_rows(num_rows, vocab, seed=num_rows).items()}
    tokens = kernels.sample(logits, **params)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens, ref.sample(logits, **params))


def test_triton_sample_reads_row_parameters_through_their_stride(kernels) -> None:
    """Per-row parameters handed as strided views (columns of a matrix) draw what their values say."""
    logits = random_logits(12, 300, seed=5, scale=2.0).to(DEVICE)
    params = {name: p.to(DEVICE) for name, p in mixed_rows(12, 300, seed=6).items()}
    strided = {name: torch.stack([p, p.flip(0)], dim=1)[:, 0] for name, p in params.items()}
    assert not any(p.is_contiguous() for p in strided.values())
    assert torch.equal(kernels.sample(logits, **strided), ref.sample(logits, **params))


@pytest.mark.parametrize("num_rows, vocab", [(24, 8), (6, 300), (3, 2100)])
def test_triton_exact_threshold_fallback_matches_reference(
    kernels, monkeypatch: pytest.MonkeyPatch, num_rows: int, vocab: int
) -> None:
    """With 4 candidates almost no row is settled by the top-C fast path: the bisection kernel must give the same
    thresholds and tokens, ties included (rows of equal logits, some with top-k inside their tie group)."""
    monkeypatch.setattr(kernels, "NUM_CANDIDATES", 4)
    logits = random_logits(num_rows, vocab, seed=vocab + 1, scale=2.0)
    logits[1] = 0.5  # one tie group of the whole vocabulary
    logits[2, : vocab // 2] = 1.0  # a tie group straddling the candidates
    logits = logits.to(DEVICE)
    params = {name: p.to(DEVICE) for name, p in mixed_rows(num_rows, vocab, seed=vocab).items()}
    params["temperature"][:3] = 1.0
    params["top_k"][1:3] = 2
    params["top_p"][1] = 0.5
    probs, _ = ref.tempered_probs(logits, params["temperature"])
    threshold = kernels.keep_threshold(probs, params["top_k"], params["top_p"], params["min_p"])
    expected = ref.keep_threshold(probs, params["top_k"], params["top_p"], params["min_p"])
    assert torch.equal(probs >= threshold, probs >= expected)
    assert torch.equal(kernels.sample(logits, **params), ref.sample(logits, **params))


@pytest.mark.parametrize("num_rows, vocab", [(3, 8), (2, 3000)])
def test_triton_tempered_probs(kernels, num_rows: int, vocab: int) -> None:
    logits = random_logits(num_rows, vocab, seed=3, scale=5.0).to(DEVICE)
    temperature = torch.tensor([0.0, 0.7, 1.9][:num_rows], device=DEVICE)
    probs, row_mass = kernels.tempered_probs(logits, temperature)
    expected, _ = ref.tempered_probs(logits, temperature)
    torch.testing.assert_close(probs, expected, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(row_mass, torch.ones(num_rows, device=DEVICE), rtol=1e-5, atol=0.0)


def unfiltered_rows(n: int, vocab: int, seed: int, has_greedy: bool) -> dict[str, torch.Tensor]:
    """`mixed_rows` with every filter off (top_k 0, top_p 1, min_p 0); greedy rows only when `has_greedy`."""
    params = mixed_rows(n, vocab, seed)
    params["top_k"].zero_()
    params["top_p"].fill_(1.0)
    params["min_p"].zero_()
    if not has_greedy:
        params["temperature"].clamp_(min=0.2)
    return params


@pytest.mark.parametrize("has_greedy", [True, False], ids=["greedy_rows", "all_sampled"])
@pytest.mark.parametrize("num_rows, vocab", [(1, 8), (40, 8), (3, 1000), (2, 3000)])
def test_sampling_promises_keep_the_draws(kernels, num_rows: int, vocab: int, has_greedy: bool) -> None:
    """With no row filtering (and, when promised, no greedy row), skipping the keep threshold (and the argmax)
    draws exactly the tokens of the full path, in the reference and the Triton variant."""
    logits = random_logits(num_rows, vocab, seed=vocab + 7, scale=2.0).to(DEVICE)
    params = {name: p.to(DEVICE) for name, p in unfiltered_rows(num_rows, vocab, num_rows, has_greedy).items()}
    promises = dict(is_filtered=False, has_greedy=has_greedy)
    full = ref.sample(logits, **params)
    assert torch.equal(ref.sample(logits, **params, **promises), full)
    assert torch.equal(kernels.sample(logits, **params, **promises), full)
    assert torch.equal(kernels.sample(logits, **params), full)


def test_sampling_promises_are_what_skip_the_work(kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """The promises really skip the threshold and the argmax (a broken promise would show: a filtering row then
    draws from its whole distribution)."""
    logits = random_logits(64, 50, seed=1, scale=2.0).to(DEVICE)
    params = {name: p.to(DEVICE) for name, p in rows(64, top_k=1).items()}  # top-k 1: the draw is the argmax
    assert torch.equal(ref.sample(logits, **params), logits.argmax(dim=-1))
    for sample in (ref.sample, kernels.sample):
        broken = sample(logits, **params, is_filtered=False, has_greedy=False)
        assert not torch.equal(broken, logits.argmax(dim=-1))

    def no_threshold(*args, **kwargs):
        raise AssertionError("the keep threshold was computed")

    monkeypatch.setattr(kernels, "keep_threshold", no_threshold)
    monkeypatch.setattr(ref, "keep_threshold", no_threshold)
    params = {name: p.to(DEVICE) for name, p in unfiltered_rows(5, 50, seed=2, has_greedy=True).items()}
    assert torch.equal(
        kernels.sample(logits[:5], **params, is_filtered=False), ref.sample(logits[:5], **params, is_filtered=False)
    )


def test_triton_sample_breaks_ties_like_the_reference(kernels) -> None:
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 0.0]]).expand(30, 5).contiguous().to(DEVICE)
    params = {name: p.to(DEVICE) for name, p in rows(30, top_k=2).items()}
    tokens = kernels.sample(logits, **params)
    assert torch.equal(tokens, ref.sample(logits, **params))
    assert set(tokens.tolist()) == {0, 2, 3}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 37, 256])
def test_sample_on_gpu_matches_cpu_without_host_sync(kernels, num_rows: int) -> None:
    vocab = 151936
    logits = random_logits(num_rows, vocab, seed=12, scale=4.0)  # [N, V]
    params = rows(num_rows, temperature=0.9)
    gen = torch.Generator().manual_seed(13)
    params["temperature"][torch.rand(num_rows, generator=gen) < 0.2] = 0.0
    params["top_k"] = torch.randint(0, 100, (num_rows,), generator=gen, dtype=torch.int32)
    params["top_p"] = torch.where(torch.rand(num_rows, generator=gen) < 0.5, 0.9, 1.0)
    params["min_p"] = torch.where(torch.rand(num_rows, generator=gen) < 0.3, 0.02, 0.0)
    params["seeds"] = torch.randint(0, 1 << 62, (num_rows,), generator=gen)
    expected = ref.sample(logits, **params)
    cuda_logits = logits.cuda()
    cuda_params = {name: p.cuda() for name, p in params.items()}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host synchronisation raises
    try:
        tokens = ref.sample(cuda_logits, **cuda_params)
        tokens_triton = kernels.sample(cuda_logits, **cuda_params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(tokens_triton, tokens)
    # CPU and CUDA round the softmax, the cumulative sums and the logs differently; a differing token needs a
    # near-tie (a top-p boundary or two equal race scores), which these random logits make rare.
    assert (tokens.cpu() == expected).float().mean() >= 0.97
    # Temperature alone, with the promises the engine's Sampler makes for it: the same tokens as the full path.
    cuda_params |= dict(top_k=torch.zeros_like(cuda_params["top_k"]), top_p=torch.ones_like(cuda_params["top_p"]),
                        min_p=torch.zeros_like(cuda_params["min_p"]))  # fmt: skip
    full = kernels.sample(cuda_logits, **cuda_params)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fast = kernels.sample(cuda_logits, **cuda_params, is_filtered=False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(fast, full)


@pytest.mark.parametrize("num_rows, vocab", [(1, 1), (1, 5000), (3, 1025), (40, 8), (2, 3001)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_argmax_matches_torch(
    kernels, monkeypatch: pytest.MonkeyPatch, num_rows: int, vocab: int, dtype: torch.dtype
) -> None:
    """The split argmax against torch's: random rows, rows of ties (the first wins), a row of -inf, a maximum in the
    last token, and NaNs (the first NaN wins, as in torch), through a strided view too. Blocks of 128 logits and 2
    programs an SM: rows split in several slices of several blocks each."""
    if DEVICE == "cpu":
        monkeypatch.setattr(kernels, "ARGMAX_BLOCK_V", 128)
        monkeypatch.setattr(kernels, "ARGMAX_PROGRAMS_PER_SM", 2)
    logits = random_logits(num_rows, vocab, seed=vocab + num_rows).to(dtype)
    cases = [logits]
    if num_rows >= 3:
        ties = logits.clone()
        ties[0] = 1.0  # one tie group over the row: token 0
        ties[1, vocab // 3 :] = 50.0  # the first of a run of maxima that starts mid-row (another split)
        ties[2] = float("-inf")  # nothing above -inf: token 0
        cases.append(ties)
        nans = logits.clone()
        nans[0, vocab - 1] = float("nan")
        nans[1, vocab // 2] = float("inf")
        nans[1, vocab - 2 :] = float("nan")
        nans[2, -1] = 100.0
        cases.append(nans)
    for case in cases:
        case = case.to(DEVICE)
        assert torch.equal(kernels.argmax(case), case.argmax(dim=-1))
    wide = torch.stack([logits, -logits], dim=1).to(DEVICE)  # [N, 2, V]: rows of [N, V] views strided by 2V
    assert torch.equal(kernels.argmax(wide[:, 1]), (-logits).to(DEVICE).argmax(dim=-1))
    assert torch.equal(kernels.argmax(wide), wide.argmax(dim=-1))  # leading dims kept


@pytest.mark.parametrize("num_rows, vocab", [(1, 1), (1, 5000), (4, 1025), (40, 8), (5, 3001)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_top_logprob_matches_torch(
    kernels, monkeypatch: pytest.MonkeyPatch, num_rows: int, vocab: int, dtype: torch.dtype
) -> None:
    """The split top-1 log-prob against `log_softmax(...).max(...)`: random rows, ties (the first wins), -inf
    entries, a row of -inf, NaN and +inf rows ((NaN, 0) as torch gives), with the draft's `d2t` offsets, through a
    strided view. Blocks of 128 logits and 2 programs an SM: rows split in several slices of several blocks each."""
    if DEVICE == "cpu":
        monkeypatch.setattr(kernels, "ARGMAX_BLOCK_V", 128)
        monkeypatch.setattr(kernels, "ARGMAX_PROGRAMS_PER_SM", 2)
    logits = random_logits(num_rows, vocab, seed=vocab + 3 * num_rows).to(dtype)
    cases = [logits]
    if num_rows >= 4:
        odd = logits.clone()
        odd[0] = 1.0  # one tie group over the row: token 0, log-prob -log(V)
        odd[1, vocab // 3 :] = 50.0  # the first of a run of maxima that starts mid-row (another split)
        odd[1, : vocab // 5] = float("-inf")
        odd[2] = float("-inf")  # no finite value: (NaN, 0)
        odd[3, vocab - 1] = float("nan")
        cases.append(odd)
        infs = logits.clone()
        infs[0, vocab // 2] = float("inf")
        infs[1, -1] = 100.0
        infs[2, 0] = float("-inf")
        cases.append(infs)
    offsets = torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(vocab))
    for case in cases:
        case = case.to(DEVICE)
        for off in (None, offsets.to(DEVICE)):
            logprob, index = kernels.top_logprob(case, off)
            expected_logprob, expected_index = ref.top_logprob(case, off)
            assert torch.equal(index, expected_index)
            torch.testing.assert_close(logprob, expected_logprob, rtol=1e-5, atol=1e-5, equal_nan=True)
    wide = torch.stack([logits, -logits], dim=1).to(DEVICE)  # [N, 2, V]: rows of [N, V] views strided by 2V
    logprob, index = kernels.top_logprob(wide[:, 1])
    expected_logprob, expected_index = ref.top_logprob((-logits).to(DEVICE))
    assert torch.equal(index, expected_index)
    torch.testing.assert_close(logprob, expected_logprob, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_rows, vocab", [(1, 300), (5, 1025)])
def test_top_logprob_into_strided_out(kernels, monkeypatch: pytest.MonkeyPatch, num_rows: int, vocab: int) -> None:
    """`out=`: both variants write each row's log-prob and index into columns of larger buffers (a chain's level
    column of its [N, T] scores and tokens, poisoned: NaN and -1) and return them; every other column stays
    untouched; the offsets may be a strided view. An out of the wrong shape, dtype or device is refused."""
    if DEVICE == "cpu":
        monkeypatch.setattr(kernels, "ARGMAX_BLOCK_V", 128)
        monkeypatch.setattr(kernels, "ARGMAX_PROGRAMS_PER_SM", 2)
    logits = random_logits(num_rows, vocab, seed=7 * vocab + num_rows).to(DEVICE)
    offsets = torch.randint(0, 1000, (vocab,), generator=torch.Generator().manual_seed(vocab)).to(DEVICE)
    expected_logprob, expected_index = ref.top_logprob(logits, offsets)
    offsets = torch.stack([offsets, -offsets], dim=1)[:, 0]  # the same d2t as a strided view: read as a vector
    for module in (kernels, ref):
        scores = torch.full((num_rows, 4), float("nan"), device=DEVICE)  # [N, T]
        tokens = torch.full((num_rows, 4), -1, dtype=torch.int64, device=DEVICE)  # [N, T]
        logprob, index = module.top_logprob(logits, offsets, out=(scores[:, 2], tokens[:, 2]))
        assert logprob.data_ptr() == scores[:, 2].data_ptr() and index.data_ptr() == tokens[:, 2].data_ptr()
        assert torch.equal(tokens[:, 2], expected_index)
        torch.testing.assert_close(scores[:, 2], expected_logprob, rtol=1e-5, atol=1e-5)
        others = [0, 1, 3]
        assert scores[:, others].isnan().all() and (tokens[:, others] == -1).all()
        bad = [
            (torch.zeros(num_rows + 1, device=DEVICE), tokens[:, 0]),
            (scores[:, 0], torch.zeros(num_rows, dtype=torch.int32, device=DEVICE)),
            (scores[:, 0].double(), tokens[:, 0]),
        ]
        for out in bad:
            with pytest.raises(ValueError, match="top_logprob: out's"):
                module.top_logprob(logits, offsets, out=out)


def test_top_logprob_rejects_bad_shapes(kernels) -> None:
    for module in (kernels, ref):
        with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
            module.top_logprob(torch.zeros(2, 3, 4, device=DEVICE))
        with pytest.raises(ValueError, match="offsets must be"):
            module.top_logprob(torch.zeros(2, 3, device=DEVICE), torch.zeros(4, dtype=torch.int64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 7, 64])
def test_top_logprob_on_gpu_at_the_draft_vocabulary(kernels, num_rows: int) -> None:
    """A 32,000-token draft vocabulary in bf16 (the draft lm_head's output) and fp32, with d2t offsets, no host
    synchronisation."""
    logits = random_logits(num_rows, 32000, seed=num_rows, scale=4.0).cuda()
    logits[0, 31999] = 1e4  # the maximum in the last token (the last split's last block)
    offsets = torch.randint(0, 100000, (32000,), device="cuda")
    for case in (logits, logits.bfloat16()):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            logprob, index = kernels.top_logprob(case, offsets)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        expected_logprob, expected_index = ref.top_logprob(case, offsets)
        assert torch.equal(index, expected_index)
        torch.testing.assert_close(logprob, expected_logprob, rtol=1e-5, atol=1e-5)


def test_argmax_rejects_an_empty_vocabulary(kernels) -> None:
    for module in (kernels, ref):
        with pytest.raises(ValueError, match="non-empty vocabulary"):
            module.argmax(torch.zeros(2, 0, device=DEVICE))


@pytest.mark.parametrize("num_rows, vocab", [(1, 1), (3, 1025), (5, 3001)])
def test_argmax_into_out(kernels, monkeypatch: pytest.MonkeyPatch, num_rows: int, vocab: int) -> None:
    """`out=`: both variants write the tokens into a given int64 buffer (poisoned with -1 first) and return it, for
    a prefix view of a larger buffer (the decode graph's `greedy[:B]`) whose rows past it stay untouched; leading
    dims kept. A wrong shape, dtype or a non-contiguous out is refused."""
    if DEVICE == "cpu":
        monkeypatch.setattr(kernels, "ARGMAX_BLOCK_V", 128)
        monkeypatch.setattr(kernels, "ARGMAX_PROGRAMS_PER_SM", 2)
    logits = random_logits(num_rows, vocab, seed=5 * vocab + num_rows).to(DEVICE)
    expected = logits.argmax(dim=-1)
    for module in (kernels, ref):
        buffer = torch.full((num_rows + 2,), -1, dtype=torch.int64, device=DEVICE)
        tokens = module.argmax(logits, out=buffer[:num_rows])
        assert torch.equal(tokens, expected) and tokens.data_ptr() == buffer.data_ptr()
        assert torch.equal(buffer[:num_rows], expected) and (buffer[num_rows:] == -1).all()
        lead = torch.full((1, num_rows), -1, dtype=torch.int64, device=DEVICE)
        assert torch.equal(module.argmax(logits[None], out=lead), expected[None]) and torch.equal(lead[0], expected)
        bad = [torch.zeros(num_rows + 1, dtype=torch.int64), torch.zeros(num_rows, dtype=torch.int32)]
        if num_rows > 1:  # one element is contiguous at any stride
            bad.append(torch.zeros(num_rows, 2, dtype=torch.int64)[:, 0])
        for out in bad:
            with pytest.raises(ValueError, match="out must be a contiguous int64"):
                module.argmax(logits, out=out.to(DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 7, 64, 256])
def test_argmax_on_gpu_at_the_2b_vocabulary(kernels, num_rows: int) -> None:
    """The 2B vocabulary in fp32 (the logits the sampler takes), no host synchronisation."""
    logits = random_logits(num_rows, 151936, seed=num_rows, scale=4.0).cuda()
    logits[0, 151935] = 1e9  # the maximum in the last token (the last split's last block)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = kernels.argmax(logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(tokens, logits.argmax(dim=-1))
