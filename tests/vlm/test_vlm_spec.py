"""EAGLE-3 on a VLM prompt (tiny-vlm, a random draft): the draft's prefill catch-up sees the image rows the target saw
(token t + 1's embedding at draft position t), and greedy speculative decoding equals plain greedy decoding."""

import torch
from test_vlm_engine import _generate, _request
from vlm_helpers import vlm_engine_config

from jetserve.engine.engine import LLMEngine
from jetserve.multimodal.inputs import ImageInputs
from jetserve.spec.drafter import Drafter
from jetserve.spec.eagle3 import make_draft_checkpoint


def test_draft_sees_image_embeddings_and_speculation_is_exact(vlm_checkpoint, tmp_path, monkeypatch):
    draft = make_draft_checkpoint(vlm_checkpoint, tmp_path / "draft", seed=0)
    plain_engine = LLMEngine(vlm_engine_config(vlm_checkpoint))
    ids, images = _request(plain_engine, vlm_checkpoint, seed=7)
    plain = _generate(plain_engine, [(ids, images)], max_tokens=8)[0]

    spec_engine = LLMEngine(vlm_engine_config(vlm_checkpoint, draft=str(draft), spec_topk=2, spec_steps=2,
                                              spec_adaptive=False, max_num_batched_tokens=20))  # fmt: skip
    seen = []
    extend_in = Drafter.extend_in  # the prefill catch-up, in the target's PREFILL batch

    def spy(self, input_ids, aux, fb, input_embeds=None):
        starts = fb.positions[fb.cu_seqlens[:-1].long()]
        seen.append((starts.tolist(), input_ids.clone(), None if input_embeds is None else input_embeds.clone()))
        return extend_in(self, input_ids, aux, fb, input_embeds)

    monkeypatch.setattr(Drafter, "extend_in", spy)
    fresh = ImageInputs(images.pixel_values, images.positions, images.num_images)
    speculative = _generate(spec_engine, [(ids, fresh)], max_tokens=8)[0]
    assert speculative.output_token_ids == plain.output_token_ids
    assert spec_engine.num_verify_steps > 0

    # Prefill catch-ups (chunks of 20 tokens): draft position t carries token t + 1; where t + 1 is an image
    # placeholder, its row is the image embedding the target spliced there, elsewhere the token's embedding.
    vision = spec_engine.vision(images.pixel_values)  # [M, hidden]
    row_of = {int(p): r for r, p in enumerate(images.positions)}
    embed = spec_engine.model.model.embed_tokens
    checked = 0
    for (start,), input_ids, embeds in seen:
        if start >= len(ids) - 1:
            break  # decode/verify catch-ups: output tokens only
        span = range(start + 1, start + 1 + input_ids.shape[0])
        if embeds is None:  # a chunk whose next tokens hold no image placeholder embeds its ids as before
            assert not any(p in row_of for p in span)
            continue
        assert embeds.shape[0] == input_ids.shape[0]
        for j in range(input_ids.shape[0]):
            position = start + j + 1
            expected = vision[row_of[position]] if position in row_of else embed(input_ids[j : j + 1])[0]
            torch.testing.assert_close(embeds[j], expected, rtol=0, atol=0)
            checked += position in row_of
    assert checked == images.num_tokens
