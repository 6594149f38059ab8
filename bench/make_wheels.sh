#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with the wheels the lent GPU machine lacks for bench/gpu_session.py's
# DeepSpeed rows; the device call carries the folder (bench/README.md, "The GPU session").
#
#   bash bench/make_wheels.sh            # about 30 s; prints each wheel's size and the total
#
# The GPU machine runs Python 3.12 on manylinux x86_64 with torch 2.11 + CUDA 13, transformers 5.17,
# accelerate and peft, and cannot reach any registry. Against the package list of the device
# tool's KINDS.md (read 2026-11-17), DeepSpeed 0.19.8's requirements stand there as follows:
#   there:   einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, torch, tqdm, nvidia-ml-py
#   missing: deepspeed itself, hjson, pydantic (+ pydantic-core, annotated-types, typing-inspection)
#   carried anyway: typing-extensions -- pydantic 2.14 needs >= 4.16.0 and the version there is not
#            listed; gpu_session.py installs all of these into a folder that only the DeepSpeed rows
#            see, so the hf_zero rows keep the machine's own typing-extensions.
# hf_zero needs nothing from here: it runs from the working tree (PYTHONPATH), and its own
# dependencies are there (datasets is not, and hf_zero never imports it).
#
# DeepSpeed is built here from its source release with DS_BUILD_OPS=0: a pure-Python wheel whose ops
# (CPU Adam) are compiled just in time on the GPU machine, which has a C++ compiler (nvcc built and
# ran kernels there) and Python's headers (Triton, which compiles a C launcher against them at run
# time, ran there). The versions below are pinned: one version of each, or the install stops.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
DEST=.whl
TMP=$(mktemp -d "${TMPDIR:-/tmp}/hf_zero_wheels.XXXXXX")
trap 'rm -rf "$TMP"' EXIT

# pip wheel/download only write files: nothing is installed into $PY's environment.
DS_BUILD_OPS=0 "$PY" -m pip wheel --quiet --no-cache-dir --no-deps --no-binary deepspeed deepspeed==0.19.8 -w "$TMP"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$TMP" \
    hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing-extensions==4.16.0

# The wheel must not contain compiled ops (they would be built for this machine, not that one).
"$PY" - "$TMP" <<'EOF'
import sys, zipfile, pathlib
whl = next(pathlib.Path(sys.argv[1]).glob("deepspeed-0.19.8-*.whl"))
assert whl.name.endswith("-py3-none-any.whl"), f"{whl.name}: expected a pure-Python wheel"
with zipfile.ZipFile(whl) as z:
    compiled = [n for n in z.namelist() if n.endswith(".so")]
    assert not compiled, f"{whl.name} holds compiled ops: {compiled[:3]}"
EOF

rm -rf "$DEST"
mkdir -p "$DEST"
mv "$TMP"/*.whl "$DEST"/
ls -l "$DEST" | awk 'NR > 1 {printf "%9.1f KiB  %s\n", $5 / 1024, $9}'
du -sh "$DEST" | awk '{print "total " $1 " in " $2}'
