"""The differentiable training forward of JetNemotronForCausalLM over rows of tokens [B, T]: the model's own parameters
(same modules, same names) through autograd-capable functions — SDPA for attention (SWA as an explicit mask), an
unfolded dynamic convolution, and the gated delta rule as fla-core's chunk kernel, a batched PyTorch chunk form
(`chunk_gated_delta_rule_rows`), or the per-sequence chunk reference of `jetserve.ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from jetserve.model.attention import Attention
from jetserve.model.jet_block import JetBlock
from jetserve.model.jet_nemotron import DecoderLayer, JetNemotronForCausalLM
from jetserve.ops.attention.reference import apply_rope
from jetserve.ops.gated_delta_rule.reference import chunk_gated_delta_rule_prefill, compute_gates, l2_normalize
from jetserve.ops.norm.reference import gated_rms_norm, rms_norm, silu_and_mul

GDR_IMPLS = ("auto", "fla", "torch", "reference")
CHUNK = 64


def fla_backward_usable(device: torch.device) -> bool:
    """fla-core 0.6.0 refuses its gated chunk backward on Hopper under Triton < 3.7.1 (wrong results, its #640)."""
    import triton

    version = tuple(int(p) for p in triton.__version__.split(".")[:3] if p.isdigit())
    return torch.cuda.get_device_capability(device)[0] != 9 or version >= (3, 7, 1)


def resolve_gdr_impl(impl: str, device: torch.device) -> str:
    """`auto` is fla-core's Triton chunk kernel on CUDA where its backward is trusted, else the batched PyTorch chunk
    form (`torch`); `reference` is the per-sequence chunk reference of `jetserve.ops` (slow; for tests)."""
    if impl not in GDR_IMPLS:
        raise ValueError(f"gdr_impl: {impl!r} is not one of {', '.join(GDR_IMPLS)}")
    if impl == "auto":
        return "fla" if device.type == "cuda" and fla_backward_usable(device) else "torch"
    return impl


def chunk_gated_delta_rule_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int = CHUNK
) -> torch.Tensor:
    """The gated delta rule over rows from zero states in chunked (WY) form, every row, head and chunk at once except
    the chunk-to-chunk state pass; differentiable, fp32 inside. q, k [B, T, H, K] (normalised, q scaled), v [B, T, H,
    V], log-decay g and β [B, T, H] fp32 → o [B, T, H, V] fp32.

    Within a chunk with cumulative decay G_i and entry state S: the deltas E = U - W S solve (I + A) E = β(V - e^G K S)
    with A_ij = β_i e^{G_i - G_j} k_i·k_j (j < i), so U = (I + A)⁻¹ βV and W = (I + A)⁻¹ β e^G K; the outputs are
    O = e^G Q S + (e^{G_i - G_j} q_i·k_j)_{j≤i} E and the exit state e^{G_C} S + (e^{G_C - G} K)ᵀ E.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    pad = (-T) % chunk  # padded tokens have β = 0 and g = 0: they change nothing
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (T + pad) // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, n*C, H, X] -> [B, H, n, C, X]
        return x.reshape(B, n, chunk, H, -1).permute(0, 3, 1, 2, 4)

    Q, Kc, Vc = chunks(q), chunks(k), chunks(v)
    G = chunks(g[..., None])[..., 0].cumsum(-1)  # [B, H, n, C]
    bc = chunks(beta[..., None])[..., 0]  # [B, H, n, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [B, H, n, C, C]
    A = (bc[..., None] * (Kc @ Kc.transpose(-1, -2)) * decay).tril(-1)  # [B, H, n, C, C]
    eye = torch.eye(chunk, device=q.device, dtype=A.dtype)
    rhs = torch.cat([bc[..., None] * Vc, (bc * G.exp())[..., None] * Kc], -1)  # [B, H, n, C, V+K]
    UW = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U, W = UW[..., :V], UW[..., V:]  # [B, H, n, C, V], [B, H, n, C, K]
    P = (Q @ Kc.transpose(-1, -2)) * decay  # [B, H, n, C, C]
    Qg = Q * G.exp()[..., None]  # [B, H, n, C, K]
    G_end = G[..., -1]  # [B, H, n]
    Kd = Kc * (G_end[..., None] - G).exp()[..., None]  # [B, H, n, C, K]
    S = q.new_zeros(B, H, K, V)
    outs = []
    for c in range(n):
        E = U[:, :, c] - W[:, :, c] @ S  # [B, H, C, V]
        outs.append(Qg[:, :, c] @ S + P[:, :, c] @ E)
        S = G_end[:, :, c, None, None].exp() * S + Kd[:, :, c].transpose(-1, -2) @ E  # [B, H, K, V]
    O = torch.stack(outs, 2)  # [B, H, n, C, V]
    return O.permute(0, 2, 3, 1, 4).reshape(B, n * chunk, H, V)[:, :T]


def _mlp(layer: DecoderLayer, x: torch.Tensor) -> torch.Tensor:
    mlp = layer.mlp
    gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)  # [B, T, 2I]
    return mlp.down_proj(silu_and_mul(gate_up))  # [B, T, D]


# Not cuDNN's: on an H200 (torch 2.11) its SDPA failed at step ~300 of a draft training ("mha_graph.execute(...)
# .is_good()"; that training's rows vary in length, pretraining's are all 512 tokens and never met it). With these
# three the same training ran its 3,000 steps.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attention(attn: Attention, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Causal GQA over each row; a `swa` layer's query sees `window_tokens` keys, itself included."""
    B, T, _ = x.shape
    H, HK, Dh = attn.num_heads, attn.num_kv_heads, attn.head_dim
    assert attn.cos_sin is not None, "call model.init_rope(device) first"
    q = attn.q_proj(x).view(B * T, H, Dh)  # [B*T, H, Dh]
    k = attn.k_proj(x).view(B * T, HK, Dh)  # [B*T, HK, Dh]
    v = attn.v_proj(x).view(B, T, HK, Dh)  # [B, T, HK, Dh]
    q, k = apply_rope(q, k, positions.repeat(B), attn.cos_sin)
    q = q.view(B, T, H, Dh).transpose(1, 2)  # [B, H, T, Dh]
    k = k.view(B, T, HK, Dh).transpose(1, 2)  # [B, HK, T, Dh]
    v = v.transpose(1, 2).to(q.dtype)  # [B, HK, T, Dh]
    mask = None
    if attn.window_tokens and attn.window_tokens < T:
        i = torch.arange(T, device=x.device)
        distance = i[:, None] - i[None, :]  # [T, T]: query minus key position
        mask = (distance >= 0) & (distance < attn.window_tokens)  # [T, T]
    with sdpa_kernel(SDPA_BACKENDS):
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=attn.scale, enable_gqa=HK != H
        )  # [B, H, T, Dh]
    return attn.o_proj(o.transpose(1, 2).reshape(B, T, H * Dh))  # [B, T, D]


