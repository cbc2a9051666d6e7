"""Ray Serve deployment of jetserve's OpenAI server (optional extra `ray`): each Serve replica builds one engine
(tensor parallel inside it when asked) and serves the same FastAPI app as `jetserve serve`; Serve spreads the
replicas over the cluster's nodes and routes requests among them.

Two nodes, two replicas of a 2-GPU tensor-parallel engine each::

    node-a$ ray start --head --port 6379
    node-b$ ray start --address node-a:6379
    node-a$ serve run jetserve.integrations.ray_serve:app_builder model=/models/Jet-Nemotron-4B \\
                tensor_parallel_size=2 num_replicas=2 dtype=bfloat16

Then any OpenAI client talks to http://node-a:8000/v1 (Serve's proxy); the checkpoint folder must exist at the same
path on every node.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ray import serve

from jetserve.engine.config import EngineConfig

# Arguments of `app_builder` that are the deployment's, not EngineConfig fields.
DEPLOYMENT_ARGS = ("num_replicas", "model_names", "api_key", "num_cpus", "num_threads")


@serve.deployment(name="jetserve", max_ongoing_requests=1024)
@serve.ingress()
class JetServeDeployment:
    """One engine and the OpenAI app around it (the app's lifespan starts and stops the engine thread)."""

    def __init__(
        self,
        engine_args: dict[str, Any],
        model_names: list[str] | None = None,
        api_key: str | None = None,
        num_threads: int | None = None,
    ) -> None:
        from jetserve.server.launch import build_server

        if num_threads is not None:
            import torch

            torch.set_num_threads(num_threads)
        config = EngineConfig(**engine_args)
        if config.data_parallel_size != 1:
            raise ValueError("data_parallel_size: under Ray Serve the replicas are the deployment's num_replicas")
        self.server, self._app = build_server(config, model_names, api_key)

    def __serve_build_asgi_app__(self):
        return self._app


def build_deployment(
    engine_args: dict[str, Any],
    num_replicas: int = 1,
    model_names: list[str] | None = None,
    api_key: str | None = None,
    num_cpus: float = 1,
    num_threads: int | None = None,
) -> serve.Application:
    """The Serve application: `num_replicas` replicas, each reserving `tensor_parallel_size` GPUs when the engine
    runs on CUDA (device "auto" on a GPU node, or "cuda…"), none on the CPU."""
    config = EngineConfig(**engine_args)  # validates before Ray ships anything
    if num_replicas < 1:
        raise ValueError(f"num_replicas: must be ≥ 1, got {num_replicas}")
    is_cpu = config.device == "cpu"
    options = {"num_cpus": num_cpus, "num_gpus": 0 if is_cpu else config.tensor_parallel_size}
    deployment = JetServeDeployment.options(num_replicas=num_replicas, ray_actor_options=options)
    return deployment.bind(engine_args, model_names, api_key, num_threads)


def app_builder(args: dict[str, str]) -> serve.Application:
    """For `serve run jetserve.integrations.ray_serve:app_builder key=value ...`: EngineConfig fields (`model=...`,
    `tensor_parallel_size=2`, `dtype=bfloat16`, ...) plus `num_replicas`, `model_names` (comma-separated),
    `api_key`, `num_cpus` and `num_threads`."""
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    engine_args: dict[str, Any] = {}
    deployment_args: dict[str, Any] = {}
    for key, value in args.items():
        if key in DEPLOYMENT_ARGS:
            deployment_args[key] = value
        elif key in fields:
            engine_args[key] = _parse(key, str(fields[key].type), value)
        else:
            raise ValueError(f"{key}: not an EngineConfig field nor one of {', '.join(DEPLOYMENT_ARGS)}")
    if "model" not in engine_args:
        raise ValueError("model: required (the checkpoint folder, at the same path on every node)")
    names = deployment_args.get("model_names")
    return build_deployment(
        engine_args,
        num_replicas=int(deployment_args.get("num_replicas", 1)),
        model_names=names.split(",") if isinstance(names, str) else names,
        api_key=deployment_args.get("api_key"),
        num_cpus=float(deployment_args.get("num_cpus", 1)),
        num_threads=int(deployment_args["num_threads"]) if "num_threads" in deployment_args else None,
    )


def _parse(key: str, kind: str, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    kind = kind.replace(" ", "").removesuffix("|None")
    try:
        if kind == "int":
            return int(value)
        if kind == "float":
            return float(value)
    except ValueError as e:
        raise ValueError(f"{key}: {value!r} is not {'an integer' if kind == 'int' else 'a number'}") from e
    if kind == "bool":
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{key}: {value!r} is not true or false")
        return value.lower() in ("true", "1")
    return value
