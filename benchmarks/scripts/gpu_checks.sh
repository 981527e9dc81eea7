#!/usr/bin/env bash
# The checks a session with a device machine owes the GPU, one stage per call (each fits the
# device tool's 600 s limit), results under $OUT/<stage>/ (default ./gpu-out):
#
#   bash benchmarks/scripts/gpu_checks.sh tests     # the CUDA-only tests (they skip on CPU, in CI)
#   bash benchmarks/scripts/gpu_checks.sh overhead  # gss bench perf's overhead part, cuda bf16, 135M and 7B shapes
#   bash benchmarks/scripts/gpu_checks.sh solve     # its calibration and solve parts
#   bash benchmarks/scripts/gpu_checks.sh variants  # the steer's variants: error, us per call, generate eager/compiled
#                                                   # (--skip-micro: the generate comparison alone)
#   bash benchmarks/scripts/gpu_checks.sh profile   # torch.profiler of decode steps: host vs GPU time, syncs
#   bash benchmarks/scripts/gpu_checks.sh nnsight   # overhead with the peer library (WHEELS=dir of its wheels)
#   bash benchmarks/scripts/gpu_checks.sh serve-op  # the vLLM plugin's op in CUDA graphs, eager vs replayed
#                                                   # (benchmarks/scripts/vllm_op.py; vLLM itself is not there)
#
# overhead and nnsight take gss bench perf's arguments after the stage's name instead of their
# defaults (overhead: --model benchmarks/configs/llama-2-7b --repeats 9; nnsight: --repeats 5).
# PERF_OUT: the results folder of gss bench perf (default $OUT/<stage>/perf-cuda); name
# results/perf-cuda to add to the committed results, as a run here does.
# Runs from the repository root with the machine's own torch (PYTHONPATH=src, no install).
set -euo pipefail
stage=${1:?"which stage: tests, overhead, solve, variants, profile, nnsight or serve-op"}
shift
out=${OUT:-gpu-out}/$stage
perf_out=${PERF_OUT:-$out/perf-cuda}
mkdir -p "$out"
export PYTHONPATH=$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" || true
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" \
    >> "$out/gpu.txt"

overhead() {  # the overhead part of gss bench perf: the tiny model, the 135M shape, "$@"
    python3 -m gss bench perf --device cuda --dtype bfloat16 --only overhead \
        --model benchmarks/configs/smollm2-135m "$@" --out "$perf_out" --no-progress
}

case $stage in
    tests)
        python3 -m pytest -q -rs -p no:cacheprovider tests/test_device_map.py \
            tests/steering/test_compiled.py tests/steering/test_gated.py \
            tests/steering/test_gated_paths.py tests/artifact/test_stack.py \
            tests/protect/test_search.py tests/inference/test_explain.py \
            tests/serving/test_vllm_op.py \
            2>&1 | tee "$out/tests.log"
        ;;
    overhead)
        [ $# -gt 0 ] || set -- --model benchmarks/configs/llama-2-7b --repeats 9
        overhead "$@" 2>&1 | tee "$out/log.txt"
        ;;
    solve)
        python3 -m gss bench perf --device cuda --dtype bfloat16 --only calibration,solve \
            --out "$perf_out" --no-progress 2>&1 | tee "$out/log.txt"
        ;;
    variants)
        python3 benchmarks/scripts/cuda_steer_variants.py --out "$out" "$@" 2>&1 | tee "$out/log.txt"
        ;;
    profile)
        python3 benchmarks/scripts/cuda_steer_variants.py --profile --out "$out" 2>&1 | tee "$out/log.txt"
        ;;
    nnsight)
        python3 -m pip install -q --no-index --find-links "${WHEELS:?"WHEELS: a folder of the nnsight wheels"}" nnsight
        [ $# -gt 0 ] || set -- --repeats 5
        overhead "$@" 2>&1 | tee "$out/log.txt"
        ;;
    serve-op)
        python3 benchmarks/scripts/vllm_op.py --out "$out" "$@" 2>&1 | tee "$out/log.txt"
        ;;
    *)
        echo "unknown stage $stage: tests, overhead, solve, variants, profile, nnsight or serve-op" >&2
        exit 2
        ;;
esac
