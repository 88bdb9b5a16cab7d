"""Chat templates rendered as Hugging Face renders them: real checkpoints' templates (Qwen3, Llama 3.1) in a
tokenizer_config.json, compared with `transformers`' own `apply_chat_template` text and token ids; the
checkpoint forms (string, named list, chat_template.jinja, AddedToken dicts, legacy special_tokens_map.json);
the environment's globals and filters; end-of-turn stop tokens; and what happens without a template."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RawTokenizer

from dspark.runtime.chat_template import PLAIN_CHAT_TEMPLATE, ChatTemplateError
from dspark.runtime.tokenizer import BOS_ID, ByteTokenizer, HFTokenizer

# Published templates, verbatim: Qwen/Qwen3-4B-Thinking-2507's tokenizer_config.json; Qwen/Qwen3-8B's, which
# differs from it in the generation prompt only (`enable_thinking`); meta-llama/Llama-3.1-8B-Instruct's.
TEMPLATES = Path(__file__).parent / "chat_templates"
QWEN3 = (TEMPLATES / "qwen3.jinja").read_text()
QWEN3_THINKING = (TEMPLATES / "qwen3_thinking_2507.jinja").read_text()
LLAMA31 = (TEMPLATES / "llama3_1_instruct.jinja").read_text()

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]  # added, not special (as released)
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                  "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
CORPUS = ["You are a helpful assistant. What is the capital of France?", "Paris is the capital.",
          "def main(argv):\n    return 0\n", "héllo wörld, naïve café 漢字 🙂", "system user assistant\n\n"]

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "  Be brief.\n"},
     {"role": "user", "content": "Write def main(argv):"},
     {"role": "assistant", "content": "def main(argv):\n    return 0\n"},
     {"role": "user", "content": "  and with docs? 🙂 naïve café  "}],
    # An assistant turn with reasoning: Qwen3 templates split it at </think> and drop it from history.
    [{"role": "user", "content": "1+1?"},
     {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n2"},
     {"role": "user", "content": "and 2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "system", "content": "late system message"}, {"role": "user", "content": "漢字"}],
]


@functools.cache
def _tokenizer_json(specials: tuple[str, ...], added: tuple[str, ...]) -> str:
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return tok.to_str()


def _checkpoint(directory: Path, tokenizer_config: dict[str, Any], specials: list[str],
                added: list[str] | None = None, files: dict[str, str] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    RawTokenizer.from_str(_tokenizer_json(tuple(specials), tuple(added or []))).save(
        str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}))
    for name, text in (files or {}).items():
        (directory / name).write_text(text)
    return directory


def _qwen(directory: Path, template: str = QWEN3, eos: str = "<|im_end|>") -> Path:
    return _checkpoint(directory, {"chat_template": template, "eos_token": eos, "pad_token": "<|endoftext|>",
                                   "bos_token": None, "unk_token": None, "add_bos_token": False},
                       QWEN_SPECIALS, QWEN_ADDED)


def _llama(directory: Path, eos: Any = "<|eot_id|>") -> Path:
    return _checkpoint(directory, {"chat_template": LLAMA31, "eos_token": eos,
                                   # The AddedToken form older checkpoints (Llama 2's) save.
                                   "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>",
                                                 "lstrip": False, "rstrip": False, "normalized": False,
                                                 "single_word": False}},
                       LLAMA_SPECIALS)


def _hf_reference(directory: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def _assert_renders_as_hugging_face(directory: Path, messages: list[dict[str, str]],
                                    kwargs: dict[str, Any] | None = None) -> str:
    ours = HFTokenizer.from_dir(directory)
    chat = ours.chat_format()
    text = chat.template.render(messages, add_generation_prompt=True, variables=kwargs)
    ids = ours.encode(text, add_bos=chat.add_bos)
    hf = _hf_reference(directory)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **(kwargs or {}))
    assert text == expected
    expected_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                          return_dict=False, **(kwargs or {}))
    assert ids == list(expected_ids)
    return text


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_thinking", "llama31"])
def test_real_templates_render_and_tokenize_as_hugging_face(tmp_path: Path, family: str,
                                                             messages: list[dict[str, str]]) -> None:
    directory = {"qwen3": lambda p: _qwen(p), "qwen3_thinking": lambda p: _qwen(p, QWEN3_THINKING),
                 "llama31": _llama}[family](tmp_path / family)
    text = _assert_renders_as_hugging_face(directory, messages)
    if family == "llama31":  # the template writes BOS itself; it must be there exactly once
        assert text.startswith("<|begin_of_text|>") and text.count("<|begin_of_text|>") == 1
        assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    else:
        assert text.endswith("<|im_start|>assistant\n" + ("<think>\n" if family == "qwen3_thinking" else ""))


@pytest.mark.parametrize(("family", "kwargs"), [
    ("qwen3", {"enable_thinking": False}),
    ("qwen3", {"enable_thinking": True}),
    ("llama31", {"date_string": "30 Nov 2026"}),
])
def test_chat_template_kwargs_reach_the_template(tmp_path: Path, family: str, kwargs: dict[str, Any]) -> None:
    directory = _qwen(tmp_path / "q") if family == "qwen3" else _llama(tmp_path / "l")
    text = _assert_renders_as_hugging_face(directory, CONVERSATIONS[1], kwargs)
    if kwargs.get("enable_thinking") is False:
        assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    if "date_string" in kwargs:
        assert "Today Date: 30 Nov 2026" in text


@pytest.mark.parametrize("template", [
    # tojson as Hugging Face defines it: no HTML escaping, non-ASCII kept, its keyword options.
    "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}",
    # strftime_now, the loop controls, namespace, dict and the generation block.
    "{{ strftime_now('%Y-%m') }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
    "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    "{{ dict(a=1) | tojson }}",
    # trim_blocks and lstrip_blocks: block tags leave no newline or indentation behind.
    "{% for m in messages %}\n    {% if m.role == 'user' %}\n<{{ m.content }}>\n    {% endif %}\n"
    "{% endfor %}\n",
    # Undefined special tokens render empty, defined ones as strings.
    "{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ add_generation_prompt }}",
])
def test_the_environment_matches_hugging_face(tmp_path: Path, template: str) -> None:
    messages = [{"role": "user", "content": "<b>&'\"漢字🙂</b>"}, {"role": "user", "content": "second"}]
    _assert_renders_as_hugging_face(_qwen(tmp_path / "q", template, eos="<|endoftext|>"), messages)


def test_raise_exception_is_a_chat_template_error_with_the_templates_words(tmp_path: Path) -> None:
    template = ("{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a "
                "user message') }}{% endif %}{{ messages[0].content }}")
    tok = HFTokenizer.from_dir(_qwen(tmp_path / "q", template))
    with pytest.raises(ChatTemplateError, match="Conversations must start with a user message"):
        tok.chat_format().template.render([{"role": "assistant", "content": "x"}])
    hf = _hf_reference(tmp_path / "q")
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="Conversations must start with a user message"):
        hf.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=False)


@pytest.mark.parametrize("template", [
    "{% set ns = namespace(_secret=1) %}{{ ns._secret }}",  # underscore attributes reach internals
    "{{ messages.__class__.__mro__ }}",  # the sandbox refuses dunder access
    "{{ messages.append(1) }}",  # immutable: the template may not mutate the conversation
])
def test_the_sandbox_refuses_escapes(tmp_path: Path, template: str) -> None:
    tok = HFTokenizer.from_dir(_qwen(tmp_path / "q", template))
    with pytest.raises(ChatTemplateError):
        tok.chat_format().template.render([{"role": "user", "content": "x"}])


def test_the_sandbox_hides_unsafe_attributes(tmp_path: Path) -> None:
    tok = HFTokenizer.from_dir(_qwen(tmp_path / "q", "[{{ ''.format.__globals__ }}]"))
    assert tok.chat_format().template.render([{"role": "user", "content": "x"}]) == "[]"


def test_named_templates_use_the_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": QWEN3}]
    directory = _checkpoint(tmp_path / "n", {"chat_template": named, "eos_token": "<|im_end|>"},
                            QWEN_SPECIALS, QWEN_ADDED)
    _assert_renders_as_hugging_face(directory, CONVERSATIONS[0])


def test_named_templates_without_a_default_are_refused_on_use(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "rag", "template": "RAG"}]
    config = {"chat_template": named, "eos_token": "<|im_end|>"}
    tok = HFTokenizer.from_dir(_checkpoint(tmp_path / "n", config, QWEN_SPECIALS))
    with pytest.raises(ChatTemplateError, match="'tool_use', 'rag' and none `default`"):
        tok.chat_format()


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    directory = _qwen(tmp_path / "j", template="IGNORED {{ messages }}")
    (directory / "chat_template.jinja").write_text(QWEN3)
    text = _assert_renders_as_hugging_face(directory, CONVERSATIONS[2])
    assert "IGNORED" not in text


def test_legacy_special_tokens_map_supplies_the_special_tokens(tmp_path: Path) -> None:
    legacy = {"bos_token": {"content": "<|begin_of_text|>", "special": True}, "eos_token": "<|eot_id|>"}
    directory = _checkpoint(tmp_path / "legacy", {"chat_template": LLAMA31}, LLAMA_SPECIALS,
                            files={"special_tokens_map.json": json.dumps(legacy)})
    text = _assert_renders_as_hugging_face(directory, CONVERSATIONS[1])
    assert text.startswith("<|begin_of_text|>")


@pytest.mark.parametrize(("family", "eos", "stop"), [
    ("qwen3", "<|im_end|>", None),  # the end of turn is the EOS already
    ("qwen3", "<|endoftext|>", "<|im_end|>"),  # a base checkpoint's EOS: the template's turn end is added
    ("llama31", "<|eot_id|>", None),
    ("llama31", "<|end_of_text|>", "<|eot_id|>"),
])
def test_the_templates_end_of_turn_token_stops_generation(tmp_path: Path, family: str, eos: str,
                                                          stop: str | None) -> None:
    directory = _qwen(tmp_path / "q", eos=eos) if family == "qwen3" else _llama(tmp_path / "l", eos=eos)
    tok = HFTokenizer.from_dir(directory)
    raw = RawTokenizer.from_file(str(directory / "tokenizer.json"))
    assert tok.eos_ids == {raw.token_to_id(eos)}
    assert tok.chat_format().stop_ids == (frozenset() if stop is None else {raw.token_to_id(stop)})


def test_a_turn_end_that_is_not_a_special_token_adds_no_stop_id(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
    tok = HFTokenizer.from_dir(_qwen(tmp_path / "q", template, eos="<|endoftext|>"))
    assert tok.chat_format().stop_ids == frozenset()


def test_without_a_chat_template_chat_is_refused_and_encoding_still_works(tmp_path: Path) -> None:
    directory = _checkpoint(tmp_path / "none", {"eos_token": "<|im_end|>"}, QWEN_SPECIALS)
    tok = HFTokenizer.from_dir(directory)
    assert tok.encode("hello") == RawTokenizer.from_file(str(directory / "tokenizer.json")).encode(
        "hello", add_special_tokens=False).ids
    with pytest.raises(ChatTemplateError, match="the model has no chat template") as err:
        tok.chat_format()
    assert "chat_template.jinja" in str(err.value) and "tokenizer_config.json" in str(err.value)


@pytest.mark.parametrize(("template", "match"), [
    ("{% for m in messages %}{{ m.content }", "not valid jinja2"),
    (42, "must be a string or a list"),
])
def test_an_unusable_template_is_reported_when_chat_is_asked_for(tmp_path: Path, template: Any,
                                                                 match: str) -> None:
    config = {"chat_template": template, "eos_token": "<|im_end|>"}
    tok = HFTokenizer.from_dir(_checkpoint(tmp_path / "bad", config, QWEN_SPECIALS))
    with pytest.raises(ChatTemplateError, match=match):
        tok.chat_format()


def test_the_byte_models_plain_template() -> None:
    tok = ByteTokenizer()
    chat = tok.chat_format()
    assert chat.template.source == PLAIN_CHAT_TEMPLATE and chat.add_bos and chat.stop_ids == frozenset()
    text = chat.template.render([{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "def main("}])
    assert text == "system: Be brief.\n\nuser: def main(\n\nassistant: "
    assert tok.encode(text, add_bos=chat.add_bos) == [BOS_ID, *text.encode()]
    assert tok.encode(text, add_bos=False) == list(text.encode())
