"""Loading a released DSpark draft checkpoint: `config.json` plus safetensors, one file or shards.

The tensor names are the released ones, unchanged. A checkpoint must hold exactly the tensors its
config implies, each with the implied shape: a missing, unexpected or misshapen tensor is refused
with its name (a draft with a missing Markov or confidence tensor would otherwise run on random or
zero weights and only draft badly). `embed_tokens.weight` and `lm_head.weight` are frozen copies
of the target's during training; a checkpoint stripped of them loads when the caller passes the
target's tensors instead.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark.checkpoints.dspark_block_config import IGNORED_FIELDS, BlockDraftConfig
from dspark.runtime.models.dspark_block_draft import DSparkBlockDraft
from dspark.runtime.models.skeleton import skeleton

INDEX_FILE = "model.safetensors.index.json"
SHARED_WITH_TARGET = ("embed_tokens.weight", "lm_head.weight")


class BlockDraftCheckpointError(ValueError):
    """A draft checkpoint whose tensors do not match its config (the message names them)."""


def expected_shapes(cfg: BlockDraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a released checkpoint with this config holds, by its released name."""
    d, v, hd = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (v, d), "lm_head.weight": (v, d), "norm.weight": (d,),
        "fc.weight": (d, cfg.context_width), "hidden_norm.weight": (d,),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, d),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, d),
            p + "mlp.down_proj.weight": (d, cfg.intermediate_size),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,), p + "self_attn.o_proj.bias": (d,)}
    r = cfg.markov_rank
    if r > 0:
        shapes |= {"markov_head.markov_w1.weight": (v, r), "markov_head.markov_w2.weight": (v, r)}
        if cfg.markov_head_type == "gated":
            shapes |= {"markov_head.gate_proj.weight": (r, d + r), "markov_head.gate_proj.bias": (r,)}
        elif cfg.markov_head_type == "rnn":
            shapes |= {"markov_head.joint_proj.weight": (3 * r, 2 * r + d),
                       "markov_head.joint_proj.bias": (3 * r,)}
    if cfg.confidence_head:
        shapes |= {"confidence_head.proj.weight": (1, cfg.confidence_inputs),
                   "confidence_head.proj.bias": (1,)}
    return shapes


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its shard index names, or every `*.safetensors`."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise BlockDraftCheckpointError(f"{index}: not a safetensors shard index ({e})") from e
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise BlockDraftCheckpointError(f"{index}: names shard {f.name}, which is not in {path}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise BlockDraftCheckpointError(f"{path}: no *.safetensors files")
    return files


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's shards by name; a name stored twice is refused."""
    tensors: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for f in shard_files(path):
        with safe_open(str(f), framework="pt") as shard:
            for name in shard.keys():
                if name in tensors:
                    raise BlockDraftCheckpointError(f"{path}: tensor {name!r} is stored in both "
                                                    f"{where[name]} and {f.name}")
                tensors[name] = shard.get_tensor(name)
                where[name] = f.name
    return tensors


def check_tensors(cfg: BlockDraftConfig, tensors: dict[str, torch.Tensor], source: str,
                  optional: tuple[str, ...] = ()) -> None:
    """Refuse missing (except `optional`), unexpected and misshapen tensors, naming them."""
    expected = expected_shapes(cfg)
    # HF checkpoints may carry the rotary table, which is recomputed from rope_theta here.
    unexpected = sorted(n for n in tensors if n not in expected and not n.endswith("rotary_emb.inv_freq"))
    missing = sorted(n for n in expected if n not in tensors and n not in optional)
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected} (not part of a draft with this config.json)")
    for name in sorted(set(tensors) & set(expected)):
        if tuple(tensors[name].shape) != expected[name]:
            problems.append(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, config.json implies "
                            f"{expected[name]}")
    if problems:
        raise BlockDraftCheckpointError(f"{source}: " + "; ".join(problems))


def load_block_draft(path: str | Path, dtype: torch.dtype = torch.float32,
                     target_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                     device: torch.device | str = "cpu") -> DSparkBlockDraft:
    """The draft in checkpoint directory `path` in `dtype` on `device`, in eval mode.

    `target_embeddings` (the target's `embed_tokens` and `lm_head` weights) stands in for a
    checkpoint that does not carry its own copies; a checkpoint that does carry them uses its own.
    """
    path = Path(path)
    cfg = BlockDraftConfig.from_file(path)
    tensors = read_tensors(path)
    optional = SHARED_WITH_TARGET if target_embeddings is not None else ()
    check_tensors(cfg, tensors, str(path), optional)
    if target_embeddings is not None:
        for name, t in zip(SHARED_WITH_TARGET, target_embeddings, strict=True):
            if name not in tensors:
                if tuple(t.shape) != expected_shapes(cfg)[name]:
                    raise BlockDraftCheckpointError(
                        f"{path}: the target's {name} has shape {tuple(t.shape)}, the draft's config.json "
                        f"implies {expected_shapes(cfg)[name]}")
                tensors[name] = t
    with skeleton():
        model = DSparkBlockDraft(cfg)
    state = {n: t for n, t in tensors.items() if not n.endswith("rotary_emb.inv_freq")}
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval()


def init_block_draft(cfg: BlockDraftConfig, seed: int = 0, std: float = 0.02,
                     target_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None) -> DSparkBlockDraft:
    """A freshly initialised draft, as DeepSpec starts training one: linear and embedding weights
    drawn from N(0, std²) (`initializer_range`), biases zero, norm weights one; with
    `target_embeddings`, `embed_tokens` and `lm_head` are copies of the target's (DeepSpec trains
    with them frozen at those copies)."""
    g = torch.Generator().manual_seed(seed)
    model = DSparkBlockDraft(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        if target_embeddings is not None:
            for name, t in zip(SHARED_WITH_TARGET, target_embeddings, strict=True):
                param = model.get_parameter(name)
                if param.shape != t.shape:
                    raise ValueError(f"the target's {name} has shape {tuple(t.shape)}, the draft's config "
                                     f"implies {tuple(param.shape)}")
                param.copy_(t)
    return model.eval()


def save_block_draft(path: str | Path, model: DSparkBlockDraft, dtype: torch.dtype | None = None,
                     metadata: dict | None = None) -> None:
    """Write `model` in the released layout: `config.json` (`BlockDraftConfig.to_hf`, the weights'
    `dtype` and `metadata`, which may hold only fields inert at inference) and `model.safetensors`
    under the released tensor names."""
    path = Path(path)
    extra = {"num_anchors": 512} | (metadata or {})
    # DeepSpec's model class will not construct without num_anchors (anchors per training sample),
    # even for inference; 512 is the value of its released training configs.
    inert = set(extra) - IGNORED_FIELDS
    if inert:
        raise ValueError(f"metadata fields {sorted(inert)} are not inert at inference; they belong "
                         "in the config")
    state = {k: v.detach().to(dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    check_tensors(model.cfg, state, str(path))
    weights_dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    config = model.cfg.to_hf() | extra | {"dtype": weights_dtype}
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
