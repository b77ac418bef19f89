#!/usr/bin/env bash
# Install torch and then the package with EXTRAS into the venv VENV (used by `make setup`).
#
#   scripts/setup_venv.sh VENV TORCH_SPEC EXTRAS      e.g. .venv "torch==2.13.0" "notebook,dev"
#
# pip chooses the torch wheel (a dry run: pip's own configuration says where wheels lie, so the pinned CPU build is
# the one chosen); uv then installs that very wheel together with the package and its extras when it can be installed
# (it installs torch and the ~190 packages of the extras in seconds where pip takes a minute), reading the same
# indexes as pip. Without uv, pip does it all.
set -euo pipefail
venv=$1 torch_spec=$2 extras=$3
python=$venv/bin/python

# The wheel pip would install for TORCH_SPEC (its URL: a file on this machine or an index's) and its version.
read -r torch_url torch_version < <("$python" -m pip install -q --dry-run --ignore-installed --report - "$torch_spec" \
    | "$python" -c 'import json, sys
torch = next(i for i in json.load(sys.stdin)["install"] if i["metadata"]["name"].lower() == "torch")
print(torch["download_info"]["url"], torch["metadata"]["version"])')

with_uv() {
    "$python" -m pip install -q uv || return 1
    local links extra index
    links=${PIP_FIND_LINKS:-$("$python" -m pip config get global.find-links 2>/dev/null || true)}
    extra=${PIP_EXTRA_INDEX_URL:-$("$python" -m pip config get global.extra-index-url 2>/dev/null || true)}
    index=${PIP_INDEX_URL:-$("$python" -m pip config get global.index-url 2>/dev/null || true)}
    # pip's index first, then its extra ones: unsafe-best-match takes the best version among all, as pip does.
    UV_EXTRA_INDEX_URL=$extra UV_FIND_LINKS=${links// /,} "$venv/bin/uv" pip install -q --python "$python" \
        ${index:+--default-index "$index"} --index-strategy unsafe-best-match "torch @ $torch_url" -e ".[$extras]"
}

if with_uv; then
    # uv writes no bytecode, and the suite runs with PYTHONDONTWRITEBYTECODE=1: every process importing torch would
    # compile it again (~2 s each). Compile torch's packages as pip's install does (~6 s on 2 cores); the extras stay
    # as they were (the RSS calibration, planning/rss_calibration.py, was measured in that state).
    "$python" - <<'PY'
import compileall, importlib.metadata as m, pathlib
tops = {f.parts[0] for f in m.files("torch") if f.suffix == ".py" and len(f.parts) > 1}
site = pathlib.Path(m.distribution("torch").locate_file(""))
for top in sorted(tops):  # a file for a newer Python (torch ships some) fails alone, as in pip's install
    compileall.compile_dir(site / top, quiet=2, workers=0)
PY
else
    echo "setup: uv unavailable or failed; installing with pip" >&2
    "$python" -m pip install -q "$torch_spec"
    "$python" -m pip install -q --upgrade pip
    "$python" -m pip install -q -e ".[$extras]"
fi
# Nothing above may have replaced the chosen build (a CUDA torch from an index would be gigabytes and slower).
test "$("$python" -c 'import importlib.metadata as m; print(m.version("torch"))')" = "$torch_version"
