"""GSM8K: lm-eval's answer filters on the real answer strings and on tricky model outputs; the exact prompt format."""

import pytest

from jetserve.evals import gsm8k
from jetserve.evals.gsm8k import INVALID, extract_flexible, extract_strict, is_correct, normalize, reference_answer


def test_vendored_splits():
    test, train = gsm8k.load_split("test"), gsm8k.load_split("train")
    assert len(test) == 1319 and len(train) == 64
    assert test[0]["question"].startswith("Janet’s ducks lay 16 eggs per day.")
    assert train[0]["question"].startswith("Natalia sold clips to 48 of her friends in April")
    with pytest.raises(ValueError, match="split"):
        gsm8k.load_split("validation")


@pytest.mark.parametrize("split", ["test", "train"])
def test_both_filters_recover_every_real_answer(split):
    """Every gold answer string, fed back as if the model wrote it, scores correct under both filters."""
    for row in gsm8k.load_split(split):
        reference = reference_answer(row["answer"])
        assert reference.lstrip("-").replace(".", "", 1).isdigit(), reference
        assert is_correct(extract_strict(row["answer"]), reference), row["answer"]
        assert is_correct(extract_flexible(row["answer"]), reference), row["answer"]


def test_real_answer_with_thousands_separator():
    (row,) = [r for r in gsm8k.load_split("test") if r["answer"].endswith("#### 114,200")]
    assert reference_answer(row["answer"]) == "114200"
    assert extract_strict(row["answer"]) == "114,200"
    assert extract_flexible(row["answer"]) == "114,200"


@pytest.mark.parametrize(
    ("text", "strict", "flexible", "normalized"),
    [
        (" She makes $1,234 per week.", INVALID, "$1,234", "1234"),
        (" The change is -5.", INVALID, "-5.", "-5"),
        (" Each costs 3.50 dollars", INVALID, "3.50", "3.50"),  # no numeric equivalence, as in lm-eval
        (" 3 + 4 = 7 apples and 12 pears.\n\n", INVALID, "12", "12"),
        (" We get 15, which is the answer", INVALID, "15,", "15"),
        (" Total: 18.\n#### 18", "18", "18", "18"),
        (" So #### 72. Then 5 more", "72.", "5", "5"),
        (" #### 1,000\n", "1,000", "1,000", "1000"),
        (" #### -3", "-3", "-3", "-3"),
        (" 0.5 of 10 is 5", INVALID, "5", "5"),
        (" I do not know.", INVALID, INVALID, None),
        ("", INVALID, INVALID, None),
    ],
)
def test_filters_on_tricky_outputs(text, strict, flexible, normalized):
    assert extract_strict(text) == strict
    assert extract_flexible(text) == flexible
    if normalized is not None:
        assert normalize(flexible) == normalized
        assert is_correct(flexible, normalized)
    assert not is_correct(INVALID, normalize(INVALID))  # an invalid answer never matches


def test_one_shot_prompt_is_the_lm_eval_format():
    shots = gsm8k.load_split("train")[:1]
    question = gsm8k.load_split("test")[0]["question"]
    expected = (
        "Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?\n"
        "Answer: Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n"
        "#### 72\n\n"
        "Question: Janet’s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
        "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh "
        "duck egg. How much in dollars does she make every day at the farmers' market?\n"
        "Answer:"
    )
    assert gsm8k.build_prompt(question, shots) == expected


def test_zero_and_eight_shot_prompts():
    train = gsm8k.load_split("train")
    assert gsm8k.build_prompt("What is 2 + 2?", ()) == "Question: What is 2 + 2?\nAnswer:"
    prompt = gsm8k.build_prompt("What is 2 + 2?", train[:8])
    assert prompt.count("Question: ") == 9 and prompt.count("\n\nQuestion: ") == 8
    assert prompt.startswith(f"Question: {train[0]['question']}\nAnswer: {train[0]['answer']}\n\n")
