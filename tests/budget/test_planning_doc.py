"""docs/planning.md shows `edgerun plan` output and a closing table; both must match the planner."""

import contextlib
import io
import re
import shlex
from pathlib import Path

from edgerun.budget import report
from edgerun.budget.cli import main

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "planning.md").read_text()


def _run(args: list[str]) -> tuple[int, str]:
    args = [str(ROOT / a) if a.startswith("configs/") else a for a in args]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        rc = main(args)
    return rc, out.getvalue()


def test_shown_outputs_are_current():
    blocks = re.findall(r"```console\n\$ edgerun plan ([^\n]*)\n(.*?)```", DOC, re.S)
    full = [
        (cmd, text) for cmd, text in blocks if "--trace" not in cmd and not text.startswith(("[...", "$ "))
    ]
    assert len(full) >= 13  # 2 models x 3 devices x 2 contexts, and the refusal
    for cmd, text in full:
        assert _run(shlex.split(cmd))[1] == text, cmd


def test_closing_table_is_current():
    rows = re.findall(
        r"^\| (qwen\S+) \| (\w+) \| (\d+)K \| ([^|]+) \| ([\d.]+) \| ([^|]+) \| ([\d.]+) ", DOC, re.M
    )
    assert len(rows) == 12
    for model, device, k, quota, reads, copies, tok_s in rows:
        args = ["--profile", f"configs/{device}.yaml", "--model", f"configs/models/{model}.json"]
        rc, text = _run([*args, "--context", str(int(k) * 1024), "--format", "json"])
        p = report.from_json(text)
        assert rc == 0 and quota.startswith(str(p.quotas[0])) and len(set(p.quotas)) == 1
        assert f"{p.prediction.misses_per_token:.2f}" == reads and f"{p.prediction.tok_s:.1f}" == tok_s
        if p.memory_kind == "discrete":
            pcie = p.prediction.far_reads_per_token or p.prediction.device_misses_per_token
            assert f"{pcie:.2f}" == copies.strip()
