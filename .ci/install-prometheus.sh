#!/usr/bin/env bash
# Install Debian's prometheus package (promtool and a real server) for the alert-rule tests; fails if it cannot.
set -euo pipefail
if command -v promtool >/dev/null && command -v prometheus >/dev/null; then
  exit 0
fi
t0=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# if the package started its own service, it is left alone: the tests start their own server on a free
# loopback port and stop it by its PID
echo "install-prometheus: $(promtool --version 2>&1 | head -1) in $(( $(date +%s) - t0 )) s"
