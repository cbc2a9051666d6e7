"""Token sampling in pure PyTorch on the logits' device: greedy, temperature, top-k/top-p/min-p, and log-probs.

The random draw is a Gumbel-max whose noise is a counter-based integer hash of (seed, counter, vocab index): no
torch.Generator, no host synchronisation, and a request's token depends only on its own row, never on the batch.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for x in [0, 2^32) held in int64, split in 16-bit halves of c so no product overflows."""
    lo = x * (c & 0xFFFF)  # < 2^48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # only the low 16 bits of x * c_hi survive the shift mod 2^32
    return (lo + hi) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash (xorshift-multiply, 2 rounds) on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row [N] int64 from the full 64 bits of (seed, counter)."""
    key = _mix32((seeds & _MASK32) ^ 0x5851F42D)  # [N]
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (counters & _MASK32))
    key = _mix32(key ^ ((counters >> 32) & _MASK32))
    return key, _mix32(key ^ 0x2545F491)


def noise_bits(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, V] int64 in [0, 2^32): a hash of (seeds[i], counters[i], v) only."""
    key_a, key_b = row_keys(seeds, counters)  # [N] each
    index = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)  # [V]
    return _mix32(_mix32(key_a[:, None] ^ index[None, :]) ^ key_b[:, None])  # [N, V]


