"""`jetserve bench offline`: prefill and decode throughput of the engine per batch size, each beside its roofline
(bytes a step must move over the copy bandwidth measured in the same run; for prefill also FLOPs over measured GEMM
throughput); with a draft, speculative decoding's throughput and speed-up over plain decoding in the same run."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from jetserve.assets import resolve_checkpoint
from jetserve.config import ModelConfig
from jetserve.engine.config import EngineConfig
from jetserve.engine.engine import LLMEngine, resolve_device
from jetserve.engine.memory_plan import slot_bytes_for
from jetserve.engine.sequence import SequenceStatus
from jetserve.model.fusion import fuse_projections
from jetserve.model.jet_nemotron import FP32_PARAMETERS, JetNemotronForCausalLM, cast_model
from jetserve.ops.jit_watch import watch_specializations
from jetserve.sampling_params import SamplingParams

MTBENCH_PROMPTS = 80  # MT-bench's questions: `--dataset mtbench` answers them all at every batch size by default


def add_offline_bench_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="checkpoint folder")
    source.add_argument("--config", help="tiny | 2b | 4b | config JSON: random weights, made on the device")
    p.add_argument("--batch-sizes", default="1,8,64,256", help="comma-separated (default 1,8,64,256)")
    p.add_argument(
        "--input-len", type=int, default=1024, help="prompt tokens per request (random); the longest allowed (mtbench)"
    )
    p.add_argument(
        "--dataset", choices=["random", "mtbench"], default="random",
        help="prompts: random tokens of --input-len, or MT-bench first turns in the model's chat template (needs a "
        "checkpoint with a tokenizer; for τ with a trained draft)",
    )  # fmt: skip
    p.add_argument(
        "--output-len", type=int, default=256,
        help="generated tokens per request (random); the most per request, each stopping at its end of turn (mtbench)",
    )  # fmt: skip
    p.add_argument(
        "--num-prompts", type=int,
        help=f"mtbench: the questions each batch size answers, at most that many at a time (default "
        f"{MTBENCH_PROMPTS}: all; a batch size past it takes as many, the questions cycled)",
    )  # fmt: skip
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--cuda-graph-batch-sizes", metavar="B,B,...",
        help="the decode buckets to capture (default: 1, 2, 4, 8, then every 16 up to the largest batch size); "
        "batches in between pad up, past the largest run eagerly",
    )  # fmt: skip
    p.add_argument(
        "--prefill-graph-max-tokens", type=int, default=EngineConfig.prefill_graph_max_tokens,
        help="prefill steps of up to this many tokens replay a CUDA graph of their token bucket (0: eager; "
        "default: %(default)s)",
    )  # fmt: skip
    p.add_argument(
        "--overlap-scheduling", action=argparse.BooleanOptionalAction, default=True,
        help="launch each decode or verify step before reading the previous one's tokens (default: on)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="ranks (GPUs) the model is split over (one process each)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per result instead of a table")
    spec = p.add_argument_group("speculative decoding (each batch size also decodes plainly, for the speed-up)")
    spec.add_argument("--draft", metavar="DIR", help="EAGLE-3 draft folder, or `random` (a random draft in memory)")
    spec.add_argument("--spec-topk", type=int, help="children per draft node (default 1)")
    spec.add_argument("--spec-steps", type=int, help="draft levels (default 7 for a chain, 3 for a tree)")
    spec.add_argument("--spec-num-draft-tokens", type=int, help="tree nodes per verify step, root included")
    spec.add_argument("--no-spec-adaptive", action="store_true", help="always verify the full tree")
    spec.add_argument(
        "--forced-acceptance", choices=["right", "all", "wrong"],
        help="replace drafted tokens by the target's own greedy continuation from the plain run (right: the best "
        "case, checked by the target; all: the same drafts accepted without the check, the best case's cost where "
        "bf16 rounding makes the verify forward leave the plain text, as with random weights) or tokens that are "
        "never it (wrong: the overhead)",
    )  # fmt: skip
    spec.add_argument(
        "--forced-depth", type=int, metavar="K",
        help="with --forced-acceptance all: accept the first K drafts of each tree (tau = K + 1 where the tree is that "
        "deep), for the speed-up curve over K = 0 .. the tree's depth",
    )  # fmt: skip
    spec.add_argument(
        "--spec-rounds", type=int, default=1, metavar="N",
        help="speculative runs per batch size, each after a plain run of the same requests (default 1); the speed-up "
        "is over every round's tokens and seconds, so that a slow stretch of the host falls on both sides",
    )  # fmt: skip
    p.add_argument("--plot", metavar="FILE.png", help="draw decode tokens/s against batch size, roofline as a line")


WARMUP_TOKENS = 40  # with a draft: its feature ring + 8 instead, so that a ring-full catch-up runs too


@dataclass
class BenchResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_tok_s: float
    prefill_roofline_tok_s: float
    decode_tok_s: float
    decode_roofline_tok_s: float
    decode_efficiency: float  # measured / roofline
    tpot_ms: float  # time per output token: the median decode step
    tpot_roofline_ms: float
    decode_step_bytes: int
    peak_memory_gib: float | None
    copy_bandwidth_gb_s: float
    gemm_tflops: float
    # With a draft: decode throughput over the same steps of both sides (tokens / seconds; every round's with
    # --spec-rounds), speculative over plain.
    plain_decode_tok_s: float | None = None
    spec_decode_tok_s: float | None = None
    spec_speedup: float | None = None
    # ... and end to end: every output token over the whole runs' wall time, prefill steps and part-full batches
    # included (a speculating engine's PREFILL steps also run the draft over the prompt: session 48 measured +5% wall
    # at batch 1 for a speculating engine that never verified, where its full-batch decode steps were +1%).
    plain_e2e_tok_s: float | None = None
    spec_e2e_tok_s: float | None = None
    spec_e2e_speedup: float | None = None
    spec_tau: float | None = None  # tokens per sequence per verify step
    spec_acceptance_per_depth: list[float] | None = None
    spec_draft_ms: float | None = None  # per verify step
    spec_verify_ms: float | None = None
    spec_verify_share: float | None = None  # timed spec-run steps that verified (the rest decoded plainly)
    spec_verify_ahead_share: float | None = None  # verify steps launched before the one before was read (overlap)
    # Where a speed-up below 1 comes from: a slower typical step (medians) or a few slow steps (maxima), in ms.
    plain_step_ms: tuple[float, float] | None = None  # the plain runs' steps: (median, max)
    spec_plain_step_ms: tuple[float, float] | None = None  # the spec run's steps that decoded plainly
    spec_verify_step_ms: tuple[float, float] | None = None  # the spec run's verify steps
    # Triton kernel specializations first built during the timed runs (each a compile or a disk-cache load inside a
    # timed step; 0 when warm): see ops.jit_watch.
    new_specializations: int | None = None
    spec_new_specializations: int | None = None
    # The requests this batch size ran (at most batch_size at a time; mtbench: a finished request's place goes to the
    # next question) and whether each stopped at its end of turn (mtbench) or ran to output_len (random).
    num_prompts: int | None = None
    stops_at_eos: bool = False


def run_offline_bench(args: argparse.Namespace) -> int:
    batch_sizes = _parse_batch_sizes(args.batch_sizes)
    if args.input_len < 1 or args.output_len < 2:
        raise ValueError("--input-len must be ≥ 1 and --output-len ≥ 2 (decode needs a step after the first token)")
    device = resolve_device(args.device)
    args.model = resolve_checkpoint(args.model, "model")  # `default`: the embedded model and draft
    args.draft = draft_arg = resolve_checkpoint(getattr(args, "draft", None), "draft")
    if getattr(args, "forced_acceptance", None) and not draft_arg:
        raise ValueError("--forced-acceptance: needs --draft")
    forced_depth = getattr(args, "forced_depth", None)
    if forced_depth is not None and (getattr(args, "forced_acceptance", None) != "all" or forced_depth < 0):
        raise ValueError("--forced-depth: needs --forced-acceptance all and a depth ≥ 0")
    dataset = getattr(args, "dataset", "random")
    if dataset != "random" and not args.model:
        raise ValueError(f"--dataset {dataset}: needs --model (a checkpoint with a tokenizer)")
    num_prompts = getattr(args, "num_prompts", None)
    if num_prompts is not None and (dataset != "mtbench" or num_prompts < 1):
        raise ValueError("--num-prompts: needs --dataset mtbench and a count ≥ 1")
    spec_rounds = getattr(args, "spec_rounds", 1)
    if spec_rounds < 1 or (spec_rounds > 1 and not draft_arg):
        raise ValueError("--spec-rounds: needs --draft and a count ≥ 1")
    kwargs = _engine_kwargs(args, batch_sizes)
    forced = getattr(args, "forced_acceptance", None)
    tensor_parallel_size = getattr(args, "tensor_parallel_size", 1)
    if tensor_parallel_size > 1:
        engine = _tensor_parallel_engine(args, device, kwargs, tensor_parallel_size)
    else:
        engine = _engine(args, device, kwargs, draft_arg, forced)
    try:
        bandwidth = measure_copy_bandwidth(device)
        tflops = measure_gemm_tflops(device, engine.runner.dtype)
        results = []
        for batch_size in batch_sizes:
            prompts = bench_prompts(engine, dataset, batch_size, args.input_len, args.seed, num_prompts)
            result = bench_batch(engine, prompts, args.output_len, bandwidth, tflops, batch_size,
                                 stop_at_eos=dataset == "mtbench", spec_rounds=spec_rounds)  # fmt: skip
            results.append(result)
            if args.json:
                print(json.dumps(asdict(result)), flush=True)
    finally:
        if hasattr(engine, "shutdown"):  # tensor parallel: stop the other ranks
            engine.shutdown()
    if not args.json:
        print_table(results)
    if args.plot:
        plot(results, args.plot, engine.model_config)
    return 0


def _tensor_parallel_engine(args: argparse.Namespace, device: torch.device, kwargs: dict, size: int) -> LLMEngine:
    """Rank 0's engine of `size` ranks (jetserve.distributed); per-rank rooflines follow from its local shard."""
    from jetserve.engine.tensor_parallel import build_engine

    if getattr(args, "draft", None):
        raise ValueError("--tensor-parallel-size: not with --draft here (the bench steers one process's draft policy)")
    config = EngineConfig(model=args.model or "", dtype=args.dtype, device=str(device), tensor_parallel_size=size,
                          **kwargs)  # fmt: skip
    return build_engine(config, random_config=args.config, seed=args.seed)


