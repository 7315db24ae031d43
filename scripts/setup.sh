#!/usr/bin/env bash
# Idempotent set-up used by `make test` and `make demo`: system packages where missing (Debian/root),
# a virtual environment in .venv, torch==2.13.0 (CPU wheel) first, then the project with its dev extra.
# Prints nothing when there is nothing to do; otherwise one line per step with its time (pip itself runs
# -q: the torch step alone takes minutes, and a line that says so beats a silent terminal).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

# step WHAT CMD...: "setup: WHAT ..." now, " done (Ns)" or " FAILED (Ns)" when CMD ends.
step() {
    local what=$1 t0=$SECONDS rc=0
    shift
    printf 'setup: %s ...' "$what"
    "$@" || rc=$?
    if [ "$rc" = 0 ]; then
        printf ' done (%ss)\n' "$((SECONDS - t0))"
    else
        printf ' FAILED (%ss, exit %s)\n' "$((SECONDS - t0))" "$rc"
        exit "$rc"
    fi
}

need_pkgs=()
have_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    # libgmp-dev, python3-dev and a compiler: fastecdsa (a py-libp2p dependency) builds from source.
    # iproute2, iptables, conntrack: the NAT-traversal tests build network namespaces. tmux: dashboard check.
    pkgs=(libgmp-dev python3-dev build-essential iproute2 iptables conntrack tmux)
    # chromium: `make test` renders the run report headless (tests/commands/test_run_report.py); the demo
    # does not need it.
    [ "${SETUP_FOR:-}" = test ] && pkgs+=(chromium)
    for p in "${pkgs[@]}"; do
        have_pkg "$p" || need_pkgs+=("$p")
    done
    if [ ${#need_pkgs[@]} -gt 0 ]; then
        t0=$SECONDS
        printf 'setup: installing system packages: %s ...' "${need_pkgs[*]}"
        if (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null); then
            printf ' done (%ss)\n' "$((SECONDS - t0))"
        else
            printf ' failed (%ss); continuing\n' "$((SECONDS - t0))"
            echo "setup: warning: could not install ${need_pkgs[*]}" >&2
        fi
    fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    step "creating $VENV" "$PY" -m venv "$VENV"
fi
stamp="$VENV/.installed"
want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
total0=$SECONDS
step "upgrading pip, wheel, setuptools" "$VENV/bin/python" -m pip install -q --upgrade pip wheel setuptools
# torch first: an unpinned torch would pull a multi-GB CUDA build.
step "installing torch==2.13.0 (CPU wheel; minutes on a first install)" \
    "$VENV/bin/python" -m pip install -q torch==2.13.0
step "installing intellect-node and its dev extra" "$VENV/bin/python" -m pip install -q -e ".[dev]"
echo "$want" > "$stamp"
echo "setup: environment ready in $VENV ($((SECONDS - total0))s)"
