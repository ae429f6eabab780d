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
#           K = SPEC_K (1,2,3), sampled rows at SPEC_T (0: greedy only), SPEC_REPEATS (5) after
#           one untimed round, SPEC_TOKENS (128) a prompt
#   specba  specb greedy, each verify row's projections by programs of their own (--window-rows alone)
#   specb4  the same on /tmp/demob4, greedy
#   speck   the same on the demo checkpoint (its experts resident: held as bf16 blocks), greedy
#   sprof   benchmarks/spec_step_profile.py on SPROF_MODEL (/tmp/demob) at SPROF_QUOTA (16; "": none),
#           files sprof$SPROF_TAG.*, more flags in SPROF_ARGS (--timeline, --ks 0,3)
#   vwin    benchmarks/bench_verify_window.py at VW_LAYERS (40) layers of Qwen3.6's geometry, quotas
#           VW_QUOTA (256: every expert held), VW_CALLS (10) timed calls
#   dec     edgerun bench decode at DEC_LAYERS (40) layers of Qwen3.6's geometry, resident, int4 dense,
#           DEC_ENV set for it, more flags in DEC_ARGS (--dense-act int8), files dec$DEC_TAG.*
#   stream  edgerun bench decode at 40 layers, experts streamed at STREAM_BUDGETS (16,8) GiB through the
#           native reader, STREAM_ARGS more flags (--read-pieces 1,4 --prefetch off,on), files stream$STREAM_TAG.*
#   tl      benchmarks/stream_timeline.py on the stream phase's bundle at TL_QUOTA (91) a layer: where a
#           streamed layer's time goes, prefetch off and on (TL_ARGS more flags), files tl$TL_TAG.*
#   route   benchmarks/bench_route.py: a MoE layer's router launch and its parts (ROUTE_TILES: router
#           tiles "block_r,row_bytes ..." timed too), files route.*
#   sbench  benchmarks/bench_sampling.py: the host sampler against the device draw (SB_VOCAB,
#           "" for none), the demo's decode rate greedy and sampled
#   ab      benchmarks/ab_decode.py at 40 layers (the dec phase's bundle in /tmp/bd): AB_VARIANTS, a
#           ;-free list of --variant arguments ("base: b8:edgerun.kernels.moe_triton.DEFAULT_GEMV.block_r=8"),
#           AB_ROUNDS (3) rounds, --profile; files ab$AB_TAG.*
#   gtests  pytest of each file of GT (tests/engine/test_speculative_cuda.py) in turn, each within
#           GT_TIMEOUT (300) s (then interrupted: the summary says where), -k GT_K when set; -v output
#           to $OUT/gtests-NAME.txt, its failures and durations printed
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
# the GPU's clocks and power every 200 ms while the phases run ($OUT/clocks.csv): a rate that
# varies between repeats of the same configuration is then checked against the clocks
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,pstate --format=csv \
  -lms 200 > "$OUT/clocks.csv" 2>/dev/null &
