"""Paged KV storage, the page pool, and request slots with generation counters.

Page 0 is the null page: unused page-table entries point at it, and it is never handed out,
so a gather through a partially filled page table reads zeros instead of another request's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVPoolExhausted(RuntimeError):
    """No free pages (or no free slot) for the request; the caller decides to wait or preempt."""


class PagedKVCache:
    """K/V for every layer in flat token slots: slot = page * page_size + offset. `keys_are_values`: a
    latent head that is both (DeepSeek-V4's K=V), stored once (`v` is `k`)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 keys_are_values: bool = False) -> None:
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.keys_are_values = keys_are_values
        self.v = self.k if keys_are_values else torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer].index_copy_(0, loc, k.to(self.k.dtype))
        if not self.keys_are_values:
            self.v[layer].index_copy_(0, loc, v.to(self.v.dtype))


@dataclass(frozen=True)
class SlotHandle:
    """A request's slot and the generation it was admitted under."""

    slot: int
    generation: int


class RequestSlots:
    """Per-request page tables over a shared page pool.

    Each admission bumps the slot's generation, so anything recorded for an earlier occupant
    of the slot (e.g. lagged confidence) can be recognised as stale.
    """

    def __init__(self, max_requests: int, pages_per_request: int, num_pages: int,
                 page_size: int) -> None:
        if num_pages < 2:
            raise ValueError("the page pool needs at least two pages (page 0 is the null page)")
        self.page_size = page_size
        self.pages_per_request = pages_per_request
        self.page_table = torch.zeros(max_requests, pages_per_request, dtype=torch.int32)
        self.num_pages_held = [0] * max_requests
        self.generation = [0] * max_requests
        self._free_slots = list(range(max_requests - 1, -1, -1))
        self._free_pages = list(range(num_pages - 1, 0, -1))
        self.num_pages = num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def admit(self) -> SlotHandle:
        if not self._free_slots:
            raise KVPoolExhausted("no free request slot")
        slot = self._free_slots.pop()
        self.generation[slot] += 1
        return SlotHandle(slot, self.generation[slot])

    def reserve(self, slot: int, num_tokens: int) -> None:
        """Make sure the slot's pages cover token positions `[0, num_tokens)`."""
        need = -(-num_tokens // self.page_size)
        if need > self.pages_per_request:
            raise KVPoolExhausted(
                f"{num_tokens} tokens exceed the per-request capacity of "
                f"{self.pages_per_request * self.page_size} (serving.max_context_len)")
        held = self.num_pages_held[slot]
        if need - held > len(self._free_pages):
            raise KVPoolExhausted(f"need {need - held} pages, {len(self._free_pages)} free")
        for i in range(held, need):
            self.page_table[slot, i] = self._free_pages.pop()
        self.num_pages_held[slot] = max(held, need)

    def release(self, slot: int) -> None:
        held = self.num_pages_held[slot]
        self._free_pages.extend(self.page_table[slot, :held].tolist()[::-1])
        self.page_table[slot].zero_()
        self.num_pages_held[slot] = 0
        self._free_slots.append(slot)

    def is_current(self, handle: SlotHandle) -> bool:
        return self.generation[handle.slot] == handle.generation
