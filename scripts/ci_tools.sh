#!/usr/bin/env bash
# The outside tools `make test` runs for real: promtool and prometheus (Debian's
# `prometheus` package) check and run deploy/'s Prometheus config and alert rules;
# kcat (Debian's `kcat`) sends the README's Open Inference Protocol one-liner;
# torch and torchvision (the `torch` extra, into the test venv, whose python is
# the first argument) run the torch engine and the nvJPEG path on the CPU.
# A developer's machine without them skips those tests, with the install command
# in the reason; under CI=true they fail instead, so CI installs the tools here.
# Idempotent and a no-op unless CI=true and a tool is missing: it costs a
# developer's `make test` nothing.
# torch is installed within the pins of $CONSTRAINTS (the Makefile passes
# constraints.txt; empty: the newest allowed versions, as `make newest` wants).
#   usage: [CONSTRAINTS=FILE] scripts/ci_tools.sh [PYTHON]   (default: python3)
set -euo pipefail

ci="${CI:-}"
case "${ci,,}" in true | 1) ;; *) exit 0 ;; esac
python="${1:-python3}"
# PyPI's torch is a CUDA build that runs on the CPU: measured 68 s and 5.4 GB
# with torchvision from an empty pip cache on the 2-core machine (README).
if ! "$python" -c "import torch, torchvision" 2>/dev/null; then
    started=$SECONDS
    pins=()
    if [ -n "${CONSTRAINTS:-}" ]; then pins=(--constraint "$CONSTRAINTS"); fi
    "$python" -m pip install --quiet --disable-pip-version-check "${pins[@]}" -e ".[torch]"
    echo "ci_tools.sh: installed torch and torchvision in $((SECONDS - started)) s"
fi
packages=()
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    packages+=(prometheus)
fi
if ! command -v kcat >/dev/null; then
    packages+=(kcat)
fi
if [ ${#packages[@]} -eq 0 ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "ci_tools.sh: ${packages[*]} missing and no apt-get here:" \
        "put Prometheus 2.x's prometheus and promtool, and kcat, on PATH" >&2
    exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
started=$SECONDS
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
# Not the recommended prometheus-node-exporter: a host agent no test uses.
$sudo apt-get install -y -q --no-install-recommends "${packages[@]}"
# Where systemd runs, the package starts its own server on :9090 (where it does
# not, as in containers, policy-rc.d keeps it stopped). The tests start theirs on
# free loopback ports; do not leave one running that nobody asked for.
if [ -d /run/systemd/system ] && [[ " ${packages[*]} " == *" prometheus "* ]]; then
    $sudo systemctl disable --now prometheus.service
fi
echo "ci_tools.sh: installed ${packages[*]} in $((SECONDS - started)) s"
