"""The target families against Hugging Face `transformers`, the independent reference.

Random-weight Llama and Qwen3 checkpoints are built with transformers and written with
`save_pretrained` (config.json as transformers 5 writes it: `rope_parameters`, no top-level
rope_theta), then compiled into a deployment with a dummy draft and served by the runtime. Through
the runtime's paged path — a prefill extend, a one-row decode extend and a ragged compact verify step
through the generated verify runner — the logits equal transformers' full forward within float32
tolerance, and greedy continuations (target-only and speculative) equal transformers' greedy ones,
for tied and untied embeddings, biases, and every RoPE scaling dspark implements. The speculative run
that is compared is one whose drafts get accepted: a scripted draft proposes transformers' own greedy
continuation with an error at a shuffled slot, and the verifier accepts every length 0 … gamma.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from dspark.compiler.api import build
from dspark.runtime.config import ModelGeometry
from dspark.runtime.engine.runtime import Runtime
from dspark.runtime.layout import plan_extend
from dspark.runtime.models import ops
from dspark.runtime.models.checkpoint import load_target
from dspark.runtime.package import load_package
from dspark.runtime.tokenizer import BOS_ID, BYTE_TOKENIZER_FILE, EOS_ID, VOCAB_SIZE

from .scripted_draft import assert_every_length, generate_scripted

transformers = pytest.importorskip("transformers")

VOCAB = 320
MAX_POSITIONS = 256
GAMMA = 3
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {"family": "llama"},
    "llama_tied_llama3_bias": {"family": "llama", "rope": LLAMA3, "tie_word_embeddings": True,
                               "attention_bias": True, "mlp_bias": True},
    "llama_linear": {"family": "llama", "rope": {"rope_type": "linear", "factor": 2.0}},
    "llama_dynamic": {"family": "llama", "rope": {"rope_type": "dynamic", "factor": 2.0}},
    "llama_yarn": {"family": "llama", "rope": YARN},
    "qwen3": {"family": "qwen3"},
    "qwen3_tied_yarn_bias": {"family": "qwen3", "rope": {**YARN, "beta_fast": 16, "truncate": False},
                             "tie_word_embeddings": True, "attention_bias": True},
}


def hf_model(variant: dict[str, Any]) -> Any:
    """A random transformers model of the variant, every parameter (norms and biases included)
    perturbed so that none is left at its neutral initial value."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                  rope_parameters={"rope_theta": 500000.0, **variant.get("rope", {"rope_type": "default"})},
                  tie_word_embeddings=variant.get("tie_word_embeddings", False),
                  attention_bias=variant.get("attention_bias", False), bos_token_id=None,
                  eos_token_id=None, pad_token_id=None, initializer_range=0.1)
    if variant["family"] == "llama":
        config = transformers.LlamaConfig(head_dim=16, mlp_bias=variant.get("mlp_bias", False), **common)
        model = transformers.LlamaForCausalLM(config)
    else:  # head_dim 32 is not hidden_size / heads: Qwen3 reads it from the config
        config = transformers.Qwen3Config(head_dim=32, **common)
        model = transformers.Qwen3ForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def compile_deployment(directory: Path, name: str, family: str, mode: str = "compact") -> Path:
    spec = {"name": name,
            "model": {"family": family, "checkpoint": "target"},
            "draft": {"checkpoint": "draft", "load_format": "dummy", "num_layers": 1, "gamma": GAMMA},
            "backend": {"kind": "cpu", "device": "generic"},
            "verify": {"mode": mode, **({"allow_no_cost_model": True} if mode != "static" else {})},
            "serving": {"max_running_requests": 4, "page_size": 16, "max_context_len": 128,
                        "max_total_tokens": 2048}}
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    out = directory / "pkgs" / name
    build(path, out)
    return out


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Runtime]:
    directory = tmp_path_factory.mktemp(request.param)
    reference = hf_model(VARIANTS[request.param])
    reference.save_pretrained(directory / "target")
    tokenizer = {"type": "byte", "bos_id": BOS_ID, "eos_id": EOS_ID, "vocab_size": VOCAB_SIZE}
    (directory / "target" / BYTE_TOKENIZER_FILE).write_text(json.dumps(tokenizer))
    package = compile_deployment(directory, f"hf_{request.param}", VARIANTS[request.param]["family"])
    return reference, Runtime(load_package(package))


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, EOS_ID, (n,), generator=gen).tolist() for n in lengths]


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


