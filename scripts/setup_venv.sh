#!/usr/bin/env bash
# Install torch and then the package with EXTRAS into the venv VENV (used by `make setup`).
#
#   scripts/setup_venv.sh VENV TORCH_SPEC EXTRAS      e.g. .venv "torch==2.13.0" "notebook,dev"
#
# torch goes first, with pip, so the pinned CPU build is the one chosen (pip's own configuration says where wheels
# lie); the rest then comes with uv when it can be installed (it installs the ~190 packages of the extras in seconds
# where pip takes a minute), held to that same torch, and reading the same indexes as pip. Without uv, pip does it all.
set -euo pipefail
venv=$1 torch_spec=$2 extras=$3
python=$venv/bin/python

"$python" -m pip install -q "$torch_spec"
torch_version=$("$python" -c 'import importlib.metadata as m; print(m.version("torch"))')

with_uv() {
    "$python" -m pip install -q uv || return 1
    local links extra
    links=${PIP_FIND_LINKS:-$("$python" -m pip config get global.find-links 2>/dev/null || true)}
    extra=${PIP_EXTRA_INDEX_URL:-$("$python" -m pip config get global.extra-index-url 2>/dev/null || true)}
    # pip's index first, then its extra ones: unsafe-best-match takes the best version among all, as pip does.
    UV_EXTRA_INDEX_URL=$extra UV_FIND_LINKS=${links// /,} "$venv/bin/uv" pip install -q --python "$python" \
        --index-strategy unsafe-best-match --constraint <(echo "torch==$torch_version") -e ".[$extras]"
}

if ! with_uv; then
    echo "setup: uv unavailable or failed; installing with pip" >&2
    "$python" -m pip install -q --upgrade pip
    "$python" -m pip install -q -e ".[$extras]"
fi
# Nothing above may have replaced the pinned build (a CUDA torch from an index would be gigabytes and slower).
test "$("$python" -c 'import importlib.metadata as m; print(m.version("torch"))')" = "$torch_version"
