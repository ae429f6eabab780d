"""The shipped units pass ``systemd-analyze verify`` with no warning, and say what the daemon expects."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNITS = Path(__file__).resolve().parents[2] / "systemd"


def test_units_declare_the_lifecycle():
    service = (UNITS / "edgerun.service").read_text()
    for line in (
        "Type=notify",
        "WatchdogSec=",
        "RuntimeDirectory=edgerun",
        "Restart=on-failure",
        "RestartPreventExitStatus=2",
        "TimeoutStopSec=",
    ):
        assert line in service
    socket_unit = (UNITS / "edgerun.socket").read_text()
    assert "ListenStream=/run/edgerun/edgerun.sock" in socket_unit and "SocketMode=0660" in socket_unit


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (apt-get install systemd)"
)
def test_systemd_analyze_verify(tmp_path):
    # ExecStart must name an executable that exists here: point it at this interpreter
    service = (
        (UNITS / "edgerun.service")
        .read_text()
        .replace("ExecStart=/usr/local/bin/edgerun", f"ExecStart={sys.executable} -m edgerun.cli")
    )
    (tmp_path / "edgerun.service").write_text(service)
    shutil.copy(UNITS / "edgerun.socket", tmp_path / "edgerun.socket")
    res = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "edgerun.service", "edgerun.socket"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0 and not res.stderr.strip(), res.stderr  # warnings count as failures
