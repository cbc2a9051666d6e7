"""`jetserve serve`: its arguments (every EngineConfig field becomes a flag), building the server, running uvicorn."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from jetserve.engine.args import add_engine_arguments, engine_config_from_args
from jetserve.engine.config import EngineConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

    from jetserve.server.api import OpenAIServer

logger = logging.getLogger(__name__)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="default", help="checkpoint folder (config.json, weights, tokenizer), or `default` (the "
        "embedded default model; the default)",
    )  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 endpoints")
    parser.add_argument(
        "--served-model-name", nargs="+", default=None, help="the names clients use (default: the --model path)"
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    parser.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs in chat requests (default: data: URLs only)",
    )
    add_engine_arguments(parser)


def build_server(
    config: EngineConfig, model_names: list[str] | None = None, api_key: str | None = None,
    allow_image_urls: bool = False,
) -> tuple[OpenAIServer, FastAPI]:  # fmt: skip
    """Load the engine and wrap it in the HTTP app (the engine thread starts with the app's lifespan)."""
    from jetserve.engine.tensor_parallel import build_engine
    from jetserve.server.api import OpenAIServer, build_app
    from jetserve.server.async_engine import AsyncEngine
    from jetserve.server.metrics import ServerMetrics

    names = model_names or [config.model]
    metrics = ServerMetrics(names[0])
    if config.data_parallel_size > 1:  # replica processes behind this front end (jetserve.server.router)
        from jetserve.server.router import DataParallelRouter
        from jetserve.tokenizer import load_tokenizer

        tokenizer_path = Path(config.tokenizer or config.model)
        if not (tokenizer_path / "tokenizer.json").is_file():
            raise ValueError(f"--model: {tokenizer_path} has no tokenizer.json; the server needs one")
        tokenizer = load_tokenizer(tokenizer_path)
        engine = DataParallelRouter(config, metrics)
    else:
        llm_engine = build_engine(config)  # tensor parallel when config.tensor_parallel_size > 1
        if llm_engine.tokenizer is None:
            raise ValueError(f"--model: {config.tokenizer or config.model} has no tokenizer.json; the server needs one")
        tokenizer = llm_engine.tokenizer
        engine = AsyncEngine(llm_engine, metrics)
    server = OpenAIServer(engine, tokenizer, names, api_key, metrics, allow_image_urls)
    return server, build_app(server)


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    if not 0 <= args.port < 65536:
        raise ValueError(f"--port: {args.port} is not a TCP port")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = args.served_model_name or (["jetserve-default"] if args.model == "default" else None)
    server, app = build_server(engine_config_from_args(args), names, args.api_key, args.allow_image_urls)
    logger.info("serving %s on http://%s:%d (max_model_len %d)", server.model_names[0], args.host, args.port,
                server.engine.max_model_len)  # fmt: skip
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_keep_alive=30,
        timeout_graceful_shutdown=10,  # streams still open then are cut (their requests abort)
    )  # fmt: skip
    return 0
