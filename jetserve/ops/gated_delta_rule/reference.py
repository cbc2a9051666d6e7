"""Gated delta rule in pure PyTorch (fp32 math, any device): recurrent and chunked prefill, decode, tree verify, commit.

These define the op semantics (docs/kernels.md §gated_delta_rule); the Triton variants are tested against them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from jetserve.ops.gated_delta_rule.chunk_table import DeltaRuleChunks
from jetserve.ops.norm import reference as norm_reference

L2NORM_EPS = 1e-6
CHUNK_TOKENS = 64


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """`x / sqrt(|x|² + 1e-6)` over the last dim, in fp32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def compute_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-space decay `g = -exp(A_log) * softplus(a + dt_bias)` and `β = sigmoid(b)`, both fp32, shaped like `a`."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    return g, beta


def prefill_inputs(
    q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the chunked prefill's kernels take: q, k `[T, H, K]` l2-normalised (in fp32, returned dense in their
    dtype) and the gates g, β `[T, H]` fp32 (`compute_gates`)."""
    check_heads(q, k, k, a, b)
    check_gate_params(A_log, dt_bias, k)
    qn = l2_normalize(q.float()).to(q.dtype)  # [T, H, K]
    kn = l2_normalize(k.float()).to(k.dtype)  # [T, H, K]
    return qn, kn, *compute_gates(a, b, A_log, dt_bias)


def check_heads(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    if q is not None and q.shape != k.shape:
        raise ValueError(f"gated_delta_rule: q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape")
    if k.dim() != 3 or v.dim() != 3 or k.shape[:2] != v.shape[:2]:
        raise ValueError(f"gated_delta_rule: k {tuple(k.shape)} must be [T, H, K] and v {tuple(v.shape)} [T, H, V]")
    if a.shape != k.shape[:2] or b.shape != k.shape[:2]:
        raise ValueError(f"gated_delta_rule: a {tuple(a.shape)} and b {tuple(b.shape)} must be [T, H] = {k.shape[:2]}")


def check_gate_params(A_log: torch.Tensor, dt_bias: torch.Tensor, k: torch.Tensor) -> None:
    H = k.shape[1]
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x.shape != (H,) or x.dtype != torch.float32:
            raise ValueError(f"gated_delta_rule: {name} {tuple(x.shape)} {x.dtype} must be [{H}] fp32")


def check_state(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    H, K, V = k.shape[1], k.shape[2], v.shape[2]
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, K, V) or state.dtype != torch.float32:
        raise ValueError(f"gated_delta_rule: state {tuple(state.shape)} {state.dtype} must be [S, {H}, {K}, {V}] fp32")


def _step(S: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One token of the recurrence on fp32 inputs: `S [..., K, V]`, `k [..., K]`, `v [..., V]`, `g, beta [...]`."""
    S = S * torch.exp(g)[..., None, None]
    e = beta[..., None] * (v - torch.einsum("...kv,...k->...v", S, k))  # [..., V]
    return S + k[..., :, None] * e[..., None, :]


def _readout(S: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.einsum("...kv,...k->...v", S, q)


def initial_states(state: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor) -> torch.Tensor:
    h0 = state[state_indices.long()]  # [N, H, K, V]
    return torch.where(has_initial_state.view(-1, 1, 1, 1), h0, torch.zeros_like(h0))


def check_varlen(cu_seqlens: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor) -> None:
    N = cu_seqlens.shape[0] - 1
    if cu_seqlens.dim() != 1 or N < 0:
        raise ValueError(f"gated_delta_rule_prefill: cu_seqlens {tuple(cu_seqlens.shape)} must be [N+1]")
    if state_indices.shape != (N,) or has_initial_state.shape != (N,):
        raise ValueError(
            f"gated_delta_rule_prefill: state_indices {tuple(state_indices.shape)} and has_initial_state "
            f"{tuple(has_initial_state.shape)} must be [N] = [{N}]"
        )


def gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
    chunks: DeltaRuleChunks | None = None,
) -> torch.Tensor:
    """Varlen prefill, token by token.

    q, k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]` (raw), A_log, dt_bias `[H]` fp32, state `[S, H, K, V]` fp32,
    cu_seqlens `[N+1]`, state_indices `[N]`, has_initial_state `[N]` bool. Sequence i starts from
    `state[state_indices[i]]` if `has_initial_state[i]` (zeros otherwise); its final state is written there.
    `chunks` (the chunked kernel's table of these cu_seqlens) goes unused here: token by token needs none.
    Returns o `[T, H, V]` in `v.dtype`.
    """
    check_heads(q, k, v, a, b)
    check_state(state, k, v)
    check_gate_params(A_log, dt_bias, k)
    check_varlen(cu_seqlens, state_indices, has_initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qn, kn = l2_normalize(q) * scale, l2_normalize(k)  # [T, H, K]
    vf = v.float()
    g, beta = compute_gates(a, b, A_log, dt_bias)  # [T, H]
    h0 = initial_states(state, state_indices, has_initial_state)  # [N, H, K, V]
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)  # [T, H, V]
    bounds = cu_seqlens.tolist()
    finals = []
    for i in range(len(bounds) - 1):
        S = h0[i]  # [H, K, V]
        for t in range(bounds[i], bounds[i + 1]):
            S = _step(S, kn[t], vf[t], g[t], beta[t])
            o[t] = _readout(S, qn[t])
        finals.append(S)
    if finals:
        state[state_indices.long()] = torch.stack(finals)
    return o.to(v.dtype)


