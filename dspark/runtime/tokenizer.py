"""Tokenizers the runtime serves with: the embedded model's byte-level one and Hugging Face `tokenizer.json`.

Both satisfy `Tokenizer`. Streaming goes through `Tokenizer.incremental_decoder()`: the concatenation of
every `step` delta plus `flush()` equals `decode` of all the ids, so a client never sees half a UTF-8
character or a word piece that a later token rewrites.

`Tokenizer.chat_format()` says how a conversation becomes a prompt (`chat_template.py`): the checkpoint's
own chat template and its end-of-turn token for Hugging Face checkpoints, a plain template for the
byte-level model. A checkpoint without a usable template still loads (completions need none); asking it
for its chat format raises `ChatTemplateError` saying why.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from dspark.runtime.chat_template import (
    ChatFormat,
    ChatTemplateError,
    load_chat_template,
    plain_template,
    with_legacy_special_tokens,
)

if TYPE_CHECKING:
    import tokenizers

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258
BYTE_TOKENIZER_FILE = "dspark_tokenizer.json"
HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
# Files whose `eos_token_id` / `bos_token_id` name special tokens; every one present is read.
HF_MODEL_CONFIGS = ("config.json", "generation_config.json")


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used, or text that cannot be encoded (the message says which)."""


def utf8_bytes(text: str) -> bytes:
    """The UTF-8 bytes of `text`; `TokenizerError` when it holds a lone surrogate (U+D800..U+DFFF):
    Python strings may (JSON's `"\\ud800"` decodes to one), UTF-8 cannot, so no tokenizer can encode it."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise TokenizerError(
            f"the text is not valid Unicode: it holds a lone surrogate U+{ord(text[err.start]):04X} at "
            f"character {err.start} (a UTF-16 surrogate half without its pair)") from None


class IncrementalDecoder(Protocol):
    def step(self, token_id: int) -> str:
        """Consume one generated token; return the text that is now final (possibly "")."""
        ...

    def flush(self) -> str:
        """End of stream: return whatever text is still held back."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    @property
    def eos_ids(self) -> frozenset[int]: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Prompt ids, with BOS prepended when `add_bos` and this tokenizer's convention says so;
        `TokenizerError` for text that is not valid Unicode (a lone surrogate)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens skipped."""
        ...

    def incremental_decoder(self) -> IncrementalDecoder: ...

    def chat_format(self) -> ChatFormat:
        """How chat messages become a prompt; `ChatTemplateError` when this checkpoint has no usable
        chat template (the message says what is missing)."""
        ...


class ByteTokenizer:
    bos_id = BOS_ID
    eos_id = EOS_ID
    eos_ids = frozenset({EOS_ID})
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """BOS (unless `add_bos` is false) followed by the UTF-8 bytes of `text`; `TokenizerError` for
        text UTF-8 cannot hold."""
        data = list(utf8_bytes(text))
        return [BOS_ID, *data] if add_bos else data

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes back to text; special tokens are dropped, broken UTF-8 is replaced."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def incremental_decoder(self) -> IncrementalDecoder:
        return _ByteStream()

    def chat_format(self) -> ChatFormat:
        # No special tokens but BOS/EOS: the plain template's text follows BOS, replies end at EOS.
        return ChatFormat(plain_template(), add_bos=True)


class _ByteStream:
    def __init__(self) -> None:
        # The codec's incremental decoder holds back an incomplete trailing sequence and replaces
        # invalid bytes exactly as the one-shot `bytes.decode(errors="replace")` in `decode` does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str:
        return self._utf8.decode(bytes([token_id])) if token_id < 256 else ""

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class _PrefixOffsetStream:
    """Streaming detokenization by re-decoding a short window of tokens.

    Decoding tokens one by one is wrong for most tokenizers: a byte-level BPE token may hold half a
    character, and SentencePiece-style decoders drop the leading space of whatever comes first. So
    the tokens since `prefix` are decoded with and without those since `read`, and the difference is
    emitted once it does not end in U+FFFD (an incomplete character that a later token may finish).
    tokenizers' own `decoders.DecodeStream` does the same but has no flush, so a stream ending in an
    incomplete character would lose the U+FFFD that `decode` shows.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # the context window starts here; its text has been emitted already
        self._read = 0  # tokens before this have been emitted

    def step(self, token_id: int) -> str:
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        emitted = self._decode(self._ids[self._prefix:self._read])
        text = self._decode(self._ids[self._prefix:])
        if len(text) <= len(emitted) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted):]


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (via the `tokenizers` library) and its special-token configs."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, eos_ids: frozenset[int], bos_id: int | None,
                 add_bos: bool, chat: ChatFormat | ChatTemplateError | None = None) -> None:
        if not eos_ids:
            raise TokenizerError("HFTokenizer needs at least one EOS id")
        if add_bos and bos_id is None:
            raise TokenizerError("HFTokenizer cannot add BOS without a bos_id")
        self._tok = tokenizer
        self.eos_ids = eos_ids
        self.bos_id = bos_id
        self.add_bos = add_bos
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._chat = chat if chat is not None else ChatTemplateError("this tokenizer has no chat template")

    @classmethod
    def from_dir(cls, directory: str | Path) -> HFTokenizer:
        """Load `tokenizer.json` and read EOS/BOS from tokenizer_config.json (or a legacy checkpoint's
        special_tokens_map.json, as transformers does), config.json and generation_config.json (EOS ids
        from all of them are unioned: chat models stop on several), and the chat template
        (`chat_template.py`); a template that cannot be used is reported when chat is asked for."""
        directory = Path(directory)
        tok = _load_tokenizer_json(directory / HF_TOKENIZER_FILE)
        try:
            tok_config = with_legacy_special_tokens(directory, _read_json(directory / HF_TOKENIZER_CONFIG))
        except ChatTemplateError as err:
            raise TokenizerError(str(err)) from None
        model_configs = {name: _read_json(directory / name) for name in HF_MODEL_CONFIGS}

        eos_ids: set[int] = set()
        eos_token = _token_id(tok, tok_config.get("eos_token"), "eos_token", directory / HF_TOKENIZER_CONFIG)
        if eos_token is not None:
            eos_ids.add(eos_token)
        bos_id = _token_id(tok, tok_config.get("bos_token"), "bos_token", directory / HF_TOKENIZER_CONFIG)
        for name, config in model_configs.items():
            eos_ids.update(_config_ids(tok, config.get("eos_token_id"), "eos_token_id", directory / name))
            if bos_id is None:
                bos_id = next(iter(_config_ids(tok, config.get("bos_token_id"), "bos_token_id",
                                               directory / name)), None)
        if not eos_ids:
            raise TokenizerError(
                f"{directory}: no EOS token; set `eos_token` in {HF_TOKENIZER_CONFIG} or `eos_token_id` "
                f"in {' or '.join(HF_MODEL_CONFIGS)}")

        add_bos = tok_config.get("add_bos_token")
        if add_bos is None:
            # No explicit setting: follow tokenizer.json's post-processor, as Hugging Face does.
            add_bos = bos_id is not None and tok.encode("").ids[:1] == [bos_id]
        elif not isinstance(add_bos, bool):
            raise TokenizerError(f"{directory / HF_TOKENIZER_CONFIG}: add_bos_token must be true or false, "
                                 f"not {add_bos!r}")
        elif add_bos and bos_id is None:
            raise TokenizerError(
                f"{directory / HF_TOKENIZER_CONFIG}: add_bos_token is true but no BOS token is named; set "
                f"`bos_token` there or `bos_token_id` in {' or '.join(HF_MODEL_CONFIGS)}")
        chat: ChatFormat | ChatTemplateError
        try:
            template = load_chat_template(directory, tok_config)
            chat = ChatFormat(template, add_bos=False,
                              stop_ids=_end_of_turn_ids(tok, template.end_of_turn_text()) - eos_ids)
        except ChatTemplateError as err:
            chat = err
        return cls(tok, frozenset(eos_ids), bos_id, add_bos, chat)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        utf8_bytes(text)  # the tokenizers library would fail on a lone surrogate with a bare TypeError
        # The post-processor is bypassed so BOS is added exactly once whatever tokenizer.json says.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos and self.add_bos and self.bos_id is not None else ids

    def chat_format(self) -> ChatFormat:
        if isinstance(self._chat, ChatTemplateError):
            raise ChatTemplateError(str(self._chat))  # a fresh error each time: no traceback piles up
        return self._chat

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def incremental_decoder(self) -> IncrementalDecoder:
        return _PrefixOffsetStream(self.decode)


