"""The server as a hostile client finds it: every malformed request gets an OpenAI-shaped 4xx on a
connection that keeps serving, and a fault in the server is a 500 (or a stream's error event) without
internals. A real `CompletionServer` over the embedded tiny model, served by uvicorn in a thread."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package
from dspark.runtime.serve import server as server_module
from dspark.runtime.serve.server import CompletionServer
from dspark.runtime.serve.streaming import StopMatcher

from .runtime_helpers import REPO
from .server_helpers import serving_in_process

MODEL = "tiny_cpu_static"
CONTEXT = 1024  # the package's serving.max_context_len
RESERVED = 8  # N = gamma + 1 rows a request reserves for a verify step
ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class Live:
    server: CompletionServer
    uv: uvicorn.Server
    url: str


@pytest.fixture(scope="module")
def live() -> Iterator[Live]:
    server = CompletionServer(Runtime(load_package(REPO / "generated" / MODEL)))
    with serving_in_process(server) as (uv, url):
        yield Live(server, uv, url)


@pytest.fixture
def client(live: Live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live.url, timeout=60, trust_env=False) as http:
        yield http


def _local_address(response: httpx.Response) -> Any:
    """The client side of the connection a response came on: equal for two responses on one connection."""
    return response.extensions["network_stream"].get_extra_info("client_addr")


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert body["error"]["message"] and not re.search(r"\brequest \d+", body["error"]["message"])
    return body["error"]


def _post(http: httpx.Client, body: dict[str, Any] | bytes, **headers: str) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post("/v1/completions", content=body,
                         headers={"content-type": "application/json", **headers})
    return http.post("/v1/completions", json=body, headers=headers)


def _ok(http: httpx.Client, **fields: Any) -> httpx.Response:
    r = _post(http, {"model": MODEL, "prompt": "def f(", "max_tokens": 4, **fields})
    assert r.status_code == 200, r.text
    return r


def test_a_lone_surrogate_is_a_400_and_the_connection_keeps_serving(client: httpx.Client) -> None:
    # httpx cannot encode a lone surrogate itself; JSON's escape is what a client sends.
    r = _post(client, b'{"model": "tiny_cpu_static", "prompt": "ab\\ud800cd", "max_tokens": 4}')
    error = _error(r, 400)
    assert error["param"] == "prompt" and "surrogate" in error["message"]
    following = _ok(client)
    assert _local_address(following) == _local_address(r)
    # a surrogate in another field, echoed back in no message, is refused the same way
    error = _error(_post(client, b'{"model": "\\udfff", "prompt": "x"}'), 400)
    assert error["param"] == "model"
    # a proper pair spelled as escapes is one character, not an error
    r = _post(client, b'{"model": "tiny_cpu_static", "prompt": "smile \\ud83d\\ude42", "max_tokens": 2}')
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len("smile \U0001f642".encode()) + 1


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/nope", 404), ("POST", "/v1/embeddings", 404), ("GET", "/docs", 404),
    ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405), ("POST", "/health", 405),
])
def test_unknown_routes_and_methods_get_openai_errors(client: httpx.Client, method: str, path: str,
                                                      status: int) -> None:
    error = _error(client.request(method, path), status)
    assert path in error["message"]
    if status == 405:
        assert "use " in error["message"]


@pytest.mark.parametrize(("body", "headers", "status", "says"), [
    (b'{"model": "tiny_cpu_static", "prompt": ', {}, 400, "not valid JSON"),
    (b"", {}, 400, "empty"),
    (b"[1, 2]", {}, 400, "must be a JSON object"),
    (b'"text"', {}, 400, "must be a JSON object"),
    (b"null", {}, 400, "must be a JSON object"),
    (b'{"model": "tiny_cpu_static", "prompt": "x", "temperature": NaN}', {}, 400, "NaN"),
    (b'{"model": "tiny_cpu_static", "prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", {}, 400,
     "out of range"),
    (b"[" * 100_000, {}, 400, "nests too deeply"),
    (b"\xff\xfe\x00", {}, 400, "not valid JSON"),
    (b'{"model": "tiny_cpu_static", "prompt": "x"}', {"content-type": "text/plain"}, 415, "Content-Type"),
    (b"model=tiny_cpu_static&prompt=x", {"content-type": "application/x-www-form-urlencoded"}, 415,
     "Content-Type"),
    (b'{"prompt": "' + b"x" * (2 << 20) + b'"}', {}, 413, "over"),
])
def test_malformed_bodies_get_a_4xx(client: httpx.Client, body: bytes, headers: dict[str, str],
                                    status: int, says: str) -> None:
    error = _error(_post(client, body, **headers), status)
    assert says in error["message"] and error["param"] is None
    _ok(client)  # and the server goes on


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"n": 2}, "n", "`n` > 1 is not supported"),
    ({"n": 0}, "n", "`n` must be 1"),
    ({"best_of": 3}, "best_of", "`best_of` > 1 is not supported"),
    ({"logprobs": 1}, "logprobs", "`logprobs` is not supported"),
    ({"logprobs": 0}, "logprobs", "`logprobs` is not supported"),
    ({"echo": True}, "echo", "`echo` is not supported"),
    ({"suffix": "}"}, "suffix", "`suffix` is not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "`presence_penalty` is not supported"),
    ({"frequency_penalty": -1}, "frequency_penalty", "`frequency_penalty` is not supported"),
    ({"logit_bias": {"50256": -100}}, "logit_bias", "`logit_bias` is not supported"),
    ({"prompt": ["a", "b"]}, "prompt", "`prompt` must be a single string; batched prompts are not supported"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "batched prompts are not supported"),
    ({"prompt": [1, "a"]}, "prompt", "token ids"),
    ({"prompt": {"text": "x"}}, "prompt", "must be a string or a list of token ids"),
    ({"prompt": [256, 999]}, "prompt", "outside the vocabulary"),
    ({"prompt": ""}, "prompt", "must not be empty"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": 2.5}, "max_tokens", "must be an integer"),
    ({"max_tokens": True}, "max_tokens", "must be an integer"),
    ({"temperature": "hot"}, "temperature", "must be a number"),
    ({"temperature": -1}, "temperature", "between 0"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_k": 10**20}, "top_k", "between 0"),
    ({"seed": -1}, "seed", "between 0"),
    ({"stop": 3}, "stop", "a string or a list of strings"),
    ({"stop": ["a"] * 5}, "stop", "at most 4"),
    ({"stream": "yes"}, "stream", "true or false"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage", "true or false"),
    ({"stream_options": {"verbose": True}}, "stream_options.verbose", "unknown parameter"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options",
     "only allowed when `stream` is true"),
    ({"frobnicate": True}, "frobnicate", "unknown parameter `frobnicate`"),
    ({"model": "gpt-4"}, "model", "not served here"),
    ({"model": None}, "model", "must be a string"),
])
def test_refused_fields_are_named_in_plain_words(client: httpx.Client, fields: dict[str, Any], param: str,
                                                 says: str) -> None:
    body = {"model": MODEL, "prompt": "x", **fields}
    status = 404 if says == "not served here" else 400
    error = _error(_post(client, body), status)
    assert error["param"] == param and says in error["message"], error
    assert "Input should" not in error["message"]  # the validation library's wording stays inside
    if "stream" not in fields:  # the same refusal, before any chunk, when streaming
        assert _error(_post(client, {**body, "stream": True}), status) == error


def test_a_missing_field_is_named(client: httpx.Client) -> None:
    error = _error(_post(client, {"prompt": "x"}), 400)
    assert error["param"] == "model" and error["message"] == "`model` is required"


def test_no_op_values_of_missing_features_and_user_are_accepted(client: httpx.Client) -> None:
    baseline = _ok(client).json()["choices"][0]["text"]
    noops = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": "", "presence_penalty": 0,
             "frequency_penalty": 0.0, "logit_bias": {}, "user": "user-1234"}
    assert _ok(client, **noops).json()["choices"][0]["text"] == baseline
    assert _ok(client, prompt=["def f("]).json()["choices"][0]["text"] == baseline  # a batch of one


def test_max_tokens_over_the_context_names_max_tokens_and_the_largest_that_fits(client: httpx.Client) -> None:
    prompt = "def f(x):\n    return x\n"
    prompt_tokens = len(prompt.encode()) + 1  # bytes and BOS
    largest = CONTEXT - prompt_tokens - RESERVED
    error = _error(_post(client, {"model": MODEL, "prompt": prompt, "max_tokens": largest + 1}), 400)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert f"lower max_tokens to at most {largest}" in error["message"]
    assert "max_new_tokens" not in error["message"]
    # the largest is exactly right: it is admitted (greedy decoding of a few tokens, stopped early)
    r = _post(client, {"model": MODEL, "prompt": prompt, "max_tokens": largest, "stop": "\n"})
    assert r.status_code == 200, r.text


def test_an_over_long_prompt_names_prompt(client: httpx.Client) -> None:
    error = _error(_post(client, {"model": MODEL, "prompt": "x" * CONTEXT, "max_tokens": 1}), 400)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert f"at most {CONTEXT - RESERVED - 1} prompt tokens" in error["message"]
    assert "shorten the prompt" in error["message"]


def test_extreme_sampling_values_do_not_stop_the_engine(client: httpx.Client) -> None:
    for fields in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300},
                   {"temperature": 100, "top_k": 2**31 - 1}, {"temperature": 1e-8, "seed": 2**63 - 1}):
        _ok(client, **fields)
    assert client.get("/health").json()["status"] == "ok"


class _FailingMatcher(StopMatcher):
    def feed(self, text: str, final: bool) -> tuple[str, bool]:
        raise RuntimeError("secret internal detail")


def test_a_client_gone_mid_request_leaves_no_handler_waiting(live: Live) -> None:
    body = {"model": MODEL, "prompt": "def f(", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up long before 900 tokens
        httpx.post(f"{live.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    deadline = time.monotonic() + 20
    while live.uv.server_state.tasks or live.server.runtime.pool_stats()["running"]:
        assert time.monotonic() < deadline, "a handler still waits for its aborted request"
        time.sleep(0.05)


def test_a_server_fault_is_a_500_without_internals_and_the_server_keeps_serving(
        live: Live, client: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    server_log = logging.getLogger("uvicorn.error")
    server_log.addHandler(handler)
    level = server_log.level
    server_log.setLevel(logging.ERROR)  # the test server logs only criticals
    try:
        with monkeypatch.context() as patch:
            def fail(*_: Any, **__: Any) -> None:
                raise RuntimeError("secret internal detail")
            patch.setattr(live.server.runtime, "new_request", fail)
            r = _post(client, {"model": MODEL, "prompt": "x"})
            error = _error(r, 500)
            assert error["type"] == "server_error" and "secret" not in r.text and "Traceback" not in r.text
        assert _local_address(_ok(client)) == _local_address(r)  # same connection, serving again
    finally:
        server_log.removeHandler(handler)
        server_log.setLevel(level)
    assert any(rec.exc_info and "secret internal detail" in str(rec.exc_info[1]) for rec in records)


def test_a_fault_after_the_stream_began_ends_it_with_an_error_event(
        live: Live, client: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "StopMatcher", _FailingMatcher)
    body = {"model": MODEL, "prompt": "def f(", "max_tokens": 64, "stream": True, "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200  # it had begun
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        address = _local_address(r)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert set(error) == ERROR_KEYS and error["type"] == "server_error" and "secret" not in events[-2]
    monkeypatch.undo()
    assert _local_address(_ok(client)) == address
    deadline = time.monotonic() + 10  # the failed request was aborted: its slot is free again
    while live.server.runtime.pool_stats()["running"]:
        assert time.monotonic() < deadline, live.server.runtime.pool_stats()
        time.sleep(0.05)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_stopped_engine_is_reported_without_internals(monkeypatch: pytest.MonkeyPatch) -> None:
    server = CompletionServer(Runtime(load_package(REPO / "generated" / MODEL)))

    def fail() -> list[Any]:
        raise RuntimeError("secret internal detail")
    monkeypatch.setattr(server.runtime, "step", fail)
    with (serving_in_process(server) as (_, url),
          httpx.Client(base_url=url, timeout=60, trust_env=False) as http):
        r = _post(http, {"model": MODEL, "prompt": "x", "max_tokens": 4})
        error = _error(r, 503)
        assert error["code"] == "engine_stopped" and "secret" not in r.text
        for stream in (False, True):  # later requests are refused before anything is sent
            error = _error(_post(http, {"model": MODEL, "prompt": "x", "stream": stream}), 503)
            assert error["type"] == "server_error"
        assert http.get("/health").status_code == 503
