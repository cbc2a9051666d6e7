"""SamplingParams validation: bad values raise ValueError naming the field."""

from __future__ import annotations

import pytest

from jetserve.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("max_tokens", 2.5),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2**31),
        ("top_k", 1.0),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("seed", 2**64),
        ("seed", "7"),
        ("stop", ["ok", ""]),
        ("stop_token_ids", [-1]),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", True),
    ],
)
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert p.max_tokens == 16 and p.temperature == 1.0 and not p.is_greedy and p.stop == ()
    p = SamplingParams(temperature=0, top_k=-1, stop="###", stop_token_ids=[3, 4], max_tokens=None, logprobs=0)
    assert p.is_greedy and p.top_k == 0 and p.stop == ("###",) and p.stop_token_ids == (3, 4)
    assert p.max_tokens is None and p.logprobs == 0
    assert hash(p) == hash(SamplingParams(temperature=0, top_k=0, stop=["###"], stop_token_ids=(3, 4), max_tokens=None,
                                          logprobs=0))  # fmt: skip
