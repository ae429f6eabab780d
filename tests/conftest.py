import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

ARCHS = ("qwen3_moe", "qwen3_5_moe")


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{arch: (hf_model, checkpoint_dir)}: tiny random HF checkpoints written by save_pretrained."""
    from hf_fixtures import build_hf

    out = {}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(arch)
        out[arch] = (build_hf(arch, d / "hf", seed=1), d / "hf")
    return out
