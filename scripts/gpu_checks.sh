#!/usr/bin/env bash
# The GPU checks, for a machine with an NVIDIA GPU and vLLM: the CUDA tests
# (FULL and PIECEWISE CUDA graphs, Model Runner V2 and V1, the batched flavour)
# and the benchmark. Run from the project root:
#   bash scripts/gpu_checks.sh [tests|bench|all] [extra benchmark flags]
# Results land in $OUT (default ./gpu-results): the test log and summary, bench.json.
set -uo pipefail
out="${OUT:-gpu-results}"
what="${1:-all}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# pytest touches CUDA before vLLM starts its workers: forked workers cannot use it.
export VLLM_WORKER_MULTIPROC_METHOD=spawn
status=0
if [[ $what == all || $what == tests ]]; then
  python3 -m pytest -q -s -p no:cacheprovider -k "Cuda or cuda" test_tl_vllm_hooks.py \
    > "$out/gpu-tests.log" 2>&1 || status=1
  grep -E "worst relative error|passed|failed|Error" "$out/gpu-tests.log" | grep -v "^E  " \
    | tee "$out/gpu-tests-summary.txt"
fi
if [[ $what == all || $what == bench ]]; then
  python3 bench_tl_vllm_hooks.py --out "$out/bench.json" "${@:2}" > "$out/bench.log" 2>&1 || status=1
  tail -n 20 "$out/bench.log"
fi
exit $status
