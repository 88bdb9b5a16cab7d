"""Serving tokenizers: the byte-level one, Hugging Face tokenizer.json, and streaming detokenization."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from dspark.checkpoints import embedded_root
from dspark.runtime.package import PackageError, load_tokenizer
from dspark.runtime.tokenizer import (
    BOS_ID,
    BYTE_TOKENIZER_FILE,
    EOS_ID,
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    TokenizerError,
)

SPECIALS = ["<s>", "</s>", "<|eot|>"]  # ids 0, 1, 2
# Multi-byte characters in the corpus make merges that end mid-character, which streaming must hold back.
CORPUS = ["def main(argv):\n    return 0\n", "héllo wörld, naïve café", "漢字かな交じり文 한국어",
          "emoji 🙂👍🏽🇫🇷 👩‍👩‍👧", "e\u0301 a\u0308 combining", "tabs\tand\r\nnewlines"]
PIECES = list("aZ é漢字한🙂👍🏽🇫🇷\u0301\u0308\u200d\n\t") + ["e\u0301", "👩‍👩‍👧", "\r\n", "def ", "café"]
# Arbitrary text (no lone surrogates, which cannot be encoded; no U+FFFD, so any in the output is an error)
# mixed with pieces that stress character and grapheme boundaries.
TEXT = st.lists(st.one_of(st.sampled_from(PIECES),
                          st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd")),
                max_size=40).map("".join)


@functools.cache
def _tokenizer_json() -> str:
    tok = RawTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok.to_str()


def _write_hf(directory: Path, tokenizer_config: dict[str, Any] | None = None,
              config: dict[str, Any] | None = None, generation_config: dict[str, Any] | None = None,
              bos_post_processor: bool = False) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tok = RawTokenizer.from_str(_tokenizer_json())
    if bos_post_processor:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(directory / "tokenizer.json"))
    for name, body in [("tokenizer_config.json", tokenizer_config), ("config.json", config),
                       ("generation_config.json", generation_config)]:
        if body is not None:
            (directory / name).write_text(json.dumps(body))
    return directory


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    directory = _write_hf(tmp_path_factory.mktemp("hf"),
                          {"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": True})
    return HFTokenizer.from_dir(directory)


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    decoder = tok.incremental_decoder()
    return [decoder.step(i) for i in ids] + [decoder.flush()]


# -- byte-level ------------------------------------------------------------------------------------

def test_byte_tokenizer_keeps_its_convention() -> None:
    tok = ByteTokenizer()
    assert tok.encode("hé") == [BOS_ID, 104, 0xC3, 0xA9]
    assert tok.decode([BOS_ID, 104, 0xC3, 0xA9, EOS_ID]) == "hé"
    assert (tok.bos_id, tok.eos_ids, tok.vocab_size) == (BOS_ID, frozenset({EOS_ID}), 258)
    assert isinstance(tok, Tokenizer)


def test_byte_stream_holds_back_a_split_character_until_flush() -> None:
    tok = ByteTokenizer()
    ids = list("🙂".encode())
    assert _stream(tok, ids) == ["", "", "", "🙂", ""]
    assert _stream(tok, ids[:2]) == ["", "", "\ufffd"] and tok.decode(ids[:2]) == "\ufffd"


@pytest.mark.parametrize("kind", ["byte", "hf"])
@pytest.mark.parametrize(("text", "at"), [("\ud800", 0), ("ab\udfffc", 2), ("🙂 \ud83d", 2)])
def test_a_lone_surrogate_is_a_tokenizer_error_naming_its_position(hf: HFTokenizer, kind: str, text: str,
                                                                   at: int) -> None:
    tok = ByteTokenizer() if kind == "byte" else hf
    with pytest.raises(TokenizerError, match=f"lone surrogate U\\+D[89A-F][0-9A-F]{{2}} at character {at}"):
        tok.encode(text)
    assert tok.encode("🙂") == tok.encode(json.loads('"\\ud83d\\ude42"'))  # JSON joins a whole pair


# -- Hugging Face ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["", "def main(argv):\n", "héllo 漢字 🙂 e\u0301\r\n\t  x", "👩‍👩‍👧🇫🇷"])
def test_hf_round_trip(hf: HFTokenizer, text: str) -> None:
    ids = hf.encode(text)
    assert ids[0] == hf.bos_id == 0 and ids.count(0) == 1
    assert hf.decode(ids) == text
    assert isinstance(hf, Tokenizer)
    assert hf.vocab_size == RawTokenizer.from_str(_tokenizer_json()).get_vocab_size() > 256
    assert hf.eos_ids == frozenset({1})


@settings(max_examples=200, deadline=None)
@given(text=TEXT)
def test_hf_round_trip_arbitrary_text(hf: HFTokenizer, text: str) -> None:
    assert hf.decode(hf.encode(text)) == text


def test_hf_stream_flushes_an_incomplete_character(hf: HFTokenizer) -> None:
    ids = hf.encode("🙂")[1:]
    assert len(ids) > 1  # the test tokenizer splits the emoji across tokens
    assert _stream(hf, ids)[-1] == "" and "".join(_stream(hf, ids)) == "🙂"
    assert "".join(_stream(hf, ids[:-1])) == hf.decode(ids[:-1]) == "\ufffd"


@pytest.mark.parametrize(("tokenizer_config", "config", "generation_config", "eos"), [
    ({"eos_token": "</s>"}, None, None, {1}),
    ({"eos_token": {"content": "<|eot|>", "special": True}}, None, None, {2}),
    (None, {"eos_token_id": 1}, None, {1}),
    (None, {"eos_token_id": [1, 2]}, None, {1, 2}),
    ({"eos_token": "</s>"}, {"eos_token_id": 1}, {"eos_token_id": [2]}, {1, 2}),
])
def test_hf_eos_forms(tmp_path: Path, tokenizer_config: dict | None, config: dict | None,
                      generation_config: dict | None, eos: set[int]) -> None:
    tok = HFTokenizer.from_dir(_write_hf(tmp_path, tokenizer_config, config, generation_config))
    assert tok.eos_ids == frozenset(eos)


@pytest.mark.parametrize(("tokenizer_config", "config", "post_processor", "bos", "adds_bos"), [
    ({"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": True}, None, False, 0, True),
    # Explicit add_bos_token wins over the post-processor: BOS once, or not at all.
    ({"eos_token": "</s>", "bos_token": {"content": "<s>"}, "add_bos_token": True}, None, True, 0, True),
    ({"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": False}, None, True, 0, False),
    # No add_bos_token: the post-processor decides.
    ({"eos_token": "</s>"}, {"bos_token_id": 0}, True, 0, True),
    ({"eos_token": "</s>"}, {"bos_token_id": 0}, False, 0, False),
    ({"eos_token": "</s>"}, None, False, None, False),
])
def test_hf_bos(tmp_path: Path, tokenizer_config: dict, config: dict | None, post_processor: bool,
                bos: int | None, adds_bos: bool) -> None:
    directory = _write_hf(tmp_path, tokenizer_config, config, bos_post_processor=post_processor)
    tok = HFTokenizer.from_dir(directory)
    assert tok.bos_id == bos
    ids = tok.encode("hi")
    assert ids[:1] == ([0] if adds_bos else ids[:1]) and ids.count(0) == int(adds_bos)
    assert tok.decode(ids) == "hi"


@pytest.mark.parametrize(("tokenizer_config", "config", "match"), [
    ({"eos_token": "<|end|>"}, None,
     r"tokenizer_config\.json: eos_token '<\|end\|>' is not in the vocabulary"),
    ({"eos_token": {"content": "<|end|>"}}, None, r"eos_token '<\|end\|>' is not in the vocabulary"),
    ({"eos_token": 7}, None, r"eos_token must be a string"),
    (None, {"eos_token_id": [1, 4000]}, r"config\.json: eos_token_id 4000 is not in the vocabulary"),
    (None, {"eos_token_id": "1"}, r"config\.json: eos_token_id must be a token id"),
    (None, None, r"no EOS token; set `eos_token` in tokenizer_config\.json"),
    ({"eos_token": "</s>", "add_bos_token": True}, None, r"add_bos_token is true but no BOS token"),
])
def test_hf_config_errors(tmp_path: Path, tokenizer_config: dict | None, config: dict | None,
                          match: str) -> None:
    with pytest.raises(TokenizerError, match=match):
        HFTokenizer.from_dir(_write_hf(tmp_path, tokenizer_config, config))


def test_hf_file_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json not found; copy the model's"):
        HFTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json is not a valid Hugging Face tokenizer file"):
        HFTokenizer.from_dir(tmp_path)
    _write_hf(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json is not valid JSON"):
        HFTokenizer.from_dir(tmp_path)
    assert issubclass(TokenizerError, ValueError)


# -- streaming: deltas concatenate to decode, for both tokenizers ---------------------------------

def _check_stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    deltas = _stream(tok, ids)
    full = tok.decode(ids)
    assert "".join(deltas) == full
    # Every emitted prefix is final: a later token never rewrites text already sent.
    emitted = ""
    for delta in deltas:
        emitted += delta
        assert full.startswith(emitted)
    return deltas


@pytest.mark.parametrize("kind", ["byte", "hf"])
@settings(max_examples=300, deadline=None)
@given(text=TEXT, eos=st.booleans())
def test_stream_of_encoded_text_equals_decode(hf: HFTokenizer, kind: str, text: str, eos: bool) -> None:
    tok: Tokenizer = ByteTokenizer() if kind == "byte" else hf
    ids = tok.encode(text) + sorted(tok.eos_ids)[:int(eos)]
    deltas = _check_stream(tok, ids)
    assert "".join(deltas) == text
    # No delta carries a split character (it would show as U+FFFD; the text holds none).
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("kind", ["byte", "hf"])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stream_of_arbitrary_ids_equals_decode(hf: HFTokenizer, kind: str, data: st.DataObject) -> None:
    # Arbitrary ids include invalid UTF-8 and special tokens mid-stream, as a sampling model may produce.
    tok: Tokenizer = ByteTokenizer() if kind == "byte" else hf
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), max_size=40))
    deltas = _check_stream(tok, ids)
    if kind == "hf":
        # Held-back text is an incomplete character; only flush may end in one.
        assert not any(d.endswith("\ufffd") for d in deltas[:-1])


@pytest.mark.parametrize("text", ["hello world", " hello  world ", "the test of the decoder"])
def test_stream_keeps_spaces_a_metaspace_decoder_strips_per_call(tmp_path: Path, text: str) -> None:
    # SentencePiece-style decoders drop the leading space of the first token of each decode call, so
    # decoding token by token would glue words together.
    raw = RawTokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    raw.decoder = decoders.Metaspace(prepend_scheme="first")
    raw.train_from_iterator(["hello world, the test of the decoder"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                show_progress=False))
    raw.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    tok = HFTokenizer.from_dir(tmp_path)
    ids = tok.encode(text)
    assert "".join(tok.decode([i]) for i in ids) != tok.decode(ids)
    assert "".join(_check_stream(tok, ids)) == tok.decode(ids)


# -- load_tokenizer dispatch -----------------------------------------------------------------------

def test_load_tokenizer_dispatch(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(embedded_root() / "tiny" / "target"), ByteTokenizer)
    hf_dir = _write_hf(tmp_path / "hf", {"eos_token": "</s>"})
    assert isinstance(load_tokenizer(hf_dir), HFTokenizer)
    # The byte-level marker wins when both are present.
    shutil.copy(embedded_root() / "tiny" / "target" / BYTE_TOKENIZER_FILE, hf_dir)
    assert isinstance(load_tokenizer(hf_dir), ByteTokenizer)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PackageError, match=r"expected tokenizer\.json .* or dspark_tokenizer\.json"):
        load_tokenizer(tmp_path / "empty")
    with pytest.raises(TokenizerError, match="no EOS token"):
        load_tokenizer(_write_hf(tmp_path / "no_eos"))
