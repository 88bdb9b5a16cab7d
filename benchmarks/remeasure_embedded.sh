#!/usr/bin/env bash
# Re-measure everything fingerprinted to the embedded pair (dspark/checkpoints/tiny) after it is retrained
# (`dspark train-tiny`), on this CPU, in dependency order:
#   1. the prompt sets (benchmarks/held_out_prompts.py);
#   2. the embedded draft's confidence head refitted for greedy decoding (in place: the published head is
#      trained against 1 - TV(q, p), the sampling event) and its STS file, scored on the held-out set;
#   3. the T 0.8 draft's confidence-head refit (from the embedded draft) and its STS file, scored likewise;
#   4. the cost tables of the greedy tiny CPU specs (tiny_cpu with its context term, _tiers,
#      _dp_attention), then every spec recompiled against them;
#   5. the T 0.8 spec's cost table (tiny_cpu_sampled), then every spec recompiled;
#   6. the simulator's traces and the simulations over the CPU and the H200 8B tables.
# Intermediate builds compile with --allow-stale-tables (they only record or profile; the tables they
# name are the ones being replaced). The figures (`dspark run --compare-target-only`, bench_modes, the
# serving sweep) are measured after this, as docs/results.md says.
#   benchmarks/remeasure_embedded.sh                 # all phases
#   PHASES="2 4 6" benchmarks/remeasure_embedded.sh  # some (here: what the embedded draft's head changes)
set -euo pipefail
cd "$(dirname "$0")/.."
PHASES=${PHASES:-1 2 3 4 5 6}
want() { [[ " $PHASES " == *" $1 "* ]]; }
PY=${PY:-.venv/bin/python}
W=${W:-runs/remeasure}
RES=benchmarks/results
DSPARK="$PY -m dspark.cli.main"
build() { "$PY" -m dspark.cli.compile build "$1" -o "$2" --allow-stale-tables >/dev/null; }
mkdir -p "$W/pkgs"
# PACKAGE, then the run's options: `dspark run --record $W/NAME` unless that recording is complete (a rerun
# of the script resumes after the last one)
record() {
  local pkg=$1 name=$2; shift 2
  [ -f "$W/$name/run.json" ] || $DSPARK run "$pkg" --record "$W/$name" "$@" >/dev/null
}
# a spec variant: SRC, NAME, then python assignments to `s` (the loaded YAML), written to $W/NAME.yaml
variant() {
  "$PY" - "$1" "$2" "$3" "$W" <<'EOF'
import os, sys, yaml
src, name, edits, w = sys.argv[1:5]
s = yaml.safe_load(open(src))
s["name"] = name
for key in ("cost_model", "calibration"):  # file paths relative to the spec, as the loader reads them
    if isinstance(s.get(key), dict) and "file" in s[key]:
        s[key]["file"] = os.path.abspath(os.path.join(os.path.dirname(src), s[key]["file"]))
ckpt = s["draft"].get("checkpoint", "")
if ckpt and ":" not in ckpt:  # a directory relative to the spec
    s["draft"]["checkpoint"] = os.path.abspath(os.path.join(os.path.dirname(src), ckpt))
exec(edits)
yaml.safe_dump(s, open(f"{w}/{name}.yaml", "w"), sort_keys=False)
EOF
  build "$W/$2.yaml" "$W/pkgs/$2"
}

if want 1; then
echo "== 1. prompt sets"
P="$PY benchmarks/held_out_prompts.py"
$P --phases 15,23,31,50,58 -o "$W/prompts_fit.json"
$P --phases 2,10 --exclude "$W/prompts_fit.json" -o "$W/prompts_cal2.json"
$P --phases 70,78,86,94 --exclude "$W/prompts_fit.json" "$W/prompts_cal2.json" -o "$W/prompts_eval2.json"
"$PY" -c "import json,sys; json.dump(json.load(open(sys.argv[1]))[:1200], open(sys.argv[2], 'w'))" \
  "$W/prompts_fit.json" "$W/prompts_fit1200.json"
"$PY" -c "import json; from dspark.corpus import held_out_prompts; json.dump(held_out_prompts(32, 200), open('$W/prompts_sim.json', 'w'))"
fi

T08="--temperature 0.8 --top-p 0.95"
# recordings speculate every step (verify.off: never): the labels are then every step's, not those of the
# steps the planner chose to speculate on
if want 2; then
echo "== 2. the embedded draft's greedy confidence head, its STS file"
variant specs/tiny_cpu_cap_accept.yaml cap_accept 's["verify"]["off"] = "never"'
# the features depend on every draft weight but the head's, so a rerun after the refit records the same ones
record "$W/pkgs/cap_accept" fit_greedy --prompts-file "$W/prompts_fit.json" --max-new-tokens 128 --record-features
rm -rf "$W/draft_greedy"
{ echo "\$ .venv/bin/dspark fit-confidence runs/fit_greedy/sts --draft dspark/checkpoints/tiny/draft -o runs/draft_greedy   # runs/fit_greedy: dspark run <tiny_cpu_cap_accept with verify.off: never> --prompts-file runs/prompts_fit.json --max-new-tokens 128 --record runs/fit_greedy --record-features; then the head copied into dspark/checkpoints/tiny/draft"
  $DSPARK fit-confidence "$W/fit_greedy/sts" --draft dspark/checkpoints/tiny/draft -o "$W/draft_greedy"; } \
  2>&1 | tee "$RES/cpu_tiny_confidence_fit_greedy.txt"
