"""`jetserve eval gsm8k | mmlu | mtbench | mmmu | compare`: argument parsing and the run → table → JSON flow of each."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from jetserve.engine.args import positive_int

DEFAULT_BASE_URL = "http://127.0.0.1:8000"


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be ≥ 0")
    return value


def _add_server_args(
    p: argparse.ArgumentParser, parallel: int, max_tokens: int, limit_help: str = "evaluate only the first N questions"
) -> None:
    p.add_argument("--base-url", default=DEFAULT_BASE_URL, help="the jetserve server (with or without /v1)")
    p.add_argument("--model", help="model name sent in requests (default: the first one /v1/models lists)")
    p.add_argument("--api-key", help="sent as a bearer token when the server needs one")
    p.add_argument("--parallel", type=positive_int, default=parallel, help="requests in flight at once")
    p.add_argument("--limit", type=positive_int, help=limit_help)
    p.add_argument("--max-tokens", type=positive_int, default=max_tokens, help="output tokens per request at most")
    p.add_argument("--label", help="inference type shown by compare (default: speculative or standard, from /metrics)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one request may take")
    p.add_argument("--out", help="result JSON path (default: ./jetserve-eval-<eval>-<UTC time>.json)")


def add_eval_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="accuracy and speed evals against a running server; compare their results")
    evals = p.add_subparsers(dest="eval_command", required=True)

    g = evals.add_parser("gsm8k", help="GSM8K few-shot chain of thought (lm-eval gsm8k format), greedy")
    _add_server_args(g, parallel=64, max_tokens=256)
    g.add_argument("--num-shots", type=_non_negative_int, default=8)
    g.set_defaults(func=_run_gsm8k)

    m = evals.add_parser("mmlu", help="MMLU k-shot, by choice log-likelihood or generation")
    _add_server_args(m, parallel=64, max_tokens=8, limit_help="evaluate only the first N questions of each subject")
    m.add_argument("--num-shots", type=_non_negative_int, default=5)
    m.add_argument("--subjects", nargs="+", metavar="SUBJECT", help="default: all 57")
    m.add_argument("--mode", choices=["logprob", "generate"], default="logprob")
    m.add_argument("--list-subjects", action="store_true", help="print the subject names and exit")
    m.set_defaults(func=_run_mmlu)

    t = evals.add_parser("mtbench", help="MT-bench 80 two-turn questions, greedy: speed and τ (no judge)")
    _add_server_args(t, parallel=1, max_tokens=1024)
    t.set_defaults(func=_run_mtbench)

    v = evals.add_parser("mmmu", help="MMMU (images) from a local copy of its parquet files, greedy, reference parsing")
    _add_server_args(v, parallel=16, max_tokens=64, limit_help="evaluate only the first N questions of each subject")
    v.add_argument("--data-dir", required=True, help="a local MMMU/MMMU snapshot: <Subject>/<split>-*.parquet")
    v.add_argument("--split", default="validation", help="dev | validation (test has no public answers)")
    v.add_argument("--subjects", nargs="+", metavar="SUBJECT", help="default: every subject folder found")
    v.set_defaults(func=_run_mmmu)

    c = evals.add_parser("compare", help="table of results (model + inference → GSM8K, MMLU, τ), flags differences")
    c.add_argument("results", nargs="+", metavar="RESULT.json", help="eval result files; the first row is the baseline")
    c.add_argument("--out", help="also write the comparison as JSON")
    c.add_argument("--fail-on-flag", action="store_true", help="exit 1 when an accuracy difference is flagged")
    c.set_defaults(func=_run_compare)


def _client(args: argparse.Namespace) -> Any:
    from jetserve.evals.client import EvalClient

    return EvalClient(args.base_url, api_key=args.api_key, timeout_s=args.timeout, max_connections=args.parallel)


def _finish(result: dict[str, Any], table: str, out: str | None) -> int:
    from jetserve.evals.results import write_result

    path = write_result(result, out)
    print(table)
    print(f"wrote {path}")
    return 0


def _run_gsm8k(args: argparse.Namespace) -> int:
    from jetserve.evals import gsm8k

    with _client(args) as client:
        model = client.model_name(args.model)
        result = gsm8k.run(client, model, args.num_shots, args.limit, args.parallel, args.max_tokens, args.label)
    return _finish(result, gsm8k.summary_table(result), args.out)


def _run_mmlu(args: argparse.Namespace) -> int:
    from jetserve.evals import mmlu

    if args.list_subjects:
        print("\n".join(mmlu.subjects()))
        return 0
    with _client(args) as client:
        model = client.model_name(args.model)
        result = mmlu.run(client, model, args.num_shots, args.subjects, args.limit, args.mode, args.parallel,
                          args.max_tokens, args.label)  # fmt: skip
    return _finish(result, mmlu.summary_table(result), args.out)


def _run_mtbench(args: argparse.Namespace) -> int:
    from jetserve.evals import mtbench

    with _client(args) as client:
        model = client.model_name(args.model)
        result = mtbench.run(client, model, args.limit, args.parallel, args.max_tokens, args.label)
    return _finish(result, mtbench.summary_table(result), args.out)


def _run_mmmu(args: argparse.Namespace) -> int:
    from jetserve.evals import mmmu

    with _client(args) as client:
        model = client.model_name(args.model)
        result = mmmu.run(client, model, args.data_dir, args.split, args.subjects, args.limit, args.parallel,
                          args.max_tokens, args.label)  # fmt: skip
    return _finish(result, mmmu.summary_table(result), args.out)


def _run_compare(args: argparse.Namespace) -> int:
    from jetserve.evals.compare import compare, format_comparison, load_results

    comparison = compare(load_results(args.results))
    print(format_comparison(comparison))
    if args.out:
        Path(args.out).write_text(json.dumps(comparison, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 1 if args.fail_on_flag and comparison["flagged"] else 0