def _chunk_forward(
    S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of C tokens in WY form. S `[H, K, V]`, q, k `[C, H, K]`, v `[C, H, V]`, g, beta `[C, H]`.

    With G the in-chunk cumulative log decay, the per-token pseudo-values U solve (I + A) U = β∘V − β∘Γ∘(K S₀),
    A[t, s] = β_t exp(G_t − G_s) k_t·k_s for s < t; then O = Γ∘(Q S₀) + (M ∘ Q Kᵀ) U and
    S_C = Γ_C S₀ + (exp(G_C − G) ∘ K)ᵀ U, M[t, s] = exp(G_t − G_s) for s ≤ t.
    """
    C = q.shape[0]
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, C, K], [H, C, K], [H, C, V]
    G = g.transpose(0, 1).cumsum(-1)  # [H, C]
    beta = beta.transpose(0, 1)  # [H, C]
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    diff = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf"))  # [H, C, C]
    decay = torch.exp(diff)  # [H, C, C]: exp(G_t - G_s) for s <= t, else 0
    strict = decay.masked_fill(torch.eye(C, dtype=torch.bool, device=q.device), 0.0)
    A = beta[:, :, None] * strict * (k @ k.transpose(-1, -2))  # [H, C, C]
    eye = torch.eye(C, dtype=torch.float32, device=q.device)
    rhs = beta[:, :, None] * (v - torch.exp(G)[:, :, None] * (k @ S))  # [H, C, V]
    U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)  # [H, C, V]
    o = torch.exp(G)[:, :, None] * (q @ S) + (decay * (q @ k.transpose(-1, -2))) @ U  # [H, C, V]
    G_end = G[:, -1:]  # [H, 1]
    S = torch.exp(G_end)[:, :, None] * S + (torch.exp(G_end - G)[:, :, None] * k).transpose(-1, -2) @ U
    return o.transpose(0, 1), S


def chunk_gated_delta_rule_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Varlen prefill in chunked (WY) form, 64 tokens per chunk; same signature and semantics as
    `gated_delta_rule_prefill`."""
    check_heads(q, k, v, a, b)
    check_state(state, k, v)
    check_gate_params(A_log, dt_bias, k)
    check_varlen(cu_seqlens, state_indices, has_initial_state)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    qn, kn = l2_normalize(q) * scale, l2_normalize(k)  # [T, H, K]
    vf = v.float()
    g, beta = compute_gates(a, b, A_log, dt_bias)  # [T, H]
    h0 = initial_states(state, state_indices, has_initial_state)  # [N, H, K, V]
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)  # [T, H, V]
    bounds = cu_seqlens.tolist()
    finals = []
    for i in range(len(bounds) - 1):
        S = h0[i]  # [H, K, V]
        for t0 in range(bounds[i], bounds[i + 1], CHUNK_TOKENS):
            t1 = min(t0 + CHUNK_TOKENS, bounds[i + 1])
            o[t0:t1], S = _chunk_forward(S, qn[t0:t1], kn[t0:t1], vf[t0:t1], g[t0:t1], beta[t0:t1])
        finals.append(S)
    if finals:
        state[state_indices.long()] = torch.stack(finals)
    return o.to(v.dtype)


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One token per sequence: q, k `[N, H, K]`, v `[N, H, V]`, a, b `[N, H]`; `state[state_indices]` updated in place.

    Returns o `[N, H, V]` in `v.dtype`. Padded rows point at slot 0 (its contents are then meaningless).
    """
    check_heads(q, k, v, a, b)
    check_state(state, k, v)
    check_gate_params(A_log, dt_bias, k)
    if state_indices.shape != (q.shape[0],):
        raise ValueError(f"gated_delta_rule_decode: state_indices {tuple(state_indices.shape)} must be [{q.shape[0]}]")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g, beta = compute_gates(a, b, A_log, dt_bias)  # [N, H]
    idx = state_indices.long()
    S = _step(state[idx], l2_normalize(k), v.float(), g, beta)  # [N, H, K, V]
    o = _readout(S, l2_normalize(q) * scale)  # [N, H, V]
    state[idx] = S
    return o.to(v.dtype)


def gated_delta_rule_decode_norm(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    scale: float | None = None,
) -> torch.Tensor:
    """`gated_rms_norm(gated_delta_rule_decode(q, ..., scale), norm_weight, gate, eps)`: the decode's o (rounded to
    v.dtype) through the JetBlock's output norm; gate [N, H, V], norm_weight [V]. Returns [N, H, V] in v.dtype."""
    o = gated_delta_rule_decode(q, k, v, a, b, A_log, dt_bias, state, state_indices, scale)
    return norm_reference.gated_rms_norm(o, norm_weight, gate, eps)


