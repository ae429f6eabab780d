#!/usr/bin/env bash
# The GPU checks of issue 17 (and a template for others) on a bare CUDA machine that has PyTorch
# and Triton but not edgerun's other dependencies, and no network: run from the checkout's root.
#
#   PHASES="conv specb gtests sprof" [WHEELS=DIR] [OUT=DIR] [BUDGET=S] bash scripts/gpu_check.sh
#
# WHEELS: a folder of wheels for what the machine lacks, installed with --no-index into
# /tmp/site (made on a machine with pip and network, e.g. for CPython 3.12 x86-64:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#     -d DIR xxhash gguf tqdm safetensors tokenizers fla-core einops pytest pluggy iniconfig \
#     packaging pygments pyyaml psutil
# ). edgerun itself is put on PYTHONPATH through a link farm (edgerun/ with kernels/ as
# edgerun.kernels, as pyproject.toml maps it), so nothing is built there. OUT: where results go
# (default ./gpu-out). BUDGET: seconds for all phases; each phase's timeout is cut to what is left.
# Phases:
#   conv    the demo as bundles: /tmp/demob (int4 experts) and /tmp/demob4 (int4 experts and dense)
#   specb   edgerun bench speculative on /tmp/demob through the expert cache (SPEC_QUOTA, 16),
#           K = SPEC_K (1,2,3), sampled rows at SPEC_T (0.8; 0: greedy only), SPEC_REPEATS (3)
#   specba  specb greedy, each verify row's projections by programs of their own (--window-rows alone)
#   specb4  the same on /tmp/demob4, greedy
#   speck   the same on the demo checkpoint (its experts resident, stacked), greedy
#   sprof   benchmarks/spec_step_profile.py on SPROF_MODEL (/tmp/demob) at SPROF_QUOTA (16)
#   sbench  benchmarks/bench_sampling.py: the host sampler against the device draw, the demo's
#           decode rate greedy and sampled
#   gtests  pytest of GT (tests/engine/test_speculative_cuda.py)
set -u
export PYTHONUNBUFFERED=1
R=$PWD
OUT=${OUT:-$R/gpu-out}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl >/dev/null 2>&1 || echo "wheel install failed"
fi
mkdir -p /tmp/lf/edgerun
for f in edgerun/*; do ln -sfn "$R/$f" /tmp/lf/edgerun/; done
ln -sfn "$R/kernels" /tmp/lf/edgerun/kernels
export PYTHONPATH=/tmp/site:/tmp/lf
ER="python3 -P -m edgerun"  # -P: not the checkout's edgerun/ (it lacks edgerun.kernels)
date -u +%FT%TZ
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
END=$((SECONDS + ${BUDGET:-560}))
lim() { local l=$((END - SECONDS)); [ "$1" -lt $l ] && l=$1; [ $l -lt 5 ] && l=5; echo $l; }
for ph in ${PHASES:-}; do
  echo "=== phase $ph $(date -u +%T), $((END - SECONDS)) s left"
  [ $((END - SECONDS)) -lt 20 ] && { echo "skipped: out of time"; continue; }
  case $ph in
  conv)
    $ER convert edgerun/demo /tmp/demob --quant int4 2>&1 | tail -1
    $ER convert edgerun/demo /tmp/demob4 --quant int4 --dense int4 2>&1 | tail -1 ;;
  specb)
    timeout "$(lim "${SPEC_TIMEOUT:-260}")" $ER bench speculative --model /tmp/demob --quota "${SPEC_QUOTA:-16}" \
      --device cuda --repeats "${SPEC_REPEATS:-3}" --max-tokens 96 --draft-tokens "${SPEC_K:-1,2,3}" \
      --temperature "${SPEC_T:-0.8}" --out "$OUT/specb" 2>&1 | tail -24 ;;
  specba)
    timeout "$(lim "${SPEC_TIMEOUT:-260}")" $ER bench speculative --model /tmp/demob --quota "${SPEC_QUOTA:-16}" \
      --device cuda --repeats "${SPEC_REPEATS:-3}" --max-tokens 96 --draft-tokens "${SPEC_K:-1,2,3}" \
      --temperature 0 --window-rows alone --out "$OUT/specba" 2>&1 | tail -12 ;;
  specb4)
    timeout "$(lim "${SPEC_TIMEOUT:-260}")" $ER bench speculative --model /tmp/demob4 --quota 16 --device cuda \
      --repeats 3 --max-tokens 96 --temperature 0 --out "$OUT/specb4" 2>&1 | tail -12 ;;
  speck)
    timeout "$(lim "${SPEC_TIMEOUT:-260}")" $ER bench speculative --device cuda --repeats 3 --max-tokens 96 \
      --temperature 0 --out "$OUT/speck" 2>&1 | tail -12 ;;
  sprof)
    timeout "$(lim "${SPROF_TIMEOUT:-200}")" python3 benchmarks/spec_step_profile.py \
      --model "${SPROF_MODEL:-/tmp/demob}" --quota "${SPROF_QUOTA:-16}" --out "$OUT/sprof.json" 2>&1 \
      | grep -v Warning | tee "$OUT/sprof.txt" ;;
  sbench)
    timeout "$(lim "${SB_TIMEOUT:-150}")" python3 benchmarks/bench_sampling.py --repeats "${SB_REPEATS:-5}" \
      --out "$OUT/sampling.json" 2>&1 | grep -v Warning | tee "$OUT/sampling.txt" ;;
  gtests)
    timeout "$(lim "${GT_TIMEOUT:-300}")" python3 -m pytest -q -p no:cacheprovider --durations=8 \
      ${GT:-tests/engine/test_speculative_cuda.py} 2>&1 | tail -25 ;;
  *) echo "unknown phase $ph" ;;
  esac
done
echo "=== done $(date -u +%T)"
