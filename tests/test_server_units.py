"""Server pieces without a server: stop-string cutting on a stream, request validation."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from dspark.runtime.serve.openai_protocol import CompletionRequest
from dspark.runtime.serve.server import StopMatcher, _validation_error

ALPHABET = st.sampled_from(list("ab\n é🙂"))


@given(text=st.text(ALPHABET, max_size=40), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4),
                                                           max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_stop_matcher_emits_the_text_up_to_the_first_stop_string(text: str, stops: list[str],
                                                                 cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)] or [""]
    matcher = StopMatcher(stops)
    out, hit = "", False
    for i, piece in enumerate(pieces):
        emitted, hit = matcher.feed(piece, final=i == len(pieces) - 1)
        out += emitted
        if hit:
            break
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    if found:
        assert hit and out == text[:min(found)]
    else:
        assert not hit and out == text


def test_without_stop_strings_nothing_is_held_back() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("abc", final=False) == ("abc", False)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs"),
])
def test_validation_errors_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(ValidationError) as err:
        CompletionRequest.model_validate(body)
    api = _validation_error(err.value)
    assert api.status == 400 and api.param == param and param.split(".")[0] in api.message


def test_defaults_and_accepted_openai_fields() -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "n": 1, "echo": False,
                                            "presence_penalty": 0, "stop": "x"})
    assert req.stop_strings() == ["x"] and req.max_tokens is None and not req.stream
