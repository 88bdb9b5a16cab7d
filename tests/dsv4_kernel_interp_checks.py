"""DSV4 attention: the Triton kernel against its torch reference, under the Triton interpreter on the CPU.

`TRITON_INTERPRET` is read when `triton.jit` decorates a kernel, so run as a script this module sets it
before importing the kernel, in a fresh process (tests/test_dsv4_attention_kernel.py starts it). Imported
(the pytest module borrows `make_case` and `ascend_reference`), it sets nothing and the kernel module
keeps whatever mode the importing process has.

The interpreter neither computes bf16 correctly nor checks bounds, so the cases are fp32, q and the
caches are views into sentinel-padded buffers (extra heads and dims of noise), the page tables column
slices of wider ones whose extra columns name a page of sentinels, and the kernel writes into an
oversized output prefilled with a sentinel: an unmasked or misindexed read changes the result, an
unmasked store changes a sentinel.

Prints one JSON object: check name -> "ok" or the failure's traceback.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dspark.runtime.families.dsv4.ascend_op_models import reference_sparse_attn_sharedkv  # noqa: E402
from dspark.runtime.families.dsv4.triton_attention import (  # noqa: E402
    dsv4_attention,
    dsv4_attention_args,
    dsv4_attention_torch,
    launch_dsv4_attention,
)
from dspark.runtime.families.dsv4.verify_metadata import (  # noqa: E402
    Dsv4PageTables,
    Dsv4StepConfig,
    Dsv4VerifyMetadata,
    plan_dsv4_verify,
)
from tests.interp_runner import run_checks  # noqa: E402  (imports neither torch nor triton)

SENTINEL = -777.0
PAD = 3  # extra heads / dims / rows of the sentinel-padded buffers
EXTRA_COLS = 2  # extra page-table columns, naming the sentinel page


@dataclass
class Case:
    """One layer of a planned verify step: the metadata, the caches and the attention inputs."""

    meta: Dsv4VerifyMetadata
    ratio: int  # 0: window only; 4 with `topk`: C4; otherwise C128-kind
    q: torch.Tensor
    swa_kv: torch.Tensor
    cmp_kv: torch.Tensor | None
    sinks: torch.Tensor | None
    topk: torch.Tensor | None
    scale: float
    args: dict[str, Any]  # dsv4_attention's keyword arguments (metadata's, padded tables), without scale

    @property
    def padding_rows(self) -> torch.Tensor:
        return self.meta.device.row_slot.long() >= self.meta.num_requests

    def call(self, impl: str = "torch", **override: Any) -> torch.Tensor:
        args = {**self.args, **override}
        return dsv4_attention(self.q, self.swa_kv, self.cmp_kv, self.sinks, scale=self.scale, impl=impl,
                              **args)  # type: ignore[arg-type]

    def operator_args(self) -> dict[str, Any]:
        """The arguments without the metadata's padding conventions: every row sees min(p + 1, W)
        positions and floor((p + 1) / r) entries, as the Ascend operator does for padding rows too."""
        args = {**self.args, "window_lens": None}
        if self.cmp_kv is not None:
            pos = self.meta.device.positions
            args["cmp_visible"] = ((pos + 1) // self.ratio).to(torch.int32)
        return args


def _noise(shape: tuple[int, ...], pad: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sentinel-sized noise buffer, its leading `shape` view holding random values)."""
    big = SENTINEL * (1 + torch.rand(*[s + p for s, p in zip(shape, pad, strict=True)]))
    view = big[tuple(slice(0, s) for s in shape)]
    view.copy_(torch.randn(shape))
    return big, view


def _cache(pages: int, page_size: int, head_dim: int, null_zero: bool) -> torch.Tensor:
    """`[pages + 1, page_size, head_dim]` view of a wider buffer; the last page holds only sentinels and
    page 0 (the null page) is zero when `null_zero`."""
    _, cache = _noise((pages + 1, page_size, head_dim), (0, 0, PAD))
    cache[-1] = SENTINEL
    if null_zero:
        cache[0] = 0.0
    return cache


def _widen(table: torch.Tensor, sentinel_page: int) -> torch.Tensor:
    """The table as a column slice of a wider one whose extra columns name the sentinel page."""
    wide = torch.full((table.shape[0], table.shape[1] + EXTRA_COLS), sentinel_page, dtype=torch.int32)
    wide[:, : table.shape[1]] = table
    return wide[:, : table.shape[1]]


