#!/usr/bin/env bash
# ONE GPU check (issues 18 and 17), under 10 minutes on an H200, in five parts, each inside its
# own time budget (`timeout`), each writing its log (then appended to parts.log) and its results
# file under the output folder:
#
#   1. kernel tests, compiled: tests/test_verify_attention.py runs the Triton kernel with
#      interpret=False on a GPU (its default there); tests/test_tpu_kernel.py checks the TPU
#      kernel in interpret mode and its Mosaic lowering           -> 1_kernel_tests.log
#   2. greedy equality of every drafter on the GPU (suffix, draft model, layerskip, the learned
#      heads eagle3 / medusa / mtp / dflash / dspark, ngram; and of int8 / int4 / fp8 targets),
#      the tiny target's attention through the compiled Pallas kernel
#      (SPECJAX_TEST_ATTENTION_IMPL=pallas)
#                                                                  -> 2_greedy.log
#   3. benchmarks/gpu_verify_attention.py (kernel vs XLA vs jax's gqa, ceilings measured)
#                                             -> 3_verify_attention.log, gpu_verify_attention.{json,md}
#   4. benchmarks/gpu_spec_system.py (forced acceptance on an 8B-shaped target; B 1, 16 and
#      D 1, 3, 7 to fit its budget)           -> 4_spec_system.log, gpu_spec_system.json
#   5. benchmarks/gpu_quant.py (issue 17: bf16 / int8 / fp8 / int4 targets of the 8B shape, the
#      decode step against the bandwidth floor and the weight copies in the layer loop)
#                                             -> 5_quant.log, gpu_quant.json
#
# and summary.md: one row per part (status, wall time, budget, headline). A part's log is
# appended to parts.log once the part ends (and removed), so the folder holds at most 8 files
# while a part runs (the device tool brings back at most 8): summary.md, parts.log, the running
# part's log, gpu_verify_attention.{json,md}, gpu_spec_system.json, gpu_quant.json. A part that
# fails or runs out of budget is recorded and the next one still runs; the exit status is 1 if
# any part failed.
#
#   benchmarks/gpu_suite.sh [--out DIR] [--only 1,2,3,4,5] # on the GPU machine
#   benchmarks/gpu_suite.sh --smoke [--out DIR]             # CPU, interpret mode, tiny sizes
#   benchmarks/gpu_suite.sh --dry-run ...                   # print the parts, run nothing
#
# SUITE_BUDGETS="S1 S2 S3 S4 S5" overrides the parts' budgets (seconds). Output folder: --out, else $OUT, else benchmarks/results/gpu_suite_<UTC date>. Python: $PYTHON,
# else .venv/bin/python if present, else python3. On the GPU machine (jax 0.11.2, Python 3.12,
# no network) specjax is installed from this tree with `pip install --no-deps
# --no-build-isolation -e .` when it does not import; the image lacks `gguf` and `qwix` (pure
# Python): `bash benchmarks/gpu_wheels.sh` puts their wheels in .whl/ and prints the device
# command that installs them (carry .whl, PYTHONPATH=/tmp/site).
set -uo pipefail

cd "$(dirname "$0")/.."
SMOKE=0 DRY=0 ONLY="1,2,3,4,5" OUT_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) SMOKE=1 ;;
    --dry-run) DRY=1 ;;
    --only) ONLY="$2"; shift ;;
    --out) OUT_DIR="$2"; shift ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) echo "gpu_suite.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
OUT_DIR="${OUT_DIR:-${OUT:-benchmarks/results/gpu_suite_$(date -u +%Y%m%d)}}"
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
mkdir -p "$OUT_DIR"
ROWS="$(mktemp)"  # part \t status \t wall s \t budget s \t file \t headline (not under OUT_DIR)
trap 'rm -f "$ROWS"' EXIT

if [ "$SMOKE" = 1 ]; then
  MODE="smoke (CPU, interpret mode, tiny sizes)"
  KERNEL_SEL=(tests/test_verify_attention.py tests/test_tpu_kernel.py
              -k "G1-T1 or tiling or dispatch")
  GREEDY_SEL=(tests/test_drafters.py -k "greedy_speculative and suffix and chain")
  GREEDY_IMPL=auto
  VA_ARGS=(--smoke --no-e2e --budget-s 5)
  SS_ARGS=(--smoke --batch-sizes 1 --draft-lengths 1 --max-new-tokens 16 --no-step-profile)
  QUANT_ARGS=(--smoke)
  BUDGETS=(120 120 120 120 120)
  VA_RESULT=gpu_verify_attention_smoke.md SS_RESULT=gpu_spec_system_smoke.json
  QUANT_RESULT=gpu_quant_smoke.json
else
  MODE="full (GPU, compiled kernels)"
  KERNEL_SEL=(tests/test_verify_attention.py tests/test_tpu_kernel.py)
  GREEDY_SEL=(tests/test_drafters.py::test_greedy_speculative_equals_plain_greedy
              tests/test_learned_drafters.py::test_greedy_equals_plain_greedy
              tests/test_one_call_api.py::test_every_form_of_draft_is_greedy_exact
              tests/test_quant.py::test_greedy_speculative_equals_plain_greedy_of_the_int8_target
              tests/test_quant.py::test_greedy_speculative_equals_plain_greedy_of_int4_and_fp8_targets)
  GREEDY_IMPL=pallas
  VA_ARGS=(--budget-s 100)
  SS_ARGS=(--batch-sizes 1,16 --draft-lengths 1,3,7)
  QUANT_ARGS=()
  BUDGETS=(90 130 110 120 90)  # 540 s of parts: inside 10 minutes with the setup
  VA_RESULT=gpu_verify_attention.md SS_RESULT=gpu_spec_system.json
  QUANT_RESULT=gpu_quant.json
