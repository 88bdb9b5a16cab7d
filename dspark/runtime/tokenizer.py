"""Byte-level tokenizer of the embedded model: one token per byte, plus BOS and EOS."""

from __future__ import annotations

BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258
BYTE_TOKENIZER_FILE = "dspark_tokenizer.json"


class ByteTokenizer:
    bos_id = BOS_ID
    eos_id = EOS_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """BOS followed by the UTF-8 bytes of `text`."""
        return [BOS_ID, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; special tokens are dropped, broken UTF-8 is replaced."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
