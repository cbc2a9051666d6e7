import json
import random
import re

import numpy as np

from jetserve.tokenizer import load_tokenizer
from jetserve.train.corpus import chunk_text, gsm8k_conversations, mmlu_prompts, split_of
from jetserve.train.templates import TOPICS, exact_conversations, teacher_prompts
from jetserve.train.tokenizer import encode_corpus, save_tokenizer, train_tokenizer


def test_split_is_stable_and_about_one_percent():
    texts = [f"document number {i}" for i in range(5000)]
    held = [t for t in texts if split_of(t) == "heldout"]
    assert 20 < len(held) < 90
    assert [split_of(t) for t in held] == ["heldout"] * len(held)


def test_chunks_keep_every_paragraph():
    text = "\n\n".join(f"paragraph {i}" + " word" * (i % 50) for i in range(300))
    chunks = list(chunk_text(text, max_chars=1000))
    assert all(len(c) <= 1300 for c in chunks)
    assert "\n\n".join(chunks) == text


def test_gsm8k_answers_lose_calculator_marks(tmp_path):
    row = {"question": "What is 2+3?", "answer": "2+3 = <<2+3=5>>5\n#### 5"}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    (chat,) = gsm8k_conversations(tmp_path / "train.jsonl")
    assert chat["messages"][1]["content"] == "2+3 = 5\n#### 5"


def test_mmlu_prompts_list_the_choices(tmp_path):
    (tmp_path / "astronomy_dev.csv").write_text('"What is the Sun?",A star,A planet,A moon,A comet,A\n')
    (prompt,) = mmlu_prompts(tmp_path)
    assert "astronomy" in prompt and "A. A star\nB. A planet\nC. A moon\nD. A comet" in prompt


def test_exact_conversations_are_correct():
    for chat in exact_conversations(random.Random(0), count=400):
        user, answer = (m["content"] for m in chat["messages"])
        if match := re.fullmatch(r"(?:What is|Calculate) (\d+) ([-+*]) (\d+)[?.]", user):
            a, op, b = int(match[1]), match[2], int(match[3])
            assert answer == f"{a} {op} {b} = {eval(f'{a}{op}{b}')}."
        elif match := re.fullmatch(r"Which is larger, (\d+) or (\d+)\?", user):
            assert answer.startswith(str(max(int(match[1]), int(match[2]))))
        elif user.startswith("Sort these numbers"):
            numbers = [int(x) for x in re.findall(r"\d+", user)]
            assert [int(x) for x in re.findall(r"\d+", answer)] == sorted(numbers)
    assert all("\n" not in t and "," not in t for t in TOPICS)


def test_teacher_prompts_cover_templates_and_passages():
    texts = ["A first line that is long enough.\nA second line that is long enough too.\n" * 5]
    prompts = teacher_prompts(random.Random(0), texts, num_passage_prompts=10)
    assert any(p.startswith("Write a sentence about") for p in prompts)
    assert sum("\n\n" in p for p in prompts) == 10


def test_tokenizer_trains_saves_and_encodes_the_corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = [{"source": "t", "text": f"The cat sat on mat number {i}. " * 3, "split": "train"} for i in range(60)]
    text.append({"source": "t", "text": "A held-out sentence.", "split": "heldout"})
    hello = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there."}]
    chats = [{"source": "c", "split": "train", "messages": hello}]
    prompts = [{"id": "p0", "source": "template", "prompt": "Write a sentence about the sun.", "split": "train"}]
    for name, records in (("text", text), ("chat", chats), ("prompts", prompts)):
        (corpus / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    teacher = tmp_path / "teacher.jsonl"
    answers = [{"id": "p0", "prompt": prompts[0]["prompt"], "answer": "The sun is bright.", "finish_reason": "stop"},
               {"id": "p1", "prompt": "cut", "answer": "The sun is", "finish_reason": "length"}]  # fmt: skip
    teacher.write_text("".join(json.dumps(a) + "\n" for a in answers))

    texts = [r["text"] for r in text] + ["Hello!", "Hi there.", prompts[0]["prompt"]]
    save_tokenizer(train_tokenizer(iter(texts), vocab_size=300), tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.eos_token_ids == (2, 0) and tok.vocab_size == 300
    sample = "The cat sat on mat number 7, said the teacher."
    assert tok.decode(tok.encode(sample)) == sample

    counts = encode_corpus(corpus, tmp_path / "tok", tmp_path / "tokens", teacher)
    assert counts["text-heldout"] == len(tok.encode("A held-out sentence.")) + 1
    chat = np.load(tmp_path / "tokens" / "chat-train.npy").tolist()
    rendered = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\nHi there.<|im_end|>\n"
    assert chat == tok.encode(rendered) + [0]
    teacher_ids = np.load(tmp_path / "tokens" / "teacher-train.npy").tolist()
    assert tok.decode(teacher_ids, skip_special_tokens=False).count("<|im_start|>assistant") == 1  # cut one dropped