cp "$W/draft_greedy/model.safetensors" "$W/draft_greedy/confidence_fit.json" dspark/checkpoints/tiny/draft/
build "$W/cap_accept.yaml" "$W/pkgs/cap_accept"  # the package records the draft's digest
record "$W/pkgs/cap_accept" cal2 --prompts-file "$W/prompts_cal2.json" --max-new-tokens 128
{ echo "\$ .venv/bin/dspark calibrate runs/cal2/sts -o specs/tables/tiny_cpu/sts.json   # runs/cal2: dspark run <tiny_cpu_cap_accept with verify.off: never> --prompts-file runs/prompts_cal2.json --max-new-tokens 128 --record runs/cal2"
  $DSPARK calibrate "$W/cal2/sts" -o specs/tables/tiny_cpu/sts.json; } 2>&1 | tee "$RES/cpu_tiny_sts_fit.txt"
record "$W/pkgs/cap_accept" eval2 --prompts-file "$W/prompts_eval2.json" --max-new-tokens 128
{ echo "\$ .venv/bin/dspark report runs/eval2 --calibration specs/tables/tiny_cpu/sts.json   # runs/eval2: dspark run <tiny_cpu_cap_accept with verify.off: never> --prompts-file runs/prompts_eval2.json --max-new-tokens 128 --record runs/eval2"
  $DSPARK report "$W/eval2" --calibration specs/tables/tiny_cpu/sts.json -o "$W/report_eval2"; } \
  2>&1 | tee "$RES/cpu_tiny_sts_held_out.txt"
grep -A10 "^| position" "$W/report_eval2/report.md" | tee -a "$RES/cpu_tiny_sts_held_out.txt"
fi

if want 3; then
echo "== 3. the T 0.8 draft's confidence head, its STS file"
variant specs/tiny_cpu_cap_accept.yaml cap_accept 's["verify"]["off"] = "never"'
record "$W/pkgs/cap_accept" fit_t08 --prompts-file "$W/prompts_fit1200.json" --max-new-tokens 128 $T08 --record-features
rm -rf specs/checkpoints/tiny_draft_t08
{ echo "\$ .venv/bin/dspark fit-confidence runs/fit_t08/sts --draft dspark/checkpoints/tiny/draft -o specs/checkpoints/tiny_draft_t08   # runs/fit_t08: dspark run <tiny_cpu_cap_accept with verify.off: never> --prompts-file <first 1200 of runs/prompts_fit.json> --max-new-tokens 128 $T08 --record runs/fit_t08 --record-features"
  $DSPARK fit-confidence "$W/fit_t08/sts" --draft dspark/checkpoints/tiny/draft -o specs/checkpoints/tiny_draft_t08; } \
  2>&1 | tee "$RES/cpu_tiny_confidence_fit_t08.txt"
variant specs/tiny_cpu_cap_accept.yaml cap_accept_t08 \
  's["draft"]["checkpoint"] = os.path.abspath("specs/checkpoints/tiny_draft_t08"); s.pop("calibration", None); s["verify"]["off"] = "never"'
record "$W/pkgs/cap_accept_t08" cal2_t08 --prompts-file "$W/prompts_cal2.json" --max-new-tokens 128 $T08
{ echo "\$ .venv/bin/dspark calibrate runs/cal2_t08/sts -o specs/tables/tiny_cpu/sts_sample_t08_p095.json   # runs/cal2_t08: dspark run <tiny_cpu_cap_accept with draft specs/checkpoints/tiny_draft_t08, verify.off: never> --prompts-file runs/prompts_cal2.json --max-new-tokens 128 $T08 --record runs/cal2_t08"
  $DSPARK calibrate "$W/cal2_t08/sts" -o specs/tables/tiny_cpu/sts_sample_t08_p095.json; } 2>&1 | tee "$RES/cpu_tiny_sts_fit_t08.txt"
record "$W/pkgs/cap_accept_t08" eval2_t08 --prompts-file "$W/prompts_eval2.json" --max-new-tokens 128 $T08
{ echo "\$ .venv/bin/dspark report runs/eval2_t08 --calibration specs/tables/tiny_cpu/sts_sample_t08_p095.json   # the same prompts, $T08, the T 0.8 draft"
  $DSPARK report "$W/eval2_t08" --calibration specs/tables/tiny_cpu/sts_sample_t08_p095.json -o "$W/report_eval2_t08"; } \
  2>&1 | tee "$RES/cpu_tiny_sts_held_out_t08.txt"
grep -A10 "^| position" "$W/report_eval2_t08/report.md" | tee -a "$RES/cpu_tiny_sts_held_out_t08.txt"
fi

