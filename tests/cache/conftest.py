"""A small expert file for the reader tests."""

import os

import pytest


@pytest.fixture()
def expert_file(tmp_path):
    """(path, data): 16 random blocks of 8192 bytes."""
    data = os.urandom(8192 * 16)
    p = tmp_path / "L00.bin"
    p.write_bytes(data)
    return p, data
