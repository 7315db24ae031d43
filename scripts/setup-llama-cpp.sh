#!/usr/bin/env bash
# llama.cpp's Python binding for `make test-llama-cpp` (tests/real/test_llama_cpp.py): llama-cpp-python
# from PyPI, which compiles llama.cpp (cmake and a C++ compiler; installed here when missing, on Debian).
# Idempotent: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
LLAMA_CPP_SPEC=${LLAMA_CPP_SPEC:-llama-cpp-python>=0.3}
stamp="$VENV/.installed-llama-cpp"
want="$(cat scripts/setup-llama-cpp.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
if ! command -v cmake >/dev/null || ! command -v c++ >/dev/null; then
    if command -v apt-get >/dev/null; then
        SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
        $SUDO apt-get install -y -q cmake g++ >/dev/null
    else
        echo "setup-llama-cpp: cmake and a C++ compiler are needed to build llama-cpp-python" >&2
        exit 1
    fi
fi
t0=$SECONDS
printf 'setup-llama-cpp: building %s (minutes) ...' "$LLAMA_CPP_SPEC"
"$VENV/bin/python" -m pip install -q "$LLAMA_CPP_SPEC"
printf ' done (%ss)\n' "$((SECONDS - t0))"
echo "$want" > "$stamp"
