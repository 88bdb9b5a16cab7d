"""Reading a request body into a JSON object, refusing with an `ApiError` whatever is not one.

Refused: a content type other than JSON (415), a body over the size bound (413), an empty body,
text that is not JSON (including the NaN and Infinity that Python's parser would accept, numbers
too long to convert, nesting too deep to parse), a JSON value that is not an object, and strings
that are not valid Unicode (a lone surrogate such as `"\\ud800"`, which JSON can spell but UTF-8
cannot hold) — each a 400 naming the field where there is one.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request as HttpRequest

from dspark.formats.json_io import json_kind
from dspark.runtime.serve.errors import ApiError
from dspark.runtime.tokenizer import TokenizerError, utf8_bytes

MIN_BODY_BYTES = 1 << 20
# A prompt's token costs this many bytes of request at most in any sane encoding: a token id in a
# list ("123456, ") or a long tokenizer piece written as JSON escapes.
BODY_BYTES_PER_CONTEXT_TOKEN = 64
MAX_INT_DIGITS = 100


def body_limit(max_context_len: int) -> int:
    """The largest request body worth reading: a prompt that fills the whole context, with room to spare."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * max_context_len)


class _NotJson(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotJson(f"{name} is not a JSON number")


def _parse_int(digits: str) -> int:
    # Python refuses to convert very long integers, in words meant for programmers; no field needs one.
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise _NotJson(f"an integer of {len(digits.lstrip('-'))} digits is out of range")
    return int(digits)


async def read_json_object(http: HttpRequest, max_bytes: int) -> dict[str, Any]:
    """The body as a JSON object; an `ApiError` for anything else."""
    # No content type at all is taken as JSON; a different one is a client that meant something else.
    media = http.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"the request body must be JSON sent with `Content-Type: application/json`, "
                            f"not {media!r}", code="unsupported_media_type")
    too_large = ApiError(413, f"the request body is over {max_bytes} bytes, more than any request this "
                              "model's context length can hold", code="request_too_large")
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object such as "
                            '{"model": "...", "prompt": "...", "max_tokens": 16}')
    try:
        payload = json.loads(raw, parse_constant=_refuse_constant, parse_int=_parse_int)
    except RecursionError:
        raise ApiError(400, "the request body is not valid JSON: it nests too deeply") from None
    except ValueError as err:  # JSONDecodeError, bad UTF-8, NaN, an integer too long
        raise ApiError(400, f"the request body is not valid JSON: {err}") from None
    if not isinstance(payload, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {json_kind(payload)}")
    check_unicode(payload)
    return payload



def check_unicode(payload: dict[str, Any]) -> None:
    """A 400 naming the top-level field whose strings (at any depth) hold a lone surrogate."""
    for key, value in payload.items():
        try:
            utf8_bytes(key)
        except TokenizerError:
            raise ApiError(400, "the request body has a field name that is not valid Unicode "
                                "(a lone surrogate)") from None
        stack = [value]  # iterative: the parser accepts nesting deeper than a recursive walk could take
        while stack:
            item = stack.pop()
            if isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
            elif isinstance(item, str):
                try:
                    utf8_bytes(item)
                except TokenizerError as err:
                    raise ApiError(400, f"`{key}`: {err}", key) from None