def _topk(rng: random.Random, visible: np.ndarray, written: np.ndarray, k: int, quirks: bool) -> torch.Tensor:
    """[T, k] entry ids: a random choice of min(k, visible) distinct visible entries, then -1 (what the
    indexer gives). With `quirks`, some rows also get an id past their visible entries (one a later row
    of the request wrote when there is one: it lies in the table), a duplicate and a -1 before valid ids
    (the operator's rules: ids >= visible skipped, reading stops at the first -1)."""
    out = torch.full((visible.shape[0], k), -1, dtype=torch.int32)
    for t, (vis, top) in enumerate(zip(visible.tolist(), written.tolist(), strict=True)):
        ids = rng.sample(range(vis), min(k, vis))
        if rng.random() < 0.5:
            ids.sort()
        if quirks and vis and rng.random() < 0.7:
            # Within the columns the operator reads (the first min(k, vis)): an id past the visible
            # entries, a duplicate, and a -1 with valid ids after it.
            for value in (rng.randint(vis, max(vis, top - 1)), ids[0], -1):
                ids.insert(rng.randrange(len(ids) + 1), value)
            ids = ids[:k]
        out[t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out


def make_case(seed: int, *, ratio: int, topk: bool = False, static: bool = False, padding: bool = True,
              sinks: bool = True, quirks: bool = False, null_zero: bool = True, heads: int | None = None,
              head_dim: int | None = None, window: int | None = None, empty_slots: int = 0,
              device: str = "cpu") -> Case:
    """A random DSV4 verify step planned with `plan_dsv4_verify` and one layer's random caches.

    Requests have prefixes from 0 (windows clipped at position 0) to ~700 (C128 entries at ratio 128,
    many C4 entries), small pages so windows and entry ranges cross page and ring boundaries, shuffled
    page ids. `static`: every request runs N rows; `padding`: the tier adds padding requests;
    `empty_slots`: 0-row slots after them.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n = rng.randint(1, 5)
    w = window if window is not None else rng.choice([1, 3, 8, 21])
    ps = rng.choice([1, 2, 4, 8])
    ring = -(-(w + n - 1 + rng.randint(0, 3)) // ps) * ps
    cps = {4: rng.choice([1, 2, 4, 8]), 128: rng.choice([1, 2])}
    index_topk = rng.choice([1, 3, 8, 20])
    config = Dsv4StepConfig(num_draft_tokens=n, window=w, compress_ratios=(4, 128), swa_page_size=ps,
                            swa_ring_size=ring, cmp_page_sizes=cps, index_topk=index_topk)
    num_reqs = rng.randint(1, 4)
    lens = [n if static else rng.randint(1, n) for _ in range(num_reqs)]
    # One long request at least (C128 entries, many C4 ones), short ones (windows clipped at 0).
    prefix = [rng.randint(128, 700)] + [rng.choice([0, 1, rng.randint(2, 12), rng.randint(100, 700)])
                                        for _ in range(num_reqs - 1)]
    rng.shuffle(prefix)
    longest = max(p + ln for p, ln in zip(prefix, lens, strict=True))
    ring_pages = ring // ps
    swa_ids = torch.randperm(num_reqs * ring_pages, generator=gen).add(1).view(num_reqs, ring_pages)
    cmp_pages = {r: max(1, -(-(longest // r) // cps[r])) + 1 for r in (4, 128)}
    cmp_ids = {r: torch.randperm(num_reqs * cmp_pages[r], generator=gen).add(1).view(num_reqs, cmp_pages[r])
               for r in (4, 128)}
    tables = Dsv4PageTables(swa=swa_ids.numpy().astype(np.int32),
                            compressed={r: ids.numpy().astype(np.int32) for r, ids in cmp_ids.items()})
    total = sum(lens)
    tier = total + (rng.randint(1, 2 * n) if padding else 0)
    slots = None
    if empty_slots:
        pad_slots = -(-(tier - total) // config.padding_request_rows)
        slots = num_reqs + pad_slots + empty_slots
    meta = plan_dsv4_verify(lens, prefix, config, tables, tier=tier, num_slots=slots, device=device)

    heads = heads if heads is not None else rng.choice([1, 4, 5])
    head_dim = head_dim if head_dim is not None else rng.choice([16, 24, 32])
    swa_kv = _cache(1 + num_reqs * ring_pages, ps, head_dim, null_zero)
    sentinel_swa = swa_kv.shape[0] - 1
    args = dsv4_attention_args(meta, ratio)
    args["ori_block_table"] = _widen(meta.device.ori_block_table, sentinel_swa)
    cmp_kv = topk_ids = None
    if ratio:
        cmp_kv = _cache(1 + num_reqs * cmp_pages[ratio], cps[ratio], head_dim, null_zero)
        args["cmp_block_table"] = _widen(meta.compressed[ratio].device.cmp_block_table, cmp_kv.shape[0] - 1)
        if topk:
            pos = meta.host.positions
            visible = (pos + 1) // ratio  # padding rows too: the operator reads them as real rows
            written = meta.compressed[ratio].host.cmp_kv_lens[meta.host.row_slot]
            topk_ids = _topk(rng, visible, written, index_topk, quirks)
            args["topk"] = topk_ids
    _, q = _noise((tier, heads, head_dim), (PAD, PAD, PAD))
    sink = torch.randn(heads) * 2 if sinks else None
    scale = rng.choice([head_dim ** -0.5, 0.3, 1.0])
    args = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    return Case(meta, ratio, q.to(device), swa_kv.to(device), None if cmp_kv is None else cmp_kv.to(device),
                None if sink is None else sink.to(device), args.get("topk"), scale, args)


def ascend_reference(case: Case) -> torch.Tensor:
    """`reference_sparse_attn_sharedkv` with the arguments the peers pass for this layer (CPU)."""
    dev = case.meta.device
    kwargs: dict[str, Any] = dict(
        ori_kv=case.swa_kv.cpu().unsqueeze(2), ori_block_table=dev.ori_block_table.cpu(),
        cu_seqlens_q=dev.cu_seqlens_q.cpu(), seqused_kv=dev.kv_lens.cpu(),
        sinks=None if case.sinks is None else case.sinks.cpu(), softmax_scale=case.scale,
        ori_win_left=case.meta.ori_win_left, ori_win_right=0)
    if case.ratio and case.cmp_kv is not None:
        kwargs.update(cmp_kv=case.cmp_kv.cpu().unsqueeze(2), cmp_ratio=case.ratio,
                      cmp_block_table=case.meta.compressed[case.ratio].device.cmp_block_table.cpu())
        if case.topk is not None:
            kwargs["cmp_sparse_indices"] = case.topk.cpu().unsqueeze(1)
    return reference_sparse_attn_sharedkv(case.q.cpu().contiguous(), **kwargs)


def rule_topk(case: Case) -> torch.Tensor:
    """Top-k ids that only the operator's reading rules make sense of, by row t % 4 (vis = the row's
    visible entries): [vis - 1, -1, 0, ...] reads entry vis - 1 alone (stop at the first -1);
    [0] * (vis + 3) reads entry 0 vis times (only the first min(K, vis) columns); [vis, vis + 1, vis + 2,
    0] reads entry 0 when vis > 3 (ids >= vis skipped); all -1 reads no entry."""
    visible = case.meta.compressed[case.ratio].host.cmp_visible
    k = int(visible.max()) + 3
    out = torch.full((visible.shape[0], k), -1, dtype=torch.int32)
    for t, vis in enumerate(visible.tolist()):
        if not vis:
            continue
        ids = [[vis - 1, -1, 0], [0] * (vis + 3), [vis, vis + 1, vis + 2, 0], []][t % 4]
        out[t, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out.to(case.q.device)


# (name, make_case keyword arguments) of the cases the checks run; the pytest module reuses them.
CASE_KINDS: list[tuple[str, dict[str, Any]]] = [
    ("window_only", dict(ratio=0)),
    ("window_only_static", dict(ratio=0, static=True, padding=False)),
    ("c4_topk", dict(ratio=4, topk=True)),
    ("c4_topk_quirks", dict(ratio=4, topk=True, quirks=True)),
    ("c4_all_entries", dict(ratio=4)),
    ("c128", dict(ratio=128)),
    ("c128_static_padded_no_sinks", dict(ratio=128, static=True, sinks=False)),
    ("c4_no_sinks_empty_slots", dict(ratio=4, topk=True, sinks=False, empty_slots=2)),
]
SEEDS = range(3)


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 2e-4) -> None:
    same_kind = got.shape == want.shape and got.dtype == want.dtype
    if not same_kind or not torch.allclose(got, want, atol=tol, rtol=tol):
        err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
        raise AssertionError(f"{name}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}, "
                             f"max error {err}")


def _run_in_buffer(case: Case, **launch: Any) -> torch.Tensor:
    """Launch into a sentinel-filled output with extra rows, heads and dims; check they stay untouched
    and return the real part."""
    t, h, d = case.q.shape
    big = torch.full((t + PAD, h + PAD, d + PAD), SENTINEL)
    launch_dsv4_attention(case.q, case.swa_kv, case.cmp_kv, case.sinks, big[:t, :h, :d], scale=case.scale,
                          **{**case.args, **launch})
    outside = big.clone()
    outside[:t, :h, :d] = SENTINEL
    if not (outside == SENTINEL).all():
        raise AssertionError("the kernel wrote outside [T, H, D]")
    return big[:t, :h, :d]


def check_kinds_match_reference() -> None:
    for name, kw in CASE_KINDS:
        for seed in SEEDS:
            # Seed 1 leaves the null page random: padding rows must still write zeros.
            case = make_case(100 * seed + 7, **{**kw, "null_zero": seed != 1})
            want = case.call("torch")
            got = case.call("triton")
            _close(f"{name}/{seed} triton", got, want)
            if not (got[case.padding_rows] == 0).all():
                raise AssertionError(f"{name}/{seed}: padding rows must write zeros")
            # Small tiles: several key tiles per row and several head blocks per row.
            _close(f"{name}/{seed} buffer", _run_in_buffer(case, block_n=16, block_h=16), want)


def check_operator_mode() -> None:
    """window_lens=None and cmp_visible from positions: padding rows read the (random) null page."""
    for name, kw in CASE_KINDS:
        case = make_case(31, **{**kw, "null_zero": False})
        args = case.operator_args()
        _close(f"{name} operator mode", case.call("triton", **args), dsv4_attention_torch(
            case.q, case.swa_kv, case.cmp_kv, case.sinks, scale=case.scale, **args))


def check_many_heads_and_wide_head_dim() -> None:
    # 20 heads: two head blocks of 16, the second mostly masked; head_dim 512 (DSV4's) and 40 (padded
    # to 64); window 64: several tiles of the default block.
    for seed, (heads, head_dim, window) in enumerate([(20, 40, 64), (3, 512, 21), (17, 128, 33)]):
        for ratio, topk in ((4, True), (128, False)):
            case = make_case(500 + seed, ratio=ratio, topk=topk, heads=heads, head_dim=head_dim,
                             window=window)
            want = case.call("torch")
            _close(f"heads {heads} dim {head_dim} ratio {ratio}", _run_in_buffer(case), want)


def check_negative_positions_write_zeros() -> None:
    case = make_case(77, ratio=4, topk=True, padding=False)
    positions = case.args["positions"].clone()
    positions[::2] = -1 - positions[::2]
    got = _run_in_buffer(case, positions=positions)
    if not (got[::2] == 0).all():
        raise AssertionError("rows at negative positions must write zeros")
    _close("negative positions", got, case.call("torch", positions=positions))


def check_topk_reading_rules() -> None:
    for seed in range(4):
        # A random null page: an id read past the request's entries would show.
        case = make_case(40 + seed, ratio=4, topk=True, null_zero=False)
        topk = rule_topk(case)
        want = case.call("torch", topk=topk)
        _close(f"topk rules {seed}", _run_in_buffer(case, topk=topk, block_n=16), want)


def check_rows_independent() -> None:
    """A row launched alone writes the bits it writes beside the step's other rows (fixed tiles)."""
    case = make_case(9, ratio=4, topk=True)
    batch = _run_in_buffer(case)
    per_row = ("positions", "row_slot", "window_lens", "cmp_visible", "topk")
    for t in range(case.q.shape[0]):
        alone = torch.full_like(batch[t:t + 1], SENTINEL)
        args = {k: (v[t:t + 1] if k in per_row else v) for k, v in case.args.items()}
        launch_dsv4_attention(case.q[t:t + 1], case.swa_kv, case.cmp_kv, case.sinks, alone, scale=case.scale,
                              **args)
        if not torch.equal(alone, batch[t:t + 1]):
            raise AssertionError(f"row {t} alone differs from the row in the step")


CHECKS: dict[str, Callable[[], None]] = {
    "kinds_match_reference": check_kinds_match_reference,
    "operator_mode": check_operator_mode,
    "many_heads_and_wide_head_dim": check_many_heads_and_wide_head_dim,
    "negative_positions_write_zeros": check_negative_positions_write_zeros,
    "topk_reading_rules": check_topk_reading_rules,
    "rows_independent": check_rows_independent,
}


if __name__ == "__main__":
    sys.exit(run_checks(CHECKS))
