#!/usr/bin/env bash
# Idempotent set-up used by `make test` and `make demo`: system packages where missing (Debian/root),
# a virtual environment in .venv, torch==2.13.0 (CPU wheel) first, then the project with its dev extra.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

need_pkgs=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    # libgmp-dev, python3-dev and a compiler: fastecdsa (a py-libp2p dependency) builds from source.
    # iproute2, iptables, conntrack: the NAT-traversal tests build network namespaces. tmux: dashboard check.
    for p in libgmp-dev python3-dev build-essential iproute2 iptables conntrack tmux; do
        have_pkg "$p" || need_pkgs+=("$p")
    done
    if [ ${#need_pkgs[@]} -gt 0 ]; then
        echo "setup: installing system packages: ${need_pkgs[*]}"
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null) \
            || echo "setup: warning: could not install ${need_pkgs[*]}; continuing" >&2
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup: creating $VENV"
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.installed"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade pip wheel setuptools
# torch first: an unpinned torch would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q -e ".[dev]"
echo "$want" > "$stamp"
echo "setup: environment ready in $VENV"