def _engine(args: argparse.Namespace, device: torch.device, kwargs: dict, draft_arg, forced) -> LLMEngine:
    if args.model:
        model = tokenizer = None
        if draft_arg == "random":
            from jetserve.model.loader import load_model

            model, tokenizer = load_model(args.model, dtype=args.dtype, device=device), None
        config = EngineConfig(model=args.model, dtype=args.dtype, device=str(device), **kwargs)
    else:
        model, tokenizer = random_model(args.config, args.dtype, device, args.seed), None
        config = EngineConfig(dtype=args.dtype, device=str(device), **kwargs)
    draft = None
    if draft_arg == "random":
        from jetserve.spec.eagle3 import random_draft_model

        draft = random_draft_model(model, seed=args.seed)
    return LLMEngine(config, model=model, tokenizer=tokenizer, draft=draft, forced_acceptance=forced,
                     forced_depth=getattr(args, "forced_depth", None))  # fmt: skip


def _parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"--batch-sizes: {text!r} is not a comma-separated list of integers") from e
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes: {text!r} must list positive integers")
    return sizes


def _engine_kwargs(args: argparse.Namespace, batch_sizes: list[int]) -> dict:
    spec = {}
    if getattr(args, "draft", None):
        spec = dict(
            draft=args.draft, spec_topk=args.spec_topk, spec_steps=args.spec_steps,
            spec_num_draft_tokens=args.spec_num_draft_tokens, spec_adaptive=not args.no_spec_adaptive,
        )  # fmt: skip
    return spec | dict(
        max_num_seqs=max(batch_sizes),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.input_len
        + args.output_len
        + catch_up_steps(max(batch_sizes), args.input_len, args.max_num_batched_tokens),
        page_size=args.page_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        cuda_graph_batch_sizes=getattr(args, "cuda_graph_batch_sizes", None),
        prefill_graph_max_tokens=getattr(args, "prefill_graph_max_tokens", EngineConfig.prefill_graph_max_tokens),
        overlap_scheduling=args.overlap_scheduling,
        seed=args.seed,
    )


