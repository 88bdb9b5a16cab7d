"""STS shards (dspark.formats.sts_shards): the samples' checks, shard IO, meta.json and the run's writer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark.formats.sts_shards import (
    PARTIAL_VERIFY_REASON,
    ShardError,
    StsData,
    StsMeta,
    StsShardWriter,
    read_shard,
    read_shards,
    read_sts_meta,
    shard_arrays,
    shard_features,
    write_shard,
)


def synthetic(n: int, gamma: int = 3, seed: int = 0) -> StsData:
    rng = np.random.default_rng(seed)
    logits = rng.normal(1.0, 2.0, size=(n, gamma))
    return StsData(logits, np.cumprod(rng.random((n, gamma)) < 0.7, axis=1).astype(bool))


def test_sts_data_validates_direct_construction() -> None:
    with pytest.raises(ShardError, match="row 1 has prefix_mask 01"):
        StsData(np.zeros((2, 2)), np.array([[True, False], [False, True]]))
    with pytest.raises(ShardError, match="bool"):
        StsData(np.zeros((2, 2)), np.ones((2, 2)))
    data = synthetic(10)
    with pytest.raises(ValueError):
        data.logits[0, 0] = 1.0  # read-only: a fit cannot be changed behind its back


def test_shard_round_trip_through_a_directory(tmp_path: Path) -> None:
    data = synthetic(120, seed=7)
    shards = tmp_path / "gsm8k"
    write_shard(shards / "rank0.1.pt", data.logits[80:], data.prefix_mask[80:])
    write_shard(shards / "rank0.0.pt", data.logits[:80], data.prefix_mask[:80])
    (shards / "meta.json").write_text('{"gamma": 3}')
    assert sorted(p.name for p in shards.iterdir()) == ["meta.json", "rank0.0.pt", "rank0.1.pt"]

    loaded = read_shards([shards])
    assert loaded.sources == (str(shards / "rank0.0.pt"), str(shards / "rank0.1.pt"))
    np.testing.assert_array_equal(loaded.logits, data.logits.astype(np.float32).astype(np.float64))
    np.testing.assert_array_equal(loaded.prefix_mask, data.prefix_mask)
    raw = torch.load(shards / "rank0.0.pt", weights_only=True)
    assert raw["logits"].dtype == torch.float32 and raw["prefix_mask"].dtype == torch.bool

    # File arguments in any order, or a shard named twice, give the same rows once each.
    again = read_shards([shards / "rank0.1.pt", shards / "rank0.0.pt", shards])
    assert again.sources == loaded.sources
    np.testing.assert_array_equal(again.logits, loaded.logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_numeric_zero_one_masks_are_accepted(tmp_path: Path, dtype: torch.dtype) -> None:
    # SGLang's recorder stores the mask as float32 0.0/1.0.
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=dtype)
    torch.save({"logits": torch.randn(2, 3), "prefix_mask": mask}, tmp_path / "s.pt")
    loaded = read_shards([tmp_path / "s.pt"]).prefix_mask
    assert loaded.tolist() == [[True, True, False], [False, False, False]]


BAD_SHARDS = {
    "missing key": ({"logits": torch.zeros(2, 3)}, "missing key 'prefix_mask'"),
    "shape mismatch": ({"logits": torch.zeros(2, 3), "prefix_mask": torch.zeros(2, 4, dtype=torch.bool)},
                       "differs from logits shape"),
    "not a prefix": ({"logits": torch.zeros(3, 3),
                      "prefix_mask": torch.tensor([[1, 0, 0], [1, 1, 1], [1, 0, 1]], dtype=torch.bool)},
                     "row 2 has prefix_mask 101"),
    "nan": ({"logits": torch.tensor([[0.0, 1.0], [0.5, 0.5], [float("nan"), 0.0]]),
             "prefix_mask": torch.zeros(3, 2, dtype=torch.bool)}, "logits row 2 is not finite"),
    "not 0/1": ({"logits": torch.zeros(2, 2), "prefix_mask": torch.tensor([[1, 0], [2, 0]])},
                "prefix_mask row 1"),
    "1-D": ({"logits": torch.zeros(3), "prefix_mask": torch.zeros(3, dtype=torch.bool)},
            r"expected \[n, gamma\]"),
    "int logits": ({"logits": torch.zeros(2, 2, dtype=torch.int32), "prefix_mask": torch.zeros(2, 2)},
                   "expected float confidence logits"),
    "not a dict": ([torch.zeros(2, 2)], "expected the recorder's dict"),
    "censored": ({"logits": torch.zeros(2, 2), "prefix_mask": torch.zeros(2, 2),
                  "observed_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]])}, "observed_mask row 1"),
}


@pytest.mark.parametrize("case", sorted(BAD_SHARDS))
def test_bad_shards_are_reported_with_the_file_name(tmp_path: Path, case: str) -> None:
    payload, message = BAD_SHARDS[case]
    logits = payload.get("logits") if isinstance(payload, dict) else None
    gamma = logits.shape[1] if logits is not None and logits.dim() == 2 else 3
    write_shard(tmp_path / "a_good.pt", np.zeros((2, gamma)), np.zeros((2, gamma), dtype=bool))
    bad = tmp_path / "b_bad.pt"
    torch.save(payload, bad)
    with pytest.raises(ShardError, match=message) as err:
        read_shards([tmp_path])  # the good shard read first does not hide the bad one
    assert str(bad) in str(err.value)


def test_other_unusable_inputs_name_the_path(tmp_path: Path) -> None:
    write_shard(tmp_path / "a.pt", np.zeros((2, 3)), np.zeros((2, 3), dtype=bool))
    write_shard(tmp_path / "b.pt", np.zeros((2, 4)), np.zeros((2, 4), dtype=bool))
    with pytest.raises(ShardError, match="gamma 4 differs from the earlier shards' gamma 3") as err:
        read_shards([tmp_path])
    assert str(tmp_path / "b.pt") in str(err.value)
    (tmp_path / "c.pt").write_bytes(b"not a torch file")
    with pytest.raises(ShardError, match="cannot read the shard") as err:
        read_shards([tmp_path / "c.pt"])
    assert str(tmp_path / "c.pt") in str(err.value)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "meta.json").write_text("{}")
    with pytest.raises(ShardError, match="holds no .pt shards"):
        read_shards([tmp_path / "empty"])
    with pytest.raises(ShardError, match="no such shard"):
        read_shards([tmp_path / "missing.pt"])
    with pytest.raises(ShardError, match="no shard paths"):
        read_shards([])


def test_features_round_trip_and_are_checked(tmp_path: Path) -> None:
    data = synthetic(4)
    features = torch.randn(4, 3, 5)
    path = write_shard(tmp_path / "f.pt", data.logits, data.prefix_mask, features)
    payload = read_shard(path)
    _, mask = shard_arrays(payload, path, None)
    got = shard_features(payload, path, *mask.shape)
    assert got.dtype == torch.float32 and torch.allclose(got, features.half().float())
    with pytest.raises(ShardError, match=r"'features' must be a float tensor \[n, gamma, F\] = \[4, 2, F\]"):
        shard_features(payload, path, 4, 2)
    plain = write_shard(tmp_path / "p.pt", data.logits, data.prefix_mask)
    with pytest.raises(ShardError, match="got None"):
        shard_features(read_shard(plain), plain, 4, 3)


def test_meta_round_trips_and_refuses_unknown_or_mistyped_fields(tmp_path: Path) -> None:
    meta = StsMeta(policy="greedy", num_samples=3, num_shards=1, skipped_requests=2, skip_reason="why",
                   features_backbone="abc", fingerprint={"draft": "d"})
    (tmp_path / "meta.json").write_text(json.dumps(meta.to_json()))
    assert read_sts_meta(tmp_path) == meta
    assert read_sts_meta(tmp_path / "nowhere") is None  # shards from elsewhere carry no meta.json
    (tmp_path / "meta.json").write_text('{"policy": "greedy", "gamma": 3}')
    with pytest.raises(ShardError, match=r"meta.json: unknown field\(s\) \['gamma'\]"):
        read_sts_meta(tmp_path)
    (tmp_path / "meta.json").write_text('{"policy": "greedy", "skipped_requests": true}')
    with pytest.raises(ShardError, match="field 'skipped_requests' must be int or null, got True"):
        read_sts_meta(tmp_path)
    (tmp_path / "meta.json").write_text('{"policy": "greedy", "features": {}}')
    with pytest.raises(ShardError, match="meta.json: features: missing field 'draft_backbone'"):
        read_sts_meta(tmp_path)


def test_the_writer_shards_keeps_only_fully_verified_rows_and_says_why(tmp_path: Path) -> None:
    writer = StsShardWriter(tmp_path / "sts", gamma=3, policy="greedy", shard_size=4)
    for step in range(3):
        logits = torch.full((3, 3), float(step))
        writer.add(logits, torch.tensor([0, 2, 3]), torch.tensor([True, True, step != 1]))
    meta = writer.close({"draft": "d"})
    assert (meta.num_samples, meta.num_shards, meta.skipped_requests) == (8, 2, 1)
    assert meta.skip_reason == PARTIAL_VERIFY_REASON and read_sts_meta(tmp_path / "sts") == meta
    assert sorted(p.name for p in (tmp_path / "sts").iterdir()) == ["meta.json", "shard-00000.pt",
                                                                    "shard-00001.pt"]
    data = read_shards(tmp_path / "sts")
    assert data.num_samples == 8 and data.prefix_mask.sum(axis=1).tolist() == [0, 2, 3, 0, 2, 0, 2, 3]
    assert data.logits[:, 0].tolist() == [0, 0, 0, 1, 1, 2, 2, 2]


def test_a_features_writer_needs_the_features(tmp_path: Path) -> None:
    writer = StsShardWriter(tmp_path, gamma=2, policy="greedy", features_backbone="abc")
    assert writer.features
    with pytest.raises(ValueError, match="pass the confidence head's inputs"):
        writer.add(torch.zeros(1, 2), torch.tensor([1]), torch.tensor([True]))
    writer.add(torch.zeros(2, 2), torch.tensor([1, 2]), torch.tensor([True, False]), torch.ones(2, 2, 6))
    assert writer.close().features_backbone == "abc"
    assert read_shard(tmp_path / "shard-00000.pt")["features"].shape == (1, 2, 6)
