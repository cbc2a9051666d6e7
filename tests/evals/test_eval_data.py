"""The vendored eval data: every file matches its recorded checksum (no line-ending rewrite); licenses beside."""

import hashlib
from importlib import resources


def test_checksums_and_licenses():
    data = resources.files("jetserve.evals").joinpath("data")
    lines = data.joinpath("SHA256SUMS").read_text().splitlines()
    listed = {}
    for line in lines:
        digest, path = line.split(maxsplit=1)
        listed[path.removeprefix("./")] = digest
    assert len(listed) == 121  # gsm8k 3, mmlu 57 + 57 + 2, mtbench 2
    for path, digest in listed.items():
        assert hashlib.sha256(data.joinpath(path).read_bytes()).hexdigest() == digest, path
    for folder in ("gsm8k", "mmlu", "mtbench"):
        assert f"{folder}/LICENSE" in listed
    assert "Apache License" in data.joinpath("mtbench", "LICENSE").read_text()
    assert "MIT License" in data.joinpath("gsm8k", "LICENSE").read_text()
    assert "train_head64.jsonl" in data.joinpath("SOURCES.md").read_text()