def _dynamic_conv(jet: JetBlock, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(v̂) [B, T, D_v] with v̂_t[c] = Σ_j κ_t[c, j] u_{t-(W-1)+j}[c] (zeros before each row), fp32 inside."""
    B, T, D = u.shape
    generator = jet.dynamic_conv1d.kernel_generator
    width = generator.w2.weight.shape[0] // D
    h = F.silu(generator.w1(x))  # [B, T, D_g]
    kappa = F.linear(h, generator.w2.weight, generator.w2.bias).float().view(B, T, D, width)  # [B, T, D, W]
    padded = F.pad(u.float(), (0, 0, width - 1, 0))  # [B, T+W-1, D]
    windows = padded.unfold(1, width, 1)  # [B, T, D, W], tap W-1 the current token
    return F.silu((kappa * windows).sum(-1)).to(u.dtype)


def _gated_delta_rule(
    jet: JetBlock, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor, impl: str
) -> torch.Tensor:
    """o [B, T, H, V] from q, k [B, T, H, K], v [B, T, H, V], raw gates a, b [B, T, H]; every row from a zero state."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if impl == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        g, beta = compute_gates(a, b, jet.A_log, jet.dt_bias)  # [B, T, H] fp32
        o, _ = chunk_gated_delta_rule(q, k.to(q.dtype), v.to(q.dtype), g, beta, scale=K**-0.5,
                                      use_qk_l2norm_in_kernel=True)  # fmt: skip
        return o  # [B, T, H, V]
    if impl == "torch":
        with torch.autocast(q.device.type, enabled=False):
            g, beta = compute_gates(a, b, jet.A_log, jet.dt_bias)  # [B, T, H] fp32
            o = chunk_gated_delta_rule_rows(l2_normalize(q) * K**-0.5, l2_normalize(k), v.float(), g, beta)
        return o.to(v.dtype)  # [B, T, H, V]
    # The reference writes final states into pool slots: give it a scratch pool, one slot per row (slot 0 spare).
    scratch = torch.zeros(B + 1, H, K, V, dtype=torch.float32, device=q.device)
    cu_seqlens = torch.arange(B + 1, dtype=torch.int32, device=q.device) * T
    slots = torch.arange(1, B + 1, dtype=torch.int32, device=q.device)
    fresh = torch.zeros(B, dtype=torch.bool, device=q.device)
    o = chunk_gated_delta_rule_prefill(
        q.reshape(B * T, H, K), k.reshape(B * T, H, K), v.reshape(B * T, H, V), a.reshape(B * T, H),
        b.reshape(B * T, H), jet.A_log, jet.dt_bias, scratch, cu_seqlens, slots, fresh,
    )  # fmt: skip
    return o.view(B, T, H, V)


def _jet_block(jet: JetBlock, x: torch.Tensor, impl: str) -> torch.Tensor:
    B, T, _ = x.shape
    H, K, V = jet.num_heads, jet.head_k_dim, jet.head_v_dim
    q = F.silu(jet.q_proj(x)).view(B, T, H, K)  # [B, T, H, K]
    k = F.silu(jet.k_proj(x)).view(B, T, H, K)  # [B, T, H, K]
    u = jet.v_proj(x)  # [B, T, D_v]
    a = jet.a_proj(x)  # [B, T, H]
    b = jet.b_proj(x)  # [B, T, H]
    v = _dynamic_conv(jet, x, u).view(B, T, H, V)  # [B, T, H, V]
    o = _gated_delta_rule(jet, q, k, v, a, b, impl)  # [B, T, H, V]
    gate = jet.g_proj(x).view(B * T, H, V)  # [B*T, H, V]
    y = gated_rms_norm(o.reshape(B * T, H, V).to(gate.dtype), jet.o_norm.weight, gate, jet.norm_eps)
    return jet.o_proj(y.reshape(B, T, H * V))  # [B, T, D]


def forward_hidden(
    model: JetNemotronForCausalLM,
    input_ids: torch.Tensor,
    capture_layers: tuple[int, ...] = (),
    gdr_impl: str = "auto",
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """input_ids [B, T] (each row one sequence from position 0) → (final-normed hidden [B, T, D], the inputs of
    `capture_layers` in that order, each [B, T, D]) — what `model.forward` returns for one PREFILL of each row.

    The residual stream stays in the parameters' dtype (fp32 for training under bf16 autocast): each mixer and MLP
    output is cast to it before the add, which is a no-op when everything is fp32 as at inference in fp32.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [B, T], got shape {tuple(input_ids.shape)}")
    impl = resolve_gdr_impl(gdr_impl, input_ids.device)
    T = input_ids.shape[1]
    positions = torch.arange(T, device=input_ids.device)  # [T]
    hidden = model.model.embed_tokens(input_ids)  # [B, T, D]
    residual: torch.Tensor | None = None
    captured = []
    for i, layer in enumerate(model.model.layers):
        if i in capture_layers:
            captured.append(hidden if residual is None else hidden + residual)
        eps = layer.input_layernorm.eps
        if residual is None:
            residual = hidden
            x = rms_norm(hidden, layer.input_layernorm.weight, eps)
        else:
            x, residual = rms_norm(hidden.to(residual.dtype), layer.input_layernorm.weight, eps, residual)
        if layer.kind == "jet":
            hidden = _jet_block(layer.self_attn, x, impl)
        else:
            hidden = _attention(layer.self_attn, x, positions)
        post = layer.post_attention_layernorm
        x, residual = rms_norm(hidden.to(residual.dtype), post.weight, post.eps, residual)
        hidden = _mlp(layer, x)
    assert residual is not None, "a model has at least one layer"
    norm = model.model.norm
    hidden, _ = rms_norm(hidden.to(residual.dtype), norm.weight, norm.eps, residual)
    by_layer = dict(zip([i for i in range(len(model.model.layers)) if i in capture_layers], captured, strict=True))
    return hidden, [by_layer[i] for i in capture_layers]


def causal_lm_loss(
    model: JetNemotronForCausalLM, input_ids: torch.Tensor, labels: torch.Tensor, gdr_impl: str = "auto"
) -> torch.Tensor:
    """Mean next-token cross-entropy (fp32) of rows input_ids [B, T] against labels [B, T] (-100 is ignored)."""
    hidden, _ = forward_hidden(model, input_ids, gdr_impl=gdr_impl)  # [B, T, D]
    logits = F.linear(hidden, model.lm_head_weight)  # [B, T, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)
