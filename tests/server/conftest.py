import pytest
from server_helpers import build_served_model


@pytest.fixture(scope="session")
def served_model(tmp_path_factory):
    """A tiny random qwen3_5_moe checkpoint with a byte-level tokenizer and a chat template."""
    return build_served_model(tmp_path_factory.mktemp("served") / "tiny")