@torch.no_grad()
def random_model(
    config_name: str, dtype: str, device: torch.device, seed: int, num_layers: int | None = None
) -> JetNemotronForCausalLM:
    """A model of a preset (or config JSON) with random weights drawn on `device` (speed does not depend on them);
    `num_layers` shortens it, keeping the mix of layer kinds."""
    from jetserve.checkpoint import preset_config
    from jetserve.model.loader import resolve_dtype

    config = ModelConfig.from_dict(preset_config(config_name, num_layers=num_layers))
    torch_dtype = resolve_dtype(dtype, config)
    with torch.device("meta"):
        model = JetNemotronForCausalLM(config)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            param.uniform_(1.0, 16.0, generator=gen).log_()
        elif leaf == "dt_bias":
            dt = torch.empty_like(param).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
            param.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            param.normal_(1.0, 0.1, generator=gen)
        elif leaf == "bias":
            param.normal_(0.0, 0.1, generator=gen)
        else:
            fan_in = config.hidden_size if name.endswith("embed_tokens.weight") else param.shape[-1]
            param.normal_(0.0, fan_in**-0.5, generator=gen)
    model.init_rope(device)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in FP32_PARAMETERS)
    return fuse_projections(cast_model(model, torch_dtype).eval().requires_grad_(False))