def test_config_fields_are_read_as_transformers_reads_them(served) -> None:
    reference, rt = served
    cfg, hf = rt.target.cfg, reference.config
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 500000.0  # transformers 5's place for it
    assert cfg.head_dim == hf.head_dim and cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.attention_bias == hf.attention_bias
    assert (cfg.rope_scaling.rope_type if cfg.rope_scaling else "default") == hf.rope_parameters["rope_type"]
    if cfg.tie_word_embeddings:
        assert rt.target.lm_head.weight is rt.target.model.embed_tokens.weight


def test_rope_frequencies_equal_transformers_bitwise(served) -> None:
    reference, rt = served
    cfg = rt.target.cfg
    rotary = reference.model.rotary_emb
    inv_freq, attention_factor = ops.rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(inv_freq, rotary.inv_freq)
    assert attention_factor == rotary.attention_scaling
    positions = torch.arange(0, 128)
    cos, sin = ops.rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    hf_cos, hf_sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)


def test_paged_prefill_decode_and_verify_logits_equal_transformers(served) -> None:
    reference, rt = served
    parts, page_size = rt.package.parts, rt.page_size
    seqs = prompts((5, 12, 19), seed=1)
    handles = [rt.slots.admit() for _ in seqs]
    for h in handles:
        rt.slots.reserve(h.slot, 64)
    table = rt.slots.page_table[[h.slot for h in handles]]
    try:
        def extend(prefix: list[int], rows: list[list[int]]) -> torch.Tensor:
            layout = plan_extend(prefix, [len(r) for r in rows], table, page_size, rt.device)
            ids = torch.tensor([t for r in rows for t in r])
            meta = parts.build_extend_metadata(layout)
            hidden = rt.target.forward_paged(ids, layout.positions, rt.attn, meta)
            return rt.target.compute_logits(hidden)

        # prefill: every prompt row
        close(extend([0] * len(seqs), seqs), torch.cat([hf_logits(reference, s) for s in seqs]))
        # decode: one row after each prompt
        nxt = prompts((1, 1, 1), seed=2)
        close(extend([len(s) for s in seqs], nxt),
              torch.stack([hf_logits(reference, s + n)[-1] for s, n in zip(seqs, nxt, strict=True)]))
        seqs = [s + n for s, n in zip(seqs, nxt, strict=True)]
        # verify: a ragged compact step (each request runs its planned rows) through the verify runner
        run_lens = (GAMMA + 1, 1, 2)
        drafts = prompts(run_lens, seed=3)
        layout = rt.verify_runner.plan(run_lens, run_lens, [len(s) for s in seqs], table,
                                       [h.slot for h in handles])
        ids = torch.tensor([t for d in drafts for t in d])
        logits = rt.target.compute_logits(rt.verify_runner.run(layout, ids))
        close(logits, torch.cat([hf_logits(reference, s + d)[-len(d):]
                                 for s, d in zip(seqs, drafts, strict=True)]))
    finally:
        for h in handles:
            rt.slots.release(h.slot)


def hf_sequence(model: Any, prompt: list[int], steps: int) -> list[int]:
    """The prompt and transformers' greedy continuation of `steps` tokens, through any EOS."""
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0].tolist()


