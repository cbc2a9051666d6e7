"""`jetserve eval mmmu`: the reference prompt and image placement, the reference answer parsing rules, and a run end to
end against the tiny-vlm server on synthetic rows written in MMMU's published parquet layout."""

import json
import random

import pytest
from vlm_helpers import png_bytes

from jetserve.cli import main
from jetserve.evals import mmmu

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _row(i: int, question: str, options: list[str] | None, answer: str, images: dict[int, bytes]) -> dict:
    row = {
        "id": f"validation_Art_{i}",
        "question": question,
        "options": repr(options or []),
        "explanation": "",
        "img_type": "['Photographs']",
        "answer": answer,
        "topic_difficulty": "Easy",
        "question_type": "multiple-choice" if options else "open",
        "subfield": "Fine Arts",
    }
    for n in range(1, 8):
        row[f"image_{n}"] = {"bytes": images[n], "path": f"img_{i}_{n}.png"} if n in images else None
    return row


def _write(folder, subject: str, rows: list[dict]) -> None:
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    fields = [(k, pa.string()) for k in rows[0] if not k.startswith("image_")]
    schema = pa.schema(fields + [(f"image_{n}", image) for n in range(1, 8)])
    (folder / subject).mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), folder / subject / "validation-00000-of-00001.parquet")


def test_prompt_and_image_placement():
    img1, img2 = png_bytes(4, 4, 1), png_bytes(4, 4, 2)
    row = _row(1, "Which is older, <image 2> or the other?", ["<image 1>", "neither"], "A", {1: img1, 2: img2})
    assert mmmu.prompt_text(row) == (
        "Which is older, <image 2> or the other?\n(A) <image 1>\n(B) neither\n\n"
        "Answer with the option's letter from the given choices directly."
    )
    parts = mmmu.message_content(row)
    kinds = [p["type"] for p in parts]
    assert kinds == ["text", "image_url", "text", "image_url", "text"]
    assert parts[1]["image_url"]["url"] == mmmu.image_data_url({"bytes": img2})  # image 2 where its tag was
    assert parts[3]["image_url"]["url"] == mmmu.image_data_url({"bytes": img1})
    assert parts[0]["text"] == "Which is older, " and parts[2]["text"].endswith("(A) ")
    untagged = mmmu.message_content(_row(2, "What is shown?", None, "cat", {1: img1}))
    assert [p["type"] for p in untagged] == ["image_url", "text"]
    assert untagged[1]["text"] == "What is shown?\nAnswer the question using a single word or phrase."


def test_reference_answer_parsing():
    rng = random.Random(0)
    choices, index2ans = ["A", "B", "C", "D"], {"A": "red", "B": "green", "C": "blue", "D": "yellow"}
    assert mmmu.parse_multi_choice("B", choices, index2ans, rng) == "B"
    assert mmmu.parse_multi_choice("The answer is (C).", choices, index2ans, rng) == "C"
    assert mmmu.parse_multi_choice("(A) or maybe (D)", choices, index2ans, rng) == "D"  # the last one mentioned
    assert mmmu.parse_multi_choice("A or B, I think B", choices, index2ans, rng) == "B"
    assert mmmu.parse_multi_choice("I am fairly sure the colour is green here", choices, index2ans, rng) == "B"
    assert mmmu.parse_multi_choice("green", choices, index2ans, random.Random(42)) == random.Random(42).choice(choices)
    # The reference's quirks kept: "1,234" is read off "1,234.5" by the thousands pattern, "234.5" by the plain one.
    assert mmmu.parse_open("The answer is 1,234.5 kg.") == ["1,234.5 kg", 1234.0, 234.5]
    assert mmmu.parse_open("x = 3\nso the total is 12") == [12.0]  # the shortest tail after a key phrase
    assert mmmu.parse_open("no key phrase here") == ["no key phrase here"]
    assert mmmu.is_open_correct(mmmu.gold_answers("['12', '12.0']"), mmmu.parse_open("It is 12."))
    assert mmmu.is_open_correct(["Paris"], mmmu.parse_open("I believe it is paris, France"))
    assert not mmmu.is_open_correct(["7"], mmmu.parse_open("It is 17"))
    assert mmmu.normalize_answer("a") == [" a", "a "]


def test_eval_mmmu_end_to_end(vlm_server, tmp_path, capsys):
    server, base_url = vlm_server
    data = tmp_path / "MMMU"
    img = {n: png_bytes(6 + n, 5, n) for n in range(1, 4)}
    _write(data, "Art", [
        _row(1, "Which painting is older? <image 1> <image 2>", ["left", "right", "both"], "B", {1: img[1], 2: img[2]}),
        _row(2, "Name the colour of <image 1>.", None, "['red', 'crimson']", {1: img[3]}),
        _row(3, "Pick one.", ["x", "y"], "A", {1: img[1]}),
    ])  # fmt: skip
    _write(data, "Math", [_row(4, "What is 2+2? <image 1>", None, "4", {1: img[2]})])
    out = tmp_path / "mmmu.json"
    code = main(["eval", "mmmu", "--base-url", base_url, "--data-dir", str(data), "--limit", "2", "--max-tokens", "4",
                 "--parallel", "2", "--out", str(out)])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(out.read_text())
    m = result["metrics"]
    assert result["eval"] == "mmmu" and result["config"]["split"] == "validation" and result["label"] == "standard"
    assert [s["id"] for s in result["samples"]] == ["validation_Art_1", "validation_Art_2", "validation_Art_4"]
    assert set(m["per_subject"]) == {"Art", "Math"} and m["overall"]["num_total"] == 3
    assert m["per_subject"]["Art"]["num_total"] == 2 and set(m["per_question_type"]) == {"multiple-choice", "open"}
    for sample in result["samples"]:
        assert sample["completion_tokens"] >= 1 and sample["prompt_tokens"] > 9  # the image tokens are in the prompt
        expected = mmmu.score({"question_type": sample["question_type"], "options": "['left', 'right', 'both']",
                               "answer": sample["reference"]}, sample["response"], random.Random(0))  # fmt: skip
        if sample["question_type"] == "open":
            assert sample["is_correct"] == expected["is_correct"]
    assert m["overall"]["num_correct"] == sum(s["is_correct"] for s in result["samples"])
    assert "OVERALL (micro)" in captured.out and "Math" in captured.out
    with pytest.raises(SystemExit):
        main(["eval", "mmmu", "--base-url", base_url])  # --data-dir is required
    assert main(["eval", "mmmu", "--base-url", base_url, "--data-dir", str(tmp_path / "nothing")]) == 2
