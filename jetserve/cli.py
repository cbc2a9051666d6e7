"""The `jetserve` command: generate | make-checkpoint | serve | bench offline|serving | eval."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from jetserve.engine.args import positive_int


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from jetserve.engine.args import add_engine_arguments

    p = sub.add_parser("generate", help="complete one prompt on the engine and print the text")
    p.add_argument(
        "--model", default="default", help="checkpoint folder (config.json, weights, tokenizer), or `default` (the "
        "embedded default model; the default)",
    )  # fmt: skip
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the request")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    add_engine_arguments(p, skip=("model", "seed"))
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    import dataclasses
    import time

    from jetserve.engine.args import engine_config_from_args
    from jetserve.llm import LLM
    from jetserve.sampling_params import SamplingParams

    # Validated before the model loads, so a typo costs no start-up.
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
    )  # fmt: skip
    llm = LLM(**dataclasses.asdict(engine_config_from_args(args, model=args.model)))
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise ValueError(f"--model: {args.model} has no tokenizer.json")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    start = time.perf_counter()
    (out,) = llm.generate([tokenizer.encode(prompt)], params)  # a list of one prompt, even an empty one
    seconds = time.perf_counter() - start
    if not args.json:
        print(out.text)
        return 0
    n = len(out.output_token_ids)
    print(json.dumps({
        "text": out.text,
        "token_ids": list(out.output_token_ids),
        "num_prompt_tokens": len(out.prompt_token_ids),
        "num_generated_tokens": n,
        "finish_reason": out.finish_reason,
        "seconds": round(seconds, 6),
        "tokens_per_second": round(n / seconds, 3) if seconds > 0 else None,
    }))  # fmt: skip
    return 0


def _add_make_checkpoint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint in the Hugging Face layout")
    p.add_argument("--config", default="tiny", help="tiny | 2b | 4b | path to a config JSON")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-layers", type=positive_int)
    p.add_argument("--vocab-size", type=positive_int)
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument(
        "--draft-for", metavar="DIR", help="write a random EAGLE-3 draft (SpecForge layout) for the target in DIR"
    )
    p.add_argument("--draft-vocab-size", type=positive_int, help="with --draft-for: the draft's reduced vocabulary")
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
    except (ValueError, OSError) as e:
        # One line, no traceback: bad input (or a path or port the system refuses) is the user's to fix.
        print(f"jetserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
