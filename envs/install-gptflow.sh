#!/bin/sh
# Installs gptflow into the image (run by envs/Dockerfile). A base image that has torch
# already (NGC's CUDA build) keeps it: the torch pin of constraints.txt is replaced by the
# installed version, so pip never swaps NVIDIA's build for a PyPI wheel.
set -eu
tree=/opt/gptflow/src-tree
python3 -m pip --version >/dev/null 2>&1 || {
    echo "install-gptflow.sh: the base image has no 'python3 -m pip'; use a base with Python 3.11+ and pip" >&2
    exit 1
}
constraints=/tmp/gptflow-constraints.txt
grep -v '^torch==' "$tree/constraints.txt" > "$constraints"
if torch_version=$(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    echo "install-gptflow.sh: keeping the base image's torch $torch_version"
    echo "torch==$torch_version" >> "$constraints"
else
    grep '^torch==' "$tree/constraints.txt" >> "$constraints" || true
fi
# shellcheck disable=SC2086  # GPTFLOW_PIP_ARGS is a list of options
python3 -m pip install -c "$constraints" ${GPTFLOW_PIP_ARGS:-} "$tree"
rm -f "$constraints"
python3 -c 'import gptflow; print("gptflow", gptflow.__version__, "installed")'