if want 4; then
echo "== 4. the greedy specs' cost tables, then every spec recompiled"
build specs/tiny_cpu_compact.yaml "$W/pkgs/compact"
{ echo "\$ .venv/bin/dspark profile generated/tiny_cpu_compact -o specs/tables/tiny_cpu --m-bin 16 --repeats 21 --context-len 128,512,900"
  $DSPARK profile "$W/pkgs/compact" -o specs/tables/tiny_cpu --m-bin 16 --repeats 21 --context-len 128,512,900 \
    --no-progress; } 2>&1 | tee "$RES/cpu_tiny_profile.txt"
build specs/tiny_cpu_compact_tiers.yaml "$W/pkgs/compact_tiers"
{ echo "\$ .venv/bin/dspark profile generated/tiny_cpu_compact_tiers -o specs/tables/tiny_cpu_tiers --m-bin 16 --repeats 21"
  $DSPARK profile "$W/pkgs/compact_tiers" -o specs/tables/tiny_cpu_tiers --m-bin 16 --repeats 21 --no-progress; } 2>&1 \
  | tee "$RES/cpu_tiny_tiers_profile.txt"
build specs/tiny_cpu_compact_dp_attention.yaml "$W/pkgs/dp_attention"
{ echo "\$ torchrun --nproc-per-node 2 -m dspark.cli.main profile generated/tiny_cpu_compact_dp_attention -o specs/tables/tiny_cpu_dp_attention --repeats 9 --m-bin 16"
  PYTHONPATH=$PWD .venv/bin/torchrun --nproc-per-node 2 -m dspark.cli.main profile "$W/pkgs/dp_attention" \
    -o specs/tables/tiny_cpu_dp_attention --repeats 9 --m-bin 16 --no-progress; } 2>&1 \
  | tee "$RES/cpu_tiny_dp_attention_profile.txt"
for f in specs/*.yaml; do "$PY" -m dspark.cli.compile build "$f" >/dev/null; done
fi

if want 5; then
echo "== 5. the T 0.8 spec's cost table, then every spec recompiled"
build specs/tiny_cpu_compact_sampled.yaml "$W/pkgs/compact_sampled"
{ echo "\$ .venv/bin/dspark profile generated/tiny_cpu_compact_sampled -o specs/tables/tiny_cpu_sampled --m-bin 16 --repeats 21"
  $DSPARK profile "$W/pkgs/compact_sampled" -o specs/tables/tiny_cpu_sampled --m-bin 16 --repeats 21 --no-progress; } 2>&1 \
  | tee "$RES/cpu_tiny_sampled_profile.txt"
for f in specs/*.yaml; do "$PY" -m dspark.cli.compile build "$f" >/dev/null; done
fi

if want 6; then
echo "== 6. traces and simulations"
rm -rf "$RES/cpu_tiny_simulate_trace_greedy" "$RES/cpu_tiny_simulate_trace_t08"
record generated/tiny_cpu_static trace_greedy --prompts-file "$W/prompts_sim.json" --max-new-tokens 128
variant specs/tiny_cpu_compact_sampled.yaml tiny_cpu_static_sampled \
  's["verify"] = {"mode": "static"}; s.pop("cost_model", None); s.pop("calibration", None)'
record "$W/pkgs/tiny_cpu_static_sampled" trace_t08 --prompts-file "$W/prompts_sim.json" --max-new-tokens 128
for t in greedy t08; do
  mkdir -p "$RES/cpu_tiny_simulate_trace_$t"
  cp "$W/trace_$t/run.json" "$W/trace_$t/steps.jsonl" "$RES/cpu_tiny_simulate_trace_$t/"
done
sim() {  # NAME PACKAGE TRACE [dspark simulate options]
  local name=$1 pkg=$2 trace=$3; shift 3
  $DSPARK simulate "$pkg" --trace "$RES/cpu_tiny_simulate_trace_$trace" "$@" | tee "$RES/$name.txt"
  $DSPARK simulate "$pkg" --trace "$RES/cpu_tiny_simulate_trace_$trace" "$@" --json --plot "$RES/$name.png" \
    > "$RES/$name.json"
}
L8B=specs/tables/llama31_8b_h200_compact
sim cpu_tiny_simulate_greedy generated/tiny_cpu_compact greedy
sim cpu_tiny_simulate_t08 generated/tiny_cpu_compact_sampled t08
sim cpu_tiny_simulate_greedy_tiers generated/tiny_cpu_compact_tiers greedy --cost-model specs/tables/tiny_cpu_tiers/tier.json
sim h200_l8b_simulate_greedy generated/tiny_cpu_compact greedy --cost-model $L8B/tier.json --concurrency 1,8,32,64,128
sim h200_l8b_simulate_greedy_additive generated/tiny_cpu_compact greedy --cost-model $L8B/additive.json \
  --concurrency 1,8,32,64,128
sim h200_l8b_simulate_t08 generated/tiny_cpu_compact_sampled t08 --cost-model $L8B/tier.json --concurrency 1,8,32,64,128
fi
