"""`POST /v1/chat/completions` with the official `openai` client: against a real `dspark serve` process on
the embedded tiny deployment (the byte-level model's plain template), non-streaming and streaming,
checked token for token against target-only greedy decoding of the rendered prompt; a Hugging Face
tokenizer whose chat template ends a turn with a special token the model really emits (the reply stops
before it and never shows it); and the refusals, each the server's 400 error shape."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dspark.checkpoints import embedded_root
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import GeneratedPackage, load_package
from dspark.runtime.serve.server import CompletionServer
from dspark.runtime.tokenizer import HFTokenizer

from .runtime_helpers import REPO
from .server_helpers import serving_in_process
from .test_server import ServerProcess, _bytes_to_unicode

openai = pytest.importorskip("openai")

MODEL = "tiny_cpu_static"
PACKAGE = REPO / "generated" / MODEL
MAX_TOKENS = 24
CONVERSATION = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def fibonacci(n):"}]


@pytest.fixture(scope="module")
def package() -> GeneratedPackage:
    return load_package(PACKAGE)


@pytest.fixture(scope="module")
def reference(package: GeneratedPackage) -> Runtime:
    return Runtime(package)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    process = ServerProcess(PACKAGE, tmp_path_factory.mktemp("chat_server") / "server.log")
    yield process
    process.stop()


def _client(url: str) -> Any:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=120))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return _client(server.url)


def _greedy(runtime: Runtime, prompt: list[int], max_tokens: int) -> list[int]:
    outputs, _ = runtime.generate([prompt], max_tokens, target_only=True)
    return outputs[0]


def _plain_prompt(package: GeneratedPackage, messages: list[dict[str, str]]) -> list[int]:
    chat = package.tokenizer.chat_format()
    return package.tokenizer.encode(chat.template.render(messages), add_bos=chat.add_bos)


def test_a_chat_completion_is_the_greedy_reply_to_the_rendered_conversation(
        client: Any, package: GeneratedPackage, reference: Runtime) -> None:
    prompt = _plain_prompt(package, CONVERSATION)
    assert package.tokenizer.decode(prompt) == \
        "system: You write Python.\n\nuser: def fibonacci(n):\n\nassistant: "
    ids = _greedy(reference, prompt, MAX_TOKENS)
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    choice = r.choices[0]
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == package.tokenizer.decode(ids)
    assert choice.finish_reason == ("length" if len(ids) == MAX_TOKENS else "stop")
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == len(prompt) + len(ids)


def test_a_streamed_chat_completion_sends_role_content_finish_usage_and_done(
        server: ServerProcess, client: Any, package: GeneratedPackage, reference: Runtime) -> None:
    messages = [{"role": "user", "content": "class Stack:\n    def push(self, item):"}]
    prompt = _plain_prompt(package, messages)
    ids = _greedy(reference, prompt, MAX_TOKENS)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    first, *middle, finish, last = chunks
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == ""
    assert all(c.choices[0].delta.role is None and c.choices[0].finish_reason is None for c in middle)
    assert "".join(c.choices[0].delta.content for c in middle) == package.tokenizer.decode(ids)
    assert finish.choices[0].finish_reason == ("length" if len(ids) == MAX_TOKENS else "stop")
    assert finish.choices[0].delta.content is None
    assert last.choices == [] and last.usage.completion_tokens == len(ids)
    assert last.usage.prompt_tokens == len(prompt)
    assert all(c.usage is None for c in chunks[:-1])
    # The wire format itself: server-sent events ending in [DONE].
    body = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and all("usage" not in json.loads(d) for d in data[:-1])


def test_stop_strings_cut_the_reply(client: Any, package: GeneratedPackage, reference: Runtime) -> None:
    prompt = _plain_prompt(package, CONVERSATION)
    text = package.tokenizer.decode(_greedy(reference, prompt, 64))
    stop = text[5:7]  # a stop string the reply really reaches
    r = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=64, temperature=0,
                                       stop=[stop])
    assert r.choices[0].message.content == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("kwargs", "param", "says"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools",
     "no tool calling"),
    ({"tool_choice": "auto"}, "tool_choice", "no tool calling"),
    ({"n": 2}, "n", "> 1 is not supported"),
    ({"logprobs": True}, "logprobs", "not supported"),
    ({"response_format": {"type": "json_object"}}, "response_format", "free text only"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "messages[0].content[1]", "reads text only"),
    ({"messages": [{"role": "tool", "content": "42", "tool_call_id": "call_1"}]}, "messages[0].role",
     "no tool calling"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "must be one of"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": [{"role": "user", "content": "hi", "mood": "calm"}]}, "messages[0].mood",
     "unknown field"),
    ({"messages": [{"role": "user", "content": "x" * 2000}]}, "messages", "shorten the prompt"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", "differ"),
    ({"max_tokens": None, "max_completion_tokens": 10**6}, "max_completion_tokens", "context length"),
    ({"extra_body": {"chat_template_kwargs": {"messages": []}}}, "chat_template_kwargs", "may not set"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate", "unknown parameter"),
    ({"model": "gpt-4o"}, "model", "not served here"),
])
def test_unsupported_requests_get_the_servers_error_shape(client: Any, kwargs: dict[str, Any], param: str,
                                                          says: str) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kwargs}
    expected = openai.NotFoundError if param == "model" else openai.BadRequestError
    with pytest.raises(expected) as err:
        client.chat.completions.create(**request)
    assert err.value.status_code == (404 if param == "model" else 400)
    assert set(err.value.body) == {"message", "type", "param", "code"}
    assert err.value.body["param"] == param and says in err.value.body["message"]
    assert err.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize(("messages", "param", "says"), [
    ("hello", "messages", "must be a list"),
    (None, "messages", "must be a list"),
    (["hello"], "messages[0]", "must be an object"),
    ([{"role": "user", "content": 5}], "messages[0].content", "string or a list of text parts"),
    ([{"role": "user", "content": ["hi"]}], "messages[0].content[0]", "with a `type`"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text",
     "must be a string"),
    ([{"role": 7, "content": "hi"}], "messages[0].role", "not a non-string"),
    ([{"role": "user", "content": "hi", "name": 3}], "messages[0].name", "must be a string"),
    ([{"role": "developer", "content": "hi"}], "messages[0].role", "as a \"system\" message"),
    ([{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}], "messages[0].tool_calls",
     "no tool calling"),
])
def test_malformed_messages_are_400s_naming_the_message(server: ServerProcess, messages: Any, param: str,
                                                        says: str) -> None:
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and says in error["message"], error


def test_text_parts_are_joined_with_newlines_and_null_fields_dropped(
        server: ServerProcess, package: GeneratedPackage, reference: Runtime) -> None:
    text_parts = [{"type": "text", "text": "def"}, {"type": "text", "text": "fibonacci(n):"}]
    parts = [{"role": "system", "content": "You write Python.", "name": None},
             {"role": "user", "content": text_parts, "tool_calls": None}]
    joined = [CONVERSATION[0], {"role": "user", "content": "def\nfibonacci(n):"}]
    ids = _greedy(reference, _plain_prompt(package, joined), 8)
    body = {"model": MODEL, "messages": parts, "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == package.tokenizer.decode(ids)


def test_the_openai_sdk_round_trip_of_its_own_message_objects(client: Any) -> None:
    # An assistant message the SDK returned goes back with its null fields (tool_calls, refusal, ...).
    first = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=8, temperature=0)
    history = [*CONVERSATION, first.choices[0].message.model_dump(), {"role": "user", "content": "more"}]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
    assert second.choices[0].message.role == "assistant" and second.usage.completion_tokens >= 1


# -- a Hugging Face tokenizer with a chat template (in-process server) --------------------------------

# NUL never occurs in the tiny model's text; spaces (byte 32) it emits all the time. So spaces are not
# text for this tokenizer: the conversation below has none.
IM_START, IM_END = 0, 32
TURN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _turn_checkpoint(directory: Path, chat_template: str | None) -> Path:
    """The embedded target with a byte-level BPE tokenizer.json in which the byte ids 0 and 32 are the
    special tokens `<|im_start|>` and `<|im_end|>` (`<s>`/`</s>` at 256/257): so the chat template's
    end-of-turn token is one the model emits, and the stop at it is exercised for real."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    directory.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(embedded_root() / "tiny" / "target" / name, directory / name)
    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256) if b not in (IM_START, IM_END)}
    vocab |= {"<|im_start|>": IM_START, "<|im_end|>": IM_END}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in ("<|im_start|>", "<|im_end|>", "<s>", "</s>")])
    tok.save(str(directory / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@dataclasses.dataclass
class InProcess:
    server: CompletionServer
    url: str


def _serve_in_process(package: GeneratedPackage) -> Iterator[InProcess]:
    server = CompletionServer(Runtime(package), MODEL)
    with serving_in_process(server) as (_, url):
        yield InProcess(server, url)


@pytest.fixture(scope="module")
def turn_server(package: GeneratedPackage, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcess]:
    checkpoint = _turn_checkpoint(tmp_path_factory.mktemp("turn") / "ckpt", TURN_TEMPLATE)
    tokenizer = HFTokenizer.from_dir(checkpoint)
    yield from _serve_in_process(dataclasses.replace(package, tokenizer=tokenizer))


@pytest.fixture(scope="module")
def untemplated_server(package: GeneratedPackage, tmp_path_factory: pytest.TempPathFactory
                       ) -> Iterator[InProcess]:
    tokenizer = HFTokenizer.from_dir(_turn_checkpoint(tmp_path_factory.mktemp("none") / "ckpt", None))
    yield from _serve_in_process(dataclasses.replace(package, tokenizer=tokenizer))


def test_the_reply_ends_at_the_templates_end_of_turn_token(turn_server: InProcess, package: GeneratedPackage,
                                                           reference: Runtime) -> None:
    tokenizer = turn_server.server.tokenizer
    assert tokenizer.eos_ids == {257} and tokenizer.chat_format().stop_ids == {IM_END}
    messages = [{"role": "user", "content": "import\tos\nimport\tsys"}]
    prompt = [256, IM_START, *b"user\nimport\tos\nimport\tsys", IM_END, IM_START, *b"assistant\n"]
    assert turn_server.server.tokenizer.encode(
        tokenizer.chat_format().template.render(messages), add_bos=False) == prompt
    ids = _greedy(reference, prompt, 64)  # the byte-level model: no stop at byte 32
    assert IM_END in ids, "the test needs a reply that reaches the end-of-turn token"
    reply = ids[:ids.index(IM_END)]
    client = _client(turn_server.url)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0)
    assert r.choices[0].message.content == package.tokenizer.decode(reply)
    assert r.choices[0].finish_reason == "stop" and " " not in r.choices[0].message.content
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(reply)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        package.tokenizer.decode(reply)
    assert chunks[-2].choices[0].finish_reason == "stop" and chunks[-1].usage.completion_tokens == len(reply)
    # ignore_eos also ignores the end of turn: the reply runs to max_tokens through it.
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=len(reply) + 3,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == len(reply) + 3
    # The engine stops at the end of turn (the request is aborted), not at max_tokens: the tokens it
    # generated are the reply's and at most a few steps run ahead (a step commits up to gamma + 1).
    before = _generated_tokens(turn_server.server)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=800, temperature=0)
    assert r.usage.completion_tokens == len(reply)
    deadline = time.monotonic() + 30
    while turn_server.server.runtime.pool_stats()["running"]:
        assert time.monotonic() < deadline, "the stopped request still runs"
        time.sleep(0.05)
    assert _generated_tokens(turn_server.server) - before < len(reply) + 4 * 8


