"""Training prompts for the embedded tiny pair: code from the standard library's training split.

They are cut like the held-out benchmark prompts (`dspark.corpus.held_out_prompts`: a fixed number
of characters from a line start) but from the files the target trained on, so a draft trained on
them never sees the held-out prompts it is measured with.
"""

from __future__ import annotations

import random

from dspark.corpus import corpus_files

LINE_STRIDE = 53  # a prompt starts every this many lines of a file


def train_prompts(count: int, length: int = 200, seed: int = 0) -> list[str]:
    """`count` distinct prompts of `length` characters from training-split files, in a seeded order."""
    train, _ = corpus_files()
    files = list(train)
    random.Random(seed).shuffle(files)
    prompts: list[str] = []
    seen: set[str] = set()
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        offset = 0
        for i, line in enumerate(text.splitlines(keepends=True)):
            piece = text[offset:offset + length]
            if i % LINE_STRIDE == 0 and len(piece) == length and piece.strip() and piece not in seen:
                seen.add(piece)
                prompts.append(piece)
                if len(prompts) == count:
                    return prompts
            offset += len(line)
    return prompts
