"""`jetserve bench serving`: load an OpenAI-compatible server with random prompts at a request rate and a
concurrency cap, and report throughput, TTFT, TPOT and inter-token latency percentiles (as vLLM and SGLang do)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from jetserve.engine.args import positive_int


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its send."""

    is_success: bool
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # gaps between chunks that carried tokens
    error: str = ""


@dataclass
class BenchReport:
    num_prompts: int
    num_succeeded: int
    num_failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (input + output) tokens/s
    max_concurrent_requests: int
    ttft_ms: dict[str, float]  # mean, median, std, p<percentile>
    tpot_ms: dict[str, float]  # time per output token after the first, per request
    itl_ms: dict[str, float]  # every gap between streamed tokens
    e2el_ms: dict[str, float]  # end-to-end request latency
    config: dict[str, Any]
    errors: list[str]


def add_bench_serving_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="model name to send (default: the first one GET /v1/models lists)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--num-prompts", type=positive_int, default=200)
    p.add_argument(
        "--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (default: all at once)"
    )
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    p.add_argument("--max-concurrency", type=positive_int, default=None, help="requests in flight at most")
    p.add_argument("--input-len", type=positive_int, default=256, help="prompt tokens per request")
    p.add_argument("--output-len", type=positive_int, default=128, help="output tokens per request (EOS ignored)")
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths drawn from [len*(1-r), len*(1+r)]")
    p.add_argument(
        "--vocab-range", type=int, nargs=2, default=(0, 256), metavar=("LO", "HI"),
        help="prompt token ids are drawn from [LO, HI) (default: the byte tokens, valid in any vocabulary)",
    )  # fmt: skip
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="50,90,99", help="comma-separated percentiles to report")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--output-json", metavar="FILE", help="also write the report there")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.add_argument("--disable-progress", action="store_true")


def run_bench_serving(args: argparse.Namespace) -> int:
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate: {args.request_rate} must be > 0 (inf sends everything at once)")
    if not args.burstiness > 0:
        raise ValueError(f"--burstiness: {args.burstiness} must be > 0")
    if not args.timeout > 0:
        raise ValueError(f"--timeout: {args.timeout} must be > 0")
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio: {args.range_ratio} must be in [0, 1)")
    lo, hi = args.vocab_range
    if not 0 <= lo < hi:
        raise ValueError(f"--vocab-range: [{lo}, {hi}) is empty or negative")
    percentiles = _parse_percentiles(args.percentiles)
    report = asyncio.run(benchmark(args, percentiles))
    if args.json:
        print(json.dumps(asdict(report), indent=2))
    else:
        print_report(report)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 0 if report.num_failed == 0 else 1


def _parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--percentiles: {text!r} is not a comma-separated list of numbers") from None
    if not values or not all(0 < p <= 100 for p in values):
        raise ValueError(f"--percentiles: {text!r} must hold numbers in (0, 100]")
    return values


def random_requests(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """(prompt token ids, output length) per request, reproducible from --seed."""
    rng = random.Random(args.seed)
    lo, hi = args.vocab_range

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - args.range_ratio)), int(mean * (1 + args.range_ratio))))

    return [([rng.randrange(lo, hi) for _ in range(length(args.input_len))], length(args.output_len))
            for _ in range(args.num_prompts)]  # fmt: skip


