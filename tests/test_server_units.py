"""Server pieces without a server: stop-string cutting on a stream, request validation, the engine's
refusals in the API's words."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dspark.runtime.engine.requests import Request, RequestError, validate_request
from dspark.runtime.serve.errors import ApiError
from dspark.runtime.serve.openai_protocol import CompletionRequest, parse_completion_request, validation_error
from dspark.runtime.serve.request_body import check_unicode
from dspark.runtime.serve.server import request_refused
from dspark.runtime.serve.streaming import StopMatcher

ALPHABET = st.sampled_from(list("ab\n é🙂"))


@given(text=st.text(ALPHABET, max_size=40), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4),
                                                           max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
@example(text=" aa", stops=["a", " aa"], cuts=[2])  # a longer stop that began first completes later
@settings(max_examples=1000)
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
    api = validation_error(err.value)
    assert api.status == 400 and api.param == param and param.split(".")[0] in api.message
    assert "Input should" not in api.message and "Value error" not in api.message


def test_defaults_and_accepted_openai_fields() -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "n": 1, "echo": False,
                                            "presence_penalty": 0, "stop": "x"})
    assert req.stop_strings() == ["x"] and req.max_tokens is None and not req.stream


def test_a_batch_of_one_is_its_prompt_and_longer_batches_are_refused() -> None:
    assert parse_completion_request({"model": "m", "prompt": ["abc"]}).prompt == "abc"
    assert parse_completion_request({"model": "m", "prompt": [[5, 6]]}).prompt == [5, 6]
    with pytest.raises(ApiError, match="batched prompts are not supported") as err:
        parse_completion_request({"model": "m", "prompt": ["a", "b"]})
    assert err.value.param == "prompt"


def _request(prompt_len: int, max_new: int) -> Request:
    return Request(rid=41, prompt=[1] * prompt_len, max_new_tokens=max_new)


def test_engine_refusals_name_the_field_to_change_and_never_the_request_id() -> None:
    with pytest.raises(RequestError) as err:
        validate_request(_request(10, 100), 8, max_context_len=64, pool_tokens=4096)
    assert err.value.field == "max_new_tokens" and err.value.code == "context_length_exceeded"
    assert "at most 46" in str(err.value) and "41" not in str(err.value)  # 64 - 10 - 8
    validate_request(_request(10, 46), 8, max_context_len=64, pool_tokens=4096)  # 46 does fit
    with pytest.raises(RequestError) as err:
        validate_request(_request(56, 1), 8, max_context_len=64, pool_tokens=4096)
    assert err.value.field == "prompt" and "at most 55 prompt tokens" in str(err.value)
    validate_request(_request(55, 1), 8, max_context_len=64, pool_tokens=4096)
    # the tighter limit decides, so the largest value offered is one that fits
    with pytest.raises(RequestError) as err:
        validate_request(_request(10, 100), 8, max_context_len=1024, pool_tokens=48)
    assert "max_total_tokens" in str(err.value) and "at most 30" in str(err.value)
    for request, field in ((_request(0, 4), "prompt"), (_request(3, 0), "max_new_tokens")):
        with pytest.raises(RequestError) as err:
            validate_request(request, 8, 64, 4096)
        assert err.value.field == field and "41" not in str(err.value)


def test_engine_refusals_speak_of_max_tokens_in_the_api() -> None:
    with pytest.raises(RequestError) as err:
        validate_request(_request(10, 100), 8, max_context_len=64, pool_tokens=4096)
    api = request_refused(err.value)
    assert api.status == 400 and api.param == "max_tokens" and api.code == "context_length_exceeded"
    assert "lower max_tokens to at most 46" in api.message and "max_new_tokens" not in api.message
    assert request_refused(RequestError("the prompt is empty", "prompt")).param == "prompt"


def test_strings_that_are_not_unicode_are_refused_naming_the_top_level_field() -> None:
    check_unicode({"prompt": "fine 🙂", "stop": ["a", "b"], "stream_options": {"include_usage": True}})
    for payload, param in (({"prompt": "a\ud800"}, "prompt"), ({"stop": ["ok", "\udc00"]}, "stop"),
                           ({"logit_bias": {"\ud800": 1}}, "logit_bias")):
        with pytest.raises(ApiError) as err:
            check_unicode(payload)
        assert err.value.status == 400 and err.value.param == param and "surrogate" in err.value.message