def catch_up_steps(batch_size: int, input_len: int, max_num_batched_tokens: int) -> int:
    """Steps a batch's first sequence decodes while the rest still prefill (chunked, a token budget a step): the
    decode run's extra tokens, so that about output_len steps decode the whole batch."""
    return math.ceil(batch_size * input_len / max_num_batched_tokens) - 1


def _timed(device: torch.device, fn, iters: int) -> float:
    """Seconds per call of `fn`, after one warm-up call."""
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device-to-device copy (read + write both counted)."""
    num_bytes = (1 << 30) if device.type == "cuda" else (1 << 26)
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = _timed(device, lambda: dst.copy_(src), 20)
    return 2 * num_bytes / seconds


def measure_gemm_tflops(device: torch.device, dtype: torch.dtype) -> float:
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = _timed(device, lambda: a @ b, 10)
    return 2 * n**3 / seconds / 1e12


def decode_step_bytes(engine: LLMEngine, batch_size: int, context_tokens: int) -> int:
    """What one decode step of `batch_size` sequences of `context_tokens` must move at the least: every weight once
    (the tied embedding once, as the lm_head), the K/V it attends over, and the JetBlock state read and written."""
    config = engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    itemsize = engine.runner.dtype.itemsize
    kv_token_bytes = 2 * config.num_key_value_heads * config.head_dim * itemsize  # K and V, one layer
    num_attn = sum(kind == "attn" for kind in config.layer_types)
    num_swa = sum(kind == "swa" for kind in config.layer_types)
    window = min(context_tokens, config.swa_window_size or 0)
    kv_bytes = batch_size * kv_token_bytes * (num_attn * context_tokens + num_swa * window)
    state_bytes = 2 * batch_size * slot_bytes_for(config, 0, engine.runner.dtype)  # JetBlock state, no SWA ring
    return weight_bytes + kv_bytes + state_bytes


def prefill_flops(engine: LLMEngine, num_tokens: int, input_len: int) -> float:
    """2 FLOPs per weight per token, plus causal attention scores and values in the attention layers."""
    config = engine.model_config
    params = sum(p.numel() for p in engine.model.parameters())
    attn_dim = config.num_attention_heads * config.head_dim
    num_attn = sum(kind == "attn" for kind in config.layer_types)
    num_swa = sum(kind == "swa" for kind in config.layer_types)
    window = min(input_len, config.swa_window_size or 0)
    per_token_keys = num_attn * input_len / 2 + num_swa * window
    return num_tokens * (2 * params + 4 * attn_dim * per_token_keys)


def bench_prompts(
    engine: LLMEngine, dataset: str, batch_size: int, input_len: int, seed: int, num_prompts: int | None = None
) -> list[list[int]]:
    """`batch_size` prompts of random tokens (`input_len` each), or `num_prompts` (default MTBENCH_PROMPTS, at least
    `batch_size`) MT-bench first turns in file order (cycled) in the model's chat template."""
    if dataset == "random":
        gen = torch.Generator().manual_seed(seed + batch_size)
        return torch.randint(0, engine.model_config.vocab_size, (batch_size, input_len), generator=gen).tolist()
    from jetserve.evals.mtbench import load_questions

    if engine.tokenizer is None:
        raise ValueError(f"--dataset {dataset}: the model has no tokenizer")
    questions = load_questions()
    count = max(batch_size, num_prompts or MTBENCH_PROMPTS)
    texts = [questions[i % len(questions)]["turns"][0] for i in range(count)]
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    longest = max(len(p) for p in prompts)
    if longest > input_len:
        raise ValueError(f"--input-len {input_len}: an MT-bench prompt has {longest} tokens; raise it to at least that")
    return prompts