def uniform_noise(seeds: torch.Tensor, counters: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u [N, V] fp32 in (0, 1) on 2^23 levels `(k + 0.5) / 2^23`: every level is exact in fp32, so u is never 1."""
    return ((noise_bits(seeds, counters, vocab_size) >> 9).float() + 0.5) * 2.0**-23


def check_sample_inputs(logits: torch.Tensor, *rows: torch.Tensor) -> None:
    """ValueError unless logits is [N, V] and every per-row parameter is [N]."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    for name, row in zip(("temperature", "top_k", "top_p", "min_p", "seeds", "counters"), rows, strict=True):
        if row.shape != (logits.shape[0],):
            raise ValueError(f"{name} must be [N] = [{logits.shape[0]}], got shape {tuple(row.shape)}")


def keep_threshold(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """The probability a token needs to survive top-k, then top-p, then min-p: probs [N, V] → [N, 1].

    Each filter is a threshold, so ties at a boundary are all kept (the result does not depend on how a sort orders
    equal values): top-k keeps p ≥ the k-th largest p (k ≤ 0 or k ≥ V: off); top-p, on the top-k survivors
    renormalised, keeps p ≥ the smallest p of the shortest most-likely-first prefix whose mass reaches top_p
    (top_p ≥ 1: off); min-p keeps p ≥ min_p · max p (min_p ≤ 0: off). Never above max p: the top token survives.
    """
    vocab_size = probs.shape[1]
    sorted_probs = probs.sort(dim=-1, descending=True).values  # [N, V]
    is_k_on = (top_k > 0) & (top_k < vocab_size)  # [N]
    k_index = torch.where(is_k_on, top_k.long() - 1, vocab_size - 1)[:, None]  # [N, 1]
    threshold = sorted_probs.gather(1, k_index)  # [N, 1]: 0 stays a valid "off" since probs ≥ 0

    after_k = torch.where(sorted_probs >= threshold, sorted_probs, 0.0)  # [N, V], a prefix in sorted order
    mass = after_k.cumsum(dim=-1)  # [N, V]
    target = top_p.float()[:, None] * mass[:, -1:]  # [N, 1]
    cut_index = (mass < target).sum(dim=-1, keepdim=True).clamp(max=vocab_size - 1)  # [N, 1]: first prefix reaching it
    threshold_p = torch.where(top_p[:, None] < 1.0, sorted_probs.gather(1, cut_index), 0.0)  # [N, 1]
    threshold_m = min_p.float()[:, None] * sorted_probs[:, :1]  # [N, 1]
    threshold = torch.maximum(torch.maximum(threshold, threshold_p), threshold_m)
    # min_p > 1 would drop the top token too; the top token is kept regardless, as the contract says.
    return torch.minimum(threshold, sorted_probs[:, :1])


def tempered_probs(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(logits / T) [N, V] fp32, is_greedy [N] bool); greedy rows (T ≤ 0) use T = 1 to stay finite."""
    is_greedy = temperature <= 0  # [N]
    scaled = logits.float() / torch.where(is_greedy, 1.0, temperature.float())[:, None]  # [N, V]
    return torch.softmax(scaled, dim=-1), is_greedy


def filtered_distribution(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `sample` draws from: (probs [N, V] = softmax(logits / T) fp32, keep threshold [N, 1], is_greedy [N])."""
    probs, is_greedy = tempered_probs(logits, temperature)
    return probs, keep_threshold(probs, top_k, top_p, min_p), is_greedy


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    counters: torch.Tensor,
    *,
    is_filtered: bool = True,
    has_greedy: bool = True,
) -> torch.Tensor:
    """One token per row: argmax where temperature == 0, else a filtered draw from softmax(logits / temperature).

    logits [N, V] (fp32), temperature [N] (0 = greedy), top_k [N] int32 (0 = off), top_p [N] (1 = off), min_p [N]
    (0 = off), seeds [N] int64, counters [N] int64 (the request's draw index: a new counter gives a fresh draw).
    Filters as in `keep_threshold`, then the Gumbel-max draw in its exponential-race form, `argmax(p / -log(u))` over
    the survivors with u from `uniform_noise` (fp32 throughout; ties to the lowest index), which picks token i with
    probability p_i / Σ_kept p. Returns [N] int64. Parameter ranges (temperature ≥ 0, 0 < top_p ≤ 1, 0 ≤ min_p ≤ 1)
    are the caller's to check: checking here would sync the host.

    Two promises a caller that knows the parameters on the host can make, to skip work (the draws stay the same):
    `is_filtered=False` — no row with temperature > 0 filters (top_k 0, top_p 1, min_p 0), so every threshold is 0
    and is not computed; `has_greedy=False` — no row has temperature 0, so no argmax is taken.
    """
    check_sample_inputs(logits, temperature, top_k, top_p, min_p, seeds, counters)
    probs, is_greedy = tempered_probs(logits, temperature)  # [N, V], [N]
    if is_filtered:
        threshold = keep_threshold(probs, top_k, top_p, min_p)  # [N, 1]
    else:  # what keep_threshold gives a row with every filter off: every token survives
        threshold = torch.zeros(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    race = -torch.log(uniform_noise(seeds, counters, logits.shape[1]))  # [N, V] exponential, ≥ 6e-8
    scores = torch.where(probs >= threshold, probs / race, -1.0)  # [N, V]
    if not has_greedy:
        return scores.argmax(dim=-1)
    return torch.where(is_greedy, logits.argmax(dim=-1), scores.argmax(dim=-1))


def check_argmax_input(logits: torch.Tensor, out: torch.Tensor | None = None) -> None:
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"argmax: logits must end in a non-empty vocabulary dimension, got {tuple(logits.shape)}")
    if out is not None and (
        out.shape != logits.shape[:-1] or out.dtype != torch.int64 or not out.is_contiguous()
        or out.device != logits.device
    ):  # fmt: skip
        raise ValueError(
            f"argmax: out must be a contiguous int64 tensor of shape {tuple(logits.shape[:-1])} on {logits.device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )


def argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy token: logits [..., V] → [...] int64, the first maximum (a NaN counts above every number); written
    into `out` [...] int64 (contiguous) when given, which is returned."""
    check_argmax_input(logits, out)
    tokens = logits.argmax(dim=-1)
    return tokens if out is None else out.copy_(tokens)


def check_top_logprob_inputs(
    logits: torch.Tensor, offsets: torch.Tensor | None, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"top_logprob: logits must be [N, V] with V > 0, got {tuple(logits.shape)}")
    if offsets is not None and (offsets.dim() != 1 or offsets.shape[0] != logits.shape[1]):
        raise ValueError(f"top_logprob: offsets must be [V={logits.shape[1]}], got {tuple(offsets.shape)}")
    if out is not None:
        for name, tensor, dtype in zip(("log-prob", "index"), out, (torch.float32, torch.int64), strict=True):
            if tensor.shape != (logits.shape[0],) or tensor.dtype != dtype or tensor.device != logits.device:
                raise ValueError(
                    f"top_logprob: out's {name} must be [{logits.shape[0]}] {dtype} on {logits.device} (any stride), "
                    f"got {tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
                )


def top_logprob(
    logits: torch.Tensor, offsets: torch.Tensor | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely token of each row and its log-prob: logits [N, V] → (log-prob [N] fp32, index [N] int64),
    exactly `log_softmax(logits.float()).max(dim=-1)`: the first maximum, and a row holding a NaN or +inf, or no
    finite value, gives (NaN, 0) — its log-softmax is NaN throughout. With `offsets` [V] (an EAGLE-3 draft's `d2t`),
    the index returned is `index + offsets[index]`. Written into `out` = (log-prob [N] fp32, index [N] int64, any
    stride: a column of a chain's buffers) when given, which is returned."""
    check_top_logprob_inputs(logits, offsets, out)
    logprob, index = torch.log_softmax(logits.float(), dim=-1).max(dim=-1)  # [N] each
    index = index if offsets is None else index + offsets[index]
    if out is None:
        return logprob, index
    return out[0].copy_(logprob), out[1].copy_(index)


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[i, token_ids[i]]: logits [N, V], token_ids [N] → [N] fp32."""
    if logits.dim() != 2 or token_ids.shape != (logits.shape[0],):
        raise ValueError(f"need logits [N, V] and token_ids [N], got {tuple(logits.shape)}, {tuple(token_ids.shape)}")
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    return logprobs.gather(1, token_ids.long()[:, None]).squeeze(1)


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probs per row, most likely first: logits [N, V] → (values [N, k] fp32, ids [N, k] int64)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if not 0 <= k <= logits.shape[1]:
        raise ValueError(f"k must be in [0, V={logits.shape[1]}], got {k}")
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)  # [N, k] each
    return values, ids
