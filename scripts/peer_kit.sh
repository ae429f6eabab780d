#!/usr/bin/env bash
# Copies the peer kit (../shared/peers/gpu, read-only) into the ignored .devout/peers-gpu and makes
# the edits every edgerun row of docs/benchmarks.md since 2026-12-01 ran with:
#   - the bundle (er_convert.py) and `edgerun bench decode` take `--dense int4`: the dense layers
#     and the lm_head as int4, the format the issue-13 rows compare against llama.cpp's Q4_K_M;
#   - er_bench.py loads as `edgerun generate` does today: Runner.load(path, cache=cache_config(path,
#     quota=q)) and runner.generate(runner.request(ids, params)) (the kit's calls predate both);
#   - PEERKIT_HF=0 skips the bf16 HF-checkpoint runs and PEERKIT_STREAM=0 the streaming rows, so the
#     llama.cpp build, the resident rows and bench decode fit one device call;
#   - PEERKIT_ACT=int8 runs every edgerun row with --dense-act int8 --expert-act int8 (W4A8; unset or
#     bf16: as they are).
#
#   bash scripts/peer_kit.sh [KIT]      # then: PEERKIT_HF=0 PEERKIT_STREAM=0 bash .devout/peers-gpu/run.sh DIR
set -eu
KIT=${1:-$(dirname "$0")/../../shared/peers/gpu}
DST=.devout/peers-gpu
rm -rf "$DST"
mkdir -p .devout
cp -r "$KIT" "$DST"
chmod -R u+w "$DST"
python3 - "$DST" <<'PYEOF'
import sys
from pathlib import Path

d = Path(sys.argv[1])


def edit(name, old, new, count=1):
    p = d / name
    s = p.read_text()
    assert s.count(old) == count, f"{name}: {old!r} found {s.count(old)} times, expected {count}"
    p.write_text(s.replace(old, new))


edit("run.sh", '"$BUNDLE" --quant int4 && mark bundle', '"$BUNDLE" --quant int4 --dense int4 && mark bundle', 2)
edit("run.sh", '--decode "$DECODE" --repeats "$REPS" --budgets "$BUDGETS"',
     '--decode "$DECODE" --repeats "$REPS" --budgets "$BUDGETS" --dense int4'
     ' --dense-act "${PEERKIT_ACT:-bf16}" --expert-act "${PEERKIT_ACT:-bf16}"')
edit("run.sh", '--max-tokens "$DECODE" --ignore-eos --token-ids "$(cat "$IDS")" "$@"',
     '--max-tokens "$DECODE" --ignore-eos --token-ids "$(cat "$IDS")" --dense-act "${PEERKIT_ACT:-bf16}" '
     '--expert-act "${PEERKIT_ACT:-bf16}" "$@"')
edit("run.sh", '    er_cli hf-resident "$HF"\n    er_runs hf-resident "$HF"\n',
     '    if [ "${PEERKIT_HF:-1}" != 0 ]; then er_cli hf-resident "$HF"; er_runs hf-resident "$HF"; fi\n')
edit("run.sh", '        for q in $QUOTAS; do er_cli "int4-q$q" "$BUNDLE" --quota "$q"; done',
     '        [ "${PEERKIT_STREAM:-1}" != 0 ] && for q in $QUOTAS; do er_cli "int4-q$q" "$BUNDLE" --quota "$q"; done')
edit("run.sh", 'if want edgerun && done_ bundle; then\n    for q in $QUOTAS; do er_runs',
     'if want edgerun && done_ bundle && [ "${PEERKIT_STREAM:-1}" != 0 ]; then\n    for q in $QUOTAS; do er_runs')
edit("er_bench.py", "from edgerun.server.cli import slot_pool\n", "from edgerun.engine.setup import cache_config\n")
edit("er_bench.py",
     "    pool = slot_pool(ns.device, None, None) if ns.quota is not None else None\n"
     "    runner = Runner.load(ns.model, device=ns.device, quota=ns.quota, kernels=KernelPolicy(), pool=pool)\n",
     "    cache = cache_config(ns.model, quota=ns.quota) if ns.quota is not None else None\n"
     "    act = __import__('os').environ.get('PEERKIT_ACT', 'bf16')\n"
     "    runner = Runner.load(ns.model, device=ns.device, cache=cache, kernels=KernelPolicy(dense_act=act, expert_act=act))\n")
edit("er_bench.py", "runner.generate(ids, params)", "runner.generate(runner.request(ids, params))")
print(f"peer kit in {d}, edited")
PYEOF
