"""The plain-torch reference forward: B requests × R new rows after C cached tokens, timed.

What a verify step costs without dspark's runtime: the target model (dspark's Llama or Qwen3 modules,
with the checkpoint of a generated package, or the seeded random weights of a named geometry that a
deployment's `load_format: dummy` also uses) runs R new rows per request against a dense
per-request KV cache holding C tokens — embed, every layer (RMSNorm in torch ops, QKV, Qwen3's per-head
q/k norms, RoPE with the family's scaling, the rows' K/V
written at positions C … C+R-1, SDPA over the C+R keys with a causal mask within the R rows, O
projection, SwiGLU MLP), final norm, LM head, argmax. No paging, no
metadata, no planner. On CUDA each (B, R) step is captured once as a CUDA graph and replayed (bf16
by default); on the CPU it runs eagerly (fp32 by default). A step is timed from a device
synchronisation to the next, and the median of the timed steps is printed as a table of ms by B
and R.

    .venv/bin/python benchmarks/reference_forward.py --geometry llama_50m --batch-sizes 1,8,32 \\
        --rows 1,2,4,8 --context-len 128 --repeats 10
    python benchmarks/reference_forward.py --geometry llama31_8b --batch-sizes 1,8,32,64,128 \\
        --context-len 1024
    python benchmarks/reference_forward.py --package generated/llama31_8b_h200_static --batch-sizes 1,8,32

The cached keys and values are random: their values do not change what a dense forward costs, and a
real prefill of B·C tokens per batch size would cost more than the measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dspark.runtime.config import ModelGeometry
from dspark.runtime.kernels.rms_norm import rms_norm_torch
from dspark.runtime.models import ops
from dspark.runtime.models.dummy import dummy_target
from dspark.runtime.models.llama import LlamaForCausalLM, RMSNorm
from dspark.runtime.models.qwen3 import Qwen3Attention

GEOMETRIES = {
    # Llama-3.1-8B: the H200 deployment's target.
    "llama31_8b": ModelGeometry(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                                num_heads=32, num_kv_heads=8, head_dim=128, max_position_embeddings=131072,
                                rope_theta=500000.0, rms_norm_eps=1e-5),
    # ~50M parameters: big enough for GEMMs to dominate, small enough for a CPU.
    "llama_50m": ModelGeometry(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_layers=6,
                               num_heads=12, num_kv_heads=4, head_dim=64, max_position_embeddings=4096,
                               rope_theta=10000.0, rms_norm_eps=1e-5),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class DenseCache:
    """Per-layer K and V of B requests, `[B, kv_heads, capacity, head_dim]`, written in place."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @classmethod
    def allocate(cls, cfg: ModelGeometry, batch: int, capacity: int, dtype: torch.dtype,
                 device: torch.device, generator: torch.Generator | None = None) -> DenseCache:
        """A cache of `capacity` positions; random contents when a `generator` is given, else zeros."""
        shape = (batch, cfg.num_kv_heads, capacity, cfg.head_dim)

        def one() -> torch.Tensor:
            if generator is None:
                return torch.zeros(shape, dtype=dtype, device=device)
            # drawn where the generator lives: an 8B cache is drawn on the GPU, never on the host
            return torch.randn(shape, generator=generator, device=generator.device, dtype=dtype).to(device)
        return cls([one() for _ in range(cfg.num_layers)], [one() for _ in range(cfg.num_layers)])


