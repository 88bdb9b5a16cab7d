#!/usr/bin/env bash
# One prepared run on a CUDA machine. The device tool lends one for 15 minutes a task and stops a
# command at 10, so the phases run most important first, each under its own time limit (about 9
# minutes together; run it with timeout_s 600), and the results are saved to $OUT after every
# phase (a run stopped early still brings back what it did):
#   1. the GPU tests (the Triton paged-attention kernel against its reference, graph replay from the
#      planned layout, lossless decoding on CUDA);
#   2. the Llama-3.1-8B geometry with dummy weights: its static and compact builds' verify steps and
#      the plain-torch reference forward of the same rows, interleaved in one run at B = 1, 8, 32,
#      64, 128 (benchmarks/bench_verify_step.py);
#   3. the kernels of the 8B static and compact steps beside the reference forward's
#      (benchmarks/kernel_breakdown.py): where a gap to the reference is spent;
#   4. `dspark profile` of both 8B builds at those batch sizes and B = 256 (the tables for
#      specs/tables/) and their point-by-point comparison;
#   5. the tiny H200 deployment's profile (with the draft-time term) and a static / cap-accept /
#      compact benchmark;
#   6. only where flashinfer-python imports: the FlashInfer GPU tests and the 8B compact build with
#      `backend.attention: flashinfer` as the anchor of the Triton compact build, in one run;
#   7. issue 23: the tiny H200 build's draft step, dense, paged (Triton) and in its graphs, beside its decode and
#      verify steps; the 8B compact build with a 5-layer dummy draft profiled (draft and decode terms;
#      phase 4's has 1 layer), and both 8B tables through `dspark simulate` on the embedded greedy trace
#      (target-only, every fixed k, adaptive with its off state) at c = 1 … 256.
# Everything lands in $RES, packed into $OUT/device_results.tgz with the main logs beside it (the
# device tool brings back at most 8 files).
#
# PHASES picks phases (default all), so a short first call can check the GPU tests before the
# measurements are spent on a build that fails:
#   OUT=runs/device benchmarks/device_check.sh
#   PHASES="2 3 4 5 6" OUT=runs/device benchmarks/device_check.sh
set -uo pipefail
OUT=${OUT:-runs/device}
PHASES=${PHASES:-1 2 3 4 5 6 7}
want() { [[ " $PHASES " == *" $1 "* ]]; }
PY=${PY:-python3}
mkdir -p "$OUT"
RES=$(mktemp -d)
if [ -d .whl ]; then  # packages missing on the device image travel as wheels
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1

save() {  # after every phase: what is done so far comes back even if a later phase is stopped
  tar -czf "$OUT/device_results.tgz" -C "$RES" .
  for f in tests.log l8b_steps.txt l8b_kernels.txt l8b_compare.txt tiny_bench.txt; do
    [ -f "$RES/$f" ] && cp "$RES/$f" "$OUT/"
  done
}

nvidia-smi -L | tee "$RES/device.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$RES/device.txt"

# The Triton interpreter checks run on the CPU under the pinned triton; a device image may carry
# another triton whose interpreter differs, so they are left out here.
if want 1; then
echo "== 1. GPU tests"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_runtime_paged_attention.py \
  tests/test_runtime_cuda.py tests/test_runtime_kernels.py tests/test_runtime_layout.py tests/test_runtime_metadata.py \
  tests/test_runtime_graph_buffers.py tests/test_runtime_device_placement.py tests/test_train_draft.py \
  tests/test_dsv4_attention_kernel.py tests/test_dsv4_cuda_layers_gpu.py tests/test_dsv4_fp8.py \
  -k "not under_interpreter" \
  2>&1 | tee "$RES/tests.log" | tail -n 25
# The CPU exactness checks on this machine's host CPU, another x86 model than the developers'
# (docs/exactness.md), in the same call.
lscpu | grep -m1 "Model name" | tee -a "$RES/tests.log"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/test_runtime_invariance.py \
  tests/test_invariance_kernel_selections.py -k "not emulated" 2>&1 | tee -a "$RES/tests.log" | tail -n 5
save
fi