def _end_of_turn_ids(tok: tokenizers.Tokenizer, text: str | None) -> frozenset[int]:
    """The special token that `text` (what a template writes after an assistant's content) starts with."""
    if not text:
        return frozenset()
    ids = tok.encode(text, add_special_tokens=False).ids
    added = tok.get_added_tokens_decoder()
    first = ids[0] if ids else None
    if first is None or first not in added or not added[first].special:
        return frozenset()
    return frozenset({first})


def _load_tokenizer_json(path: Path) -> tokenizers.Tokenizer:
    if not path.is_file():
        raise TokenizerError(f"{path} not found; copy the model's Hugging Face tokenizer.json into "
                             f"{path.parent}")
    try:
        import tokenizers
    except ImportError as err:
        raise TokenizerError(f"{path}: the `tokenizers` package is needed to read it; "
                             "`pip install tokenizers`") from err
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for unparsable files
        raise TokenizerError(f"{path} is not a valid Hugging Face tokenizer file ({err}); replace it with "
                             "the model's original tokenizer.json") from err


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise TokenizerError(f"{path} is not valid JSON ({err})") from err
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


def _token_id(tok: tokenizers.Tokenizer, token: object, key: str, source: Path) -> int | None:
    """Id of a tokenizer_config special token, given as a string or an AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    if token is None:
        return None
    if not isinstance(token, str):
        raise TokenizerError(f"{source}: {key} must be a string or {{\"content\": ...}}, not {token!r}")
    token_id = tok.token_to_id(token)
    if token_id is None:
        raise TokenizerError(f"{source}: {key} {token!r} is not in the vocabulary of "
                             f"{source.parent / HF_TOKENIZER_FILE}; fix {key} or use the model's own "
                             "tokenizer")
    return token_id


def _config_ids(tok: tokenizers.Tokenizer, value: object, key: str, source: Path) -> list[int]:
    """Ids of a model config's `eos_token_id` / `bos_token_id`: absent, an int or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerError(f"{source}: {key} must be a token id or a list of token ids, not {value!r}")
    for v in values:
        if tok.id_to_token(v) is None:
            raise TokenizerError(f"{source}: {key} {v} is not in the vocabulary of "
                                 f"{source.parent / HF_TOKENIZER_FILE} (size "
                                 f"{tok.get_vocab_size(with_added_tokens=True)}); fix {key} or use the "
                                 "model's own tokenizer")
    return values
