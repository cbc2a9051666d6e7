"""Paged GQA attention and RoPE in pure PyTorch (fp32 math, any device): prefill, decode, tree verify, KV commit.

Vectorised over sequences with static shapes (no host synchronisation), so it also serves CPU inference.
"""

from __future__ import annotations

import torch


def rope_cos_sin(max_pos: int, head_dim: int, theta: float) -> torch.Tensor:
    """The RoPE table [max_pos, Dh] fp32: `[cos(f), sin(f)]` for the Dh/2 frequencies f = pos * theta^(-2i/Dh)."""
    if head_dim % 2:
        raise ValueError(f"rope_cos_sin: head_dim must be even, got {head_dim}")
    # Same fp32 arithmetic as the Qwen2 rotary embedding, so the table matches it bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # [Dh/2]
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.int64).float(), inv_freq)  # [max_pos, Dh/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh] rotated by cos/sin [T, 1, Dh/2] in fp32: x*cos + rotate_half(x)*sin."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def check_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"apply_rope: q must be [T, H, Dh] and k [T, HK, Dh], got {tuple(q.shape)}, {tuple(k.shape)}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != q.shape[2] or positions.shape != (q.shape[0],):
        raise ValueError(
            f"apply_rope: cos_sin must be [max_pos, {q.shape[2]}] and positions [{q.shape[0]}], "
            f"got {tuple(cos_sin.shape)}, {tuple(positions.shape)}"
        )


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE over all head dims, in fp32, returning new tensors in the input dtypes.

    q [T, H, Dh], k [T, HK, Dh], positions [T] int, cos_sin [max_pos, Dh] fp32 (from `rope_cos_sin`).
    """
    check_rope(q, k, positions, cos_sin)
    half = q.shape[2] // 2
    table = cos_sin[positions.to(cos_sin.device, torch.long)]  # [T, Dh]
    cos, sin = table[:, None, :half], table[:, None, half:]  # [T, 1, Dh/2]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(
            f"attention: q must be [T, H, Dh], k and v [T, HK, Dh]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: query heads H={q.shape[1]} must be a multiple of KV heads HK={k.shape[1]}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"attention: k_cache and v_cache must be [num_pages, page_size, {k.shape[1]}, {k.shape[2]}], got "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )


def check_window(window_tokens: int, ring_tokens: int) -> None:
    if window_tokens < 0 or ring_tokens < 0:
        raise ValueError(f"attention: window_tokens={window_tokens} and ring_tokens={ring_tokens} must be >= 0")
    if ring_tokens and not (window_tokens and ring_tokens >= window_tokens):
        raise ValueError(
            f"attention: a ring cache (ring_tokens={ring_tokens}) needs a window no longer than it, "
            f"got window_tokens={window_tokens}"
        )


def check_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_attention_inputs(q, k, v, k_cache, v_cache)
    _check_batch(q, cu_seqlens.shape[0] - 1, context_lens, block_tables, slot_mapping)


def check_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_attention_inputs(q, k, v, k_cache, v_cache)
    _check_batch(q, q.shape[0], context_lens, block_tables, slot_mapping)


def _check_batch(
    q: torch.Tensor, num_seqs: int, context_lens: torch.Tensor, block_tables: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if context_lens.shape != (num_seqs,) or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"attention: context_lens must be [N] and block_tables [N, P] for N={num_seqs}, got "
            f"{tuple(context_lens.shape)}, {tuple(block_tables.shape)}"
        )
    if slot_mapping.shape != (q.shape[0],):
        raise ValueError(f"attention: slot_mapping must be [T]={q.shape[0]}, got {tuple(slot_mapping.shape)}")


def check_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree_mask: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_attention_inputs(q, k, v, k_cache, v_cache)
    if tree_mask.dim() != 3 or tree_mask.shape[1] != tree_mask.shape[2] or tree_mask.dtype != torch.bool:
        raise ValueError(f"attention_verify: tree_mask must be [N, T_d, T_d] bool, got {tuple(tree_mask.shape)}")
    num_seqs, num_nodes = tree_mask.shape[:2]
    if q.shape[0] != num_seqs * num_nodes:
        raise ValueError(f"attention_verify: q must hold N*T_d = {num_seqs * num_nodes} tokens, got {q.shape[0]}")
    _check_batch(q, num_seqs, context_lens, block_tables, slot_mapping)


def check_commit(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    ring_tokens: int,
) -> None:
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"kv_cache_commit: caches must be [num_pages, page_size, HK, Dh], got {tuple(k_cache.shape)}")
    if accepted_nodes.dim() != 2 or prefix_lens.shape != (accepted_nodes.shape[0],):
        raise ValueError(
            f"kv_cache_commit: accepted_nodes must be [N, T_d] and prefix_lens [N], got "
            f"{tuple(accepted_nodes.shape)}, {tuple(prefix_lens.shape)}"
        )
    if (
        num_accepted.shape != prefix_lens.shape
        or block_tables.dim() != 2
        or block_tables.shape[0] != prefix_lens.shape[0]
    ):
        raise ValueError("kv_cache_commit: num_accepted and block_tables [N, P] must have one row per sequence")
    if ring_tokens < 0:
        raise ValueError(f"kv_cache_commit: ring_tokens must be >= 0, got {ring_tokens}")


def cache_slots(block_tables: torch.Tensor, positions: torch.Tensor, page_size: int, ring_tokens: int) -> torch.Tensor:
    """Physical slots of logical `positions` [N, L] (row i in sequence i's pages); any position maps somewhere valid,
    so callers mask out-of-range ones themselves."""
    num_pages = block_tables.shape[1]
    logical = positions % ring_tokens if ring_tokens else positions
    logical = logical.clamp(0, num_pages * page_size - 1)  # [N, L]
    pages = torch.gather(block_tables.to(torch.long), 1, logical // page_size)  # [N, L]
    return pages * page_size + logical % page_size


def _paged_attention(
    q_pad: torch.Tensor,
    k_pad: torch.Tensor,
    v_pad: torch.Tensor,
    new_visible: torch.Tensor,
    starts: torch.Tensor,
    attn_pos: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    window_tokens: int,
    ring_tokens: int,
) -> torch.Tensor:
    """Attention of padded queries over cached prefix keys plus the new keys; returns [N, M, H, Dh] fp32.

    q_pad [N, M, H, Dh], k_pad/v_pad [N, M, HK, Dh] (new token j of sequence i at [i, j]), new_visible [N, M, M] bool
    (query j may see new key j': causal or tree, padding excluded), starts [N] (positions before `starts[i]` are in the
    cache), attn_pos [N, M] (the positions the window is measured in).
    """
    num_seqs, max_new, num_heads, head_dim = q_pad.shape
    num_kv_heads = k_pad.shape[2]
    group = num_heads // num_kv_heads
    page_size = k_cache.shape[1]
    device = q_pad.device

    # Candidate prefix keys: a ring holds at most the ring_tokens positions before `starts`; a plain cache, every
    # position its block table can address.
    num_prefix = ring_tokens if ring_tokens else block_tables.shape[1] * page_size
    base = starts - ring_tokens if ring_tokens else torch.zeros_like(starts)  # [N]
    prefix_pos = base[:, None] + torch.arange(num_prefix, device=device)  # [N, Lp]
    prefix_ok = (prefix_pos >= 0) & (prefix_pos < starts[:, None])  # [N, Lp]
    slots = cache_slots(block_tables, prefix_pos, page_size, ring_tokens)  # [N, Lp]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    # Unused cache rows may hold anything (NaN included): zero them so masked keys contribute exactly nothing.
    keep = prefix_ok[..., None, None]
    k_pre = torch.where(keep, k_flat[slots].float(), 0.0)  # [N, Lp, HK, Dh]
    v_pre = torch.where(keep, v_flat[slots].float(), 0.0)
    keys = torch.cat([k_pre, k_pad.float()], dim=1)  # [N, L, HK, Dh], L = Lp + M
    values = torch.cat([v_pre, v_pad.float()], dim=1)

    # Query chunks keep the score tensor near 2^26 elements.
    num_keys = keys.shape[1]
    chunk = max(1, (1 << 26) // max(1, num_seqs * num_heads * num_keys))
    out = q_pad.new_empty(num_seqs, max_new, num_heads, head_dim, dtype=torch.float32)
    for lo in range(0, max_new, chunk):
        hi = min(max_new, lo + chunk)
        qf = q_pad[:, lo:hi].float().view(num_seqs, hi - lo, num_kv_heads, group, head_dim)
        scores = torch.einsum("nqkgd,nlkd->nkgql", qf, keys) * scale  # [N, HK, G, Mc, L]
        q_pos = attn_pos[:, lo:hi, None]  # [N, Mc, 1]
        see_prefix = prefix_ok[:, None, :].expand(-1, hi - lo, -1)  # [N, Mc, Lp]
        see_new = new_visible[:, lo:hi]  # [N, Mc, M]
        if window_tokens:
            see_prefix = see_prefix & (prefix_pos[:, None, :] > q_pos - window_tokens)
            see_new = see_new & (attn_pos[:, None, :] > q_pos - window_tokens)
        visible = torch.cat([see_prefix, see_new], dim=2)  # [N, Mc, L]
        scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o = torch.einsum("nkgql,nlkd->nqkgd", probs, values)  # [N, Mc, HK, G, Dh]
        out[:, lo:hi] = o.reshape(num_seqs, hi - lo, num_heads, head_dim)
    return out


def _write_rows(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """flat[slots[t]] = rows[t] for slots >= 0, without a host sync: skipped rows rewrite slot 0 with its own old
    value (slot 0 is reserved for padded rows, so no live row targets it)."""
    skip = slots < 0  # [T]
    source = torch.where(skip.view(-1, *([1] * (rows.dim() - 1))), flat[0], rows.to(flat.dtype))
    flat.index_copy_(0, torch.where(skip, 0, slots), source)


def _store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write k/v [T, HK, Dh] to `slots` [T] of the caches (-1 skips)."""
    _write_rows(k_cache.view(-1, *k_cache.shape[2:]), slots, k)
    _write_rows(v_cache.view(-1, *v_cache.shape[2:]), slots, v)


def _varlen_layout(cu_seqlens: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence [T], index within its sequence [T], new-token count [N]) of packed tokens."""
    device = cu_seqlens.device
    cu = cu_seqlens.to(torch.long)
    seq = torch.searchsorted(cu[1:], torch.arange(num_tokens, device=device), right=True)  # [T]
    offset = torch.arange(num_tokens, device=device) - cu[seq]  # [T]
    return seq, offset, cu[1:] - cu[:-1]


def _pad(x: torch.Tensor, seq: torch.Tensor, offset: torch.Tensor, num_seqs: int, max_new: int) -> torch.Tensor:
    out = x.new_zeros(num_seqs, max_new, *x.shape[1:])
    out[seq, offset] = x
    return out


def attention_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: float,
    window_tokens: int = 0,
    ring_tokens: int = 0,
    max_seqlen_q: int,
) -> torch.Tensor:
    """Causal varlen attention of new tokens over their cached prefix and themselves; stores the new K/V.

    q [T, H, Dh], k/v [T, HK, Dh], k_cache/v_cache [num_pages, page_size, HK, Dh] (updated in place),
    cu_seqlens [N+1] int32, context_lens [N] int32 (prefix + new), block_tables [N, P] int32, slot_mapping [T]
    (-1 skips). Sequence i's new tokens sit at positions [context_lens[i] - q_len_i, context_lens[i]); a query at p
    sees keys [p - window_tokens + 1, p] (all of [0, p] when 0). With a ring (`ring_tokens > 0`) only the last
    ring_tokens tokens of each sequence are stored (older ones would be overwritten in the same call); the ring must
    hold the window (ring_tokens >= window_tokens).
    Returns [T, H, Dh] in q.dtype.
    """
    check_prefill(q, k, v, k_cache, v_cache, cu_seqlens, context_lens, block_tables, slot_mapping)
    check_window(window_tokens, ring_tokens)
    num_seqs = cu_seqlens.shape[0] - 1
    num_tokens = q.shape[0]
    device = q.device
    max_new = max(1, max_seqlen_q)
    seq, offset, q_lens = _varlen_layout(cu_seqlens.to(device), num_tokens)
    ctx = context_lens.to(device, torch.long)  # [N]
    starts = ctx - q_lens  # [N]
    cols = torch.arange(max_new, device=device)
    attn_pos = starts[:, None] + cols  # [N, M]
    is_new = cols[None, :] < q_lens[:, None]  # [N, M]
    causal = cols[None, :, None] >= cols[None, None, :]  # [1, M, M]
    new_visible = causal & is_new[:, None, :]  # [N, M, M]
    out = _paged_attention(
        _pad(q, seq, offset, num_seqs, max_new),
        _pad(k, seq, offset, num_seqs, max_new),
        _pad(v, seq, offset, num_seqs, max_new),
        new_visible,
        starts,
        attn_pos,
        k_cache,
        v_cache,
        block_tables.to(device),
        scale,
        window_tokens,
        ring_tokens,
    )
    slots = slot_mapping.to(device, torch.long)
    if ring_tokens:
        token_pos = starts[seq] + offset  # [T]
        slots = torch.where(token_pos < ctx[seq] - ring_tokens, -1, slots)
    _store(k, v, k_cache, v_cache, slots)
    return out[seq, offset].to(q.dtype)


def attention_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: float,
    window_tokens: int = 0,
    ring_tokens: int = 0,
) -> torch.Tensor:
    """One new token per sequence (at position context_lens[i] - 1) over its cached prefix; stores its K/V.

    q [N, H, Dh], k/v [N, HK, Dh], k_cache/v_cache [num_pages, page_size, HK, Dh] (updated in place),
    context_lens [N] int32, block_tables [N, P] int32, slot_mapping [N] (-1 skips). Returns [N, H, Dh] in q.dtype.
    """
    num_seqs = q.shape[0]
    cu_seqlens = torch.arange(num_seqs + 1, device=q.device, dtype=torch.int32)
    return attention_prefill(
        q,
        k,
        v,
        k_cache,
        v_cache,
        cu_seqlens,
        context_lens,
        block_tables,
        slot_mapping,
        scale=scale,
        window_tokens=window_tokens,
        ring_tokens=ring_tokens,
        max_seqlen_q=1,
    )


def attention_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tree_mask: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    scale: float,
    window_tokens: int = 0,
    ring_tokens: int = 0,
) -> torch.Tensor:
    """Tree-masked attention of T_d draft nodes per sequence over the prefix and their ancestors; stores node K/V.

    q [T, H, Dh], k/v [T, HK, Dh] with T = N*T_d (token i*T_d + j is node j of sequence i), k_cache/v_cache
    [num_pages, page_size, HK, Dh] (updated in place), tree_mask [N, T_d, T_d] bool (mask[i, j, a]: a is j or an
    ancestor of j), context_lens [N] int32 (prefix + T_d), block_tables [N, P] int32, slot_mapping [T] (-1 skips).
    Node j is stored at position prefix + j and attends at position prefix + depth_j. Returns [T, H, Dh] in q.dtype.
    """
    check_verify(q, k, v, k_cache, v_cache, tree_mask, context_lens, block_tables, slot_mapping)
    check_window(window_tokens, ring_tokens)
    num_seqs, num_nodes = tree_mask.shape[:2]
    device = q.device
    mask = tree_mask.to(device, torch.bool)  # [N, T_d, T_d]
    starts = context_lens.to(device, torch.long) - num_nodes  # [N]
    depth = mask.sum(dim=-1) - 1  # [N, T_d]
    attn_pos = starts[:, None] + depth  # [N, T_d]

    def padded(x: torch.Tensor) -> torch.Tensor:
        return x.view(num_seqs, num_nodes, *x.shape[1:])

    out = _paged_attention(
        padded(q),
        padded(k),
        padded(v),
        mask,
        starts,
        attn_pos,
        k_cache,
        v_cache,
        block_tables.to(device),
        scale,
        window_tokens,
        ring_tokens,
    )
    _store(k, v, k_cache, v_cache, slot_mapping.to(device, torch.long))
    return out.view(q.shape[0], *q.shape[1:]).to(q.dtype)


def kv_cache_commit(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    ring_tokens: int = 0,
) -> None:
    """Move accepted draft nodes' K/V to their final positions, in place and with no host sync.

    k_cache/v_cache [num_pages, page_size, HK, Dh], block_tables [N, P] int32, prefix_lens [N] int32 (context before
    the verified tree), accepted_nodes [N, T_d] int32 (root first, entries past num_accepted ignored), num_accepted [N]
    int32. Node `accepted_nodes[i, d]` moves from position prefix_i + node to prefix_i + d; every source is read
    before any write, so a move never reads another move's destination.
    """
    check_commit(k_cache, v_cache, block_tables, prefix_lens, accepted_nodes, num_accepted, ring_tokens)
    device = k_cache.device
    page_size = k_cache.shape[1]
    num_nodes = accepted_nodes.shape[1]
    prefix = prefix_lens.to(device, torch.long)[:, None]  # [N, 1]
    depth = torch.arange(num_nodes, device=device)  # [T_d]
    moves = depth[None, :] < num_accepted.to(device, torch.long)[:, None]  # [N, T_d]
    nodes = accepted_nodes.to(device, torch.long).clamp(0, num_nodes - 1)  # [N, T_d]
    tables = block_tables.to(device)
    src = cache_slots(tables, prefix + nodes, page_size, ring_tokens).view(-1)  # [N*T_d]
    dst = cache_slots(tables, prefix + depth[None, :], page_size, ring_tokens).view(-1)
    dst = torch.where(moves.view(-1), dst, -1)
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, *cache.shape[2:])
        rows = flat[src]  # gathered before any write
        _write_rows(flat, dst, rows)
