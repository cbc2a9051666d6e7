"""Images through the engine (CPU, reference ops, tiny-vlm): the spliced embeddings sit exactly at the placeholder
positions, the same image twice in a batch gives identical outputs (and a different image a different one), and
chunked prefill that cuts through an image equals whole prefill."""

import numpy as np
import pytest
import torch
from vlm_helpers import png_bytes, vlm_engine_config

from jetserve.config import VLMConfig
from jetserve.engine.engine import LLMEngine
from jetserve.multimodal.inputs import ImageInputs, spliced_input_embeds
from jetserve.multimodal.processor import ImageLimits, ImageProcessor, decode_image
from jetserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(vlm_checkpoint):
    return LLMEngine(vlm_engine_config(vlm_checkpoint))


def _request(engine, vlm_checkpoint, seed: int, size=(60, 20)) -> tuple[list[int], ImageInputs]:
    processor = ImageProcessor.from_pretrained(vlm_checkpoint, line_feed_id=engine.tokenizer.encode("\n")[0])
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "look: <image> what is it?"}])
    image = decode_image(png_bytes(*size, seed=seed), ImageLimits())
    return processor.expand(engine.tokenizer.encode(text), processor.tiles([image]))


def _generate(engine, requests, max_tokens=6, logprobs=None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    for i, (ids, images) in enumerate(requests):
        engine.add_request(f"r{i}", ids, params, images)
    outputs: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert engine.is_idle_and_clean()
    return [outputs[f"r{i}"] for i in range(len(requests))]


def test_splice_puts_rows_at_placeholders():
    embedding = torch.nn.Embedding(50, 4)
    positions = np.array([2, 3, 4, 7, 8])
    rows = torch.arange(5 * 4, dtype=torch.float32).view(5, 4) + 100
    images = ImageInputs(torch.zeros(1, 3, 2, 2), positions, 1, embeds=rows)
    ids = torch.arange(12) % 50
    # Sequence 0 brings prompt positions [3, 8) (a chunk cutting the image), sequence 1 (no images) 5 tokens.
    out = spliced_input_embeds(embedding, ids[:10], [images, None], [3, 0], [5, 5])
    expected = embedding(ids[:10]).detach().clone()
    expected[0:2] = rows[1:3]  # positions 3, 4 → packed rows 0, 1
    expected[4] = rows[3]  # position 7 → packed row 4 (position 8 is outside the chunk)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert spliced_input_embeds(embedding, ids[:3], [images], [9], [3]) is None  # no placeholder in [9, 12)


def test_engine_splices_at_placeholder_positions(engine, vlm_checkpoint, monkeypatch):
    ids, images = _request(engine, vlm_checkpoint, seed=0)
    seen = []
    forward = type(engine.model).forward

    def spy(model, fb, input_embeds=None):
        seen.append((fb.input_ids.clone(), None if input_embeds is None else input_embeds.clone()))
        return forward(model, fb, input_embeds)

    monkeypatch.setattr(type(engine.model), "forward", spy)
    _generate(engine, [(ids, images)], max_tokens=2)
    input_ids, embeds = seen[0]  # the prefill
    assert input_ids.tolist() == ids and embeds is not None
    vision = engine.vision(images.pixel_values)  # [M, hidden]
    positions = torch.as_tensor(images.positions)
    torch.testing.assert_close(embeds[positions], vision, rtol=0, atol=0)
    text_rows = torch.ones(len(ids), dtype=torch.bool)
    text_rows[positions] = False
    torch.testing.assert_close(embeds[text_rows], engine.model.model.embed_tokens(input_ids)[text_rows])
    image_token_id = VLMConfig.from_hf(vlm_checkpoint).image_token_id
    assert all(ids[p] == image_token_id for p in images.positions)
    assert seen[1][1] is None  # decode steps embed their token ids


def test_same_image_twice_in_a_batch(engine, vlm_checkpoint):
    a1, a2, b = (_request(engine, vlm_checkpoint, seed=s) for s in (1, 1, 2))
    out = _generate(engine, [a1, a2, b], max_tokens=8, logprobs=3)
    assert out[0].output_token_ids == out[1].output_token_ids
    assert [e.logprob for e in out[0].logprobs] == [e.logprob for e in out[1].logprobs]
    # The image matters: another image (same prompt text) changes the log-probs.
    assert [e.logprob for e in out[0].logprobs] != [e.logprob for e in out[2].logprobs]
    # Shared ImageInputs (two choices of one request) are encoded once, and give the same result.
    shared = _request(engine, vlm_checkpoint, seed=1)
    again = _generate(engine, [shared, shared], max_tokens=8, logprobs=3)
    assert again[0].output_token_ids == again[1].output_token_ids == out[0].output_token_ids


def test_chunked_prefill_across_an_image_equals_whole(vlm_checkpoint):
    whole_engine = LLMEngine(vlm_engine_config(vlm_checkpoint))
    ids, images = _request(whole_engine, vlm_checkpoint, seed=3, size=(80, 40))  # a 2x1 grid → 3 tiles, 27 rows
    assert images.pixel_values.shape[0] == 3
    whole = _generate(whole_engine, [(ids, images)], max_tokens=6, logprobs=5)[0]
    # Chunks of 7 tokens start and end inside tiles' runs of 9 image tokens.
    chunked_engine = LLMEngine(vlm_engine_config(vlm_checkpoint, max_num_batched_tokens=7))
    fresh = ImageInputs(images.pixel_values, images.positions, images.num_images)
    chunked = _generate(chunked_engine, [(ids, fresh)], max_tokens=6, logprobs=5)[0]
    assert chunked.output_token_ids == whole.output_token_ids
    for a, b in zip(chunked.logprobs, whole.logprobs, strict=True):
        assert a.top_ids == b.top_ids
        np.testing.assert_allclose(a.top_logprobs, b.top_logprobs, rtol=1e-4, atol=1e-4)


def test_engine_refuses_bad_image_inputs(engine, vlm_checkpoint):
    ids, images = _request(engine, vlm_checkpoint, seed=4)
    short = ImageInputs(images.pixel_values, images.positions[:-1], 1)
    with pytest.raises(ValueError, match="images: .* placeholder positions"):
        engine.add_request("bad", ids, SamplingParams(max_tokens=2), short)
    assert not engine.has_unfinished_requests()
