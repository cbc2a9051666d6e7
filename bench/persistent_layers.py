"""Batch-1 decode's projections in one persistent launch against one launch each (issue 4's fixed step cost, a probe).

Session 53 found that a 2B decode step at batch 1 takes its bytes over the copy bandwidth plus a fixed 0.56 ms (218
kernels, ~2.6 µs each), and that issue 4's target (80% of the roofline on the H200) needs 0.24 ms. Tuning single
kernels has not moved it since session 28. This probe asks, before any of the model is built on it, whether a
persistent kernel does: one program an SM for the whole chain, a grid-wide barrier between dependent phases where
today a kernel ends and the next one starts.

The chain is a JetBlock layer's four projections at one row, `--layers` deep, each layer its own weights (read from
HBM): RMSNorm then the fused input projection (`jet_in` × hidden), o_proj (hidden × channels) over the first
`channels` of its output (a stand-in for the mixer), the residual add, RMSNorm then gate|up (2·mlp × hidden) with
`silu(gate) * up`, down (hidden × mlp), the residual add. A narrow projection (hidden outputs) splits K into fp32
partials; the next phase's programs each add them to the residual and normalise it themselves (every program needs
the whole normed row). Variants, each over the same weights and input, its result checked against `reference`:

- `launched`: the same phase code, one launch per projection (four a layer), in one CUDA graph, with PDL where the
  device has it (the engine's chain today, minus its separate norm launches);
- `persistent`: one launch, one program an SM, a barrier between phases (an arrival counter, polled);
- `persistent+prefetch N`: each program asks L2 for its first N weight tiles of the next phase before it waits;
- `ops`: the engine's own Triton ops for the same projections (`rms_norm`, `linear` with its add-norm, `swiglu_linear`),
  one CUDA graph: what a batch-1 step runs now;
- `barrier`: one launch of only barriers: what one costs.

Predicted before the first run: `persistent` −4 to −8 µs a layer against `launched` (a barrier ~1 µs where a kernel
boundary costs ~2.6), `persistent+prefetch` −8 to −12. Measured (session 54, an H100, docs/performance.md): a barrier
1.04 µs, −9.2 µs a layer with the prefetch — but one program an SM streams each phase ~38% slower than the engine's
kernels, so the best persistent variant was 20% slower than `ops`.
Each figure is the median of CUDA-graph replays; the roofline is the chain's bytes (weights, x and the output once)
over the copy bandwidth measured in the same run. One JSON line per variant with --json FILE.
Usage: python bench/persistent_layers.py [--model 2b] [--layers 28] [--tiles 4/5/4/5/8,...] [--prefetch 1,2,4]
       [--programs-per-sm 1,2] [--json FILE]
       python bench/persistent_layers.py --smoke   (the CPU, the Triton interpreter: launched over 3 programs,
       persistent over 1, both against the reference)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

if "--smoke" in sys.argv:  # the kernels below are defined at import: the interpreter must be chosen before
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from timing import copy_bandwidth, smoke_or_gpu, time_ms, warm_clocks  # noqa: E402

from jetserve.ops.pdl import pdl_enter, pdl_exit, uses_pdl  # noqa: E402

EPS = 1e-6
SPIN_LIMIT = tl.constexpr(1 << 16)  # polls before a barrier gives up and flags it (programs not all resident)
NARROW_BLOCK_N = 16  # a narrow phase's output rows a tile: 96 row tiles x 4 splits = 2.9 items a program on 132 SMs
NARROW_BLOCK_K = 256  # ... and its K tile
NARROW_SPLITS = 4  # a narrow phase's K splits (its fp32 partials, added by the next phase's programs)
LINE = tl.constexpr(64)  # bf16 elements of a 128-byte line (what one L2 prefetch asks for)


@dataclass(frozen=True)
class Chain:
    """One layer's projections: hidden H, the fused input's width, o_proj's K (channels), the MLP's width."""

    hidden: int
    jet_in: int
    channels: int
    mlp: int

    def weights_bytes(self, itemsize: int) -> int:
        h = self.hidden
        return itemsize * (self.jet_in * h + h * self.channels + 2 * self.mlp * h + h * self.mlp)


@dataclass(frozen=True)
class Tiles:
    """A wide phase's rows a tile (whole rows of the hidden size: 4 deal 2214 / 2240 tiles of the 2B's input and
    gate|up projections over 132 SMs within 1.5%), the loads in flight (software-pipeline stages) of the wide, gated
    and narrow loops, warps a program."""

    wide_bn: int = 4
    wide_stages: int = 5
    gated_stages: int = 4
    narrow_stages: int = 5
    warps: int = 8

    @classmethod
    def parse(cls, text: str) -> Tiles:
        """ "bn/wide/gated/narrow/warps", e.g. "4/5/4/5/8"."""
        return cls(*map(int, text.split("/")))

    def __str__(self) -> str:
        return f"{self.wide_bn}/{self.wide_stages}/{self.gated_stages}/{self.narrow_stages}/{self.warps}"


# the smoke run's chain: small, but each narrow phase's four K splits hold columns and its last tile is partial, and the
# input projection's rows do not fill its last tile
SMOKE_CHAIN = Chain(hidden=32, jet_in=1030, channels=1000, mlp=1800)


def chain_for(model: str) -> Chain:
    if model == "smoke":
        return SMOKE_CHAIN
    from common import SHAPES

    s = SHAPES[model]
    return Chain(s.hidden, s.jet_in, s.channels, s.mlp)


def split_len(k: int) -> int:
    """A narrow phase's K split: K over NARROW_SPLITS, rounded up to whole NARROW_BLOCK_K tiles."""
    return triton.cdiv(triton.cdiv(k, NARROW_SPLITS), NARROW_BLOCK_K) * NARROW_BLOCK_K


