"""benchmarks/reference_forward.py: the plain-torch reference forward computes the model's forward."""

from __future__ import annotations

import json

import pytest
import torch

from dspark.runtime.config import ModelGeometry
from dspark.runtime.models.dummy import dummy_target
from dspark.runtime.models.llama import LlamaForCausalLM

from .benchmark_loader import load_benchmark
from .runtime_helpers import REPO

reference = load_benchmark("reference_forward")
PACKAGE = REPO / "generated" / "tiny_cpu_static"

TINY = ModelGeometry(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=16, max_position_embeddings=256)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request) -> LlamaForCausalLM:
    # qwen3 normalises each query and key head before RoPE: the reference must do it too
    return dummy_target(TINY, torch.float32, torch.device("cpu"), request.param)


def test_a_packages_reference_model_is_its_family() -> None:
    qwen3 = reference.package_model(REPO / "generated" / "qwen3_tiny_cpu_compact", torch.float32,
                                    torch.device("cpu"))[0]
    assert type(qwen3).__name__ == "Qwen3ForCausalLM"


def test_rows_after_a_cached_context_are_the_dense_forward_of_the_whole_sequence(model) -> None:
    ids = torch.randint(TINY.vocab_size, (3, 13), generator=torch.Generator().manual_seed(1))
    context, rows = 9, 4
    with torch.inference_mode():
        dense = model.forward_dense(ids)
        cache = reference.DenseCache.allocate(TINY, 3, context + rows, torch.float32, torch.device("cpu"))
        whole = reference.forward_rows(model, ids, cache, 0)  # start 0: the dense causal forward itself
        torch.testing.assert_close(whole, dense, rtol=1e-5, atol=1e-5)
        cache = reference.DenseCache.allocate(TINY, 3, context + rows, torch.float32, torch.device("cpu"))
        reference.forward_rows(model, ids[:, :context], cache, 0)  # prefill the context
        for r in (1, rows):  # one row (no mask) and several (causal among themselves)
            step = reference.forward_rows(model, ids[:, context:context + r], cache, context)
            torch.testing.assert_close(step, dense[:, context:context + r], rtol=1e-5, atol=1e-5)
        argmax = reference.verify_step(model, ids[:, context:], cache, context)
        assert torch.equal(argmax, model.dense_logits(dense[:, context:]).argmax(-1))


def test_the_named_geometries_have_their_sizes() -> None:
    with torch.device("meta"):
        sizes = {name: sum(p.numel() for p in LlamaForCausalLM(g).parameters())
                 for name, g in reference.GEOMETRIES.items()}
    assert 49e6 < sizes["llama_50m"] < 51e6
    assert 8.0e9 < sizes["llama31_8b"] < 8.1e9  # Llama-3.1-8B: 8.03B parameters


def test_measure_times_every_point_and_the_table_lays_them_out_by_b_and_r(model) -> None:
    results = reference.measure(model, [1, 2], [1, 3], context_len=5, warmup=1, repeats=2, graphs=False)
    assert [(m.num_reqs, m.rows, len(m.seconds)) for m in results] == [(1, 1, 2), (1, 3, 2), (2, 1, 2),
                                                                       (2, 3, 2)]
    assert all(s > 0 for m in results for s in m.seconds)
    setup = reference.Setup(model="tiny", parameters=1, device="cpu", dtype="float32", cuda_graphs=False,
                            context_len=5, warmup=1, repeats=2, threads=1, results=results)
    lines = reference.format_table(setup).splitlines()
    assert lines[3].split() == ["B", "R=1", "R=3"]
    assert lines[5].split() == ["2", f"{results[2].median_seconds * 1e3:.3f}",
                                f"{results[3].median_seconds * 1e3:.3f}"]


def test_the_command_times_a_packages_target_and_prints_json(capsys) -> None:
    assert reference.main(["--package", str(PACKAGE), "--batch-sizes", "2", "--rows", "1,2",
                           "--context-len", "8", "--repeats", "2", "--warmup", "0", "--device", "cpu",
                           "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "tiny_cpu_static" and data["device"] == "cpu" and data["dtype"] == "float32"
    assert data["cuda_graphs"] is False and data["context_len"] == 8
    assert [(r["num_reqs"], r["rows"], len(r["seconds"])) for r in data["results"]] == [(2, 1, 2), (2, 2, 2)]


def test_the_command_times_a_geometry_with_random_weights(capsys) -> None:
    assert reference.main(["--geometry", "llama_50m", "--batch-sizes", "1", "--rows", "2",
                           "--context-len", "4", "--repeats", "1", "--warmup", "0", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "reference forward: llama_50m (50.3M parameters), cpu float32, eager" in out
    assert out.splitlines()[3].split() == ["B", "R=2"] and out.splitlines()[4].split()[0] == "1"


def test_the_command_refuses_a_context_past_the_models_positions(capsys) -> None:
    assert reference.main(["--package", str(PACKAGE), "--batch-sizes", "1", "--rows", "8",
                           "--context-len", "1020", "--device", "cpu"]) == 2
    assert "exceed the model's max_position_embeddings 1024" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_replayed_cuda_graph_computes_the_eager_step() -> None:
    cuda = torch.device("cuda")
    gpu = dummy_target(TINY, torch.float32, cuda)
    ids = torch.randint(TINY.vocab_size, (2, 4), device=cuda)
    cache = reference.DenseCache.allocate(TINY, 2, 12, torch.float32, cuda, torch.Generator().manual_seed(0))
    with torch.inference_mode():
        eager = reference.verify_step(gpu, ids, cache, 8)
        replay, out = reference.cuda_graph(lambda: reference.verify_step(gpu, ids, cache, 8), warmup=1)
        out.fill_(-1)
        replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        results = reference.measure(gpu, [1, 2], [1, 4], context_len=8, warmup=1, repeats=2, graphs=True)
    assert [(m.num_reqs, m.rows) for m in results] == [(1, 1), (1, 4), (2, 1), (2, 4)]
