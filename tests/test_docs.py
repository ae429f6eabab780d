"""The README and the command-line doc say what the code does."""

import re
from pathlib import Path

import pytest

from edgerun.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_links_nothing_outside_the_repository():
    targets = re.findall(r"\]\(([^)]+)\)", README)
    assert targets and all(not re.match(r"[a-z]+://", t) for t in targets), targets
    for t in targets:
        assert (ROOT / t.split("#")[0]).exists(), t
    urls = [u for u in re.findall(r"https?://\S+", README) if not u.startswith("http://localhost/")]
    assert urls == []


def test_readme_says_when_to_move_to_a_multi_gpu_server():
    assert "vLLM" in README and "SGLang" in README and "same Hugging Face checkpoint" in README


def test_readme_does_not_promise_a_cpu_wheel_from_the_pin():
    assert "(a CPU wheel;" not in README and "PyPI alone, on Linux x86_64, it is the CUDA build" in README


@pytest.mark.parametrize("command", ["generate", "serve", "trace", "plan"])
def test_the_shared_flags_are_spelled_the_same_in_every_command(command):
    """docs/cli.md's table: --model, --profile, --context in every command that runs or plans."""
    sub = build_parser()._subparsers._group_actions[0].choices[command]
    flags = {s for a in sub._actions for s in a.option_strings}
    assert {"--model", "--profile", "--context", "--quota"} <= flags
    if command != "plan":
        device = next(a for a in sub._actions if "--device" in a.option_strings)
        assert device.metavar == "{cpu,cuda}"
