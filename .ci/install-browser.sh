#!/usr/bin/env bash
# Install Debian's chromium for the headless dashboard test (tests/gateway/test_dashboard.py); fails if it cannot.
set -euo pipefail
if command -v chromium >/dev/null; then
  exit 0
fi
t0=$(date +%s)
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
echo "install-browser: $(chromium --version 2>&1 | head -1) in $(( $(date +%s) - t0 )) s"
