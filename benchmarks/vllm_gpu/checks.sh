#!/usr/bin/env bash
# The last device call (README.md beside this file): once every part is in $PARTS, installs
# vLLM and gss, then runs, in this order, each stage only if it fits before $DEADLINE seconds:
#
#   tests-compiled  tests/vllm's mixed steered/unsteered batch = transformers, CUDA graphs on
#   prep            benchmarks/vllm_throughput.py prep on SmolLM2-135M's shape (random weights)
#   bench-compiled  its bench, vLLM's default torch.compile + CUDA graphs
#   bench-eager     the same with enforce_eager
#   tests-eager     the mixed batch in eager mode
#
# Everything lands in $OUT (log.txt, prep.json, bench-*.json, tests-*.xml); `report` runs here
# afterwards on them: `python benchmarks/vllm_throughput.py report --work DIR --out DIR`.
set -uo pipefail
out=${OUT:-gpu-out}
deadline=${DEADLINE:-560}
work=/tmp/serve-bench
mkdir -p "$out" "$work"
exec > >(tee -a "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1

fits() {  # fits NAME SECONDS: whether a stage of at most SECONDS ends before the deadline
    local left=$((deadline - SECONDS))
    if ((left < $2)); then echo "=== skip $1: ${left} s left, it needs up to $2"; return 1; fi
    echo "=== $1 at +${SECONDS} s"
}
bench() {  # bench MODE ROUNDS
    timeout $((deadline - SECONDS)) python3 benchmarks/vllm_throughput.py bench --mode "$1" \
        --rounds "$2" --work "$work" --gpu-memory-utilization 0.2
    cp "$work/bench-$1.json" "$out/" 2>/dev/null
}
tests() {  # tests KEYWORD
    timeout $((deadline - SECONDS)) python3 -m pytest -x -q -rs -p no:cacheprovider \
        --junitxml="$out/tests-$1.xml" tests/vllm -k "matches_transformers and $1"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
bash benchmarks/vllm_gpu/install_on_device.sh || exit 3
export PYTHONPATH=/tmp/site VLLM_USE_V2_MODEL_RUNNER=0
python3 -c "from vllm import LLM; import vllm.v1.engine.core" || exit 4  # fail fast
fits tests-compiled 200 && tests compiled
fits prep 60 && python3 benchmarks/vllm_throughput.py prep --work "$work" \
    --model benchmarks/configs/smollm2-135m && cp "$work/prep.json" "$out/"
[ -f "$work/prep.json" ] && fits bench-compiled 150 && bench compiled 8
[ -f "$work/prep.json" ] && fits bench-eager 80 && bench eager 8
fits tests-eager 60 && tests eager
echo "=== done at +${SECONDS} s"
