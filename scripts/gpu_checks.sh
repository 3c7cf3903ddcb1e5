#!/usr/bin/env bash
# The GPU checks, for a machine with NVIDIA GPUs and vLLM. Run from the project root:
#   bash scripts/gpu_checks.sh tests [CLASS...]  # CUDA graphs (FULL, PIECEWISE), Model Runner V2 and V1,
#                                         # both flavours, every site of Llama, Gemma 2, Mixtral, Falcon-H1 (a Mamba-2 hybrid) and LFM2, SAEs (TestCudaGraphs TestCudaBatched
#                                         # TestCudaFamilies TestCudaSAEs, or those named: a class or any pytest -k
#                                         # expression); all at once, spread over the GPUs (the tests' engines take
#                                         # their KV cache in bytes, so several share a GPU); TestCudaRay (Ray's
#                                         # executor, staged by scripts/stage_ray.sh) only when named
#   bash scripts/gpu_checks.sh families DIR [--flavours one-prompt]  # scripts/gpu_families.py capture of the
#                                         # tiny models in DIR (made here with its `models` command and carried), one
#                                         # process a family, all at once, packed with their logs as families.tar.xz.*,
#                                         # unpacked and compared here with its `compare`
#   bash scripts/gpu_checks.sh parallel   # tensor and pipeline parallel (two GPUs)
#   bash scripts/gpu_checks.sh bench [flags]     # benchmark, e.g. --cases plain,f,g --rounds 2, or
#                                                # --cases plain,b --repeats 1 --compiled-code "$OUT/code", or
#                                                # --cases plain,a,b,c,d --side-by-side (one process, alternating)
#                                                # --cases plain,b,tl-b,e,tl-e --peer-plugin .tl-peer: beside
#                                                # TransformerLens 4.3's plugin, its four files copied beforehand
#                                                # (the GPU machine has no transformer_lens) on a machine that has it:
#     mkdir .tl-peer && cp "$(python3 -c 'import importlib.util as u; print(u.find_spec("transformer_lens")
#       .submodule_search_locations[0])')"/model_bridge/sources/vllm/{plugin,internals,worker_extension,intervention_specs}.py .tl-peer
#   bash scripts/gpu_checks.sh patching   # examples/activation_patching.py at the 1B shape: its sweep's time
#   bash scripts/gpu_checks.sh bench-tp [flags]  # plain vs compiled capture, tensor parallel 2
# Results land in $OUT (default ./gpu-results): logs, summaries, bench*.json.
set -uo pipefail
out="${OUT:-gpu-results}"
what="${1:-tests}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# pytest touches CUDA before vLLM starts its workers: forked workers cannot use it.
export VLLM_WORKER_MULTIPROC_METHOD=spawn
# All-reduce without NVLink multicast (symmetric memory); NCCL and vLLM's own kernels stay.
export VLLM_ALLREDUCE_USE_SYMM_MEM=0
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
tests() {  # tests LOG_NAME PYTEST_K [GPU_INDEX]
  (if [[ -n ${3:-} ]]; then export CUDA_VISIBLE_DEVICES=$3; fi
   export VLLM_CACHE_ROOT="/tmp/vllm-cache-$1"  # compiled graphs: no two runs write one cache at once
   timeout "${TESTS_TIMEOUT:-3600}" python3 -m pytest -q -s -p no:cacheprovider --basetemp="/tmp/pytest-$1" \
     -k "$2" test_gpu.py > "$out/$1.log" 2>&1)
  local status=$?
  grep -E "worst relative error|routings followed|passed|failed|Error" "$out/$1.log" | grep -v "^E  " \
    > "$out/$1-summary.txt"
  return $status
}
status=0
case "$what" in
  tests)  # the test classes (or -k expressions) named after "tests", or the four; all at once, GPUs round robin;
    # TESTS_TIMEOUT (seconds) cuts each short and still packs the logs
    classes=("${@:2}")
    [[ ${#classes[@]} -gt 0 ]] || classes=(TestCudaGraphs TestCudaBatched TestCudaFamilies TestCudaSAEs)
    pids=()
    for i in "${!classes[@]}"; do
      tests "gpu-tests-${classes[i]//[^A-Za-z0-9_]/_}" "${classes[i]}" "$((i % gpus))" & pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    # one summary and one packed file of logs (a device machine returns few files)
    (cd "$out" && for f in gpu-tests-*-summary.txt; do echo "== ${f%-summary.txt}"; cat "$f"; done \
       > gpu-tests-summary.txt && rm gpu-tests-*-summary.txt &&
     tar -cJf gpu-tests-logs.tar.xz gpu-tests-*.log && rm gpu-tests-*.log)
    cat "$out/gpu-tests-summary.txt" ;;
  families)  # each family in its own process, all at once; FAMILIES_TIMEOUT (seconds) cuts them short and
    # still packs what they wrote
    pids=()
    for family in $(ls "$2"); do
      mkdir -p "/tmp/families/$family" && ln -sfn "$(realpath "$2/$family")" "/tmp/families/$family/$family"
      (export VLLM_CACHE_ROOT="/tmp/vllm-cache-$family"
       timeout "${FAMILIES_TIMEOUT:-3600}" python3 scripts/gpu_families.py capture "/tmp/families/$family" \
         "$out/families" "${@:3}" > "$out/families-$family.log" 2>&1) & pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    grep -hE "tensors|FAILED" "$out"/families-*.log
    mkdir -p "$out/families" && (cd "$out" && tar -cf families/logs.tar families-*.log && rm families-*.log)
    # packed in parts of 15 MiB (a device machine returns few files); unpack with: cat families.tar.xz.* | tar xJ
    tar -C "$out" -cf - families | xz -T0 | split -b 15M - "$out/families.tar.xz." && rm -rf "$out/families" ;;
  parallel)
    tests gpu-tests-parallel "parallel_layout" || status=1
    cat "$out/gpu-tests-parallel-summary.txt" ;;
  bench)
    python3 bench_tl_vllm_hooks.py --out "$out/bench.json" "${@:2}" > "$out/bench.log" 2>&1 || status=1
    tail -n 20 "$out/bench.log" ;;
  patching)  # examples/activation_patching.py at the benchmark's 1B shape (a random bf16 Llama made here): 16 layers
    # x 128 positions, 2,048 patched requests in one generate, beside the same requests unedited
    python3 -c "import bench_tl_vllm_hooks as b; b._make_model('/tmp/patching-model', b._FULL_MODEL)" &&
      python3 examples/activation_patching.py --model /tmp/patching-model --prompt-len 128 --no-compare \
      > "$out/patching.log" 2>&1 || status=1
    grep -A2 "patched requests" "$out/patching.log" ;;
  bench-tp)
    python3 bench_tl_vllm_hooks.py --cases plain,b --tensor-parallel-size 2 --out "$out/bench-tp.json" "${@:2}" \
      > "$out/bench-tp.log" 2>&1 || status=1
    tail -n 12 "$out/bench-tp.log" ;;
  *)
    echo "usage: bash scripts/gpu_checks.sh tests|families|parallel|bench|patching|bench-tp [flags]" >&2
    exit 2 ;;
esac
exit $status