fi

# run_part NUMBER NAME BUDGET_S LOG RESULT_FILE CMD...: one part under `timeout`, one row
run_part() {
  local number="$1" name="$2" budget="$3" log="$4" result="$5"; shift 5
  case ",$ONLY," in *",$number,"*) ;; *) return 0 ;; esac
  if [ "$DRY" = 1 ]; then
    echo "[$number] $name (budget ${budget} s): $*"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$number. $name" "dry-run" "-" "$budget" "$result" "$*" >>"$ROWS"
    return 0
  fi
  echo "[$number] $name (budget ${budget} s) -> $OUT_DIR/$log" >&2
  local start rc status headline
  start=$(date +%s)
  timeout --kill-after=10 "$budget" "$@" >"$OUT_DIR/$log" 2>&1
  rc=$?
  { echo "===== $number. $name: $log (rc $rc) ====="; cat "$OUT_DIR/$log"; } >>"$OUT_DIR/parts.log"
  case $rc in 0) status=ok ;; 124|137) status="timeout (${budget} s)" ;; *) status="failed (rc $rc)" ;; esac
  [ $rc -eq 0 ] || FAILED=1
  headline=$(grep -E "^=*.* (passed|failed|error)|^# |efficiency|Error" "$OUT_DIR/$log" | tail -1 | tr '\t|' '  ')
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$number. $name" "$status" "$(( $(date +%s) - start ))" \
    "$budget" "$result" "${headline:-$(tail -1 "$OUT_DIR/$log" | tr '\t|' '  ')}" >>"$ROWS"
  rm -f "$OUT_DIR/$log"  # kept in parts.log
}

FAILED=0
if [ "$DRY" = 0 ]; then
  if ! "$PY" -c "import specjax" 2>/dev/null; then
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || { echo "gpu_suite.sh: cannot install specjax" >&2; exit 1; }
    MISSING=$("$PY" -c "import specjax" 2>&1 | grep -o "No module named '[^']*'")
    [ -z "$MISSING" ] || { echo "gpu_suite.sh: $MISSING: carry its wheel (see the header)" >&2; exit 1; }
  fi
  DEVICE=$("$PY" -c "import jax; d = jax.devices()[0]; print(f'{jax.default_backend()}: {getattr(d, \"device_kind\", d)}, jax {jax.__version__}')" 2>&1 | tail -1)
  if [ "$SMOKE" = 0 ] && [[ "$DEVICE" != gpu:* ]]; then
    echo "gpu_suite.sh: no GPU ($DEVICE); use --smoke on a CPU" >&2; exit 1
  fi
else
  DEVICE="(dry run)"
fi
if [ -n "${SUITE_BUDGETS:-}" ]; then  # e.g. "90 130 110 120 90"
  read -r -a BUDGETS <<<"$SUITE_BUDGETS"
  if [ "${#BUDGETS[@]}" -ne 5 ]; then
    echo "gpu_suite.sh: SUITE_BUDGETS needs 5 budgets in seconds, one a part (got '$SUITE_BUDGETS')" >&2; exit 2
  fi
fi
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts="")

run_part 1 "kernel tests" "${BUDGETS[0]}" 1_kernel_tests.log parts.log \
  "${PYTEST[@]}" "${KERNEL_SEL[@]}"
run_part 2 "greedy equality, every drafter" "${BUDGETS[1]}" 2_greedy.log parts.log \
  env SPECJAX_TEST_ATTENTION_IMPL="$GREEDY_IMPL" "${PYTEST[@]}" "${GREEDY_SEL[@]}"
run_part 3 "verify attention benchmark" "${BUDGETS[2]}" 3_verify_attention.log "$VA_RESULT" \
  "$PY" benchmarks/gpu_verify_attention.py --out "$OUT_DIR" "${VA_ARGS[@]}"
run_part 4 "spec system benchmark" "${BUDGETS[3]}" 4_spec_system.log "$SS_RESULT" \
  "$PY" benchmarks/gpu_spec_system.py --out "$OUT_DIR" "${SS_ARGS[@]}"
run_part 5 "quantized targets benchmark" "${BUDGETS[4]}" 5_quant.log "$QUANT_RESULT" \
  "$PY" benchmarks/gpu_quant.py --out "$OUT_DIR" "${QUANT_ARGS[@]}"

{
  echo "# GPU suite — $(date -u +%Y-%m-%dT%H:%MZ), $MODE"
  echo
  echo "Device: $DEVICE. Commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
  echo
  echo "| part | status | wall s | budget s | results | headline |"
  echo "| --- | --- | --- | --- | --- | --- |"
  while IFS=$'\t' read -r part status wall budget result headline; do
    echo "| $part | $status | $wall | $budget | \`$result\` | $headline |"
  done <"$ROWS"
} >"$OUT_DIR/summary.md"
cat "$OUT_DIR/summary.md"
exit $FAILED