async def benchmark(args: argparse.Namespace, percentiles: list[float]) -> BenchReport:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url.rstrip("/")
    limits = httpx.Limits(max_connections=args.max_concurrency or args.num_prompts, max_keepalive_connections=None)
    async with httpx.AsyncClient(headers=headers, timeout=args.timeout, limits=limits) as client:
        model = args.model or await _first_model(client, base)
        requests = random_requests(args)
        semaphore = asyncio.Semaphore(args.max_concurrency or args.num_prompts)
        in_flight = 0
        max_in_flight = 0
        done = 0

        async def one(prompt: list[int], output_len: int) -> RequestResult:
            nonlocal in_flight, max_in_flight, done
            async with semaphore:
                in_flight += 1
                max_in_flight = max(max_in_flight, in_flight)
                try:
                    return await send_request(client, base, args.endpoint, model, prompt, output_len)
                finally:
                    in_flight -= 1
                    done += 1
                    if not args.disable_progress:
                        print(f"\r{done}/{args.num_prompts} requests", end="", file=sys.stderr, flush=True)

        rng = random.Random(args.seed + 1)
        start = time.perf_counter()
        tasks = []
        for prompt, output_len in requests:
            tasks.append(asyncio.create_task(one(prompt, output_len)))
            if args.request_rate != float("inf"):
                # Gamma gaps with mean 1/rate; shape 1 is a Poisson process, smaller is burstier.
                await asyncio.sleep(rng.gammavariate(args.burstiness, 1 / (args.request_rate * args.burstiness)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if not args.disable_progress:
            print(file=sys.stderr)
    config = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")} | {"model": model}
    return summarize(results, duration, percentiles, max_in_flight, config)


async def _first_model(client: Any, base: str) -> str:
    """The first name GET /v1/models lists; a ValueError (one line from the CLI) when the server cannot say."""
    import httpx

    url = base + "/v1/models"
    try:
        response = await client.get(url)
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise ValueError(f"--base-url: GET {url}: {type(e).__name__}: {e}") from None
    if not models:
        raise ValueError(f"--base-url: GET {url} lists no model; pass --model")
    return str(models[0]["id"])


async def send_request(
    client: Any, base: str, endpoint: str, model: str, prompt: list[int], output_len: int
) -> RequestResult:
    """One streamed request; the time of every chunk that carries text or tokens is recorded."""
    body: dict[str, Any] = {
        "model": model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if endpoint == "chat":
        url = base + "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": "".join(chr(32 + t % 95) for t in prompt)}]
    else:
        url = base + "/v1/completions"
        body["prompt"] = prompt
    result = RequestResult(is_success=False, num_prompt_tokens=len(prompt))
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                if chunk.get("usage"):
                    result.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.num_output_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if result.ttft_s == 0.0:
                    if endpoint == "chat" and chunk["choices"][0].get("delta", {}).get("role"):
                        continue  # the role announcement carries no token
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
    except Exception as e:  # a transport failure is a failed request, not a crashed benchmark
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency_s = time.perf_counter() - start
    if result.num_output_tokens == 0:  # a server without usage in streams: count the chunks that carried tokens
        result.num_output_tokens = len(result.itl_s) + (result.ttft_s > 0)
    result.is_success = result.ttft_s > 0
    if not result.is_success:
        result.error = "the stream carried no tokens"
    return result


def _stats(values_s: list[float], percentiles: list[float]) -> dict[str, float]:
    values = sorted(v * 1000 for v in values_s)
    if not values:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{_fmt(p)}": 0.0 for p in percentiles}}
    out = {"mean": statistics.fmean(values), "median": statistics.median(values),
           "std": statistics.pstdev(values) if len(values) > 1 else 0.0}  # fmt: skip
    for p in percentiles:
        out[f"p{_fmt(p)}"] = _percentile(values, p)
    return out


def _percentile(sorted_values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    position = (len(sorted_values) - 1) * p / 100
    lower = int(position)
    upper = min(lower + 1, len(sorted_values) - 1)
    return sorted_values[lower] + (sorted_values[upper] - sorted_values[lower]) * (position - lower)


def _fmt(p: float) -> str:
    return str(int(p)) if p == int(p) else str(p)


def summarize(
    results: list[RequestResult], duration_s: float, percentiles: list[float], max_in_flight: int, config: dict
) -> BenchReport:
    ok = [r for r in results if r.is_success]
    input_tokens = sum(r.num_prompt_tokens for r in ok)
    output_tokens = sum(r.num_output_tokens for r in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.num_output_tokens - 1) for r in ok if r.num_output_tokens > 1]
    return BenchReport(
        num_prompts=len(results),
        num_succeeded=len(ok),
        num_failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(input_tokens + output_tokens) / duration_s,
        max_concurrent_requests=max_in_flight,
        ttft_ms=_stats([r.ttft_s for r in ok], percentiles),
        tpot_ms=_stats(tpots, percentiles),
        itl_ms=_stats([gap for r in ok for gap in r.itl_s], percentiles),
        e2el_ms=_stats([r.latency_s for r in ok], percentiles),
        config=config,
        errors=sorted({r.error for r in results if not r.is_success})[:10],
    )


def print_report(report: BenchReport) -> None:
    width = 50
    print(" Serving Benchmark Result ".center(width, "="))
    rows = [
        ("Successful requests:", report.num_succeeded),
        ("Failed requests:", report.num_failed),
        ("Maximum request concurrency:", report.max_concurrent_requests),
        ("Benchmark duration (s):", f"{report.duration_s:.2f}"),
        ("Total input tokens:", report.total_input_tokens),
        ("Total generated tokens:", report.total_output_tokens),
        ("Request throughput (req/s):", f"{report.request_throughput:.2f}"),
        ("Output token throughput (tok/s):", f"{report.output_throughput:.2f}"),
        ("Total token throughput (tok/s):", f"{report.total_token_throughput:.2f}"),
    ]
    for label, value in rows:
        print(f"{label:<40}{value:>10}")
    for title, name, stats in (
        ("Time to First Token", "TTFT", report.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", report.tpot_ms),
        ("Inter-token Latency", "ITL", report.itl_ms),
        ("End-to-end Latency", "E2EL", report.e2el_ms),
    ):
        print(f" {title} ".center(width, "-"))
        for key, value in stats.items():
            label = {"mean": "Mean", "median": "Median", "std": "Std"}.get(key, key.upper())
            print(f"{f'{label} {name} (ms):':<40}{value:>10.2f}")
    if report.errors:
        print(" Errors ".center(width, "-"))
        for error in report.errors:
            print(error)
    print("=" * width)
