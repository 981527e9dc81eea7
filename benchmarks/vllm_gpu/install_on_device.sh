#!/usr/bin/env bash
# On the device, from the repository root, once every .vllm-gpu/part-NN was copied to
# $PARTS: reassembles the bundle of bundle.sh, installs vLLM and its missing wheels into $SITE,
# and gss itself with its vllm.general_plugins entry point. Then, in the same shell:
#   export PYTHONPATH=/tmp/site
set -euo pipefail
PARTS=${PARTS:-/tmp/vllm-parts}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
tmp=$(mktemp -d /tmp/vllm-bundle.XXXX)

got=$(cat "$PARTS"/part-* | sha256sum | cut -d' ' -f1)
if [ -f "$PARTS/bundle.sha256" ]; then
    [ "$got" = "$(cat "$PARTS/bundle.sha256")" ] || {
        echo "bundle checksum differs: parts missing or damaged ($(ls "$PARTS"))" >&2; exit 1; }
fi
if [ "$(cat "$SITE/.bundle.sha256" 2>/dev/null)" = "$got" ]; then
    echo "vLLM from this bundle is already in $SITE (a later call on the same machine)"
else
    # xz (bundle.sh), unpacked by Python's lzma: the image need not have the xz tool
    cat "$PARTS"/part-* | "$PY" -c 'import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer, 1 << 20)' | tar -xf - -C "$tmp"
    mkdir -p "$SITE"
    pip_install() { "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target "$SITE" "$@"; }
    pip_install "$tmp"/wheels/*.whl
    for whl in "$tmp"/wheels-if-older/*.whl; do  # only where the image's copy is older
        name=$(basename "$whl" | cut -d- -f1); want=$(basename "$whl" | cut -d- -f2)
        if ! "$PY" - "$name" "$want" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.version import Version
try:
    sys.exit(Version(version(sys.argv[1])) < Version(sys.argv[2]))
except PackageNotFoundError:
    sys.exit(1)
EOF
        then
            pip_install "$whl"
        fi
    done
    cp -a "$tmp"/site/. "$SITE"/  # vllm/ and vllm-0.26.0.dist-info/ (entry_points.txt kept)
    echo "$got" > "$SITE/.bundle.sha256"
fi
rm -rf "$tmp"

# gss: its package and a dist-info carrying pyproject's name, version and entry points
rm -rf "$SITE"/gss "$SITE"/gated_subspace_steering-*.dist-info
cp -a src/gss "$SITE"/gss
"$PY" - "$SITE" <<'EOF'
import sys, tomllib
from pathlib import Path
project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
name, version = project["name"], project["version"]
info = Path(sys.argv[1]) / f"{name.replace('-', '_')}-{version}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
(info / "INSTALLER").write_text("install_on_device.sh\n")
lines = [f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
         for group, eps in project.get("entry-points", {}).items()]
lines.append("[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in project["scripts"].items()))
(info / "entry_points.txt").write_text("\n".join(lines))
EOF

export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import vllm, gss; print(vllm.__version__)"
"$PY" -c "from importlib.metadata import entry_points as e; print([p.value for p in e(group='vllm.general_plugins')])"
