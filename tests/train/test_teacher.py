import json
import random

import pytest

from jetserve.train.teacher import GGUF_NAME, answer_prompts, join_gguf, render_chat, split_gguf

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_render_chat_uses_the_teacher_template_with_our_system_prompt():
    text = render_chat(SMOLLM2_TEMPLATE, "List three fruits.", system="Be brief.")
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nList three fruits.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_answers_are_appended_as_jsonl_and_a_rerun_skips_answered_ids(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    records = [{"id": f"p{i}", "prompt": "x" * (10 - i), "split": "train"} for i in range(5)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    seen = []

    def fake_generate(texts):
        seen.append(texts)
        return [(f" answer to {t.count('x')} x ", "stop") for t in texts]

    out = tmp_path / "answers.jsonl"
    counts = answer_prompts(prompts, out, fake_generate, SMOLLM2_TEMPLATE, batch_size=2, limit=3)
    assert counts == {"answered": 3, "total": 3, "remaining": 0}
    out.write_text(out.read_text() + '{"id": "p4", "prom')  # a line cut short by a stop mid-write
    counts = answer_prompts(prompts, out, fake_generate, SMOLLM2_TEMPLATE, batch_size=2)
    assert counts["total"] == 5
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.endswith("}")]
    assert sorted(x["id"] for x in lines) == [f"p{i}" for i in range(5)]
    by_id = {x["id"]: x for x in lines}
    assert by_id["p1"] == {"id": "p1", "prompt": "x" * 9, "answer": "answer to 9 x", "finish_reason": "stop"}
    assert all(t.endswith("<|im_start|>assistant\n") for batch in seen for t in batch)
    assert [len(b) for b in seen] == [2, 1, 2]


def test_gguf_parts_join_back_and_a_missing_part_is_named(tmp_path):
    source = tmp_path / GGUF_NAME
    source.write_bytes(random.Random(0).randbytes(10240))  # incompressible: gzip keeps two parts
    split_gguf(source, [tmp_path / "a", tmp_path / "b"], part_bytes=6000)
    joined = join_gguf([tmp_path / "a", tmp_path / "b"], tmp_path / "out" / GGUF_NAME)
    assert joined.read_bytes() == source.read_bytes()
    with pytest.raises(ValueError, match="numbered from 0"):
        join_gguf([tmp_path / "b"], tmp_path / "out2" / GGUF_NAME)
    with pytest.raises(ValueError, match="do not match"):
        join_gguf([tmp_path / "a"], tmp_path / "out3" / GGUF_NAME)