def forward_rows(model: LlamaForCausalLM, ids: torch.Tensor, cache: DenseCache, start: int) -> torch.Tensor:
    """The residual stream `[B, R, d]` of R rows per request at positions `start … start+R-1`.

    The rows' K/V are written into the cache at those positions; each row attends to the `start`
    cached positions and to the rows before it. With `start = 0` this is `model.forward_dense`.
    """
    c = model.cfg
    b, r = ids.shape
    end = start + r
    positions = torch.arange(start, end, device=ids.device)
    cos, sin = model.rope(positions)  # the family's RoPE, its scaling included
    group = c.num_heads // c.num_kv_heads
    # Row i sees key j when j <= start + i; a single row sees every key, so it needs no mask. The query
    # heads sharing a KV head are folded into the rows (head h reads KV head h // group, as Llama's
    # repeat_kv does), so SDPA sees plain multi-head shapes: on CUDA a masked step then stays on the
    # fused memory-efficient kernel instead of the unfused path grouped-query SDPA takes with a mask.
    mask = None
    if r > 1:
        mask = (torch.arange(end, device=ids.device)[None, :] <= positions[:, None]).repeat(group, 1)
    x = model.model.embed_tokens(ids)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        h = plain_norm(layer.input_layernorm, x)
        q, k = plain_qk_heads(attn, attn.q_proj(h).view(b, r, c.num_heads, c.head_dim),
                              attn.k_proj(h).view(b, r, c.num_kv_heads, c.head_dim))
        q = ops.apply_rope(q, cos, sin).transpose(1, 2)
        k = ops.apply_rope(k, cos, sin).transpose(1, 2)
        v = attn.v_proj(h).view(b, r, c.num_kv_heads, c.head_dim).transpose(1, 2)
        cache.keys[i][:, :, start:end] = k
        cache.values[i][:, :, start:end] = v
        grouped = q.reshape(b, c.num_kv_heads, group * r, c.head_dim)  # [B, kv heads, group·R, D]
        out = F.scaled_dot_product_attention(grouped, cache.keys[i][:, :, :end], cache.values[i][:, :, :end],
                                             attn_mask=mask)
        out = out.reshape(b, c.num_heads, r, c.head_dim).transpose(1, 2)
        x = x + attn.o_proj(out.reshape(b, r, -1))
        x = x + layer.mlp.forward_dense(plain_norm(layer.post_attention_layernorm, x))
    return x


def plain_norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    # torch's own ops, not the runtime's fused kernel: the reference is what plain torch costs.
    return rms_norm_torch(x, norm.weight, norm.eps)


def plain_qk_heads(attn: torch.nn.Module, q: torch.Tensor, k: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the family does to the query and key heads before RoPE (`qk_heads`), in torch's own ops:
    Qwen3 normalises each head, Llama leaves them."""
    if isinstance(attn, Qwen3Attention):
        return plain_norm(attn.q_norm, q), plain_norm(attn.k_norm, k)
    return q, k


def verify_step(model: LlamaForCausalLM, ids: torch.Tensor, cache: DenseCache, start: int) -> torch.Tensor:
    """One reference verify step: the rows' forward, LM head and argmax (as a verify step ends)."""
    return model.lm_head(plain_norm(model.model.norm, forward_rows(model, ids, cache, start))).argmax(-1)


def package_model(directory: Path, dtype: torch.dtype, device: torch.device) -> tuple[LlamaForCausalLM, str]:
    """The target of a generated package (its checkpoint, or its dummy weights), and the deployment's name."""
    from dspark.runtime.models.checkpoint import load_target
    from dspark.runtime.package import load_package

    pkg = load_package(directory)
    model = pkg.deployment.model
    if model.load_format == "dummy":
        return dummy_target(model.geometry, dtype, device, model.family), pkg.deployment.name
    name = next(k for k, v in DTYPES.items() if v == dtype)
    target = load_target(model.checkpoint, name, pkg.directory, model.family)
    return target.to(device).eval(), pkg.deployment.name


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cuda_graph(fn: Callable[[], torch.Tensor], warmup: int) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture `fn` once (after warming it up on a side stream, as capture requires); returns the
    graph's replay and the tensor each replay writes `fn`'s result into."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def time_steps(run: Callable[[], Any], device: torch.device, warmup: int, repeats: int) -> tuple[float, ...]:
    """Wall seconds of `repeats` steps, each between two device synchronisations, after `warmup`."""
    for _ in range(warmup):
        run()
    synchronize(device)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return tuple(seconds)


@dataclass(frozen=True)
class Measurement:
    num_reqs: int
    rows: int
    seconds: tuple[float, ...]

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)

    def to_json(self) -> dict[str, Any]:
        return {"num_reqs": self.num_reqs, "rows": self.rows, "median_seconds": self.median_seconds,
                "seconds": list(self.seconds)}


@dataclass(frozen=True)
class Setup:
    """What was measured, and how (printed above the table and kept in the JSON)."""

    model: str
    parameters: int
    device: str
    dtype: str
    cuda_graphs: bool
    context_len: int
    warmup: int
    repeats: int
    threads: int
    results: list[Measurement] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "parameters": self.parameters, "device": self.device,
                "dtype": self.dtype, "cuda_graphs": self.cuda_graphs, "context_len": self.context_len,
                "warmup": self.warmup, "repeats": self.repeats, "cpu_threads": self.threads,
                "results": [m.to_json() for m in self.results]}