CLOCKS=$!
trap 'kill $CLOCKS 2>/dev/null' EXIT
spec() {  # spec MODEL NAME "FLAGS": bench speculative on MODEL, results to $OUT/NAME
  timeout -s INT -k 10 "$(lim "${SPEC_TIMEOUT:-260}")" $ER bench speculative --model "$1" --device cuda \
    --repeats "${SPEC_REPEATS:-5}" --max-tokens "${SPEC_TOKENS:-128}" --draft-tokens "${SPEC_K:-1,2,3}" \
    $3 --out "$OUT/$2" 2>&1 | tee "$OUT/$2.log" | grep -v Warning | tail -16
}
lim() { local l=$((END - SECONDS)); [ "$1" -lt $l ] && l=$1; [ $l -lt 5 ] && l=5; echo $l; }
for ph in ${PHASES:-}; do
  echo "=== phase $ph $(date -u +%T), $((END - SECONDS)) s left"
  [ $((END - SECONDS)) -lt 20 ] && { echo "skipped: out of time"; continue; }
  case $ph in
  conv)
    $ER convert edgerun/demo /tmp/demob --quant int4 2>&1 | tail -1
    $ER convert edgerun/demo /tmp/demob4 --quant int4 --dense int4 2>&1 | tail -1 ;;
  specb) spec /tmp/demob specb "--quota ${SPEC_QUOTA:-16} --temperature ${SPEC_T:-0}" ;;
  specba) spec /tmp/demob specba "--quota ${SPEC_QUOTA:-16} --temperature 0 --window-rows alone" ;;
  specb4) spec /tmp/demob4 specb4 "--quota 16 --temperature 0" ;;
  speck) spec edgerun/demo speck "--temperature 0" ;;
  sprof)  # SPROF_QUOTA "" for a model held whole (a checkpoint); SPROF_TAG names the files
    q=${SPROF_QUOTA-16}
    timeout "$(lim "${SPROF_TIMEOUT:-200}")" python3 benchmarks/spec_step_profile.py \
      --model "${SPROF_MODEL:-/tmp/demob}" ${q:+--quota "$q"} --out "$OUT/sprof${SPROF_TAG:-}.json" ${SPROF_ARGS:-} 2>&1 \
      | grep -v Warning | tee "$OUT/sprof${SPROF_TAG:-}.txt" ;;
  vwin)  # benchmarks/bench_verify_window.py: windows against one-row steps, real geometry (VW_LAYERS, 40)
    timeout -s INT "$(lim "${VW_TIMEOUT:-200}")" python3 benchmarks/bench_verify_window.py --dir /tmp/vw \
      --layers "${VW_LAYERS:-40}" --quota "${VW_QUOTA:-256}" --calls "${VW_CALLS:-10}" --out "$OUT/vwin.json" 2>&1 \
      | grep -v Warning | tee "$OUT/vwin.txt" ;;
  dec)  # edgerun bench decode at DEC_LAYERS (40) layers, every expert held, int4 dense; env DEC_ENV
    # (e.g. "EDGERUN_PDL=0"), files dec$DEC_TAG.*; the bundle in /tmp/bd is made once and reused
    env ${DEC_ENV:-} timeout -s INT "$(lim "${DEC_TIMEOUT:-300}")" $ER bench decode --dir /tmp/bd \
      --out "$OUT/dec${DEC_TAG:-}" --prompt "${DEC_PROMPT:-64}" --decode "${DEC_DECODE:-128}" \
      --repeats "${DEC_REPEATS:-3}" --budgets resident --dense int4 --layers "${DEC_LAYERS:-40}" \
      --calibrate-seconds 0.2 ${DEC_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/dec${DEC_TAG:-}.txt" | tail -25 ;;
  stream)  # edgerun bench decode at 40 layers, experts streamed from /tmp/bd at STREAM_BUDGETS (16,8) GiB,
    # native reader, int4 dense, STREAM_DECODE (32) tokens; more flags in STREAM_ARGS ("--read-pieces 1,4
    # --prefetch off,on"); files stream$STREAM_TAG.*
    timeout -s INT "$(lim "${STREAM_TIMEOUT:-400}")" $ER bench decode --dir /tmp/bd --out "$OUT/stream${STREAM_TAG:-}" \
      --prompt 8 --decode "${STREAM_DECODE:-32}" --repeats 2 --budgets "${STREAM_BUDGETS:-16,8}" --dense int4 \
      --reader native --calibrate-seconds "${STREAM_CAL:-0.5}" ${STREAM_ARGS:-} 2>&1 | grep -v Warning \
      | tee "$OUT/stream${STREAM_TAG:-}.txt" | grep -v "^{" | tail -40 ;;
  tl)  # benchmarks/stream_timeline.py on /tmp/bd (the stream phase makes it) at TL_QUOTA (91: 8 GiB),
    # prefetch off and on, TL_ARGS more flags (--read-depth 2 --read-pieces 2); files tl$TL_TAG.*
    timeout -s INT "$(lim "${TL_TIMEOUT:-200}")" python3 -P benchmarks/stream_timeline.py --model /tmp/bd \
      --quota "${TL_QUOTA:-91}" --json "$OUT/tl${TL_TAG:-}.json" ${TL_ARGS:-} 2>&1 | grep -v Warning \
      | tee "$OUT/tl${TL_TAG:-}.txt" | tail -6 ;;
  route)  # benchmarks/bench_route.py: the router launch and its parts, the router tiles ROUTE_TILES
    timeout "$(lim "${ROUTE_TIMEOUT:-120}")" python3 benchmarks/bench_route.py --reps "${ROUTE_REPS:-50}" \
      --tiles ${ROUTE_TILES:-} --json "$OUT/route.json" 2>&1 | grep -v Warning | tee "$OUT/route.txt" ;;
  sbench)
    timeout "$(lim "${SB_TIMEOUT:-150}")" python3 benchmarks/bench_sampling.py --repeats "${SB_REPEATS:-5}" \
      --vocab "${SB_VOCAB-4096,151936,248320}" --out "$OUT/sampling.json" 2>&1 | grep -v Warning \
      | tee "$OUT/sampling.txt" ;;
  ab)  # benchmarks/ab_decode.py: variants of module switches in one load of the 40-layer bundle
    V=""; for v in ${AB_VARIANTS:-base:}; do V="$V --variant $v"; done
    timeout -s INT -k 5 "$(lim "${AB_TIMEOUT:-400}")" python3 -P benchmarks/ab_decode.py --dir /tmp/bd $V \
      --rounds "${AB_ROUNDS:-3}" --profile --json "$OUT/ab${AB_TAG:-}.json" 2>&1 | grep -v Warning \
      | tee "$OUT/ab${AB_TAG:-}.txt" | tail -12 ;;
  gtests)
    for f in ${GT:-tests/engine/test_speculative_cuda.py}; do
      n=$(basename "$f" .py)
      echo "--- $f $(date -u +%T)"
      timeout -s INT -k 10 "$(lim "${GT_TIMEOUT:-300}")" python3 -m pytest -v -p no:cacheprovider --durations=12 \
        ${GT_K:+-k "$GT_K"} "$f" > "$OUT/gtests-$n.txt" 2>&1
      echo "rc $?"; grep -E "FAILED|ERROR|Error|assert" "$OUT/gtests-$n.txt" | head -20
      grep -E "passed|failed" "$OUT/gtests-$n.txt" | tail -2; grep -E "^[0-9.]+s (call|setup)" "$OUT/gtests-$n.txt" | head -6
      [ $((END - SECONDS)) -lt 20 ] && break
    done ;;
  *) echo "unknown phase $ph" ;;
  esac
done
echo "=== done $(date -u +%T)"