W=$(mktemp -d)
"$PY" - "$W" <<'PYEOF'
import os, sys, yaml
w = sys.argv[1]
def write(base, name, **changes):
    spec = yaml.safe_load(open(base))
    spec.pop("cost_model", None)
    for section, values in changes.items():
        spec[section] = {**spec.get(section, {}), **values} if isinstance(values, dict) else values
    with open(f"{w}/{name}.yaml", "w") as f:
        yaml.safe_dump({**spec, "name": name}, f, sort_keys=False)
# Llama-3.1-8B geometry with dummy weights, up to B = 256 (tiers up to 256 x N = 2048 rows: `dspark
# simulate` prices concurrency 256 only from a table that reaches it); a KV pool of 40960 tokens holds
# 256 requests of context 128 + N (5.4 GB), so two builds and the reference fit at once.
dummy = {"model": {"load_format": "dummy"}, "draft": {"load_format": "dummy", "num_layers": 1},
         "serving": {"max_running_requests": 256, "max_context_len": 1024, "max_total_tokens": 40960}}
write("specs/llama31_8b_h200_static.yaml", "l8b_static", **dummy,
      graph={"enabled": True, "capture_batch_sizes": [1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256],
             "token_tiers": []})
compact_tiers = {"enabled": True, "capture_batch_sizes": [],
                 "token_tiers": [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 640, 768, 896, 1024, 1280,
                                 1536, 1792, 2048]}
write("specs/llama31_8b_h200_compact.yaml", "l8b_compact", **dummy, graph=compact_tiers)
write("specs/llama31_8b_h200_flashinfer.yaml", "l8b_flashinfer", **dummy, graph=compact_tiers)
dummy5 = {**dummy, "draft": {"load_format": "dummy", "num_layers": 5}}
write("specs/llama31_8b_h200_compact.yaml", "l8b_compact_d5", **dummy5, graph=compact_tiers)
# The tiny deployment on the H200: a compact build without a table (to profile), and the builds to compare.
tiny = yaml.safe_load(open("specs/tiny_h200_compact.yaml"))
calibration = {"file": os.path.abspath("specs/tables/tiny_cpu/sts.json")}
table = {"type": "additive", "file": f"{w}/tiny_tables/additive.json"}
for name, verify, cost in [("h200_profile", {"mode": "compact", "allow_no_cost_model": True}, None),
                           ("h200_cap_accept", {"mode": "cap-accept"}, table),
                           ("h200_compact", {"mode": "compact"}, table),
                           ("h200_compact_aligned", {"mode": "compact", "align_to_graph_tier": True}, table)]:
    spec = {**tiny, "name": name, "verify": verify, "calibration": calibration}
    spec.pop("cost_model", None)
    if cost:
        spec["cost_model"] = cost
    with open(f"{w}/{name}.yaml", "w") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
PYEOF

if want 2 || want 3 || want 4; then
for name in l8b_static l8b_compact; do
  "$PY" -m dspark.cli.compile build "$W/$name.yaml" -o "$W/pkgs/$name" >/dev/null
done
fi
if want 2; then
echo "== 2. 8B geometry, dummy weights: static, compact and the reference forward interleaved"
timeout 150 "$PY" benchmarks/bench_verify_step.py "$W/pkgs/l8b_static" "$W/pkgs/l8b_compact" \
  --batch-sizes 1,8,32,64,128 --fractions 0.125,0.25,0.5,1 --reference --repeats 10 2>&1 | tee "$RES/l8b_steps.txt"
save
fi

if want 3; then
echo "== 3. where the 8B steps spend their time: kernels of static and compact steps beside the reference"
for name in l8b_static l8b_compact; do
  points=$([ $name = l8b_static ] && echo 1:8,128:1024 || echo 1:1,1:8,32:32,128:128)
  timeout 60 "$PY" benchmarks/kernel_breakdown.py "$W/pkgs/$name" --points $points --reference --top 14 2>&1 \
    | grep -v USDT | tee -a "$RES/l8b_kernels.txt"
done
save
fi
if want 4; then
echo "== 4. 8B geometry: profiles of both builds (the tables) and their comparison"
for name in l8b_static l8b_compact; do
  timeout 120 "$PY" -m dspark.cli.main profile "$W/pkgs/$name" -o "$RES/$name" --batch-sizes 1,8,32,64,128,256 \
    --context-len 128 --repeats 5 --warmup 2 --grid-density 6 --m-bin 64 --no-progress 2>&1 \
    | tee "$RES/$name.profile.txt" | tail -n 8
