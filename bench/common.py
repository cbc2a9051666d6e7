"""Inputs at the real Jet-Nemotron shapes for every op, shared by bench/kernels.py and bench/memcheck_kernels.py.

Each case builder returns (call, bytes_moved, flops): `call()` runs the public op once (the Triton variant on CUDA),
`bytes_moved` counts each input the op needs read once and each output written once (the roofline's numerator);
index tensors (slots, block tables, cu_seqlens, tree parents and masks), a few bytes per sequence, are left out.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jetserve.model.fusion import OUTPUT_ROW_ALIGN  # noqa: E402
from jetserve.ops.attention import (  # noqa: E402
    apply_rope,
    attention_decode,
    attention_prefill,
    attention_verify,
    kv_cache_commit,
    rope_cos_sin,
)
from jetserve.ops.backend import use_triton  # noqa: E402
from jetserve.ops.dynamic_conv import (  # noqa: E402
    dynamic_conv_commit,
    dynamic_conv_decode,
    dynamic_conv_prefill,
    dynamic_conv_verify,
)
from jetserve.ops.feature_ring import store_features  # noqa: E402
from jetserve.ops.gated_delta_rule import (  # noqa: E402
    gated_delta_rule_commit,
    gated_delta_rule_decode,
    gated_delta_rule_prefill,
    gated_delta_rule_verify,
)
from jetserve.ops.gated_delta_rule.prefill_inputs import prefill_inputs  # noqa: E402
from jetserve.ops.jet_mixer import decode as fused_mixer  # noqa: E402
from jetserve.ops.jet_mixer import jet_mixer_commit  # noqa: E402
from jetserve.ops.jet_mixer import reference as reference_mixer  # noqa: E402
from jetserve.ops.kv_metadata import kv_metadata  # noqa: E402
from jetserve.ops.linear import gated_norm_linear, linear, logits_linear, swiglu_linear  # noqa: E402
from jetserve.ops.norm import gated_rms_norm, rms_norm, silu_and_mul  # noqa: E402
from jetserve.ops.sampling import argmax, sample, top_logprob  # noqa: E402
from jetserve.spec.eagle3 import DEFAULT_DRAFT_VOCAB  # noqa: E402

Case = tuple[Callable[[], object], int, int]


@dataclass(frozen=True)
class Shapes:
    name: str
    hidden: int
    mlp: int
    jet_heads: int  # H
    key_dim: int  # K
    value_dim: int  # V
    conv: int  # W
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @property
    def channels(self) -> int:  # D_v
        return self.jet_heads * self.value_dim

    @property
    def generator(self) -> int:  # D_g
        return self.channels // 8

    @property
    def jet_in(self) -> int:
        """The JetBlock's fused input projection's width as the model runs it: 2 D_k + D_g + 2 D_v + 2 H, padded to a
        multiple of `fusion.OUTPUT_ROW_ALIGN`."""
        width = 2 * self.jet_heads * self.key_dim + self.generator + 2 * self.channels + 2 * self.jet_heads
        return width + -width % OUTPUT_ROW_ALIGN


SHAPES = {
    "2b": Shapes("2b", 1536, 8960, 12, 96, 256, 4, 12, 2, 128, 151936),
    "4b": Shapes("4b", 2048, 11008, 16, 128, 256, 4, 16, 2, 128, 151936),
    # Small enough for the CPU reference backend: checks this script, not speed.
    "smoke": Shapes("smoke", 64, 128, 2, 16, 32, 4, 4, 2, 16, 1000),
}
PAGE_SIZE = 16
NUM_ACCEPTED = 3  # nodes a commit case accepts per sequence, root included


_GENERATORS: dict[str, torch.Generator] = {}


def _gen(device: str) -> torch.Generator:
    """The cases' own generator per device: the timing's CUDA-graph capture registers the default generator, and a
    capture that fails (an op that syncs on the host) leaves that one unusable for the rest of the process."""
    if device not in _GENERATORS:
        _GENERATORS[device] = torch.Generator(device=device).manual_seed(0)
    return _GENERATORS[device]


def _randn(*shape: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=device, dtype=torch.float32, generator=_gen(device)).mul_(scale).to(dtype)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def jet_projection(s: Shapes, T: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """q, k [T, H, K], h [T, G], u [T, D], a, b [T, H], gate [T, D] as a JetBlock's ops get them: views of one
    [T, `Shapes.jet_in`] projection output, rows strided (the stride decides whether row loads vectorise)."""
    H, K, D, G = s.jet_heads, s.key_dim, s.channels, s.generator
    split = [H * K, H * K, G, D, H, H, D]
    q, k, h, u, a, b, gate = _randn(T, s.jet_in, dtype=dtype, device=device)[:, : sum(split)].split(split, dim=-1)
    return q.view(T, H, K), k.view(T, H, K), h, u, a, b, gate


def tree_parents(num_seqs: int, num_nodes: int, chain: bool, device: str) -> torch.Tensor:
    """[N, T_d] int32: a chain (parent j-1) or a binary-ish tree (parent (j-1)//2), node 0's parent -1."""
    j = torch.arange(num_nodes, device=device)
    parents = j - 1 if chain else (j - 1) // 2
    parents[0] = -1
    return parents.to(torch.int32).expand(num_seqs, num_nodes).contiguous()


def accepted_path(num_seqs: int, num_nodes: int, chain: bool, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first NUM_ACCEPTED nodes of the path to the last node of `tree_parents`, for every sequence:
    (accepted_nodes [N, T_d] int32 root first, padded with -1; num_accepted [N] int32)."""
    parents = tree_parents(1, num_nodes, chain, "cpu")[0].tolist()
    path, node = [], num_nodes - 1
    while node >= 0:
        path.append(node)
        node = parents[node]
    path = path[::-1][:NUM_ACCEPTED]
    row = torch.tensor(path + [-1] * (num_nodes - len(path)), dtype=torch.int32, device=device)
    num = torch.full((num_seqs,), len(path), dtype=torch.int32, device=device)
    return row.expand(num_seqs, num_nodes).contiguous(), num


def _slots(num_seqs: int, device: str) -> torch.Tensor:
    return torch.arange(1, num_seqs + 1, dtype=torch.int32, device=device)  # slot 0 is the padding slot


def conv_cases(s: Shapes, dtype: torch.dtype, device: str, kind: str, n: int, nodes: int = 0, chain: bool = True):
    """dynamic_conv: kind decode (n sequences), prefill (n tokens, one sequence), verify/commit (n sequences)."""
    D, G, W = s.channels, s.generator, s.conv
    w2 = _randn(D * W, G, dtype=dtype, device=device, scale=G**-0.5)
    bias = _randn(D * W, dtype=dtype, device=device, scale=0.1)
    num_seqs = 1 if kind == "prefill" else n
    state = _randn(num_seqs + 1, W - 1, D, dtype=dtype, device=device)
    idx = _slots(num_seqs, device)
    T = n if kind in ("decode", "prefill") else n * nodes
    _, _, h, u, _, _, _ = jet_projection(s, T, dtype, device)  # [T, G], [T, D]
    window_bytes = _nbytes(state[1:])
    io_bytes = _nbytes(u, h, w2, bias) + _nbytes(u)  # inputs + output
    if kind == "decode":
        return lambda: dynamic_conv_decode(u, h, w2, bias, state, idx), io_bytes + 2 * window_bytes, 2 * T * G * D * W
    if kind == "prefill":
        cu = torch.tensor([0, T], dtype=torch.int32, device=device)
        has = torch.ones(1, dtype=torch.bool, device=device)
        return (
            lambda: dynamic_conv_prefill(u, h, w2, bias, state, cu, idx, has),
            io_bytes + 2 * window_bytes,
            2 * T * G * D * W,
        )
    parents = tree_parents(n, nodes, chain, device)
    if kind == "verify":
        return (
            lambda: dynamic_conv_verify(u, h, w2, bias, state, idx, parents),
            io_bytes + window_bytes,
            2 * T * G * D * W,
        )
    accepted, num = accepted_path(n, nodes, chain, device)
    count = int(num[0])
    # Reads the accepted inputs and the old rows the new window keeps, writes the window.
    read_rows = n * (count + max(0, W - 1 - count))
    return lambda: dynamic_conv_commit(u, state, idx, accepted, num), read_rows * _nbytes(u[0]) + window_bytes, 0


def mixer_case(s: Shapes, dtype: torch.dtype, device: str, n: int, fused: bool) -> Case:
    """A JetBlock's decode conv and gated delta rule for n sequences: the fused kernel (`ops.jet_mixer`), or the two
    public ops one after the other. w2 rotates through copies past 4x the L2 on a GPU (in a decode step it comes from
    HBM; a single copy would be read from L2 here); one call runs every copy once."""
    D, G, W, H, K, V = s.channels, s.generator, s.conv, s.jet_heads, s.key_dim, s.value_dim
    w2_bytes = D * W * G * dtype.itemsize
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device == "cuda" else 0
    copies = max(1, -(-4 * l2 // w2_bytes))
    w2s = [_randn(D * W, G, dtype=dtype, device=device, scale=G**-0.5) for _ in range(copies)]
    bias = _randn(D * W, dtype=dtype, device=device, scale=0.1)
    conv_state = _randn(n + 1, W - 1, D, dtype=dtype, device=device)
    state = _randn(n + 1, H, K, V, dtype=torch.float32, device=device, scale=0.1)
    q, k, h, u, a, b, _ = jet_projection(s, n, dtype, device)
    A_log = torch.empty(H, device=device).uniform_(0, 2.7)
    dt_bias = torch.empty(H, device=device).uniform_(-4, -1)
    idx = _slots(n, device)
    mixer = fused_mixer if use_triton(u) else reference_mixer  # the smoke run: the reference backend

    def one(w2: torch.Tensor) -> torch.Tensor:
        if fused:
            return mixer.jet_mixer_decode(u, h, w2, bias, conv_state, q, k, a, b, A_log, dt_bias, state, idx)
        v = dynamic_conv_decode(u, h, w2, bias, conv_state, idx).view(n, H, V)
        return gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, state, idx)

    # per copy: w2 and bias, the inputs and the output, both windows and both states read and written
    per_call = _nbytes(w2s[0], bias, u, h, q, k, a, b, u) + 2 * _nbytes(conv_state[1:], state[1:])
    return lambda: [one(w2) for w2 in w2s], copies * per_call, copies * (2 * n * G * D * W + 6 * n * H * K * V)


def mixer_commit_case(s: Shapes, dtype: torch.dtype, device: str, n: int, nodes: int, chain: bool) -> Case:
    """A JetBlock's commit after verifying n trees of `nodes` (`ops.jet_mixer.jet_mixer_commit`: the conv window and
    the recurrent state in one launch on the Triton backend); bytes and flops the two commits' together."""
    H, K, V, W = s.jet_heads, s.key_dim, s.value_dim, s.conv
    T = n * nodes
    _, k, _, u, a, b, _ = jet_projection(s, T, dtype, device)  # k [T, H, K], u [T, H*V], a, b [T, H]
    v = _randn(T, H, V, dtype=dtype, device=device)  # the conv's output: contiguous
    A_log = torch.empty(H, device=device).uniform_(0, 2.7)
    dt_bias = torch.empty(H, device=device).uniform_(-4, -1)
    conv_state = _randn(n + 1, W - 1, s.channels, dtype=dtype, device=device)
    state = _randn(n + 1, H, K, V, dtype=torch.float32, device=device, scale=0.1)
    idx = _slots(n, device)
    accepted, num = accepted_path(n, nodes, chain, device)
    count = int(num[0])
    window_bytes = n * (count + max(0, W - 1 - count)) * _nbytes(u[0]) + _nbytes(conv_state[1:])
    state_bytes = _nbytes(k, v, a, b) // nodes * count + 2 * _nbytes(state[1:])
    return (
        lambda: jet_mixer_commit(u, conv_state, k, v, a, b, A_log, dt_bias, state, idx, accepted, num),
        window_bytes + state_bytes,
        6 * n * count * H * K * V,
    )


def feature_ring_case(s: Shapes, dtype: torch.dtype, device: str, n: int) -> Case:
    """A speculating engine's decode step storing the target's features at 3 capture layers into the draft's
    catch-up ring (128 positions per slot)."""
    ring = torch.zeros(n + 1, 128, 3, s.hidden, dtype=dtype, device=device)
    features = [_randn(n, s.hidden, dtype=dtype, device=device) for _ in range(3)]
    slots, positions = _slots(n, device), torch.arange(n, device=device) * 37 + 5
    return lambda: store_features(ring, features, slots, positions), 2 * _nbytes(*features), 0


def kv_metadata_case(device: str, n: int, context: int) -> Case:
    """A decode step's K/V metadata for n sequences at `context` tokens (page 16, an SWA ring of 2048 tokens): slot
    mappings and the block tables' rows, gathered from a table of 64K-token rows."""
    pages_per_seq = 65536 // PAGE_SIZE
    table = torch.randint(0, 1 << 20, (n + 1, pages_per_seq), dtype=torch.int32, device=device)
    slots, positions = _slots(n, device), torch.full((n,), context - 1, device=device)
    cols = -(-context // PAGE_SIZE)
    args = (positions, slots, positions + 1, slots, table, cols, PAGE_SIZE, 2048, True, True)
    return lambda: kv_metadata(*args), n * cols * 4 * 2, 0


def gdr_cases(s: Shapes, dtype: torch.dtype, device: str, kind: str, n: int, nodes: int = 0, chain: bool = True):
    """gated_delta_rule: decode (n sequences), prefill (n tokens, one sequence) and its inputs' launch
    (prefill_inputs), verify/commit (n sequences)."""
    H, K, V = s.jet_heads, s.key_dim, s.value_dim
    num_seqs = 1 if kind in ("prefill", "prefill_inputs") else n
    T = n if kind in ("decode", "prefill", "prefill_inputs") else n * nodes
    q, k, _, _, a, b, _ = jet_projection(s, T, dtype, device)  # q, k [T, H, K]; a, b [T, H]
    v = _randn(T, H, V, dtype=dtype, device=device)  # the conv's output: contiguous
    A_log = torch.empty(H, device=device).uniform_(0, 2.7)
    dt_bias = torch.empty(H, device=device).uniform_(-4, -1)
    state = _randn(num_seqs + 1, H, K, V, dtype=torch.float32, device=device, scale=0.1)
    idx = _slots(num_seqs, device)
    state_bytes = _nbytes(state[1:])
    io_bytes = _nbytes(q, k, v, a, b) + _nbytes(v)
    gates = (A_log, dt_bias, state)
    if kind == "decode":
        return (
            lambda: gated_delta_rule_decode(q, k, v, a, b, *gates, idx),
            io_bytes + 2 * state_bytes,
            6 * T * H * K * V,
        )
    if kind == "prefill_inputs":  # q, k read and written dense; a, b read, g and β written in fp32
        return (
            lambda: prefill_inputs(q, k, a, b, A_log, dt_bias),
            2 * _nbytes(q, k) + _nbytes(a, b) + 8 * T * H,
            6 * T * H * K,
        )
    if kind == "prefill":
        cu = torch.tensor([0, T], dtype=torch.int32, device=device)
        has = torch.ones(1, dtype=torch.bool, device=device)
        return (
            lambda: gated_delta_rule_prefill(q, k, v, a, b, *gates, cu, idx, has),
            io_bytes + 2 * state_bytes,
            6 * T * H * K * V,
        )
    parents = tree_parents(n, nodes, chain, device)
    if kind == "verify":
        return (
            lambda: gated_delta_rule_verify(q, k, v, a, b, *gates, idx, parents, is_chain=chain),  # as the engine
            io_bytes + state_bytes,
            6 * T * H * K * V,
        )
    accepted, num = accepted_path(n, nodes, chain, device)
    count = int(num[0])
    # Replays the accepted tokens' k, v, a, b only; the state is read and written once.
    return (
        lambda: gated_delta_rule_commit(k, v, a, b, *gates, idx, accepted, num),
        _nbytes(k, v, a, b) // nodes * count + 2 * state_bytes,
        6 * n * count * H * K * V,
    )


def attention_cases(
    s: Shapes,
    dtype: torch.dtype,
    device: str,
    kind: str,
    n: int,
    context: int,
    nodes: int = 0,
    chain: bool = True,
    window: int = 0,
):
    """attention over a paged cache: decode (n sequences at `context`), prefill (n new tokens after `context`
    cached ones, one sequence), verify (n sequences, a tree of `nodes` after `context`), commit (moving the K/V of
    that tree's accepted path)."""
    H, HK, Dh = s.heads, s.kv_heads, s.head_dim
    num_seqs = 1 if kind == "prefill" else n
    new = {"decode": 1, "prefill": n}.get(kind, nodes)
    total = context + new
    pages_per_seq = -(-total // PAGE_SIZE)
    num_pages = 1 + num_seqs * pages_per_seq
    k_cache = _randn(num_pages, PAGE_SIZE, HK, Dh, dtype=dtype, device=device)
    v_cache = _randn(num_pages, PAGE_SIZE, HK, Dh, dtype=dtype, device=device)
    tables = (1 + torch.arange(num_seqs * pages_per_seq, device=device, dtype=torch.int32)).view(num_seqs, -1)
    row_bytes = HK * Dh * dtype.itemsize  # one token's K (or V)
    if kind == "commit":
        accepted, num = accepted_path(n, nodes, chain, device)
        moved = sum(node != depth for depth, node in enumerate(accepted[0, : int(num[0])].tolist()))
        prefix = torch.full((n,), context, dtype=torch.int32, device=device)
        return (
            lambda: kv_cache_commit(k_cache, v_cache, tables, prefix, accepted, num),
            2 * 2 * n * moved * row_bytes,  # K and V of each moved node, read and written
            0,
        )
    T = num_seqs * new
    q = _randn(T, H, Dh, dtype=dtype, device=device)
    k, v = _randn(T, HK, Dh, dtype=dtype, device=device), _randn(T, HK, Dh, dtype=dtype, device=device)
    pos = torch.arange(context, total, device=device).repeat(num_seqs)  # [T]
    owner = torch.arange(num_seqs, device=device).repeat_interleave(new)
    slots = (tables[owner, pos // PAGE_SIZE].long() * PAGE_SIZE + pos % PAGE_SIZE).contiguous()
    lens = torch.full((num_seqs,), total, dtype=torch.int32, device=device)
    # The earliest new token sees the most of the cache; the new K/V are written to it.
    cached_keys = min(context, window - 1) if window else context
    kv_bytes = 2 * num_seqs * (cached_keys + new) * row_bytes
    io_bytes = _nbytes(q, k, v) + _nbytes(q)
    opts = dict(scale=Dh**-0.5, window_tokens=window, ring_tokens=0)
    flops = 4 * T * (min(total, window) if window else total) * H * Dh
    if kind == "decode":
        return (
            lambda: attention_decode(q, k, v, k_cache, v_cache, lens, tables, slots, **opts),
            kv_bytes + io_bytes,
            flops,
        )
    if kind == "prefill":
        cu = torch.tensor([0, T], dtype=torch.int32, device=device)
        return (
            lambda: attention_prefill(q, k, v, k_cache, v_cache, cu, lens, tables, slots, max_seqlen_q=T, **opts),
            kv_bytes + io_bytes,
            flops // 2 if context == 0 else flops,
        )
    parents = tree_parents(1, nodes, chain, "cpu")[0].tolist()
    mask = torch.eye(nodes, dtype=torch.bool)
    for j in range(1, nodes):
        mask[j] |= mask[parents[j]]  # node j sees itself and its parent's ancestry
    mask = mask.to(device).expand(n, nodes, nodes).contiguous()
    return (
        lambda: attention_verify(q, k, v, k_cache, v_cache, mask, lens, tables, slots, **opts),
        kv_bytes + io_bytes,
        flops,
    )


def rope_case(s: Shapes, dtype: torch.dtype, device: str, n: int) -> Case:
    """apply_rope on n tokens at distinct positions: q, k and one table row per token read, q and k written."""
    q = _randn(n, s.heads, s.head_dim, dtype=dtype, device=device)
    k = _randn(n, s.kv_heads, s.head_dim, dtype=dtype, device=device)
    table = rope_cos_sin(n, s.head_dim, 1e6).to(device)  # [n, Dh] fp32
    positions = torch.arange(n, device=device)
    return lambda: apply_rope(q, k, positions, table), 2 * _nbytes(q, k) + _nbytes(positions, table), 0


def rope_expanded_case(s: Shapes, dtype: torch.dtype, device: str, n: int) -> Case:
    """apply_rope with positions an expanded (stride-0) view, as a one-row draft tree level hands it over."""
    q = _randn(n, s.heads, s.head_dim, dtype=dtype, device=device)
    k = _randn(n, s.kv_heads, s.head_dim, dtype=dtype, device=device)
    table = rope_cos_sin(8, s.head_dim, 1e6).to(device)  # [8, Dh] fp32
    positions = torch.tensor([5], device=device).expand(n)
    return lambda: apply_rope(q, k, positions, table), 2 * _nbytes(q, k) + _nbytes(table), 0


def linear_case(s: Shapes, dtype: torch.dtype, device: str, kind: str, m: int) -> Case:
    """The decode-time GEMMs of one layer through `ops.linear` (Triton up to GEMV_MAX_ROWS rows), and the logits:
    the weight read once, x read and y written."""
    n, k = {
        "jet in": (s.jet_in, s.hidden),
        "gate|up": (2 * s.mlp, s.hidden),
        "down": (s.hidden, s.mlp),
        "logits": (s.vocab, s.hidden),
    }[kind]
    x = _randn(m, k, dtype=dtype, device=device)
    w = _randn(n, k, dtype=dtype, device=device, scale=k**-0.5)
    fn = logits_linear if kind == "logits" else linear
    out_bytes = m * n * (4 if kind == "logits" else dtype.itemsize)
    return lambda: fn(x, w), _nbytes(x, w) + out_bytes, 2 * m * n * k


def fused_linear_case(s: Shapes, dtype: torch.dtype, device: str, kind: str, m: int) -> Case:
    """The skinny GEMM's fused modes as the model calls them: the JetBlock input projection with SiLU on q|k|h
    ("jet in silu"), the MLP's SwiGLU + down projection ("swiglu down"), the JetBlock's gated output norm + o_proj
    ("gated-norm o")."""
    key_dim, value_dim = s.jet_heads * s.key_dim, s.channels
    if kind == "jet in silu":
        n, k = s.jet_in, s.hidden
        x, w = _randn(m, k, dtype=dtype, device=device), _randn(n, k, dtype=dtype, device=device, scale=k**-0.5)
        silu_cols = 2 * key_dim + s.generator
        return lambda: linear(x, w, silu_cols=silu_cols), _nbytes(x, w) + m * n * dtype.itemsize, 2 * m * n * k
    if kind == "swiglu down":
        x = _randn(m, 2 * s.mlp, dtype=dtype, device=device)
        w = _randn(s.hidden, s.mlp, dtype=dtype, device=device, scale=s.mlp**-0.5)
        return lambda: swiglu_linear(x, w), _nbytes(x, w) + m * s.hidden * dtype.itemsize, 2 * m * s.hidden * s.mlp
    o, g = _randn(m, value_dim, dtype=dtype, device=device), _randn(m, value_dim, dtype=dtype, device=device)
    norm_w = _randn(s.value_dim, dtype=dtype, device=device)
    w = _randn(s.hidden, value_dim, dtype=dtype, device=device, scale=value_dim**-0.5)
    return (lambda: gated_norm_linear(o, g, norm_w, 1e-5, w), _nbytes(o, g, norm_w, w) + m * s.hidden * dtype.itemsize,
            2 * m * s.hidden * value_dim)  # fmt: skip


def add_norm_case(s: Shapes, dtype: torch.dtype, device: str, kind: str, m: int, fused: bool) -> Case:
    """A layer's producing GEMM and the RMSNorm after it, as a decode step at m rows runs them: the SwiGLU down
    projection then the next layer's input norm ("down"), or the JetBlock's gated-norm o_proj then the
    post-attention norm ("gated-norm o"); the norm in the GEMM's epilogue (`add_norm`, fused) or its own launch.
    The weight rotates through copies past 4x the L2 on a GPU (in a decode step it comes from HBM); one call runs
    every copy once."""
    if kind == "down":
        n, k = s.hidden, s.mlp
        x = _randn(m, 2 * k, dtype=dtype, device=device)
        inputs = (x,)

        def gemm(w: torch.Tensor, add=None):
            return swiglu_linear(x, w, add_norm=add)
    else:
        n, k = s.hidden, s.channels
        o, g = _randn(m, k, dtype=dtype, device=device), _randn(m, k, dtype=dtype, device=device)
        head_w = _randn(s.value_dim, dtype=dtype, device=device)
        inputs = (o, g)

        def gemm(w: torch.Tensor, add=None):
            return gated_norm_linear(o, g, head_w, 1e-5, w, add_norm=add)

    w_bytes = n * k * dtype.itemsize
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device == "cuda" else 0
    copies = max(1, -(-4 * l2 // w_bytes))
    ws = [_randn(n, k, dtype=dtype, device=device, scale=k**-0.5) for _ in range(copies)]
    residual, norm_w = _randn(m, n, dtype=dtype, device=device), _randn(n, dtype=dtype, device=device)
    add = (residual, norm_w, 1e-6)
    gemm(ws[0], add)  # once eagerly: the epilogue's ticket counter is allocated outside any graph capture

    def one(w: torch.Tensor):
        return gemm(w, add) if fused else rms_norm(gemm(w), norm_w, 1e-6, residual)

    # per copy: the weight and the GEMM's inputs read, the residual read, h and the normed rows written
    per_call = _nbytes(ws[0], *inputs, residual) + 2 * m * n * dtype.itemsize
    return lambda: [one(w) for w in ws], copies * per_call, copies * 2 * m * n * k


def sample_case(s: Shapes, device: str, n: int, filtered: bool = True) -> Case:
    """sample over the vocabulary with top-k 50 and top-p 0.9 (`filtered`), or temperature alone with the promise
    that no row filters (the engine's Sampler makes it from the host's parameters): the fp32 logits and row
    parameters read, tokens written."""
    logits = _randn(n, s.vocab, dtype=torch.float32, device=device, scale=4.0)
    params = dict(
        temperature=torch.full((n,), 0.8, device=device),
        top_k=torch.full((n,), 50 if filtered else 0, dtype=torch.int32, device=device),
        top_p=torch.full((n,), 0.9 if filtered else 1.0, device=device),
        min_p=torch.zeros(n, device=device),
        seeds=torch.arange(n, device=device),
        counters=torch.zeros(n, dtype=torch.int64, device=device),
    )
    promises = {} if filtered else dict(is_filtered=False, has_greedy=False)
    return lambda: sample(logits, **params, **promises), _nbytes(logits, *params.values()) + n * 8, 0


def argmax_case(s: Shapes, device: str, n: int, torch_op: bool = False) -> Case:
    """The greedy token of n rows of fp32 logits over the vocabulary (the sampler's all-greedy step, greedy
    acceptance): `ops.sampling.argmax`, or torch's argmax (`torch_op`) for comparison."""
    logits = _randn(n, s.vocab, dtype=torch.float32, device=device, scale=4.0)
    op = (lambda: logits.argmax(dim=-1)) if torch_op else (lambda: argmax(logits))
    return op, _nbytes(logits) + n * 8, 0


def top_logprob_case(s: Shapes, dtype: torch.dtype, device: str, n: int, torch_op: bool = False) -> Case:
    """A draft's top-1 of n rows of its lm_head's logits (dtype) with the d2t shift (each chain level):
    `ops.sampling.top_logprob`, or torch's `log_softmax(logits.float()).max` and the shift (`torch_op`)."""
    vocab = min(s.vocab, DEFAULT_DRAFT_VOCAB)  # a random draft's vocabulary (`random_draft_config`)
    logits = _randn(n, vocab, dtype=dtype, device=device, scale=4.0)
    d2t = torch.randint(0, s.vocab - vocab + 1, (vocab,), device=device)

    def torch_top() -> tuple[torch.Tensor, torch.Tensor]:
        logprob, index = torch.log_softmax(logits.float(), dim=-1).max(dim=-1)
        return logprob, index + d2t[index]

    op = torch_top if torch_op else (lambda: top_logprob(logits, d2t))
    return op, _nbytes(logits) + n * 12, 0


def silu_columns_case(s: Shapes, dtype: torch.dtype, device: str, n: int, torch_op: bool = False) -> Case:
    """The SiLU of the JetBlock's q, k and generator columns of n rows of its fused projection output, in place (past
    the Triton GEMM's rows): `linear.kernels.silu_columns_`, or torch's in-place SiLU on the slice (`torch_op`)."""
    from jetserve.ops.linear import kernels as linear_kernels

    y = _randn(n, s.jet_in, dtype=dtype, device=device)
    cols = 2 * s.jet_heads * s.key_dim + s.generator
    nbytes = 2 * n * cols * y.element_size()
    if torch_op or not use_triton(y):  # the reference backend: torch's
        return lambda: torch.nn.functional.silu(y[:, :cols], inplace=True), nbytes, 0
    return lambda: linear_kernels.silu_columns_(y, cols), nbytes, 0


def norm_cases(s: Shapes, dtype: torch.dtype, device: str, kind: str, n: int):
    """rms_norm with residual (n tokens, hidden), gated_rms_norm (n tokens, JetBlock heads), silu_and_mul (MLP)."""
    if kind == "rms_norm":
        x, r = _randn(n, s.hidden, dtype=dtype, device=device), _randn(n, s.hidden, dtype=dtype, device=device)
        w = _randn(s.hidden, dtype=dtype, device=device)
        return lambda: rms_norm(x, w, 1e-6, r), 4 * _nbytes(x) + _nbytes(w), 0
    if kind == "gated_rms_norm":
        o = _randn(n, s.jet_heads, s.value_dim, dtype=dtype, device=device)
        g = _randn(n, s.jet_heads, s.value_dim, dtype=dtype, device=device)
        w = _randn(s.value_dim, dtype=dtype, device=device)
        return lambda: gated_rms_norm(o, w, g, 1e-5), 3 * _nbytes(o) + _nbytes(w), 0
    x = _randn(n, 2 * s.mlp, dtype=dtype, device=device)
    return lambda: silu_and_mul(x), _nbytes(x) * 3 // 2, 0


def all_cases(s: Shapes, dtype: torch.dtype, device: str, small: bool = False) -> dict[str, Callable[[], Case]]:
    """Every case by name, built lazily. `small` shrinks the sizes (memcheck and the CPU smoke run)."""
    decode_batches = (1, 64, 256) if not small else (1, 3)
    prefill_tokens = (4096, 32768) if not small else (300, 65)
    verify_batches = (1, 16, 64) if not small else (1, 2)
    context = 4096 if not small else 40
    cases: dict[str, Callable[[], Case]] = {}
    for n in decode_batches:
        cases[f"dynamic_conv decode N={n}"] = lambda n=n: conv_cases(s, dtype, device, "decode", n)
        cases[f"gated_delta_rule decode N={n}"] = lambda n=n: gdr_cases(s, dtype, device, "decode", n)
        if n == 1:  # the fused mixer's only batch size (ops.jet_mixer.FUSED_MAX_ROWS)
            for fused in (True, False):
                label = "fused" if fused else "conv then gated_delta_rule"
                cases[f"jet_mixer decode {label} N=1, w2 from HBM"] = lambda f=fused: mixer_case(s, dtype, device, 1, f)
        cases[f"attention decode N={n} ctx={context}"] = lambda n=n: attention_cases(
            s, dtype, device, "decode", n, context
        )
        for kind in ("rms_norm", "gated_rms_norm", "silu_and_mul"):
            cases[f"{kind} T={n}"] = lambda n=n, kind=kind: norm_cases(s, dtype, device, kind, n)
        cases[f"rope T={n}"] = lambda n=n: rope_case(s, dtype, device, n)
        cases[f"feature_ring store N={n}"] = lambda n=n: feature_ring_case(s, dtype, device, n)
        cases[f"kv_metadata decode N={n} ctx={context}"] = lambda n=n: kv_metadata_case(device, n, context)
        if small:
            cases[f"rope expanded positions T={n}"] = lambda n=n: rope_expanded_case(s, dtype, device, n)
        for kind in ("jet in", "gate|up", "down", "logits"):
            cases[f"linear {kind} M={n}"] = lambda n=n, kind=kind: linear_case(s, dtype, device, kind, n)
        for kind in ("jet in silu", "swiglu down", "gated-norm o"):
            cases[f"linear {kind} M={n}"] = lambda n=n, kind=kind: fused_linear_case(s, dtype, device, kind, n)
        cases[f"sample N={n}"] = lambda n=n: sample_case(s, device, n)
        cases[f"argmax N={n}"] = lambda n=n: argmax_case(s, device, n)
        cases[f"argmax (torch) N={n}"] = lambda n=n: argmax_case(s, device, n, torch_op=True)
        cases[f"top_logprob draft N={n}"] = lambda n=n: top_logprob_case(s, dtype, device, n)
        cases[f"top_logprob draft (torch) N={n}"] = lambda n=n: top_logprob_case(s, dtype, device, n, torch_op=True)
        if n > 1:  # past the Triton GEMM's rows (batch 1's SiLU is in its epilogue)
            cases[f"silu columns T={n}"] = lambda n=n: silu_columns_case(s, dtype, device, n)
            cases[f"silu columns (torch) T={n}"] = lambda n=n: silu_columns_case(s, dtype, device, n, torch_op=True)
        cases[f"sample temperature-only N={n}"] = lambda n=n: sample_case(s, device, n, filtered=False)
    # decode rows on the Triton GEMM (ops.linear.GEMV_MAX_ROWS), and 256 rows past it: cuBLAS then the norm op, or
    # with add_norm the K split's batched GEMM and one launch for the sum, the residual add and the norm
    for m in (1, 4, 16, 256) if not small else (1, 3):
        for kind in ("down", "gated-norm o"):  # the next RMSNorm in the GEMM's epilogue, or its own launch
            for fused in (True, False):
                label = ("+ add_norm epilogue" if m <= 16 else "+ add_norm batched split") if fused else "then rms_norm"
                cases[f"linear {kind} {label} M={m}, weights from HBM"] = lambda m=m, kind=kind, fused=fused: (
                    add_norm_case(s, dtype, device, kind, m, fused)
                )
    for t in prefill_tokens:
        cases[f"dynamic_conv prefill T={t}"] = lambda t=t: conv_cases(s, dtype, device, "prefill", t)
        cases[f"gated_delta_rule prefill T={t}"] = lambda t=t: gdr_cases(s, dtype, device, "prefill", t)
        cases[f"gated_delta_rule prefill_inputs T={t}"] = lambda t=t: gdr_cases(s, dtype, device, "prefill_inputs", t)
        cases[f"attention prefill T={t}"] = lambda t=t: attention_cases(s, dtype, device, "prefill", t, 0)
    # Small runs (memcheck) add trees of sizes that are not powers of two, as the engine's tree shapes are.
    trees = ((7, True, "chain6"), (8, False, "tree8"))
    if small:
        trees += ((3, False, "tree3"), (6, False, "tree6"))
    for n in verify_batches:
        for nodes, chain, label in trees:
            for kind in ("verify", "commit"):
                cases[f"dynamic_conv {kind} {label} N={n}"] = lambda n=n, nodes=nodes, chain=chain, kind=kind: (
                    conv_cases(s, dtype, device, kind, n, nodes, chain)
                )
                cases[f"gated_delta_rule {kind} {label} N={n}"] = lambda n=n, nodes=nodes, chain=chain, kind=kind: (
                    gdr_cases(s, dtype, device, kind, n, nodes, chain)
                )
            cases[f"jet_mixer commit {label} N={n}"] = lambda n=n, nodes=nodes, chain=chain: mixer_commit_case(
                s, dtype, device, n, nodes, chain
            )
        cases[f"attention verify chain6 N={n} ctx={context}"] = lambda n=n: attention_cases(
            s, dtype, device, "verify", n, context, nodes=7
        )
        cases[f"attention commit tree8 N={n} ctx={context}"] = lambda n=n: attention_cases(
            s, dtype, device, "commit", n, context, nodes=8, chain=False
        )
        if small:
            cases[f"attention verify tree6 N={n} ctx={context}"] = lambda n=n: attention_cases(
                s, dtype, device, "verify", n, context, nodes=6, chain=False
            )
    return cases
