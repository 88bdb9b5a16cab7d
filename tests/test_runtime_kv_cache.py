import pytest
import torch

from dspark.runtime.kv_cache import KVPoolExhausted, PagedKVCache, RequestSlots


def test_reserve_allocates_whole_pages_and_release_returns_them() -> None:
    slots = RequestSlots(max_requests=2, pages_per_request=4, num_pages=6, page_size=16)
    h = slots.admit()
    slots.reserve(h.slot, 17)
    assert slots.num_pages_held[h.slot] == 2
    assert 0 not in slots.page_table[h.slot, :2].tolist()  # page 0 is never handed out
    assert slots.num_free_pages == 3
    slots.reserve(h.slot, 10)  # already covered: no change
    assert slots.num_free_pages == 3
    slots.release(h.slot)
    assert slots.num_free_pages == 5
    assert slots.page_table[h.slot].tolist() == [0, 0, 0, 0]


def test_reused_slot_gets_a_new_generation() -> None:
    slots = RequestSlots(max_requests=1, pages_per_request=2, num_pages=3, page_size=4)
    first = slots.admit()
    slots.release(first.slot)
    second = slots.admit()
    assert second.slot == first.slot
    assert second.generation == first.generation + 1
    assert not slots.is_current(first) and slots.is_current(second)


def test_exhaustion_is_an_error_not_a_crash() -> None:
    slots = RequestSlots(max_requests=1, pages_per_request=8, num_pages=3, page_size=4)
    h = slots.admit()
    with pytest.raises(KVPoolExhausted, match="pages"):
        slots.reserve(h.slot, 12)
    with pytest.raises(KVPoolExhausted, match="slot"):
        slots.admit()
    with pytest.raises(KVPoolExhausted, match="max_context_len"):
        slots.reserve(h.slot, 33)


def test_cache_write_lands_in_flat_slots() -> None:
    cache = PagedKVCache(num_layers=2, num_pages=3, page_size=4, num_kv_heads=1, head_dim=2,
                         dtype=torch.float32)
    cache.write(1, torch.tensor([5, 9]), torch.ones(2, 1, 2), 2 * torch.ones(2, 1, 2))
    assert cache.k[1, 5].sum() == 2 and cache.v[1, 9].sum() == 4
    assert cache.k[0].abs().sum() == 0
