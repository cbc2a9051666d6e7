"""A small byte-level BPE tokenizer trained on the corpus (ChatML special tokens, HF layout with the chat template and
generation config), and the encoding of the corpus into token files (.npy, documents joined by <|endoftext|>)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from jetserve.checkpoint import SPECIAL_TOKENS, write_tokenizer
from jetserve.tokenizer import Tokenizer, load_tokenizer

DEFAULT_VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 4096


def _read_jsonl(path: Path) -> Iterator[dict]:
    with path.open() as f:
        for line in f:
            yield json.loads(line)


def corpus_texts(corpus_dir: Path) -> Iterator[str]:
    """Every piece of text in the corpus: documents, both sides of each conversation, teacher prompts."""
    for record in _read_jsonl(corpus_dir / "text.jsonl"):
        yield record["text"]
    for record in _read_jsonl(corpus_dir / "chat.jsonl"):
        for message in record["messages"]:
            yield message["content"]
    for record in _read_jsonl(corpus_dir / "prompts.jsonl"):
        yield record["prompt"]


def train_tokenizer(texts: Iterator[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> HFTokenizer:
    """Byte-level BPE: the ChatML special tokens take ids 0-2, then the 256 byte symbols, then merges."""
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(f"vocab_size: {vocab_size} must be ≥ {len(SPECIAL_TOKENS) + 256} (specials + bytes)")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok: HFTokenizer, out_dir: str | Path) -> Path:
    """tokenizer.json, tokenizer_config.json (ChatML template, eos <|im_end|>) and generation_config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    endoftext, im_end = write_tokenizer(tok, out, MODEL_MAX_LENGTH)
    generation = {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def render_conversation(tokenizer: Tokenizer, messages: list[dict[str, str]]) -> str:
    """The conversation in the chat template, as the model sees it at inference (each turn closed by <|im_end|>)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=False)


def _encode_documents(tokenizer: Tokenizer, documents: Iterator[str], endoftext: int) -> np.ndarray:
    ids: list[int] = []
    for text in documents:
        ids += tokenizer.encode(text)
        ids.append(endoftext)
    assert tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1, "token files are uint16"
    return np.array(ids, dtype=np.uint16)


def encode_corpus(corpus_dir: str | Path, tokenizer_dir: str | Path, out_dir: str | Path,
                  teacher: str | Path | None = None) -> dict[str, int]:  # fmt: skip
    """Write {text,chat[,teacher]}-{train,heldout}.npy into `out_dir`; returns the token count of each file.

    `teacher` is the teacher's JSONL ({"id", "prompt", "answer", "finish_reason"}); its finished answers (cut-off
    ones would teach rambling) become conversations, held out like the prompt they answer.
    """
    corpus, out = Path(corpus_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(tokenizer_dir)
    endoftext = tokenizer.token_to_id("<|endoftext|>")
    assert endoftext is not None, "the tokenizer has no <|endoftext|>"
    groups: dict[str, list[dict]] = {"text": list(_read_jsonl(corpus / "text.jsonl")),
                                     "chat": list(_read_jsonl(corpus / "chat.jsonl"))}  # fmt: skip
    if teacher is not None:
        splits = {r["id"]: r["split"] for r in _read_jsonl(corpus / "prompts.jsonl")}
        groups["teacher"] = [
            {"split": splits.get(r["id"], "train"), "messages": [{"role": "user", "content": r["prompt"]},
                                                                  {"role": "assistant", "content": r["answer"]}]}
            for r in _read_jsonl(Path(teacher)) if r["answer"].strip() and r.get("finish_reason") == "stop"
        ]  # fmt: skip
    counts = {}
    for name, records in groups.items():
        for split in ("train", "heldout"):
            chosen = [r for r in records if r["split"] == split]
            texts = (r["text"] if "text" in r else render_conversation(tokenizer, r["messages"]) for r in chosen)
            ids = _encode_documents(tokenizer, texts, endoftext)
            np.save(out / f"{name}-{split}.npy", ids)
            counts[f"{name}-{split}"] = int(ids.shape[0])
    (out / "counts.json").write_text(json.dumps(counts, indent=2) + "\n")
    return counts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jetserve.train.tokenizer", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the BPE tokenizer on a corpus folder")
    t.add_argument("--corpus", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    e = sub.add_parser("encode", help="encode the corpus (and teacher answers) into token files")
    e.add_argument("--corpus", required=True)
    e.add_argument("--tokenizer", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--teacher", help="the teacher's answers (JSONL)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            tok = train_tokenizer(corpus_texts(Path(args.corpus)), args.vocab_size)
            save_tokenizer(tok, args.out)
            print(f"tokenizer: {tok.get_vocab_size(with_added_tokens=True)} tokens in {args.out}")
        else:
            print(json.dumps(encode_corpus(args.corpus, args.tokenizer, args.out, args.teacher), indent=1))
    except ValueError as e:
        print(f"tokenizer: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
