#!/usr/bin/env bash
# The outside tools `make test` runs for real: promtool and prometheus (Debian's
# `prometheus` package) check and run deploy/'s Prometheus config and alert rules.
# A developer's machine without them skips those tests, with the install command
# in the reason; under CI=true they fail instead, so CI installs the tools here.
# Idempotent and a no-op unless CI=true and a tool is missing: it costs a
# developer's `make test` nothing.
set -euo pipefail

ci="${CI:-}"
case "${ci,,}" in true | 1) ;; *) exit 0 ;; esac
if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null; then
    echo "ci_tools.sh: promtool/prometheus missing and no apt-get here:" \
        "put Prometheus 2.x's prometheus and promtool on PATH" >&2
    exit 1
fi
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
started=$SECONDS
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -q
# Not the recommended prometheus-node-exporter: a host agent no test uses.
$sudo apt-get install -y -q --no-install-recommends prometheus
# Where systemd runs, the package starts its own server on :9090 (where it does
# not, as in containers, policy-rc.d keeps it stopped). The tests start theirs on
# free loopback ports; do not leave one running that nobody asked for.
if [ -d /run/systemd/system ]; then
    $sudo systemctl disable --now prometheus.service
fi
echo "ci_tools.sh: $(promtool --version 2>&1 | head -n 1), installed in $((SECONDS - started)) s"
