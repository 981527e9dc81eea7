#!/usr/bin/env bash
# The last device call (README.md beside this file): once every part is in $PARTS, installs
# vLLM and gss, then runs, in this order, each stage only if it fits before $DEADLINE seconds:
#
#   op-tests        tests/serving/test_vllm_op.py: the op and the runner patches without vLLM,
#                   its CUDA tests (the op in a CUDA graph and under reduce-overhead) included
#                   (~30 s)
#   prep            benchmarks/scripts/vllm_throughput.py prep on SmolLM2-135M's shape (random
#                   weights)
#   bench-compiled  its bench, vLLM's default torch.compile + CUDA graphs (at most 240 s)
#   bench-eager     the same with enforce_eager (at most 180 s)
#   op-share        vllm_op_share.py, compiled: each step's forward timed on the device (CUDA
#                   events), one engine after another (~125 s each): OP_SHARE (default "plain
#                   hard hard-torch": without the artifact, serving it with the op's Triton
#                   kernel, serving it with the op's torch form)
#   repeat          repeat.py: are unsteered log-probs bit-reproducible, compiled?
#   repeat-v2       repeat.py --eager --v2: the same through Model Runner V2, eager (200 s on
#                   the 2-core CPU build, where all its log-probs are equal; not timed on a GPU)
#   tests-eager     tests/vllm's mixed steered/unsteered batch = transformers, eager
#   tests-compiled  the same, torch.compile + CUDA graphs
#   tests-v2        the same mixed batch through Model Runner V2, eager and compiled (175 s on
#                   the 2-core CPU; not yet timed on a GPU)
#   tests-bf16      the mixed batch in bfloat16 (FA3 on Hopper), eager and compiled: unsteered
#                   requests bit-identical to vLLM without the plugin (CUDA compiled may not be
#                   reproducible from engine to engine: read its log-prob differences)
#
# STAGES (default: all eleven) names the stages to run, e.g. STAGES="bench-compiled tests-eager";
# prep runs whenever a bench or op-share does. BENCH (default below) is the bench's workload: 64-token
# rounds (vllm_throughput.py's CPU default) were too short on an H200 to resolve 2% (per-round
# ratios 0.64-1.51 on 2026-11-27), hence longer outputs, more load requests. COMPILED_S and
# EAGER_S (240, 180) cap the two benches, engine starts included (~170 s compiled, ~40 s eager).
#
# Everything lands in $OUT (log.txt, prep.json, bench-*.json, repeat-*.json, tests-*.xml);
# `report` runs here afterwards: `python benchmarks/scripts/vllm_throughput.py report --work DIR
# --out DIR`. Timings seen on an H200 (2026-11-26): install ~45 s, prep ~22 s, an eager engine of
# SmolLM2's shape ~8-22 s to start, an eager round ~37 s, tests-compiled ~105 s.
set -uo pipefail
out=${OUT:-gpu-out}
deadline=${DEADLINE:-560}
stages=" ${STAGES:-op-tests prep bench-compiled bench-eager op-share repeat repeat-v2 tests-eager tests-compiled tests-v2 tests-bf16} "
bench_args=${BENCH:---batch1 4 --load 48 --max-tokens 256 --max-tokens-cap 256}
op_share=${OP_SHARE:-plain hard hard-torch}
[[ $stages == *" bench-"* || $stages == *" op-share "* ]] && stages+="prep "
work=/tmp/serve-bench
mkdir -p "$out" "$work"
exec > >(tee -a "$out/log.txt") 2>&1
export PYTHONUNBUFFERED=1

fits() {  # fits NAME SECONDS: whether a stage asked for, of at most SECONDS, ends in time
    [[ $stages == *" $1 "* ]] || return 1
    local left=$((deadline - SECONDS))
    if ((left < $2)); then echo "=== skip $1: ${left} s left, it needs up to $2"; return 1; fi
    echo "=== $1 at +${SECONDS} s"
}
bench() {  # bench MODE SECONDS: rounds until SECONDS are spent (each round is kept)
    local cap=$((deadline - SECONDS)); ((cap > $2)) && cap=$2
    timeout "$cap" python3 benchmarks/scripts/vllm_throughput.py bench --mode "$1" \
        --rounds 12 --work "$work" --gpu-memory-utilization 0.2 $bench_args
    cp "$work/bench-$1.json" "$out/" 2>/dev/null
}
tests() {  # tests NAME KEYWORDS
    timeout $((deadline - SECONDS)) python3 -m pytest -x -q -rs -p no:cacheprovider \
        --junitxml="$out/tests-$1.xml" tests/vllm -k "$2"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
bash benchmarks/vllm_gpu/install_on_device.sh || exit 3
# V1 runner (tests-v2 asks for V2 per engine); the bundle has no flashinfer (a pip-installed vllm
# brings it), whose top-k/top-p sampler vLLM's CUDA runner otherwise imports at start-up
export PYTHONPATH=/tmp/site VLLM_USE_V2_MODEL_RUNNER=0 VLLM_USE_FLASHINFER_SAMPLER=0
python3 -c "from vllm import LLM; import vllm.v1.engine.core" || exit 4  # fail fast
fits op-tests 90 && timeout $((deadline - SECONDS)) python3 -m pytest -x -q -rs \
    -p no:cacheprovider --junitxml="$out/tests-op.xml" tests/serving/test_vllm_op.py
fits prep 40 && python3 benchmarks/scripts/vllm_throughput.py prep --work "$work" \
    --model benchmarks/configs/smollm2-135m && cp "$work/prep.json" "$out/"
[ -f "$work/prep.json" ] && fits bench-compiled 150 && bench compiled "${COMPILED_S:-240}"
[ -f "$work/prep.json" ] && fits bench-eager 120 && bench eager "${EAGER_S:-180}"
if [ -f "$work/prep.json" ] && fits op-share $((125 * $(wc -w <<<"$op_share"))); then
    for engine in $op_share; do  # hard-torch: the op's torch form (GSS_VLLM_TRITON=0)
        kernel=auto && [[ $engine == *-torch ]] && kernel=torch
        timeout $((deadline - SECONDS)) python3 benchmarks/scripts/vllm_op_share.py \
            --mode compiled --work "$work" --artifact "${engine%-torch}" --kernel $kernel --rounds 4 \
            --batch1 2 --load 16 --max-tokens 256 --out "$out/op-share"
    done
fi
fits repeat 200 && timeout $((deadline - SECONDS)) python3 benchmarks/vllm_gpu/repeat.py --out "$out"
fits repeat-v2 150 && timeout $((deadline - SECONDS)) python3 benchmarks/vllm_gpu/repeat.py \
    --eager --v2 --out "$out"
fits tests-eager 80 && tests eager "matches_transformers and eager and not v2"
fits tests-compiled 120 && tests compiled "matches_transformers and compiled and not v2"
fits tests-v2 200 && tests v2 "model_runner_v2"
fits tests-bf16 200 && tests bf16 "bfloat16"
echo "=== done at +${SECONDS} s"
