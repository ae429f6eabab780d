"""``edgerun bench decode``'s markdown report, from a result recorded on a GPU (docs/bench/)."""

import json
from pathlib import Path

from edgerun.bench.decode import markdown

RESULT = Path(__file__).parents[1] / "docs/bench/decode40_2026-12-05/fused_new.json"


def test_the_report_names_a_resident_steps_kernels_and_rate():
    result = json.loads(RESULT.read_text())
    text = markdown(result)
    assert "| resident | 256 | True | 0.03 | 539.2 (538.6-539.4) |" in text
    assert "resident: 325 kernels a step, 3,074 GPU us a step" in text
    del result["configs"][0]["profile"]  # a configuration not profiled (streamed) says nothing of it
    assert "kernels a step" not in markdown(result)
