#!/usr/bin/env bash
# redis-server for the tests of the gateway's shared store (--store redis://...): Debian's package, installed when
# absent. The tests start their own server on a free loopback port (--save '', stopped by its PID); this script
# never starts or stops the system service.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
  echo "install-redis: $(redis-server --version | cut -d' ' -f1-3) present"
  exit 0
fi
t0=$(date +%s)
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
# (a package's maintainer scripts start its service unless policy-rc.d says no: say no for this install only)
blocker=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
  blocker=/usr/sbin/policy-rc.d
  printf '#!/bin/sh\nexit 101\n' | $SUDO tee "$blocker" >/dev/null
  $SUDO chmod +x "$blocker"
  trap '$SUDO rm -f "$blocker"' EXIT
fi
$SUDO apt-get update -qq || true
$SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
echo "install-redis: $(redis-server --version | cut -d' ' -f1-3) installed in $(( $(date +%s) - t0 )) s"
