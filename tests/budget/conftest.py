from pathlib import Path

import pytest

from edgerun.budget import inputs
from edgerun.config import load_device_profile

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MODELS = ("qwen3.6-35b-a3b", "qwen3-30b-a3b")
DEVICES = ("jetson_thor", "orin", "orin_nano", "rtx5070", "cpu")


@pytest.fixture(scope="session")
def model_inputs():
    """The real models' metadata (configs/models/*.json), int4 g32 experts."""
    return {name: inputs.from_config_file(CONFIGS / "models" / f"{name}.json") for name in MODELS}


@pytest.fixture(scope="session")
def profiles():
    return {name: load_device_profile(CONFIGS / f"{name}.yaml") for name in DEVICES}