def _generated_tokens(server: CompletionServer) -> float:
    return sum(sample.value for metric in server.metrics.registry.collect()
               if metric.name == "dspark_generation_tokens" for sample in metric.samples
               if sample.name.endswith("_total"))


def test_without_a_chat_template_the_chat_route_says_so_and_completions_work(
        untemplated_server: InProcess) -> None:
    client = _client(untemplated_server.url)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4)
    assert err.value.body["code"] == "chat_template_error" and err.value.body["param"] == "messages"
    assert "no chat template" in err.value.body["message"]
    assert "POST /v1/completions" in err.value.body["message"]
    completion = client.completions.create(model=MODEL, prompt="def main(", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("length", "stop")


def test_a_template_that_refuses_the_conversation_is_a_400_in_its_words(
        package: GeneratedPackage, tmp_path: Path) -> None:
    template = ("{% if messages[-1].role != 'user' %}{{ raise_exception('The last message must come from the "
                "user') }}{% endif %}{{ messages[-1].content }}")
    tokenizer = HFTokenizer.from_dir(_turn_checkpoint(tmp_path / "ckpt", template))
    for live in _serve_in_process(dataclasses.replace(package, tokenizer=tokenizer)):
        client = _client(live.url)
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}])
        assert "The last message must come from the user" in err.value.body["message"]
        ok = client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                            messages=[{"role": "user", "content": "def_main("}])
        assert ok.choices[0].message.role == "assistant"
