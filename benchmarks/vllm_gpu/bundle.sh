#!/usr/bin/env bash
# Builds .vllm-gpu/part-NN: one xz-compressed tar, in chunks, of vLLM 0.26.0 (CUDA 13, torch 2.11)
# and the wheels it needs at import time that the device's image lacks, for a device machine
# with no network (README.md beside this file). Runs here, from the repository root:
#
#   bash benchmarks/vllm_gpu/bundle.sh
#
# WHEEL: the vllm wheel (default /tmp/vw/..., else downloaded); WORK: scratch (/tmp/vllm-bundle);
# CHUNK_MIB: chunk size (default: what fits one call beside the working tree, at most 55);
# KEEP_MOE=1 keeps vllm/_moe_C_stable_libtorch.abi3.so (MoE kernels; +41 MB compressed),
# KEEP_FA2=1 vllm_flash_attn/_vllm_fa2_C.abi3.so (FlashAttention 2; +129 MB compressed).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
VERSION=0.26.0
WHEEL=${WHEEL:-/tmp/vw/vllm-$VERSION-cp38-abi3-manylinux_2_28_x86_64.whl}
WORK=${WORK:-/tmp/vllm-bundle}
OUTDIR=.vllm-gpu
PIP=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12
     --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
     --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64
     --platform manylinux_2_24_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_31_x86_64)
# Imported unconditionally on `from vllm import LLM` + LLM(...).generate (import_closure.py),
# with their own needs; the device has the rest (numpy, torch, transformers, aiohttp, ...).
DEPS=(msgspec==0.22.0 pyzmq==27.3.0 cbor2==6.3.0 pybase64==1.5.1 cachetools==8.0.2
      blake3==1.0.11 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7
      pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      openai==2.54.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 openai-harmony==0.0.8
      fastapi==0.136.3 starlette==1.10.0 depyf==0.20.0 astor==0.8.1 dill==0.4.1
      # the OpenAI server (gss serve: python -m gss.serving.vllm_cli serve, vLLM's CLI)
      uvicorn==0.54.0 watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0
      python-multipart==0.0.34 model-hosting-container-standards==0.1.16 jmespath==1.1.0
      # structured output: vllm.v1.structured_output imports its guidance and xgrammar
      # backends, whose dataclass fields name llguidance.* / xgr.* types: evaluating those
      # annotations at import loads the LazyLoader'd modules (found on the device, 2026-11-26)
      llguidance==1.7.6 xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2)
# installed there only if the device's own copy is older (pydantic needs typing-extensions
# >= 4.16, starlette anyio >= 4): install_on_device.sh decides
IF_OLDER=(typing-extensions==4.16.0 anyio==4.16.0)
# dropped from the vllm wheel: FA2 (Hopper runs FA3; flash_attn_interface.py tolerates its
# ImportError), the Rust frontend binary (only with VLLM_USE_RUST_FRONTEND), deep_gemm builds
# for other Pythons, and the MoE kernels (import_kernels suppresses their ImportError)
DROP=(vllm/vllm-rs vllm/third_party/deep_gemm/_C.cpython-3{10,11,13,14}-x86_64-linux-gnu.so)
[ "${KEEP_FA2:-0}" = 1 ] || DROP+=(vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so)
[ "${KEEP_MOE:-0}" = 1 ] || DROP+=(vllm/_moe_C_stable_libtorch.abi3.so)

rm -rf "$WORK" && mkdir -p "$WORK/stage/site" "$WORK/stage/wheels" "$WORK/stage/wheels-if-older"
if [ ! -f "$WHEEL" ]; then
    "${PIP[@]}" -d "$WORK" "vllm==$VERSION"
    WHEEL=$WORK/vllm-$VERSION-cp38-abi3-manylinux_2_28_x86_64.whl
fi
nice -n 19 unzip -q "$WHEEL" -d "$WORK/stage/site"
for f in "${DROP[@]}"; do
    rm -f "$WORK/stage/site/$f"
    grep -v "^$f," "$WORK/stage/site/vllm-$VERSION.dist-info/RECORD" > "$WORK/RECORD" || true
    mv "$WORK/RECORD" "$WORK/stage/site/vllm-$VERSION.dist-info/RECORD"
done
"${PIP[@]}" -d "$WORK/stage/wheels" "${DEPS[@]}"
"${PIP[@]}" -d "$WORK/stage/wheels-if-older" "${IF_OLDER[@]}"
(cd "$WORK/stage" && ls wheels wheels-if-older > MANIFEST.txt && { echo dropped:; printf '%s\n' "${DROP[@]}"; } >> MANIFEST.txt)

# xz -9, not gzip: 83 MB against 122 MB, one call fewer (~1.5 min here on 2 cores)
tar -C "$WORK/stage" -cf - . | nice -n 19 xz -9 -T0 > "$WORK/bundle.tar.xz"
if [ -z "${CHUNK_MIB:-}" ]; then  # one call carries the working tree and one chunk: 64 MiB
    tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
    [ -d shared ] && tree=$((tree + $(du -sb shared | cut -f1)))
    CHUNK_MIB=$(( 64 - (tree + 1048575) / 1048576 - 2 ))
    (( CHUNK_MIB > 55 )) && CHUNK_MIB=55
    echo "working tree $((tree / 1048576)) MiB: chunks of $CHUNK_MIB MiB"
fi
grep -qxF "/$OUTDIR/" .git/info/exclude 2>/dev/null || echo "/$OUTDIR/" >> .git/info/exclude
rm -rf "$OUTDIR" && mkdir "$OUTDIR"
split -b "${CHUNK_MIB}M" -d -a 2 "$WORK/bundle.tar.xz" "$OUTDIR/part-"
(cd "$WORK" && sha256sum bundle.tar.xz | sed 's/ .*//') > "$OUTDIR/bundle.sha256"
rm -f "$WORK/bundle.tar.xz"
n=$(ls "$OUTDIR"/part-* | wc -l)
ls -l "$OUTDIR"
echo "$n chunks, $(du -cb "$OUTDIR"/part-* | tail -1 | cut -f1) bytes in all ($(du -ch "$OUTDIR"/part-* | tail -1 | cut -f1))"