def bench_batch(
    engine: LLMEngine,
    prompts: list[list[int]],
    output_len: int,
    bandwidth: float,
    tflops: float,
    batch_size: int | None = None,
    *,
    stop_at_eos: bool = False,
    spec_rounds: int = 1,
) -> BenchResult:
    """Prefill the first `batch_size` (default: all) of `prompts` alone, then decode `prompts`, at most `batch_size`
    at a time (a finished request's place goes to the next prompt), `output_len` tokens each or, `stop_at_eos`, to
    each one's end of turn within `output_len` — plainly, and speculatively with a draft (`spec_rounds` speculative
    runs, each after a plain one). Decode figures are over the steps that decoded `batch_size` sequences and nothing
    else; the plain ones (TPOT, decode tok/s) are the first plain run's."""
    device = engine.runner.device
    batch_size = batch_size or len(prompts)
    batch = prompts[:batch_size]
    input_len = round(statistics.mean(len(p) for p in prompts))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    extra = catch_up_steps(batch_size, input_len, engine.config.max_num_batched_tokens)
    _warm_up(engine, batch, output_len + extra)
    if engine.spec is not None:
        engine.set_speculation(False)
    # Prefill alone: one token each, so no decode rows mix into the timed steps.
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefill_seconds = _run(engine, batch, params, f"prefill b={batch_size}").seconds
    # Decode: time only the steps that decode the whole batch at once; early-prefilled sequences get the catch-up
    # steps on top (the roofline's context grows by as much).
    params = SamplingParams(temperature=0, max_tokens=output_len + extra, ignore_eos=not stop_at_eos)
    with watch_specializations() as plain_new:
        plain = _run(engine, prompts, params, f"decode  b={batch_size}", batch_size)
    _report_specializations(f"decode  b={batch_size}", plain_new)
    decode_steps = plain.decode_step_seconds
    assert engine.is_idle_and_clean()
    spec_fields = {}
    if engine.spec is not None:
        spec_fields = _bench_speculative(engine, prompts, params, plain, batch_size, spec_rounds)
    if not decode_steps:
        raise ValueError(f"--batch-sizes: {batch_size} never decoded as one batch (too few state slots or pages, or "
                         f"every request ended before the last one started decoding?)")  # fmt: skip
    tpot = statistics.median(decode_steps)
    step_bytes = decode_step_bytes(engine, batch_size, input_len + extra + output_len // 2)
    tpot_roofline = step_bytes / bandwidth
    prefill_tokens = sum(map(len, batch))
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    steps = math.ceil(prefill_tokens / engine.config.max_num_batched_tokens)
    prefill_roofline_s = max(prefill_flops(engine, prefill_tokens, input_len) / (tflops * 1e12),
                             steps * weight_bytes / bandwidth)  # fmt: skip
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return BenchResult(
        batch_size=batch_size,
        input_len=input_len,
        output_len=output_len,
        prefill_tok_s=round(prefill_tokens / prefill_seconds, 1),
        prefill_roofline_tok_s=round(prefill_tokens / prefill_roofline_s, 1),
        decode_tok_s=round(batch_size / tpot, 1),
        decode_roofline_tok_s=round(batch_size / tpot_roofline, 1),
        decode_efficiency=round(tpot_roofline / tpot, 6),
        tpot_ms=round(tpot * 1e3, 4),
        tpot_roofline_ms=round(tpot_roofline * 1e3, 4),
        decode_step_bytes=step_bytes,
        peak_memory_gib=None if peak is None else round(peak, 3),
        copy_bandwidth_gb_s=round(bandwidth / 1e9, 1),
        gemm_tflops=round(tflops, 1),
        new_specializations=sum(plain_new.values()),
        num_prompts=len(prompts),
        stops_at_eos=stop_at_eos,
        **spec_fields,
    )


def _report_specializations(label: str, new: Counter) -> None:
    if new:
        names = ", ".join(f"{name} x{count}" for name, count in new.most_common())
        print(f"{label.strip()}: Triton specialized kernels inside the timed run: {names}", file=sys.stderr)


def _warm_up(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> None:
    """The batch once untimed, plainly and (with a draft) speculatively, for up to WARMUP_TOKENS tokens (with a draft,
    past its feature ring): Triton compiles a kernel per specialization of its integer arguments (== 1, multiples of
    16) on first use, which on a fresh machine cost the first measured run of the draft's catch-up up to seconds per
    step (H200, measured)."""
    tokens = WARMUP_TOKENS if engine.spec is None else engine.spec.ring + 8
    params = SamplingParams(temperature=0, max_tokens=min(tokens, max_tokens), ignore_eos=True)
    if engine.spec is not None:
        engine.set_speculation(False)
    plain = _run(engine, prompts, params, f"warm-up b={len(prompts)}")
    if engine.spec is not None:
        label = f"warm-up spec b={len(prompts)}"
        engine.spec.forced_continuations = {f"{label}-{i}": p + plain.outputs[i] for i, p in enumerate(prompts)}
        engine.set_speculation(True)
        _run(engine, prompts, params, label)
    assert engine.is_idle_and_clean()


def _bench_speculative(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    plain: RunResult,
    batch_size: int,
    rounds: int = 1,
) -> dict:
    """The same requests again with speculation on, `rounds` times, a plain run before each after the first (`plain`
    is the first round's); with forced acceptance, the drafts come from the plain run's greedy continuations.
    Throughput on both sides is tokens over seconds of the steps that decoded the whole batch, over every round."""
    from jetserve.engine.speculative import SpecStats

    spec = engine.spec
    label = f"spec    b={batch_size}"
    spec.forced_continuations = {
        f"{label}-{i}": prompt + plain.outputs[i] for i, prompt in enumerate(prompts)
    }  # fmt: skip
    spec.stats = SpecStats()
    plains, runs = [plain], []
    with watch_specializations() as spec_new:
        for r in range(rounds):
            if r:  # alternate: a slower stretch of the host falls on both sides
                engine.set_speculation(False)
                plains.append(_run(engine, prompts, params, f"decode  b={batch_size} round {r + 1}", batch_size))
            engine.set_speculation(True)
            runs.append(_run(engine, prompts, params, label, batch_size))
    _report_specializations(label, spec_new)
    assert engine.is_idle_and_clean()
    stats = spec.stats
    plain_tok_s = _tokens_per_second(plains)
    spec_tok_s = _tokens_per_second(runs)
    plain_e2e, spec_e2e = _end_to_end_tokens_per_second(plains), _end_to_end_tokens_per_second(runs)
    spec_steps = [step for r in runs for step in r.steps()]  # (seconds, verified) of every round's timed steps
    plain_steps = [t for p in plains for t in p.decode_step_seconds]
    return dict(
        plain_decode_tok_s=round(plain_tok_s, 1),
        spec_decode_tok_s=round(spec_tok_s, 1),
        spec_speedup=round(spec_tok_s / plain_tok_s, 4) if plain_tok_s > 0 else None,
        plain_e2e_tok_s=round(plain_e2e, 1),
        spec_e2e_tok_s=round(spec_e2e, 1),
        spec_e2e_speedup=round(spec_e2e / plain_e2e, 4) if plain_e2e > 0 else None,
        spec_tau=round(stats.mean_acceptance_length, 4),
        spec_acceptance_per_depth=[round(r, 4) for r in stats.acceptance_rate_per_depth],
        spec_draft_ms=round(stats.draft_ms_per_step, 4),
        spec_verify_ms=round(stats.verify_ms_per_step, 4),
        spec_verify_share=round(sum(v for _, v in spec_steps) / max(len(spec_steps), 1), 4),
        spec_verify_ahead_share=round(stats.num_verify_steps_ahead / max(stats.num_verify_steps, 1), 4),
        plain_step_ms=_median_and_max(plain_steps),
        spec_plain_step_ms=_median_and_max([t for t, v in spec_steps if not v]),
        spec_verify_step_ms=_median_and_max([t for t, v in spec_steps if v]),
        spec_new_specializations=sum(spec_new.values()),
    )


@dataclass
class RunResult:
    seconds: float  # the whole run
    decode_step_seconds: list[float]  # each step that decoded the full batch
    decode_tokens: int  # tokens those steps produced
    outputs: list[list[int]]  # each request's output tokens, in prompt order
    step_verified: list[bool] = field(default_factory=list)  # per timed step: did it verify draft trees

    @property
    def verify_steps(self) -> int:
        return sum(self.step_verified)

    def steps(self) -> list[tuple[float, bool]]:
        """(seconds, verified) of each timed step."""
        return list(zip(self.decode_step_seconds, self.step_verified, strict=True))


def _run(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, label: str, full_batch: int = 0
) -> RunResult:
    """Generate to the end, timing the steps that decoded `full_batch` sequences at once. With `full_batch` below
    the prompts, at most that many requests are in the engine at a time: each finished one's place goes to the next
    prompt (request `{label}-{i}` is prompt i)."""
    in_flight = full_batch if 0 < full_batch < len(prompts) else len(prompts)
    for i in range(in_flight):
        engine.add_request(f"{label}-{i}", prompts[i], params)
    next_prompt = in_flight
    total_steps = _estimate_steps(engine, prompts, params, in_flight)
    decode_steps: list[float] = []
    decode_tokens = 0
    step_verified: list[bool] = []
    outputs: dict[str, list[int]] = {}
    step = 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        is_full_decode = full_batch > 0 and _is_full_decode(engine, full_batch)
        verified_before = engine.num_verify_steps
        t0 = time.perf_counter()
        outs = engine.step()
        if is_full_decode:
            decode_steps.append(time.perf_counter() - t0)
            decode_tokens += sum(len(o.new_token_ids) for o in outs)
            step_verified.append(engine.num_verify_steps > verified_before)
        for out in outs:
            if out.finished:
                outputs[out.request_id] = out.output_token_ids
                if next_prompt < len(prompts):
                    engine.add_request(f"{label}-{next_prompt}", prompts[next_prompt], params)
                    next_prompt += 1
        step += 1
        _progress(label, step, total_steps)
    seconds = time.perf_counter() - start
    print(file=sys.stderr)
    ordered = [outputs[f"{label}-{i}"] for i in range(len(prompts))]
    return RunResult(seconds, decode_steps, decode_tokens, ordered, step_verified)


def _tokens_per_second(runs: list[RunResult]) -> float:
    """Decode tokens over the seconds of the steps that decoded the whole batch, summed over `runs`."""
    return sum(r.decode_tokens for r in runs) / max(sum(sum(r.decode_step_seconds) for r in runs), 1e-12)


def _end_to_end_tokens_per_second(runs: list[RunResult]) -> float:
    """Every output token over the whole runs' seconds, summed over `runs`."""
    tokens = sum(len(out) for r in runs for out in r.outputs)
    return tokens / max(sum(r.seconds for r in runs), 1e-12)


def _median_and_max(seconds: list[float]) -> tuple[float, float] | None:
    return (round(statistics.median(seconds) * 1e3, 4), round(max(seconds) * 1e3, 4)) if seconds else None


def _is_full_decode(engine: LLMEngine, batch_size: int) -> bool:
    running = engine.scheduler.running
    return len(running) == batch_size and all(s.is_decoding and s.status == SequenceStatus.RUNNING for s in running)


def _estimate_steps(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, in_flight: int) -> int:
    """Steps if every request runs to max_tokens, `in_flight` at a time (an end of turn makes it fewer)."""
    prefill = math.ceil(sum(len(p) for p in prompts) / engine.config.max_num_batched_tokens)
    return prefill + math.ceil(len(prompts) / max(in_flight, 1)) * ((params.max_tokens or 1) - 1)


def _progress(label: str, done: int, total: int, width: int = 30) -> None:
    """`total` is `_estimate_steps`'s, which counts prefill as if each step's whole budget went to prompts; decode rows
    that ride in prefill steps take some of it (H200, 128 × 64K prompts: 2087 steps against 2078), so past the
    estimate the count is its own total."""
    total = max(total, done)
    filled = min(width, width * done // max(total, 1))
    print(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} steps", end="", file=sys.stderr)


def print_table(results: list[BenchResult]) -> None:
    header = (f"{'batch':>6} {'prefill tok/s':>14} {'(roofline)':>12} {'decode tok/s':>13} {'(roofline)':>12} "
              f"{'eff':>6} {'TPOT ms':>9} {'(roofline)':>11} {'(over)':>8} {'peak GiB':>9}")  # fmt: skip
    print(header)
    for r in results:
        peak = "-" if r.peak_memory_gib is None else f"{r.peak_memory_gib:.2f}"
        print(f"{r.batch_size:>6} {r.prefill_tok_s:>14.0f} {r.prefill_roofline_tok_s:>12.0f} {r.decode_tok_s:>13.1f} "
              f"{r.decode_roofline_tok_s:>12.1f} {r.decode_efficiency:>6.1%} {r.tpot_ms:>9.3f} "
              f"{r.tpot_roofline_ms:>11.3f} {r.tpot_ms - r.tpot_roofline_ms:>8.3f} {peak:>9}")  # fmt: skip
    if results and results[0].spec_decode_tok_s is not None:
        print(f"{'batch':>6} {'plain tok/s':>12} {'spec tok/s':>11} {'speed-up':>9} {'end to end':>11} {'tau':>6} "
              f"{'draft ms':>9} {'verify ms':>10} {'verify steps':>12}  acceptance per depth")  # fmt: skip
        for r in results:
            depths = " ".join(f"{a:.2f}" for a in r.spec_acceptance_per_depth or [])
            print(f"{r.batch_size:>6} {r.plain_decode_tok_s:>12.1f} {r.spec_decode_tok_s:>11.1f} "
                  f"{r.spec_speedup:>8.2f}x {r.spec_e2e_speedup:>10.2f}x {r.spec_tau:>6.2f} {r.spec_draft_ms:>9.3f} "
                  f"{r.spec_verify_ms:>10.3f} {r.spec_verify_share:>12.0%}  {depths}")  # fmt: skip
        for r in results:
            print(f"batch {r.batch_size} step ms, median / max: plain run {_pair(r.plain_step_ms)}; speculating: "
                  f"plain steps {_pair(r.spec_plain_step_ms)}, verify {_pair(r.spec_verify_step_ms)} "
                  f"({r.spec_verify_ahead_share:.0%} launched ahead)")  # fmt: skip
    if results:
        r = results[0]
        if r.stops_at_eos:
            counts = ", ".join(f"{x.num_prompts} at batch {x.batch_size}" for x in results)
            print(f"requests: {counts}, at most the batch size at a time, each to its end of turn (at most "
                  f"{r.output_len} tokens); decode figures over the steps that decoded a full batch")  # fmt: skip
        print(f"copy bandwidth {r.copy_bandwidth_gb_s:.0f} GB/s, GEMM {r.gemm_tflops:.0f} TFLOP/s (measured here); "
              "(over): TPOT beyond its roofline, a step's part that the bandwidth does not set")  # fmt: skip


def _pair(ms: tuple[float, float] | None) -> str:
    return "-" if ms is None else f"{ms[0]:.3f} / {ms[1]:.3f}"


def plot(results: list[BenchResult], path: str, config: ModelConfig) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot: needs matplotlib (pip install matplotlib)") from e
    sizes = [r.batch_size for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(sizes, [r.decode_tok_s for r in results], "o-", label="decode (measured)")
    ax.plot(sizes, [r.decode_roofline_tok_s for r in results], "--", label="decode roofline (bytes / copy bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("output tokens / s")
    r = results[0]
    ax.set_title(f"{config.model_type}, {config.num_hidden_layers} layers: input {r.input_len}, output {r.output_len}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