@triton.jit
def _grid_sync(bar, target, flag):
    """Arrive at the counter `bar`, then poll it until `target` programs have (the counter only grows within a launch:
    barrier j of P programs waits for (j + 1) P). After SPIN_LIMIT polls it gives up and sets `flag`, so a launch whose
    programs are not all resident reports itself instead of hanging."""
    tl.debug_barrier()  # every thread's stores before the arrival (one thread arrives, releasing what it saw)
    tl.atomic_add(bar, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
    polls = 0
    while (seen < target) & (polls < SPIN_LIMIT):
        seen = tl.atomic_add(bar, 0, sem="acquire", scope="gpu")
        polls += 1
    if seen < target:
        tl.atomic_xchg(flag, 1)


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at `ptrs` (sm_90 `prefetch.global.L2`); nothing is loaded into registers."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _prefetch_wide(w, pid, N, H: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr, GATED: tl.constexpr):
    """L2 prefetch of this program's first tile of a wide phase (BN whole rows; with GATED their up rows too)."""
    r_n = tl.minimum(pid * BN + tl.arange(0, BN), N - 1).to(tl.int64)
    o_l = tl.minimum(tl.arange(0, HB // LINE) * LINE, H - 1)
    _prefetch_l2(w + r_n[:, None] * H + o_l[None, :])
    if GATED:
        _prefetch_l2(w + (r_n + N)[:, None] * H + o_l[None, :])


@triton.jit
def _prefetch_narrow(w, pid, K, split, S, TILES: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """L2 prefetch of this program's first TILES K tiles of a narrow phase (its first item's rows)."""
    o_n = (pid // S) * BN + tl.arange(0, BN)
    o_l = tl.minimum((pid % S) * split + tl.arange(0, TILES * BK // LINE) * LINE, K - 1)
    _prefetch_l2(w + o_n.to(tl.int64)[:, None] * K + o_l[None, :])


@triton.jit
def _wide_phase(
    w,  # [N, H] (GATED: [2N, H], gate rows then up rows)
    y,  # [N] out (GATED: silu(gate) * up)
    r_in,  # [H] fp32, the residual as the phase before left it
    r_out,  # [H] fp32 out (program 0): r_in plus the partials, for the phase after the next
    partial,  # [num_partials, H] fp32, the previous narrow phase's K splits
    num_partials,
    norm_w,  # [H]
    eps,
    pid,
    P,
    N,
    H: tl.constexpr,
    HB: tl.constexpr,  # next power of two ≥ H
    BN: tl.constexpr,
    GATED: tl.constexpr,
    STAGES: tl.constexpr,
):
    """y = W @ rms_norm(r) (rounded to W's dtype as a GEMM's output is; GATED: silu(gate) * up rounded as
    `silu_and_mul` rounds). Every program adds the partials and normalises the whole row itself; tiles of BN rows are
    dealt round-robin over the P programs."""
    o_h = tl.arange(0, HB)
    m_h = o_h < H
    r = tl.load(r_in + o_h, mask=m_h, other=0.0, cache_modifier=".cg")  # [HB]
    for s in range(num_partials):
        r += tl.load(partial + s * H + o_h, mask=m_h, other=0.0, cache_modifier=".cg")
    if pid == 0:
        tl.store(r_out + o_h, r, mask=m_h)
    nw = tl.load(norm_w + o_h, mask=m_h, other=0.0).to(tl.float32)
    xn = (r * tl.rsqrt(tl.sum(r * r) / H + eps) * nw).to(w.dtype.element_ty).to(tl.float32)  # [HB]
    for t in tl.range(pid, tl.cdiv(N, BN), P, num_stages=STAGES):
        o_n = t * BN + tl.arange(0, BN)
        r_n = tl.minimum(o_n, N - 1).to(tl.int64)  # rows past N read row N-1; their outputs are dropped
        p_w = w + r_n[:, None] * H + o_h[None, :]  # [BN, HB]
        out = tl.sum(tl.load(p_w, mask=m_h[None, :], other=0.0).to(tl.float32) * xn[None, :], axis=1)  # [BN]
        if GATED:
            up = tl.sum(tl.load(p_w + N * H, mask=m_h[None, :], other=0.0).to(tl.float32) * xn[None, :], axis=1)
            gate = out.to(y.dtype.element_ty).to(tl.float32)
            out = gate * tl.sigmoid(gate) * up.to(y.dtype.element_ty).to(tl.float32)
        tl.store(y + o_n, out.to(y.dtype.element_ty), mask=o_n < N)


@triton.jit
def _narrow_phase(
    w,  # [H, K]
    a,  # [K] (its row stride is 1; only the first K entries are read)
    partial,  # [S, H] fp32 out: partial[s] = W[:, split s] @ a[split s]
    pid,
    P,
    K,
    split,  # K a split (a multiple of BK)
    S,
    H: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STAGES: tl.constexpr,
):
    """K-split GEMV with H outputs: items (BN rows, one split) dealt round-robin over the programs, each program's
    items and their K tiles walked as one loop (one software pipeline across items)."""
    tiles = split // BK
    num_items = (H // BN) * S
    steps = tl.cdiv(num_items - pid, P) * tiles
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for j in tl.range(steps, num_stages=STAGES):
        item = pid + (j // tiles) * P
        kt = j % tiles
        o_n = (item // S) * BN + tl.arange(0, BN)
        start = (item % S) * split
        o_k = start + kt * BK + tl.arange(0, BK)
        m_k = o_k < K
        wt = tl.load(w + o_n.to(tl.int64)[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
        av = tl.load(a + o_k, mask=m_k, other=0.0, cache_modifier=".cg")
        acc += wt.to(tl.float32) * av.to(tl.float32)[None, :]
        if kt == tiles - 1:
            tl.store(partial + (item % S) * H + o_n, tl.sum(acc, axis=1))
            acc = tl.zeros([BN, BK], dtype=tl.float32)


@triton.jit
def _persistent_kernel(
    w_in,  # [L, jet_in, H]
    w_o,  # [L, H, C]
    w_gu,  # [L, 2 I, H]
    w_d,  # [L, H, I]
    norm_w,  # [2 L + 1, H]: each RMSNorm's weight (the last one unused)
    y_in,  # [jet_in] scratch: the input projection's output
    act,  # [I] scratch: silu(gate) * up
    r_buf,  # [2, H] fp32: the residual, alternating (r_buf[0] holds x at the start; the result lands in r_buf[1])
    partial,  # [NARROW_SPLITS, H] fp32 scratch
    bar,  # [1] int32, 0 at the launch
    flag,  # [1] int32, set if a barrier gave up
    eps,
    L,
    N_in,
    C,
    I,
    split_o,
    split_d,
    S,
    H: tl.constexpr,
    HB: tl.constexpr,
    WIDE_BN: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PREFETCH: tl.constexpr,  # K tiles (a narrow phase) / tiles (a wide one, ≥ 1 means one) asked of L2 before a wait
    WS: tl.constexpr,  # the wide, gated and narrow loops' stages
    GS: tl.constexpr,
    NS: tl.constexpr,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    syncs = 0
    for layer in range(L):
        q = 2 * layer  # the wide phases so far: the residual's buffer alternates with them
        num_partials = tl.where(layer == 0, 0, S)  # layer 0's residual is x alone
        _wide_phase(w_in + layer * N_in * H, y_in, r_buf + (q % 2) * H, r_buf + ((q + 1) % 2) * H, partial,
                    num_partials, norm_w + q * H, eps, pid, P, N_in, H, HB, WIDE_BN, False, WS)  # fmt: skip
        if PREFETCH > 0:
            _prefetch_narrow(w_o + layer * H * C, pid, C, split_o, S, PREFETCH, BN, BK)
        syncs += 1
        _grid_sync(bar, syncs * P, flag)
        _narrow_phase(w_o + layer * H * C, y_in, partial, pid, P, C, split_o, S, H, BN, BK, NS)
        if PREFETCH > 0:
            _prefetch_wide(w_gu + layer * 2 * I * H, pid, I, H, HB, WIDE_BN, True)
        syncs += 1
        _grid_sync(bar, syncs * P, flag)
        _wide_phase(w_gu + layer * 2 * I * H, act, r_buf + ((q + 1) % 2) * H, r_buf + (q % 2) * H, partial, S,
                    norm_w + (q + 1) * H, eps, pid, P, I, H, HB, WIDE_BN, True, GS)  # fmt: skip
        if PREFETCH > 0:
            _prefetch_narrow(w_d + layer * H * I, pid, I, split_d, S, PREFETCH, BN, BK)
        syncs += 1
        _grid_sync(bar, syncs * P, flag)
        _narrow_phase(w_d + layer * H * I, act, partial, pid, P, I, split_d, S, H, BN, BK, NS)
        if PREFETCH > 0:
            if layer + 1 < L:
                _prefetch_wide(w_in + (layer + 1) * N_in * H, pid, N_in, H, HB, WIDE_BN, False)
        syncs += 1
        _grid_sync(bar, syncs * P, flag)
    # the last down projection's partials into the residual: r_buf[1] = r_buf[0] + Σ partials (no rows to multiply)
    _wide_phase(w_in, y_in, r_buf, r_buf + H, partial, S, norm_w + 2 * L * H, eps, pid, P, 0, H, HB, WIDE_BN, False, WS)


@triton.jit
def _wide_kernel(w, y, r_in, r_out, partial, num_partials, norm_w, eps, N,
                 H: tl.constexpr, HB: tl.constexpr, BN: tl.constexpr, GATED: tl.constexpr, STAGES: tl.constexpr,
                 PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(PDL)
    _wide_phase(w, y, r_in, r_out, partial, num_partials, norm_w, eps, tl.program_id(0), tl.num_programs(0), N, H, HB,
                BN, GATED, STAGES)  # fmt: skip
    pdl_exit(PDL)


@triton.jit
def _narrow_kernel(w, a, partial, K, split, S, H: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   STAGES: tl.constexpr, PDL: tl.constexpr = False):  # fmt: skip
    pdl_enter(PDL)
    _narrow_phase(w, a, partial, tl.program_id(0), tl.num_programs(0), K, split, S, H, BN, BK, STAGES)
    pdl_exit(PDL)


@triton.jit
def _barriers_kernel(bar, flag, count):
    P = tl.num_programs(0)
    for j in range(count):
        _grid_sync(bar, (j + 1) * P, flag)


@dataclass
class Weights:
    """Every layer's weights (stacked), the norms' weights, the input row."""

    w_in: torch.Tensor  # [L, jet_in, H]
    w_o: torch.Tensor  # [L, H, C]
    w_gu: torch.Tensor  # [L, 2 I, H]
    w_d: torch.Tensor  # [L, H, I]
    norm_w: torch.Tensor  # [2 L + 1, H]
    x: torch.Tensor  # [H] fp32


def make_weights(chain: Chain, layers: int, dtype: torch.dtype, device: str, seed: int = 0) -> Weights:
    g = torch.Generator(device=device).manual_seed(seed)
    h = chain.hidden

    def rand(*shape: int, scale: float) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    return Weights(
        w_in=rand(layers, chain.jet_in, h, scale=h**-0.5),
        w_o=rand(layers, h, chain.channels, scale=chain.channels**-0.5),
        w_gu=rand(layers, 2 * chain.mlp, h, scale=h**-0.5),
        w_d=rand(layers, h, chain.mlp, scale=chain.mlp**-0.5),
        norm_w=(1 + 0.1 * torch.randn(2 * layers + 1, h, device=device, generator=g)).to(dtype),
        x=torch.randn(h, device=device, generator=g),
    )


def reference(wt: Weights, eps: float = EPS) -> torch.Tensor:
    """The chain in PyTorch, rounded where the kernels round: the normed row and each GEMM's output to the weights'
    dtype, the residual kept in fp32. → the final residual [H] fp32."""
    dtype = wt.w_in.dtype
    r = wt.x.float()
    channels = wt.w_o.shape[2]
    mlp = wt.w_d.shape[2]

    def normed(r: torch.Tensor, i: int) -> torch.Tensor:
        return (r * torch.rsqrt(r.square().mean() + eps) * wt.norm_w[i].float()).to(dtype).float()

    for layer in range(wt.w_in.shape[0]):
        y_in = (wt.w_in[layer].float() @ normed(r, 2 * layer)).to(dtype)
        r = r + wt.w_o[layer].float() @ y_in[:channels].float()
        gu = (wt.w_gu[layer].float() @ normed(r, 2 * layer + 1)).to(dtype).float()
        gate, up = gu[:mlp], gu[mlp:]
        act = (gate * torch.sigmoid(gate) * up).to(dtype)
        r = r + wt.w_d[layer].float() @ act.float()
    return r


class Runner:
    """The Triton variants over one set of weights and tiles: scratch made once, each call runs the whole chain."""

    def __init__(self, wt: Weights, programs: int, tiles: Tiles, pdl: bool) -> None:
        self.wt, self.programs, self.tiles, self.pdl = wt, programs, tiles, pdl
        layers, self.n_in, self.h = wt.w_in.shape[:3]
        self.layers, self.c, self.i = layers, wt.w_o.shape[2], wt.w_d.shape[2]
        dev, dtype = wt.x.device, wt.w_in.dtype
        self.y_in = torch.empty(self.n_in, device=dev, dtype=dtype)
        self.act = torch.empty(self.i, device=dev, dtype=dtype)
        self.r_buf = torch.empty(2, self.h, device=dev, dtype=torch.float32)
        self.partial = torch.empty(NARROW_SPLITS, self.h, device=dev, dtype=torch.float32)
        self.bar = torch.zeros(1, device=dev, dtype=torch.int32)
        self.flag = torch.zeros(1, device=dev, dtype=torch.int32)
        self.hb = triton.next_power_of_2(self.h)
        self.split_o, self.split_d = split_len(self.c), split_len(self.i)
        assert self.h % NARROW_BLOCK_N == 0, "the hidden size must be a multiple of NARROW_BLOCK_N"

    def persistent(self, prefetch: int = 0) -> torch.Tensor:
        """The chain in one launch (`programs` must all be resident at once: one an SM)."""
        self.r_buf[0].copy_(self.wt.x)
        self.bar.zero_()
        wt, t = self.wt, self.tiles
        _persistent_kernel[(self.programs,)](
            wt.w_in, wt.w_o, wt.w_gu, wt.w_d, wt.norm_w, self.y_in, self.act, self.r_buf, self.partial, self.bar,
            self.flag, EPS, self.layers, self.n_in, self.c, self.i, self.split_o, self.split_d, NARROW_SPLITS,
            H=self.h, HB=self.hb, WIDE_BN=t.wide_bn, BN=NARROW_BLOCK_N, BK=NARROW_BLOCK_K, PREFETCH=prefetch,
            WS=t.wide_stages, GS=t.gated_stages, NS=t.narrow_stages, num_warps=t.warps,
        )  # fmt: skip
        return self.r_buf[1]

    def launched(self) -> torch.Tensor:
        """The same phases, one launch each (four a layer and the last residual add), PDL where the device has it."""
        self.r_buf[0].copy_(self.wt.x)
        wt, t, grid = self.wt, self.tiles, (self.programs,)
        opts = {"PDL": True, "launch_pdl": True, "num_warps": t.warps} if self.pdl else {"num_warps": t.warps}
        wide = {"H": self.h, "HB": self.hb, "BN": t.wide_bn, **opts}
        narrow = {"H": self.h, "BN": NARROW_BLOCK_N, "BK": NARROW_BLOCK_K, "STAGES": t.narrow_stages, **opts}
        r0, r1, split = self.r_buf[0], self.r_buf[1], NARROW_SPLITS
        for layer in range(self.layers):
            norms = wt.norm_w[2 * layer :]
            _wide_kernel[grid](wt.w_in[layer], self.y_in, r0, r1, self.partial, 0 if layer == 0 else split, norms[0],
                               EPS, self.n_in, GATED=False, STAGES=t.wide_stages, **wide)  # fmt: skip
            _narrow_kernel[grid](wt.w_o[layer], self.y_in, self.partial, self.c, self.split_o, split, **narrow)
            _wide_kernel[grid](wt.w_gu[layer], self.act, r1, r0, self.partial, split, norms[1], EPS, self.i,
                               GATED=True, STAGES=t.gated_stages, **wide)  # fmt: skip
            _narrow_kernel[grid](wt.w_d[layer], self.act, self.partial, self.i, self.split_d, split, **narrow)
        _wide_kernel[grid](wt.w_in[0], self.y_in, r0, r1, self.partial, split, wt.norm_w[-1], EPS, 0, GATED=False,
                           STAGES=t.wide_stages, **wide)  # fmt: skip
        return r1

    def barriers(self, count: int) -> None:
        """`count` barriers in one launch, nothing else."""
        self.bar.zero_()
        _barriers_kernel[(self.programs,)](self.bar, self.flag, count, num_warps=self.tiles.warps)


def engine_ops(wt: Weights) -> torch.Tensor:
    """The same chain on the engine's ops as a batch-1 decode step calls them (the Triton backend on CUDA): layer 0's
    RMSNorm, the input projection, o_proj with the residual add and the next RMSNorm, gate|up, the SwiGLU down
    projection with the add and the next norm. Its residual is in the weights' dtype, as the model's is."""
    from jetserve.ops.linear import linear, swiglu_linear
    from jetserve.ops.norm import rms_norm

    channels = wt.w_o.shape[2]
    x = wt.x.to(wt.w_in.dtype)[None]  # [1, H]
    xn = rms_norm(x, wt.norm_w[0], EPS)
    r = x
    for layer in range(wt.w_in.shape[0]):
        y_in = linear(xn, wt.w_in[layer])
        xn, r = linear(y_in[:, :channels], wt.w_o[layer], add_norm=(r, wt.norm_w[2 * layer + 1], EPS))
        gu = linear(xn, wt.w_gu[layer])
        xn, r = swiglu_linear(gu, wt.w_d[layer], add_norm=(r, wt.norm_w[2 * layer + 2], EPS))
    return r[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="2b")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--prefetch", default="1,2,4", help="K tiles asked of L2 before each barrier, one variant each")
    p.add_argument("--tiles", default=str(Tiles()), help="tilings to run, comma-separated: wide rows / wide, gated "
                   "and narrow stages / warps (the first also for `launched`)")  # fmt: skip
    p.add_argument("--programs-per-sm", default="1", help="programs an SM, comma-separated: 2 needs the tiling's "
                   "registers and shared memory to let two stay resident (e.g. 4 warps)")  # fmt: skip
    p.add_argument("--json", default=None, help="append one JSON line per variant to this file")
    p.add_argument("--smoke", action="store_true", help="the CPU, the Triton interpreter, fp32, the smoke shapes")
    args = p.parse_args()
    device, dtype = smoke_or_gpu(args.smoke)
    on_gpu = device == "cuda"
    chain = chain_for(args.model if on_gpu else "smoke")
    layers = args.layers if on_gpu else 2
    wt = make_weights(chain, layers, dtype, device)
    expected = reference(wt)
    tilings = [Tiles.parse(t) for t in args.tiles.split(",")]
    pdl = uses_pdl(wt.x)
    if on_gpu:
        programs = torch.cuda.get_device_properties(device).multi_processor_count
        first = Runner(wt, programs, tilings[0], pdl)
        variants = [
            (f"launched {tilings[0]}", first, first.launched),
            ("ops (the engine's)", first, lambda: engine_ops(wt)),
        ]
        for per_sm in map(int, args.programs_per_sm.split(",")):
            for tiles in tilings:
                run = Runner(wt, programs * per_sm, tiles, pdl)
                label = f"{tiles} x{per_sm}"
                if per_sm > 1:
                    variants.append((f"launched {label}", run, run.launched))
                variants.append((f"persistent {label}", run, run.persistent))
                variants += [(f"persistent {label} +prefetch {n}", run, lambda run=run, n=n: run.persistent(n))
                             for n in map(int, args.prefetch.split(","))]  # fmt: skip
        warm_clocks(device, first.launched)
        copy_bw = copy_bandwidth(device)
        name = torch.cuda.get_device_name()
    else:  # the interpreter runs programs one after another: a barrier holds with one program only
        programs, copy_bw, name = 1, 0.0, "cpu (Triton interpreter)"
        spread, alone = Runner(wt, 3, tilings[0], pdl), Runner(wt, 1, tilings[0], pdl)
        variants = [
            ("launched, 3 programs", spread, spread.launched),
            ("persistent, 1 program", alone, alone.persistent),
        ]
    nbytes = chain.weights_bytes(dtype.itemsize) * layers
    roof_us = nbytes / copy_bw * 1e6 if copy_bw else 0.0
    print(f"{name}, {chain} x {layers} layers, {programs} programs, PDL {'on' if pdl else 'off'}, "
          f"copy {copy_bw / 1e9:.0f} GB/s, roofline {roof_us:.1f} µs ({roof_us / layers:.2f} a layer)")  # fmt: skip
    print(f"{'variant':<34} {'µs':>9} {'µs/layer':>9} {'% roof':>7} {'max |diff|/max':>15}")
    scale = expected.abs().max().item()
    rows = []
    for label, run, fn in variants:
        run.flag.zero_()
        diff = ((fn().float() - expected).abs().max() / scale).item()
        if run.flag.item():  # programs not all resident: this tiling cannot run persistent at this count
            print(f"{label:<34} skipped: a barrier gave up (its programs were not all resident)")
            continue
        tol = 5e-2 if label.startswith("ops") else 1e-2 if on_gpu else 1e-4
        if not diff < tol:
            raise SystemExit(f"{label}: result off by {diff:.3g} of its largest value (tolerance {tol})")
        us = time_ms(fn, device) * 1e3
        pct = 100 * roof_us / us if roof_us else 0.0
        print(f"{label:<34} {us:9.1f} {us / layers:9.2f} {pct:6.1f}% {diff:15.2e}")
        rows.append({"bench": "persistent_layers", "variant": label, "device": name, "chain": str(chain),
                     "layers": layers, "programs": run.programs, "us": us, "us_per_layer": us / layers,
                     "roofline_us": roof_us, "copy_bandwidth_gb_s": copy_bw / 1e9, "max_rel_diff": diff})  # fmt: skip
    if on_gpu:
        run = variants[0][1]
        for count in (112, 448):
            run.flag.zero_()
            us = time_ms(lambda count=count: run.barriers(count), device) * 1e3
            if run.flag.item():
                raise SystemExit("barriers: a barrier gave up")
            print(f"{f'barriers x {count}':<34} {us:9.1f} {us / count:9.3f} µs a barrier")
            rows.append({"bench": "persistent_layers", "variant": f"barriers x {count}", "device": name,
                         "programs": programs, "us": us, "us_per_barrier": us / count})  # fmt: skip
    if args.json:
        with open(args.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