def check_tree(k: torch.Tensor, state_indices: torch.Tensor, nodes: torch.Tensor, what: str) -> tuple[int, int]:
    if nodes.dim() != 2 or state_indices.shape != (nodes.shape[0],):
        raise ValueError(
            f"gated_delta_rule: {what} {tuple(nodes.shape)} must be [N, T_d] with N = len(state_indices) "
            f"= {state_indices.shape[0]}"
        )
    N, T_d = nodes.shape
    if k.shape[0] != N * T_d:
        raise ValueError(f"gated_delta_rule: {k.shape[0]} tokens, but N * T_d = {N} * {T_d} draft nodes")
    return N, T_d


def gated_delta_rule_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    tree_parents: torch.Tensor,
    scale: float | None = None,
    *,
    is_chain: bool = False,
) -> torch.Tensor:
    """Outputs of a draft tree per sequence, without writing `state`.

    Token `i*T_d + j` is node j of sequence i; `tree_parents [N, T_d]` gives each node's parent (-1 for node 0, and
    `parent < j` otherwise). Node j's state is `state[state_indices[i]]` advanced along its ancestry path (root first,
    node j last). Returns o `[T, H, V]` in `v.dtype`, `T = N*T_d`. `is_chain` promises every row is a chain (parent
    j - 1); the result is the same with or without it (the Triton kernel then skips the parents).
    """
    check_heads(q, k, v, a, b)
    check_state(state, k, v)
    check_gate_params(A_log, dt_bias, k)
    N, T_d = check_tree(k, state_indices, tree_parents, "tree_parents")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    H, K, V = state.shape[1:]
    qn = (l2_normalize(q) * scale).view(N, T_d, H, K)
    kn = l2_normalize(k).view(N, T_d, H, K)
    vf = v.float().view(N, T_d, H, V)
    g, beta = compute_gates(a, b, A_log, dt_bias)
    g, beta = g.view(N, T_d, H), beta.view(N, T_d, H)
    S0 = state[state_indices.long()]  # [N, H, K, V]
    node_states = torch.empty(N, T_d, H, K, V, dtype=torch.float32, device=state.device)
    o = torch.empty(N, T_d, H, V, dtype=torch.float32, device=state.device)
    rows = torch.arange(N, device=state.device)
    parents = tree_parents.long()
    for j in range(T_d):
        p = parents[:, j]  # [N]
        S_parent = torch.where((p < 0).view(N, 1, 1, 1), S0, node_states[rows, p.clamp(min=0)])
        S = _step(S_parent, kn[:, j], vf[:, j], g[:, j], beta[:, j])
        node_states[:, j] = S
        o[:, j] = _readout(S, qn[:, j])
    return o.view(N * T_d, H, V).to(v.dtype)


def gated_delta_rule_commit(
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    accepted_nodes: torch.Tensor,
    num_accepted: torch.Tensor,
) -> None:
    """Advance each committed state along its accepted path: nodes `accepted_nodes[i, :num_accepted[i]]` (root first)
    of the verify step's tokens k `[T, H, K]`, v `[T, H, V]`, a, b `[T, H]`, `T = N*T_d`. `num_accepted = 0` leaves
    the slot unchanged."""
    check_heads(None, k, v, a, b)
    check_state(state, k, v)
    check_gate_params(A_log, dt_bias, k)
    N, T_d = check_tree(k, state_indices, accepted_nodes, "accepted_nodes")
    if num_accepted.shape != (N,):
        raise ValueError(f"gated_delta_rule_commit: num_accepted {tuple(num_accepted.shape)} must be [{N}]")
    kn = l2_normalize(k)  # [T, H, K]
    vf = v.float()
    g, beta = compute_gates(a, b, A_log, dt_bias)  # [T, H]
    idx = state_indices.long()
    S = state[idx]  # [N, H, K, V]
    base = torch.arange(N, device=state.device) * T_d  # [N]
    nodes = accepted_nodes.long().clamp(0, T_d - 1)  # entries past num_accepted are ignored
    for d in range(T_d):
        t = base + nodes[:, d]  # [N]
        S_next = _step(S, kn[t], vf[t], g[t], beta[t])
        S = torch.where((d < num_accepted).view(N, 1, 1, 1), S_next, S)
    state[idx] = S
