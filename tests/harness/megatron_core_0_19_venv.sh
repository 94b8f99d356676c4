#!/usr/bin/env bash
# Test harness only (never shipped in the package, never imported by it): builds a virtualenv with
# megatron-core 0.19.2 on this machine's Python 3.11, where pip refuses every 0.17+ wheel (cp312,
# Requires-Python >=3.12). The shims below exist only in that venv:
#   - the 0.19.2 wheel installed under a py3-none-any file name with --ignore-requires-python --no-deps
#     (its .py files parse and import on 3.11; its cp312 dataset helpers .so does not load);
#   - the dataset helpers rebuilt for 3.11 with Megatron-LM core_v0.19.0's Makefile (no wheel ships it)
#     beside the wheel's helpers.cpp, and pybind11; with -DNDEBUG, as every published wheel's .so is built
#     (setuptools' flags): helpers.cpp's assert()s are off there (an empty split's tokens_per_epoch of 0,
#     which a 1 MiB corpus at split 98,1,1 gives, aborted the whole pytest process otherwise);
#   - triton (from 0.18, `import megatron.core` imports it: moe/paged_stash);
#   - typing.override (3.12) bound to typing_extensions.override by a sitecustomize.py in that venv's
#     site-packages, before megatron.training's models import it.
# The plugin is installed from the checkout, editable and without dependencies (pip would otherwise
# look for a megatron-core for 3.11); its other dependencies (pyproject's) are installed first.
# Usage: tests/harness/megatron_core_0_19_venv.sh [DEST]   (default /tmp/bitdet-mcore-0.19; prints
# the time and size at the end). Needs PyPI (or the machine's wheel folders) and a C++ compiler.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="${1:-/tmp/bitdet-mcore-0.19}"
VERSION=0.19.2
SHARED="${MEGATRON_LM_019_PATH:-$(cd "$REPO/.." && pwd)/shared/megatron-lm-0.19}"
SECONDS=0

[ -f "$SHARED/megatron-core-datasets.Makefile" ] || { echo "$0: no $SHARED/megatron-core-datasets.Makefile" >&2; exit 1; }
python3.11 -m venv "$DEST"
PY="$DEST/bin/python"
"$PY" -m pip install -q torch==2.13.0
read -ra DEPS <<< "$("$PY" - "$REPO/pyproject.toml" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
deps = project["dependencies"] + project["optional-dependencies"]["test"]
print(" ".join(d for d in deps if re.split(r"[<>=!~\[;\s]", d)[0] not in ("megatron-core", "torch")))
EOF
)"
"$PY" -m pip install -q "${DEPS[@]}" triton pybind11 typing_extensions

WHEELS="$(mktemp -d)"
trap 'rm -rf "$WHEELS"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$WHEELS" "megatron-core==$VERSION"
mv "$WHEELS"/megatron_core-"$VERSION"-*.whl "$WHEELS/megatron_core-$VERSION-py3-none-any.whl"
"$PY" -m pip install -q --no-deps --ignore-requires-python "$WHEELS/megatron_core-$VERSION-py3-none-any.whl"
"$PY" -m pip install -q --no-deps -e "$REPO"

SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cat > "$SITE/sitecustomize.py" <<'EOF'
"""bitdet's megatron-core 0.19 test venv only (tests/harness/megatron_core_0_19_venv.sh): Python 3.11 has
no typing.override (3.12), which megatron.training's models import; typing_extensions' is the same."""
import typing

if not hasattr(typing, "override"):
    import typing_extensions

    typing.override = typing_extensions.override
EOF
DATASETS="$SITE/megatron/core/datasets"
rm -f "$DATASETS"/helpers_cpp.cpython-312-*.so
cp "$SHARED/megatron-core-datasets.Makefile" "$DATASETS/Makefile"
(PATH="$DEST/bin:$PATH" CPPFLAGS=-DNDEBUG "$PY" -c 'from megatron.core.datasets.utils import compile_helpers; compile_helpers()' >/dev/null)
"$PY" -c 'import typing, megatron.core, megatron.core.datasets.helpers_cpp; from importlib.metadata import version
assert typing.override and version("megatron-core") == "'"$VERSION"'"
print("megatron-core", version("megatron-core"), "imports on", __import__("sys").version.split()[0])'
echo "$0: $DEST built in ${SECONDS} s, $(du -sh "$DEST" | cut -f1)"
