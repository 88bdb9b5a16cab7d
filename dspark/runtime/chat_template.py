"""Chat templates: a chat request's prompt, rendered from the checkpoint's own jinja2 template exactly
as Hugging Face `transformers`' `apply_chat_template(messages, add_generation_prompt=True)` renders it.

Where the template comes from, as `AutoTokenizer.from_pretrained` finds it: `chat_template.jinja` beside
the tokenizer (what `transformers` >= 4.47 saves), else `chat_template` in `tokenizer_config.json` — a
string, or a list of `{"name": ..., "template": ...}` of which the one named `default` is used.

How it is rendered (`transformers.utils.chat_template_utils`): an immutable sandboxed jinja2 environment
with `trim_blocks` and `lstrip_blocks`, the loop controls (`break`, `continue`) and the
`{% generation %}` block (it renders its body; Hugging Face uses it to mark assistant text for training
masks); the globals `raise_exception(message)` (a template refusing a conversation), `strftime_now(format)`
(the local time), `dict` and a `namespace` that refuses underscore-prefixed attributes; and a `tojson`
filter that is `json.dumps(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, not
jinja2's HTML-escaping one. Its variables: `messages`, `add_generation_prompt`, `tools` and `documents`
(None: this server has neither), the tokenizer's named special tokens as strings (`bos_token`,
`eos_token`, `unk_token`, `sep_token`, `pad_token`, `cls_token`, `mask_token` and a dict-valued
`extra_special_tokens`, each given in `tokenizer_config.json` as a string or an AddedToken dict; a null
one is not defined), and a request's `chat_template_kwargs` (for example Qwen3's `enable_thinking`).
A legacy checkpoint whose `tokenizer_config.json` has no `added_tokens_decoder` takes its special tokens
from `special_tokens_map.json`, as `transformers` does. The rendered text is tokenized without adding
BOS (`add_special_tokens=False`): a template that wants BOS writes `{{ bos_token }}` itself.

The end of a turn: rendering a probe conversation (a user message, then an assistant message) shows what
the template writes right after an assistant's content; when that starts with a special token (Qwen's
`<|im_end|>`, Llama 3's `<|eot_id|>`, Gemma's `<end_of_turn>`), generation stops there too, besides
the checkpoint's EOS ids (`tokenizer.py` maps the text to its id).

The embedded byte-level model has no chat template and no end-of-turn token. It gets `PLAIN_CHAT_TEMPLATE`:
BOS (added by its tokenizer), then each message as `<role>: <content>` followed by a blank line, then
`assistant: `; its replies end at EOS or `max_tokens`. It is a code model: this makes the route usable
with it, not a chat model of it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

CHAT_TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
DEFAULT_TEMPLATE_NAME = "default"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens a template sees as variables.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                       "mask_token")
# Variables the server sets; a request's chat_template_kwargs may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "tools", "documents",
                                *SPECIAL_TOKEN_NAMES})

PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] + ': ' + message['content'] + '\\n\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)
PLAIN_TEMPLATE_ORIGIN = "dspark's plain chat template for the byte-level model"

# Content no template rewrites (no think tags, no surrounding whitespace) that occurs nowhere else.
_PROBE = "dspark-end-of-turn-probe"


class ChatTemplateError(ValueError):
    """A checkpoint without a usable chat template, or a conversation its template refuses."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's source, where it came from, and the special-token variables it is rendered with."""

    source: str
    origin: str
    special_tokens: Mapping[str, Any] = field(default_factory=dict)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               variables: Mapping[str, Any] | None = None) -> str:
        """The prompt text; `ChatTemplateError` with the template's own words when it refuses."""
        compiled = compile_template(self.source)  # checked when loaded; cached
        context = {**self.special_tokens, **(variables or {})}
        try:
            return compiled.render(messages=[dict(m) for m in messages], tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as err:  # raise_exception, undefined names, sandbox refusals
            raise ChatTemplateError(f"the chat template refused this conversation: {err}") from None
        except Exception as err:  # a template computing on values it did not expect (e.g. None + str)
            raise ChatTemplateError(f"the chat template failed on this conversation "
                                    f"({type(err).__name__}: {err})") from None

    def end_of_turn_text(self) -> str | None:
        """What the template writes right after an assistant message's content, or None when a probe
        conversation cannot show it (the template refuses it or rewrites the content)."""
        probe = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": _PROBE}]
        try:
            text = self.render(probe, add_generation_prompt=False)
        except ChatTemplateError:
            return None
        at = text.rfind(_PROBE)
        return None if at < 0 else text[at + len(_PROBE):]


@dataclass(frozen=True)
class ChatFormat:
    """How a tokenizer turns a conversation into prompt ids and where a reply ends.

    `add_bos`: whether the tokenizer's BOS goes before the rendered text (the plain template, which cannot
    write BOS as text), or the template writes its own special tokens (checkpoint templates).
    `stop_ids`: the template's end-of-turn token where it is not already one of the EOS ids."""

    template: ChatTemplate
    add_bos: bool
    stop_ids: frozenset[int] = frozenset()


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body. Hugging Face records where the body
    falls to build assistant-token masks for training; a prompt needs only the text."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    """`dict(...)` in a template without handing it the dict type itself (its attributes are a way out)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's `namespace` refusing underscore-prefixed attributes, which reach interpreter internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's own signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML; templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in Hugging Face's environment; `jinja2.TemplateSyntaxError` if it is not
    jinja2."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def plain_template() -> ChatTemplate:
    return ChatTemplate(PLAIN_CHAT_TEMPLATE, PLAIN_TEMPLATE_ORIGIN)


def load_chat_template(directory: Path, tokenizer_config: Mapping[str, Any]) -> ChatTemplate:
    """The checkpoint's chat template; `ChatTemplateError` saying why there is none to use.
    `tokenizer_config` is tokenizer_config.json as `with_legacy_special_tokens` completes it."""
    source, origin = _template_source(directory, tokenizer_config)
    try:
        compile_template(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"the chat template in {origin} is not valid jinja2 (line {err.lineno}: "
                                f"{err.message}); fix it or replace it with the model's original") from None
    return ChatTemplate(source, origin, _special_tokens(tokenizer_config))


def _template_source(directory: Path, tokenizer_config: Mapping[str, Any]) -> tuple[str, str]:
    jinja_file = directory / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except UnicodeDecodeError as err:
            raise ChatTemplateError(f"{jinja_file} is not UTF-8 text ({err})") from None
    config_path = directory / TOKENIZER_CONFIG
    where = f"`chat_template` in {config_path}"
    template = tokenizer_config.get("chat_template")
    if template is None:
        raise ChatTemplateError(
            f"the model has no chat template: neither {jinja_file} nor `chat_template` in {config_path} "
            "exists, so chat messages cannot be turned into a prompt; use POST /v1/completions with the "
            "prompt text, or add the model's chat template to its tokenizer_config.json")
    if isinstance(template, str):
        return template, where
    if isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                          and isinstance(t.get("template"), str) for t in template):
        named = {t["name"]: t["template"] for t in template}
        if DEFAULT_TEMPLATE_NAME in named:
            return named[DEFAULT_TEMPLATE_NAME], f"{where} (the one named `{DEFAULT_TEMPLATE_NAME}`)"
        raise ChatTemplateError(f"{where} names the templates {', '.join(map(repr, named))} and none "
                                f"`{DEFAULT_TEMPLATE_NAME}`: there is no template to use for chat")
    raise ChatTemplateError(f"{where} must be a string or a list of {{\"name\", \"template\"}} objects")


def with_legacy_special_tokens(directory: Path, tokenizer_config: Mapping[str, Any]) -> dict[str, Any]:
    """`tokenizer_config` with the special tokens of `special_tokens_map.json` over it where transformers
    reads that file: a legacy checkpoint, whose tokenizer_config.json has no `added_tokens_decoder`."""
    config = dict(tokenizer_config)
    legacy = directory / SPECIAL_TOKENS_MAP
    if "added_tokens_decoder" in config or not legacy.is_file():
        return config
    try:
        extra = json.loads(legacy.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ChatTemplateError(f"{legacy} is not valid JSON ({err})") from None
    if isinstance(extra, dict):
        config.update(extra)
    return config


def _special_tokens(config: Mapping[str, Any]) -> dict[str, Any]:
    """The special-token variables, as transformers' `special_tokens_map` gives them to a template."""
    names = list(SPECIAL_TOKEN_NAMES)
    extra_special = config.get("extra_special_tokens")
    if isinstance(extra_special, dict):  # model-specific named tokens (e.g. an image token)
        names += [k for k in extra_special if isinstance(k, str)]
        config = {**extra_special, **config}
    out: dict[str, Any] = {}
    for name in names:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out
