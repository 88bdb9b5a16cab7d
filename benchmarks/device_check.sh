#!/usr/bin/env bash
# One prepared run on a CUDA machine (the device tool lends one for minutes): GPU tests (graph
# capture per tier from the planned layout, CUDA metadata, Triton kernels compiled for real,
# lossless on CUDA), then `dspark profile` of the tiny compact deployment (the tables in
# specs/tables/tiny_h200/) and a static / cap-accept / compact benchmark with the measured table.
# Results land in $OUT (default: runs/device).
#
#   OUT=runs/device benchmarks/device_check.sh
set -uo pipefail
OUT=${OUT:-runs/device}
PY=${PY:-python3}
mkdir -p "$OUT"
if [ -d .whl ]; then  # packages missing on the device image travel as wheels
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/device.txt"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/device.txt"

# The Triton interpreter checks run on the CPU under the pinned triton; a device image may carry
# another triton whose interpreter differs, so they are left out here.
echo "== GPU tests"
"$PY" -m pytest -q -p no:cacheprovider tests/test_runtime_cuda.py tests/test_runtime_kernels.py \
  tests/test_runtime_layout.py tests/test_runtime_metadata.py tests/test_runtime_planner.py \
  tests/test_runtime_device_placement.py -k "not under_interpreter" 2>&1 | tee "$OUT/tests.log" | tail -n 25

echo "== profile (the tiny_h200_compact deployment without a cost model)"
W=$(mktemp -d)
"$PY" - "$W" <<'PYEOF'
import os, sys, yaml
w = sys.argv[1]
base = yaml.safe_load(open("specs/tiny_h200_compact.yaml"))
base.pop("cost_model")
base["calibration"] = {"file": os.path.abspath("specs/tables/tiny_cpu/sts.json")}
def write(name, **changes):
    with open(f"{w}/{name}.yaml", "w") as f:
        yaml.safe_dump({**base, "name": name, **changes}, f, sort_keys=False)
table = {"type": "additive", "file": f"{w}/tables/additive.json"}
write("h200_profile", verify={"mode": "compact", "allow_no_cost_model": True})
write("h200_cap_accept", verify={"mode": "cap-accept"}, cost_model=table)
write("h200_compact", verify={"mode": "compact"}, cost_model=table)
write("h200_compact_aligned", verify={"mode": "compact", "align_to_graph_tier": True}, cost_model=table)
PYEOF
"$PY" -m dspark.cli.compile build "$W/h200_profile.yaml" -o "$W/pkgs/h200_profile"
"$PY" -m dspark.cli.main profile "$W/pkgs/h200_profile" -o "$W/tables" --repeats 5 --grid-density 8 --m-bin 16 \
  --no-progress 2>&1 | tee "$OUT/profile.txt" | tail -n 12
cp "$W"/tables/*.json "$OUT/"

echo "== benchmark: static vs cap-accept vs compact, same prompts, one process"
for name in h200_cap_accept h200_compact h200_compact_aligned; do
  "$PY" -m dspark.cli.compile build "$W/$name.yaml" -o "$W/pkgs/$name" >/dev/null
done
"$PY" -m dspark.cli.compile build specs/tiny_h200_static.yaml -o "$W/pkgs/h200_static" >/dev/null
"$PY" benchmarks/bench_modes.py "$W/pkgs/h200_static" "$W/pkgs/h200_cap_accept" "$W/pkgs/h200_compact" \
  "$W/pkgs/h200_compact_aligned" --prompts 32 --max-new-tokens 128 --rounds 3 \
  2>&1 | tee "$OUT/bench.txt"