def hf_greedy(model: Any, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy continuation, cut where the runtime stops (before EOS)."""
    out = hf_sequence(model, prompt, steps)[len(prompt):]
    return out[:out.index(EOS_ID)] if EOS_ID in out else out


def test_greedy_continuations_equal_transformers(served) -> None:
    """Target-only, speculative with the dummy draft (its drafts are rejected), and speculative with a
    scripted draft proposing transformers' continuation (accepted at every length 0 … gamma): each is
    transformers' greedy output."""
    reference, rt = served
    seqs = prompts((3, 9, 14, 6), seed=4)
    expected = [hf_greedy(reference, s, 16) for s in seqs]
    target_only, _ = rt.generate(seqs, 16, target_only=True)
    speculative, _ = rt.generate(seqs, 16)
    assert target_only == expected
    assert speculative == expected
    scripts = {tuple(s): hf_sequence(reference, s, 16 + GAMMA + 1) for s in seqs}
    scripted = generate_scripted(rt, seqs, 16, scripts)
    assert scripted.outputs == expected
    assert_every_length(scripted, GAMMA)


def test_a_tied_checkpoint_loads_without_an_lm_head_tensor(tmp_path: Path) -> None:
    """transformers leaves a tied LM head out of model.safetensors; dspark loads it as the embedding."""
    reference = hf_model(VARIANTS["qwen3_tied_yarn_bias"])
    reference.save_pretrained(tmp_path)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    model = load_target(str(tmp_path))  # the family from config.json's model_type
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        close(model.dense_logits(model.forward_dense(ids))[0], reference(ids).logits[0])


@pytest.mark.parametrize("variant", ["llama_tied_llama3_bias", "qwen3", "qwen3_tied_yarn_bias"])
def test_tensor_names_are_those_transformers_writes(variant: str) -> None:
    from dspark.runtime.models.families import build_target

    reference = hf_model(VARIANTS[variant])
    cfg = ModelGeometry.from_hf(reference.config.to_dict(), VARIANTS[variant]["family"])
    ours = build_target(VARIANTS[variant]["family"], cfg)
    tied = set(ours.tied_weights)
    assert set(ours.state_dict()) - tied == set(reference.state_dict()) - tied


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_equals_transformers_bitwise(dtype: torch.dtype) -> None:
    """Bitwise, so that in half precision it tells transformers' double rounding from a single one."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    gen = torch.Generator().manual_seed(5)
    norm = Qwen3RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(32, generator=gen))
    norm = norm.to(dtype)
    x = (3 * torch.randn(7, 4, 32, generator=gen)).to(dtype)
    with torch.no_grad():
        theirs = norm(x)
        assert torch.equal(ops.rms_norm(x, norm.weight, 1e-6), theirs)
        if dtype == torch.float32:
            return
        # transformers rounds twice (the normalised rows to `dtype`, then the product with the weight);
        # rounding once, after scaling in float32, differs in many elements, which only an exact
        # comparison sees: a relative tolerance of 1e-2 lets it through.
        xf = x.float()
        once = (norm.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))).to(dtype)
        assert (once != theirs).sum() > once.numel() // 10
        torch.testing.assert_close(once, theirs, rtol=1e-2, atol=0)


def test_captured_residual_streams_equal_transformers_hidden_states(served) -> None:
    """What a draft reading several target layers conditions on: the residual stream after n layers
    is transformers' `output_hidden_states[n]` (whose last entry transformers takes after the final
    norm, so the test normalises that one)."""
    reference, rt = served
    num_layers = rt.target.cfg.num_layers
    capture = (1, 0, num_layers)  # any order, the embeddings and the last layer included
    seqs = prompts((4, 9), seed=6)
    handles = [rt.slots.admit() for _ in seqs]
    for h in handles:
        rt.slots.reserve(h.slot, 32)
    table = rt.slots.page_table[[h.slot for h in handles]]
    try:
        layout = plan_extend([0, 0], [len(s) for s in seqs], table, rt.page_size, rt.device)
        hidden, states = rt.target.forward_paged_states(
            torch.tensor([t for s in seqs for t in s]), layout.positions, rt.attn,
            rt.package.parts.build_extend_metadata(layout), capture)
    finally:
        for h in handles:
            rt.slots.release(h.slot)
    d = rt.target.cfg.hidden_size
    assert states is not None and states.shape == (hidden.shape[0], len(capture) * d)
    assert torch.equal(states[:, 2 * d:], hidden)
    with torch.no_grad():
        expected = [reference(torch.tensor([s]), output_hidden_states=True).hidden_states for s in seqs]
    for j, n in enumerate(capture):
        ours = states[:, j * d:(j + 1) * d]
        if n == num_layers:
            ours = rt.target.model.norm(ours)
        close(ours, torch.cat([e[n][0] for e in expected]))
    _, dense_states = rt.target.forward_dense_states(torch.tensor([seqs[1]]), capture=capture)
    assert dense_states is not None
    close(dense_states[0], states[len(seqs[0]):])


def test_a_config_edited_after_compiling_is_refused_naming_the_field(tmp_path: Path) -> None:
    from dspark.runtime.engine.requests import RequestError

    hf_model(VARIANTS["qwen3"]).save_pretrained(tmp_path / "target")
    tokenizer = {"type": "byte", "bos_id": BOS_ID, "eos_id": EOS_ID, "vocab_size": VOCAB_SIZE}
    (tmp_path / "target" / BYTE_TOKENIZER_FILE).write_text(json.dumps(tokenizer))
    package = compile_deployment(tmp_path, "hf_edited", "qwen3")
    config_path = tmp_path / "target" / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_parameters"]["rope_theta"] = 10000.0
    config_path.write_text(json.dumps(config))
    with pytest.raises(RequestError, match=r"rope_theta 10000.0 \(compiled 500000.0\); recompile"):
        Runtime(load_package(package))
