"""MMLU: the vendored splits, the exact k-shot prompt, choice scoring from echoed log-probs, generative extraction."""

import pytest

from jetserve.evals import mmlu
from jetserve.evals.client import EvalError


def test_vendored_splits():
    names = mmlu.subjects()
    assert len(names) == 57 and "abstract_algebra" in names and "world_religions" in names
    assert sum(len(mmlu.load_split(s, "dev")) for s in names) == 285
    assert sum(len(mmlu.load_split(s, "test")) for s in names) == 14042
    # A quoted field with an embedded newline and a CRLF file both parse into six columns.
    assert all(len(r) == 6 for s in names for r in mmlu.load_split(s, "dev"))
    with pytest.raises(ValueError, match="not an MMLU subject"):
        mmlu.load_split("astrology", "test")


def test_one_shot_prompt_is_the_standard_format():
    shots = mmlu.load_split("abstract_algebra", "dev")[:1]
    row = mmlu.load_split("abstract_algebra", "test")[0]
    expected = (
        "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        "Find all c in Z_3 such that Z_3[x]/(x^2 + c) is a field.\n"
        "A. 0\nB. 1\nC. 2\nD. 3\n"
        "Answer: B\n\n"
        "Find the degree for the given field extension Q(sqrt(2), sqrt(3), sqrt(18)) over Q.\n"
        "A. 0\nB. 4\nC. 2\nD. 6\n"
        "Answer:"
    )
    assert mmlu.build_prompt("abstract_algebra", row, shots) == expected


def test_five_shot_prompt_strips_questions_only():
    subject = next(s for s in mmlu.subjects() if any(r[0] != r[0].strip() for r in mmlu.load_split(s, "test")))
    row = next(r for r in mmlu.load_split(subject, "test") if r[0] != r[0].strip())
    prompt = mmlu.build_prompt(subject, row, mmlu.load_split(subject, "dev"))
    assert prompt.count("\nAnswer: ") == 5 and prompt.endswith(f"{row[0].strip()}\nA. {row[1]}\nB. {row[2]}\n"
                                                                 f"C. {row[3]}\nD. {row[4]}\nAnswer:")  # fmt: skip


def _choice(tokens, logprobs):
    return {"logprobs": {"tokens": tokens, "token_logprobs": logprobs}}


def test_scores_start_where_the_tokenisations_differ():
    # Byte-level: " A" is two tokens; the shared " " is left out, only the letter is scored.
    prefix, lps = ["Answer", ":", " "], [None, -3.0, -0.5]
    choices = [_choice(prefix + [x], lps + [lp]) for x, lp in zip("ABCD", [-2.0, -0.25, -1.0, -4.0], strict=True)]
    assert mmlu.continuation_scores(choices) == [-2.0, -0.25, -1.0, -4.0]


def test_scores_cover_a_token_merged_across_the_boundary():
    # A tokenizer that merges ": A" into one token for one choice: the whole divergent tail is summed for each.
    choices = [
        _choice(["Answer", ": A"], [None, -1.5]),
        _choice(["Answer", ":", " B"], [None, -0.25, -0.5]),
        _choice(["Answer", ":", " C"], [None, -0.25, -3.0]),
        _choice(["Answer", ":", " D"], [None, -0.25, -2.0]),
    ]
    assert mmlu.continuation_scores(choices) == [-1.5, -0.75, -3.25, -2.25]


def test_scores_need_log_probs():
    choices = [_choice(["x", c], [None, None]) for c in "ABCD"]
    with pytest.raises(EvalError, match="no log-prob"):
        mmlu.continuation_scores(choices)
    with pytest.raises(EvalError, match="identically"):
        mmlu.continuation_scores([_choice(["x", "A"], [None, -1.0])] * 4)


@pytest.mark.parametrize(
    ("text", "letter"),
    [(" B", "B"), (" (C) because", "C"), ("D.", "D"), (" The answer is A", "A"), (" Apple", None), ("", None)],
)
def test_generative_letter(text, letter):
    assert mmlu.extract_letter(text) == letter