done
"$PY" benchmarks/compare_profiles.py "$RES/l8b_static" "$RES/l8b_compact" 2>&1 | tee "$RES/l8b_compare.txt"
save
fi

if want 5; then
echo "== 5. tiny H200 deployment: profile with the draft term, then static vs cap-accept vs compact"
"$PY" -m dspark.cli.compile build "$W/h200_profile.yaml" -o "$W/pkgs/h200_profile" >/dev/null
timeout 45 "$PY" -m dspark.cli.main profile "$W/pkgs/h200_profile" -o "$W/tiny_tables" --repeats 5 \
  --grid-density 8 --m-bin 16 --no-progress 2>&1 | tee "$RES/tiny_profile.txt" | tail -n 6
mkdir -p "$RES/tiny_tables" && cp "$W"/tiny_tables/*.json "$RES/tiny_tables/"
for name in h200_cap_accept h200_compact h200_compact_aligned; do
  "$PY" -m dspark.cli.compile build "$W/$name.yaml" -o "$W/pkgs/$name" >/dev/null
done
"$PY" -m dspark.cli.compile build specs/tiny_h200_static.yaml -o "$W/pkgs/h200_static" >/dev/null
timeout 60 "$PY" benchmarks/bench_modes.py "$W/pkgs/h200_static" "$W/pkgs/h200_cap_accept" \
  "$W/pkgs/h200_compact" "$W/pkgs/h200_compact_aligned" --prompts 32 --max-new-tokens 128 --rounds 3 2>&1 \
  | tee "$RES/tiny_bench.txt"
save
fi

if ! want 6; then
  :
elif "$PY" -c "import flashinfer" 2>/dev/null; then
  echo "== 6. FlashInfer: its GPU tests, then the 8B compact build against it"
  timeout 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_runtime_flashinfer.py \
    tests/test_runtime_flashinfer_gpu.py 2>&1 | tee "$RES/flashinfer_tests.log" | tail -n 8
  "$PY" -m dspark.cli.compile build "$W/l8b_flashinfer.yaml" -o "$W/pkgs/l8b_flashinfer" >/dev/null
  timeout 120 "$PY" benchmarks/bench_verify_step.py "$W/pkgs/l8b_static" "$W/pkgs/l8b_compact" \
    --anchor "$W/pkgs/l8b_flashinfer" --batch-sizes 1,8,32,128 --fractions 0.25,0.5,1 --repeats 7 2>&1 \
    | tee "$RES/l8b_flashinfer_steps.txt"
  save
else
  echo "== 6. skipped: flashinfer-python is not installed here" | tee "$RES/flashinfer_skipped.txt"
fi
if want 7; then
echo "== 7. issue 23: the tiny draft step on CUDA; 8B with 1- and 5-layer drafts through dspark simulate"
[ -d "$W/pkgs/h200_profile" ] || "$PY" -m dspark.cli.compile build "$W/h200_profile.yaml" -o "$W/pkgs/h200_profile" >/dev/null
timeout 60 "$PY" benchmarks/bench_draft_step.py "$W/pkgs/h200_profile" --batch-sizes 1,4,16,32 2>&1 \
  | tee "$RES/tiny_draft_step.txt"
"$PY" -m dspark.cli.compile build "$W/l8b_compact_d5.yaml" -o "$W/pkgs/l8b_compact_d5" >/dev/null
timeout 120 "$PY" -m dspark.cli.main profile "$W/pkgs/l8b_compact_d5" -o "$RES/l8b_compact_d5" \
  --batch-sizes 1,8,32,64,128,256 --context-len 128 --repeats 5 --warmup 2 --grid-density 6 --m-bin 64 \
  --no-progress 2>&1 | tee "$RES/l8b_compact_d5.profile.txt" | tail -n 8
for d in l8b_compact l8b_compact_d5; do
  [ -f "$RES/$d/tier.json" ] && timeout 60 "$PY" -m dspark.cli.main simulate generated/tiny_cpu_compact \
    --trace benchmarks/results/cpu_tiny_simulate_trace_greedy --cost-model "$RES/$d/tier.json" \
    --concurrency 1,8,32,64,128,256 2>&1 | tee "$RES/$d.simulate.txt" | grep "adaptive / "
done
save
fi
ls "$OUT"
