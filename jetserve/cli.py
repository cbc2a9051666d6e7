"""The `jetserve` command: generate | make-checkpoint (serve, bench and eval join as they land)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be ≥ 1")
    return value


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete one prompt and print the text")
    p.add_argument("--model", required=True, help="checkpoint folder (config.json, model.safetensors, tokenizer)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=_positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from jetserve.generate import generate_tokens
    from jetserve.model.loader import load_model
    from jetserve.tokenizer import load_tokenizer

    if args.temperature < 0:
        raise ValueError(f"--temperature: {args.temperature} must be ≥ 0")
    if not 0 < args.top_p <= 1:
        raise ValueError(f"--top-p: {args.top_p} must be in (0, 1]")
    if args.top_k < 0:
        raise ValueError(f"--top-k: {args.top_k} must be ≥ 0 (0 turns it off)")
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt_ids = tokenizer.encode(prompt)
    result = generate_tokens(
        model, prompt_ids, args.max_tokens, args.temperature, args.top_p, args.top_k, args.seed,
        stop_token_ids=tokenizer.eos_token_ids,
    )  # fmt: skip
    text = tokenizer.decode(result.token_ids)
    if args.json:
        n = len(result.token_ids)
        print(json.dumps({
            "text": text,
            "token_ids": result.token_ids,
            "num_prompt_tokens": result.num_prompt_tokens,
            "num_generated_tokens": n,
            "finish_reason": result.finish_reason,
            "seconds": round(result.seconds, 6),
            "tokens_per_second": round(n / result.seconds, 3) if result.seconds > 0 else None,
        }))  # fmt: skip
    else:
        print(text)
    return 0


def _add_make_checkpoint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint in the Hugging Face layout")
    p.add_argument("--config", default="tiny", help="tiny | 2b | 4b | path to a config JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=_positive_int)
    p.add_argument("--vocab-size", type=_positive_int)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument(
        "--draft-for", metavar="DIR", help="write a random EAGLE-3 draft (SpecForge layout) for the target in DIR"
    )
    p.add_argument("--draft-vocab-size", type=_positive_int, help="with --draft-for: the draft's reduced vocabulary")
    p.set_defaults(func=_make_checkpoint)


def _make_checkpoint(args: argparse.Namespace) -> int:
    if args.draft_for:
        from jetserve.spec.eagle3 import make_draft_checkpoint

        out = make_draft_checkpoint(args.draft_for, args.out, args.seed, args.draft_vocab_size, args.dtype)
        print(f"wrote {out}")
        return 0
    from jetserve.checkpoint import make_checkpoint

    out = make_checkpoint(args.config, args.out, args.seed, args.num_layers, args.vocab_size, args.dtype)
    print(f"wrote {out}")
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:
    from jetserve.evals.commands import add_eval_parser  # argparse only; httpx loads when an eval runs

    add_eval_parser(sub)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    from jetserve.server.launch import add_serve_arguments, serve  # argparse only; fastapi loads when it serves

    p = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API")
    add_serve_arguments(p)
    p.set_defaults(func=serve)


def _add_bench_serving(bench: argparse._SubParsersAction) -> None:
    from jetserve.server.bench_serving import add_bench_serving_arguments, run_bench_serving

    p = bench.add_parser("serving", help="load a running server: throughput, TTFT, TPOT and ITL percentiles")
    add_bench_serving_arguments(p)
    p.set_defaults(func=run_bench_serving)


def _add_bench_offline(bench: argparse._SubParsersAction) -> None:
    from jetserve.engine.bench_offline import add_offline_bench_arguments, run_offline_bench

    p = bench.add_parser("offline", help="the engine alone: prefill and decode throughput per batch size vs roofline")
    add_offline_bench_arguments(p)
    p.set_defaults(func=run_offline_bench)


# `jetserve bench <kind>`: each entry adds one kind to the `bench` sub-parsers.
BENCH_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_bench_serving, _add_bench_offline]


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks: `serving` (a running server), `offline` (the engine alone)")
    bench = p.add_subparsers(dest="bench_command", required=True)
    for add in BENCH_COMMANDS:
        add(bench)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_generate, _add_make_checkpoint, _add_eval, _add_serve, _add_bench
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetserve", description="Fast, exact inference for Jet-Nemotron.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        # One line, no traceback: bad input is the user's to fix.
        print(f"jetserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
