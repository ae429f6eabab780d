"""The kernels' arrival counters (``kernels/scratch.py``): one set a device and scratch set, kept
for the process, never allocated during graph capture."""

import pytest
import torch

from edgerun.kernels import scratch as S
from edgerun.kernels.scratch import scratch_set


def test_counters_are_kept_and_never_allocated_during_capture(monkeypatch):
    cpu = torch.device("cpu")
    c = S.counters(cpu, 10)
    assert c.dtype == torch.int32 and c.numel() >= 10 and not c.any()
    assert S.counters(cpu, 5) is c  # one set a device, kept
    with scratch_set(1):  # a lane's calls (another stream) use a set of their own
        lane = S.counters(cpu, 5)
        assert lane is not c and S.counters(cpu, 5) is lane
    assert S.counters(cpu, 5) is c
    # a larger need replaces the set, and the old one stays alive (a captured graph reads it)
    monkeypatch.setitem(S._COUNTERS, (cpu, 0), c)
    monkeypatch.setattr(S, "_RETIRED", [])
    bigger = S.counters(cpu, c.numel() + 1)
    assert bigger is not c and bigger.numel() > c.numel() and not bigger.any()
    assert S._RETIRED == [c] and S.counters(cpu, 5) is bigger
    # a fill captured into a graph would not have run before the next eager call: refused
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    gpu = torch.device("cuda", 7)
    monkeypatch.delitem(S._COUNTERS, (gpu, 0), raising=False)
    with pytest.raises(RuntimeError, match="outside graph capture"):
        S.counters(gpu, 10)
