import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# `python -m pytest` puts the checkout's root on sys.path, where its kernels/ folder (installed as
# edgerun.kernels, never a top-level package) would shadow the PyPI package `kernels`, which
# transformers (the tests' oracle) imports: the root is taken off (edgerun imports as installed)
ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]

# The test models are tiny: intra-op threads only add OpenMP barriers, which stall badly when
# the machine is shared (20x slower under load). One thread keeps the suite fast and stable.
torch.set_num_threads(1)

from hf_fixtures import ARCHS  # noqa: E402

INTERPRET = "test_interpret.py"  # tests/kernels/: Triton's interpreter, each script a child process


def pytest_collection_modifyitems(session, config, items):
    """The interpreter scripts' tests last: they only wait for children started with the
    session (``interpreter_pool``), which by then have run beside every other test."""
    items.sort(key=lambda item: item.path.name == INTERPRET)  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def interpreter_pool(request, tmp_path_factory):
    """Starts the selected interpreter scripts (tests/kernels/test_interpret.py) with the
    session's first test, so that their children run beside the suite's single-threaded tests."""
    import importlib.util

    items = [item for item in request.session.items if item.path.name == INTERPRET]
    if not items or importlib.util.find_spec("triton") is None:
        yield
        return
    module = items[0].module
    with module.started(module.selected_cases(items), tmp_path_factory):
        yield


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """{arch: (hf_model, checkpoint_dir)}: tiny random HF checkpoints written by save_pretrained."""
    from hf_fixtures import build_hf

    out = {}
    for arch in ARCHS:
        d = tmp_path_factory.mktemp(arch)
        out[arch] = (build_hf(arch, d / "hf", seed=1), d / "hf")
    return out
