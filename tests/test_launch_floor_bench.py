"""benchmarks/launch_floor.py's variants: what a persistent variant runs with, and the names it refuses."""

import sys

import bench_scripts
import pytest
import torch


@pytest.fixture(scope="module")
def lf():
    return bench_scripts.load("launch_floor")


def test_a_persistent_variant_names_its_arguments(lf):
    # (before, dep, per_sm, wait, one poller, split counters) for a 16 KB tile in 4 KB steps
    assert lf.persist_plan("persist-first/4", 16384, 4096) == (1, False, 4, True, True, 1)
    assert lf.persist_plan("persist-all-s8/2", 16384, 4096) == (4, False, 2, True, True, 8)
    assert lf.persist_plan("persist-s32", 16384, 4096) == (1, False, 4, True, True, 32)
    assert lf.persist_plan("persist-every/8", 8192, 4096) == (1, False, 8, True, False, 1)
    assert lf.persist_plan("persist-free/4", 16384, 4096) == (1, False, 4, False, True, 1)
    assert lf.persist_plan("persist-dep/2", 16384, 4096) == (1, True, 2, True, True, 1)
    assert lf.persist_plan("pdl-first", 16384, 4096) is None


@pytest.mark.parametrize("name", ["persist-frst/4", "persist-first/x", "pdl-first/4", "nope"])
def test_a_variant_that_names_nothing_is_refused(lf, name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["launch_floor.py", "--variants", f"pdl-first,{name}"])
    with pytest.raises(SystemExit) as e:
        lf.main()
    assert e.value.code == 2 and repr(name) in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the names only where no GPU would run them")
def test_known_variants_pass_to_the_gpu_check(lf, monkeypatch):
    names = "plain,first-dep,persist-first/4,persist-all-s8/2,persist-free,persist-every/8"
    monkeypatch.setattr(sys, "argv", ["launch_floor.py", "--variants", names])
    assert lf.main() == 2  # "needs a CUDA GPU", after every name passed
