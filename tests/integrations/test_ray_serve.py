"""The Ray Serve deployment: its argument parsing, and (slow) a local Ray cluster serving 2 replicas of the tiny
checkpoint on the reference backend, answering through the `openai` client exactly as one engine does."""

from __future__ import annotations

import pytest

serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

import ray  # noqa: E402

from jetserve.distributed.group import free_port  # noqa: E402
from jetserve.integrations.ray_serve import app_builder, build_deployment  # noqa: E402
from jetserve.llm import LLM  # noqa: E402
from jetserve.sampling_params import SamplingParams  # noqa: E402

ENGINE_ARGS = dict(dtype="float32", device="cpu", max_num_seqs=8, max_model_len=256, cpu_cache_bytes=32 << 20)


def test_app_builder_parses_engine_and_deployment_args(tiny_checkpoint):
    app = app_builder({"model": str(tiny_checkpoint), "device": "cpu", "max_num_seqs": "4", "enforce_eager": "true",
                       "gpu_memory_utilization": "0.5", "num_replicas": "3", "model_names": "a,b"})  # fmt: skip
    assert app is not None
    with pytest.raises(ValueError, match="max_num_seqs: 'x' is not an integer"):
        app_builder({"model": "m", "max_num_seqs": "x"})
    with pytest.raises(ValueError, match="colour: not an EngineConfig field"):
        app_builder({"model": "m", "colour": "red"})
    with pytest.raises(ValueError, match="model: required"):
        app_builder({"device": "cpu"})
    with pytest.raises(ValueError, match="num_replicas"):
        build_deployment({"model": "m"}, num_replicas=0)


@pytest.mark.slow
def test_two_replicas_answer_through_openai(tiny_checkpoint):
    prompts = [f"ray {i}: " + "jumps over the lazy dog " * (i + 1) for i in range(4)]
    want = [o.text for o in LLM(str(tiny_checkpoint), **ENGINE_ARGS).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]  # fmt: skip
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = build_deployment(dict(model=str(tiny_checkpoint), **ENGINE_ARGS), num_replicas=2,
                               model_names=["tiny"], num_cpus=1, num_threads=1)  # fmt: skip
        serve.run(app, name="jetserve", route_prefix="/")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in prompts]  # fmt: skip
        assert got == want
        status = serve.status().applications["jetserve"].deployments["jetserve"]
        assert status.replica_states.get("RUNNING") == 2
    finally:
        serve.shutdown()
        ray.shutdown()
