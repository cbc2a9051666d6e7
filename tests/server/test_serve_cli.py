"""`jetserve serve` as a user starts it (a subprocess on loopback) and `jetserve bench serving` against a server,
including the bounded load test: 200 requests, 32 at a time, every one answered."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx

from jetserve.cli import build_parser, main
from jetserve.server.bench_serving import random_requests
from jetserve.server.launch import engine_config_from_args


def test_serve_flags_become_the_engine_config():
    args = build_parser().parse_args(
        ["serve", "--model", "ckpt", "--port", "9000", "--api-key", "k", "--served-model-name", "a", "b",
         "--max-num-seqs", "4", "--max-model-len", "256", "--dtype", "float32", "--enforce-eager"]
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert (config.model, config.max_num_seqs, config.max_model_len, config.dtype) == ("ckpt", 4, 256, "float32")
    assert config.enforce_eager and config.page_size == 16  # untouched flags keep EngineConfig's defaults
    assert (args.port, args.api_key, args.served_model_name) == (9000, "k", ["a", "b"])


def test_bench_has_serving_and_offline():
    from jetserve.engine.bench_offline import run_offline_bench
    from jetserve.server.bench_serving import run_bench_serving

    parser = build_parser()
    assert parser.parse_args(["bench", "offline", "--config", "tiny"]).func is run_offline_bench
    assert parser.parse_args(["bench", "serving", "--base-url", "http://127.0.0.1:1"]).func is run_bench_serving


def test_bench_serving_without_a_server_is_one_line(capsys):
    port = _free_port()  # nothing listens there
    assert main(["bench", "serving", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "--base-url" in err and "ConnectError" in err and err.count("\n") == 1
    assert main(["bench", "serving", "--base-url", "http://127.0.0.1:1", "--burstiness", "0"]) == 2
    assert "--burstiness" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_subprocess_answers_and_bench_reports(tiny_checkpoint, tmp_path):
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "jetserve.cli", "serve", "--model", tiny_checkpoint, "--port", str(port),
               "--served-model-name", "tiny-cli", "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
               "--cpu-cache-bytes", str(32 << 20), "--log-level", "warning"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.stdout.read()
            try:
                if httpx.get(base_url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "jetserve serve did not come up"
            time.sleep(0.2)
        models = httpx.get(base_url + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["tiny-cli"] and models["data"][0]["max_model_len"] == 256
        out = tmp_path / "bench.json"
        code = main(["bench", "serving", "--base-url", base_url, "--num-prompts", "12", "--max-concurrency", "4",
                     "--input-len", "10", "--output-len", "5", "--request-rate", "50", "--disable-progress",
                     "--output-json", str(out)])  # fmt: skip
        assert code == 0
        report = json.loads(out.read_text())
        assert (report["num_succeeded"], report["num_failed"]) == (12, 0)
        assert report["total_input_tokens"] == 120 and report["total_output_tokens"] == 60
        assert report["config"]["model"] == "tiny-cli" and 1 <= report["max_concurrent_requests"] <= 4
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            assert set(report[key]) == {"mean", "median", "std", "p50", "p90", "p99"}
            assert 0 < report[key]["median"] <= report[key]["p99"]
        assert report["output_throughput"] > 0
    finally:
        process.send_signal(signal.SIGINT)  # uvicorn shuts down gracefully on SIGINT
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode == 0


def test_load_200_requests_32_concurrent(running_server, capsys):
    """The bounded load test, through the benchmark client: every request answered, nothing left behind."""
    argv = ["bench", "serving", "--base-url", running_server.base_url, "--api-key", running_server.api_key,
            "--num-prompts", "200", "--max-concurrency", "32", "--input-len", "24", "--output-len", "4",
            "--range-ratio", "0.5", "--disable-progress", "--json"]  # fmt: skip
    requests = random_requests(build_parser().parse_args(argv))
    code = main(argv)
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report["errors"]
    assert (report["num_succeeded"], report["num_failed"]) == (200, 0)
    assert report["max_concurrent_requests"] == 32
    assert report["total_input_tokens"] == sum(len(prompt) for prompt, _ in requests)
    assert report["total_output_tokens"] == sum(n for _, n in requests)  # EOS ignored: every token asked for
    running_server.wait_idle_and_clean()