def measure(model: LlamaForCausalLM, batch_sizes: Sequence[int], rows: Sequence[int], context_len: int,
            warmup: int, repeats: int, graphs: bool, seed: int = 0,
            progress: Callable[[str], None] | None = None) -> list[Measurement]:
    """Time every (B, R); one cache per batch size, holding C random tokens and room for max(R) rows."""
    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    generator = torch.Generator().manual_seed(seed)
    cache_generator = torch.Generator(device=device).manual_seed(seed)
    out = []
    with torch.inference_mode():
        for b in batch_sizes:
            cache = DenseCache.allocate(model.cfg, b, context_len + max(rows), dtype, device, cache_generator)
            for r in rows:
                ids = torch.randint(model.cfg.vocab_size, (b, r), generator=generator).to(device)
                step = functools.partial(verify_step, model, ids, cache, context_len)
                run: Callable[[], Any] = cuda_graph(step, warmup)[0] if graphs else step
                out.append(Measurement(b, r, time_steps(run, device, warmup, repeats)))
                if progress is not None:
                    progress(f"B={b} R={r}: {out[-1].median_seconds * 1e3:.3f} ms")
                del run
            del cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


def format_table(setup: Setup) -> str:
    rows = sorted({m.rows for m in setup.results})
    batches = sorted({m.num_reqs for m in setup.results})
    ms = {(m.num_reqs, m.rows): m.median_seconds * 1e3 for m in setup.results}
    how = "CUDA graph replay" if setup.cuda_graphs else "eager"
    threads = f", {setup.threads} CPU threads" if setup.device == "cpu" else ""
    lines = [f"reference forward: {setup.model} ({setup.parameters / 1e6:.1f}M parameters), {setup.device} "
             f"{setup.dtype}, {how}{threads}",
             f"B requests x R new rows after {setup.context_len} cached tokens each (dense KV cache, SDPA); "
             "a step is the forward, LM head and argmax",
             f"ms per step: median of {setup.repeats} synchronised steps after {setup.warmup} warmup steps",
             f"{'B':>6}" + "".join(f"{'R=' + str(r):>11}" for r in rows)]
    for b in batches:
        cells = (f"{ms[b, r]:>11.3f}" if (b, r) in ms else f"{'-':>11}" for r in rows)
        lines.append(f"{b:>6}" + "".join(cells))
    return "\n".join(lines) + "\n"


def positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(values))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--package", type=Path, help="a generated package: time its target checkpoint")
    source.add_argument("--geometry", choices=sorted(GEOMETRIES), help="a geometry with random weights")
    p.add_argument("--batch-sizes", type=positive_ints, default=[1, 8, 32], metavar="B1,B2,...")
    p.add_argument("--rows", type=positive_ints, default=[1, 2, 4, 8], metavar="R1,R2,...",
                   help="new rows per request (default: 1,2,4,8)")
    p.add_argument("--context-len", type=int, default=128, help="cached tokens per request (default: 128)")
    p.add_argument("--repeats", type=int, default=20, help="timed steps per point (default: 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per point (default: 3)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--no-graphs", action="store_true", help="on cuda, run the steps eagerly")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the token ids and the cached K/V")
    p.add_argument("--json", action="store_true", help="print the setup and results as JSON instead")
    args = p.parse_args(argv)
    for flag in ("context_len", "repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be a positive integer")
    if args.warmup < 0:
        p.error("--warmup must be 0 or more")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: this torch sees no CUDA device; use --device cpu")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if use_cuda else "cpu")
    dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.package is not None:
        model, name = package_model(args.package, dtype, device)
    else:
        name = args.geometry
        model = dummy_target(GEOMETRIES[name], dtype, device)
    cfg = model.cfg
    if args.context_len + max(args.rows) > cfg.max_position_embeddings:
        print(f"reference_forward: error: context {args.context_len} + {max(args.rows)} rows exceed the "
              f"model's max_position_embeddings {cfg.max_position_embeddings}", file=sys.stderr)
        return 2
    setup = Setup(model=name, parameters=sum(p.numel() for p in model.parameters()), device=device.type,
                  dtype=str(dtype).removeprefix("torch."),
                  cuda_graphs=device.type == "cuda" and not args.no_graphs,  # graphs need CUDA
                  context_len=args.context_len, warmup=args.warmup, repeats=args.repeats,
                  threads=torch.get_num_threads())
    report = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    setup.results.extend(measure(model, args.batch_sizes, args.rows, args.context_len, args.warmup,
                                 args.repeats, setup.cuda_graphs, args.seed, report))
    if args.json:
        print(json.dumps(setup.to_json(), indent=2))
    else:
        print(format_table(setup), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
