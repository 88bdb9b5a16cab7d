"""Continuous batching: requests wait for a slot and their KV pages, are prefilled in chunks, then
decode until they finish; between steps finished requests leave and waiting ones are admitted."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dspark.runtime.engine.requests import Request, RequestError, reserved_tokens
from dspark.runtime.kv_cache import RequestSlots


@dataclass(frozen=True)
class PrefillChunk:
    """One request's share of a prefill step: `take` prompt tokens after the `prefilled` ones."""

    request: Request
    take: int


class Scheduler:
    """The request queues over the KV pool's slots and pages.

    A request reserves the pages for its whole life (`prompt + max_new_tokens + N`) when it is
    admitted, so the pool never runs out mid-request; one that does not fit waits.
    """

    def __init__(self, slots: RequestSlots, num_draft_tokens: int, chunked_prefill_tokens: int,
                 max_chunk_rows: int | None = None) -> None:
        self.slots = slots
        self.num_draft_tokens = num_draft_tokens
        self.chunked_prefill_tokens = chunked_prefill_tokens
        # A target whose caches bound the rows one request appends per step (DSV4's raw-KV ring)
        self.max_chunk_rows = max_chunk_rows
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt not fully prefilled yet
        self.running: list[Request] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def pool_stats(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "running": len(self.running) + len(self.prefilling),
                "free_slots": self.slots.num_free_slots, "free_pages": self.slots.num_free_pages,
                "total_pages": self.slots.num_pages - 1}

    def enqueue(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request) -> bool:
        """Drop a queued or admitted request, freeing its slot and pages; False if it is not here."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running or request in self.prefilling:
            (self.running if request in self.running else self.prefilling).remove(request)
            self.slots.release(request.handle.slot)
        else:
            return False
        request.done = True
        request.finish_reason = request.finish_reason or "abort"
        return True

    def admit(self) -> None:
        """Move waiting requests into prefill, in arrival order, while a slot and their pages are free."""
        admitted = 0
        while self.waiting and self.slots.num_free_slots:
            reserve = reserved_tokens(self.waiting[0], self.num_draft_tokens)
            if -(-reserve // self.slots.page_size) > self.slots.num_free_pages:
                if not (self.running or self.prefilling or admitted):
                    raise RequestError("the KV pool cannot hold even one request; raise "
                                       "serving.max_total_tokens")
                break
            r = self.waiting.popleft()
            r.handle = self.slots.admit()
            self.slots.reserve(r.handle.slot, reserve)
            self.prefilling.append(r)
            admitted += 1

    def prefill_chunks(self) -> list[PrefillChunk]:
        """This step's prompt tokens: at most `chunked_prefill_tokens` over all requests (and
        `max_chunk_rows` per request), in admission order (a long prompt is prefilled over several
        steps)."""
        budget = self.chunked_prefill_tokens
        chunks = []
        for r in self.prefilling:
            if budget == 0:
                break
            take = min(len(r.prompt) - r.prefilled, budget, self.max_chunk_rows or budget)
            chunks.append(PrefillChunk(r, take))
            budget -= take
        return chunks

    def start_decoding(self, request: Request) -> None:
        self.prefilling.remove(request)
        self.running.append(request)

    def retire(self) -> list[Request]:
        """Release the running requests that finished."""
        done = [r for r in self.running if r.done]
        for r in done:
            self.slots.release(r.handle.slot)
            self.running.remove(r)
        return done


def commit_tokens(r: Request, tokens: list[int], eos_ids: frozenset[int]) -> None:
    """Append a step's committed tokens to `r`'s output, stopping at EOS or `max_new_tokens`."""
    for t in tokens:
        if t in eos_ids and not r.ignore_eos:
            r.done, r.finish_reason = True, "stop"
            return
        r.output.append(t)
        if len(r.output) >= r.max_new_tokens:
            r.done, r.finish_reason = True, "length"
            return
