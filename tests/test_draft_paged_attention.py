"""The draft's block attention through the paged attention backend (`PagedDraftBlock`): the block's keys
and values written into the draft's cache where the commit will write the context's, every block row
reading its request's context and whole block in place. On the CPU it has the bits of the dense path
(the context gathered, then `block_step_attention`), and a request's rows do not depend on the batch.
(Through the Triton kernel: tests/kernels_interp_checks.py.)"""

from __future__ import annotations

import pytest
import torch

from dspark.runtime.engine.forward import PagedDraftBlock
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.package import load_package

from .runtime_helpers import REPO

GAMMA = 7
PREFIX = [3, 70, 128, 17, 200]  # within a page, across chunks, a chunk's end, past 3 chunks


@pytest.fixture(scope="module")
def runtime() -> tuple[Runtime, torch.Tensor]:
    runtime = Runtime(load_package(REPO / "generated" / "tiny_cpu_compact"))
    handles = [runtime.slots.admit() for _ in PREFIX]
    for h, p in zip(handles, PREFIX, strict=True):
        runtime.slots.reserve(h.slot, p + GAMMA + 1)
    torch.manual_seed(0)
    for layer in range(runtime.draft.cfg.num_layers):
        runtime.models.draft_kv.k[layer].normal_()
        runtime.models.draft_kv.v[layer].normal_()
    return runtime, runtime.slots.page_table[[h.slot for h in handles]]


def _paged(runtime: Runtime, table: torch.Tensor, rows: slice, roots: torch.Tensor):
    m, prefix = runtime.models, PREFIX[rows]
    block = PagedDraftBlock.plan(m.draft_attn, prefix, torch.tensor(prefix), GAMMA, table[rows], m.page_size)
    return runtime.draft.propose_paged(roots[rows], torch.tensor(prefix), block, None, gamma=GAMMA)


def test_the_paged_block_has_the_dense_paths_bits(runtime: tuple[Runtime, torch.Tensor]) -> None:
    rt, table = runtime
    m = rt.models
    roots = torch.randint(rt.draft.cfg.vocab_size, (len(PREFIX),), generator=torch.Generator().manual_seed(1))
    prefix = torch.tensor(PREFIX)
    dense = rt.draft.propose(roots, prefix, m.draft_context(table, prefix), prefix, None, gamma=GAMMA)
    paged = _paged(rt, table, slice(None), roots)
    assert torch.equal(paged.hidden, dense.hidden) and torch.equal(paged.drafts, dense.drafts)
    assert torch.equal(paged.conf_logits, dense.conf_logits)


def test_a_request_alone_has_its_bits_in_the_batch(runtime: tuple[Runtime, torch.Tensor]) -> None:
    rt, table = runtime
    roots = torch.randint(rt.draft.cfg.vocab_size, (len(PREFIX),), generator=torch.Generator().manual_seed(2))
    batch = _paged(rt, table, slice(None), roots)
    for b in range(len(PREFIX)):
        alone = _paged(rt, table, slice(b, b + 1), roots)
        assert torch.equal(alone.hidden[0], batch.hidden[b]), b


def test_the_block_writes_only_the_slots_the_commit_overwrites(runtime: tuple[Runtime, torch.Tensor]) -> None:
    rt, table = runtime
    m = rt.models
    before = [(k.clone(), v.clone()) for k, v in zip(m.draft_kv.k, m.draft_kv.v, strict=True)]
    roots = torch.zeros(len(PREFIX), dtype=torch.long)
    _paged(rt, table, slice(None), roots)
    page = m.page_size
    written = {int(table[b, p // page]) * page + p % page for b, start in enumerate(PREFIX)
               for p in range(start, start + GAMMA)}
    for layer, (k0, v0) in enumerate(before):
        k, v = m.draft_kv.k[layer], m.draft_kv.v[layer]
        changed = (k != k0).flatten(1).any(1) | (v != v0).flatten(1).any(1)
        assert set(torch.nonzero(changed).flatten().tolist()) <= written, layer
        assert changed.any()
