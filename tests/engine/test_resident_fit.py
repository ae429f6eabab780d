"""A model held whole (no expert cache) whose weights cannot fit the memory free on its device is
refused before anything is allocated, naming the bytes and what would fit; the sizes come from
the config or manifest alone and are the loaded model's, byte for byte."""

import pytest
import torch

from edgerun.bundle.convert import ConvertOptions, convert
from edgerun.engine import setup
from edgerun.engine.runner import DEMO_MODEL, Runner
from edgerun.engine.speculative import SpeculativeConfig
from edgerun.errors import ConfigError


@pytest.mark.parametrize("mtp", [False, True])
def test_the_sizes_are_the_loaded_models(mtp):
    spec = SpeculativeConfig("mtp", 1) if mtp else None
    runner = Runner.load(None, device="cpu", dtype=torch.bfloat16, speculative=spec)
    dense, experts = setup.resident_weight_bytes(DEMO_MODEL, "bf16", mtp)
    assert dense + experts == sum(p.nbytes for p in runner.model.parameters())
    routed = [m.experts for m in runner.model.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    assert experts == sum(e.gate_up_proj.nbytes + e.down_proj.nbytes for e in routed[: len(routed) - mtp])
    assert setup.resident_weight_bytes(DEMO_MODEL, "fp32", mtp) == (2 * dense, 2 * experts)


def test_a_model_that_cannot_fit_is_refused_before_loading(tmp_path, monkeypatch):
    import psutil

    from edgerun.models import checkpoint

    dense, experts = setup.resident_weight_bytes(DEMO_MODEL, "fp32")
    total = psutil.virtual_memory().total

    class Tight:  # the host's available memory: one byte short of the weights
        available = dense + experts - 1

    def loads(*a, **kw):
        raise AssertionError("the loader ran: the refusal must come first")

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tight())
    monkeypatch.setattr(checkpoint, "load_model", loads)
    with pytest.raises(ConfigError) as err:
        Runner.load(None, device="cpu", dtype=torch.float32)
    text = str(err.value)
    assert "held whole in fp32 its weights take" in text and "routed experts" in text
    assert "edgerun convert" in text and "--quota N" in text and "free on this host" in text
    # a bundle held whole: its dense part as stored, its experts dequantized to the compute dtype
    bundle = tmp_path / "b"
    convert(DEMO_MODEL, bundle, ConvertOptions("int4", 32, dense="int4"))
    bdense, bexperts = setup.resident_weight_bytes(bundle, "fp32")
    assert bexperts == experts and bdense < dense
    Tight.available = bdense + bexperts - 1
    with pytest.raises(ConfigError, match=r"--model .* --profile configs/<your device>\.yaml, or --quota N"):
        Runner.load(bundle, device="cpu", dtype=torch.float32)
    Tight.available = total  # fits: loads (the real loader), and streams need no check
    monkeypatch.undo()
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tight())
    assert Runner.load(bundle, device="cpu", dtype=torch.float32).cache is None


@pytest.mark.parametrize("integrated", [False, True])
def test_free_memory_on_a_gpu_that_shares_the_hosts(monkeypatch, integrated):
    """A discrete GPU's free memory is what a load may take; on one that shares the host's memory
    (Jetson) the CUDA driver does not count page cache or swap as free, so the host's available
    memory and free swap count too, whichever is larger (the driver's figure alone would refuse
    models that load)."""
    import types

    import psutil

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (2 * gib, 64 * gib))
    props = types.SimpleNamespace(is_integrated=integrated)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: props)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: types.SimpleNamespace(available=5 * gib))
    monkeypatch.setattr(psutil, "swap_memory", lambda: types.SimpleNamespace(free=3 * gib))
    assert setup._free_memory("cuda") == (8 * gib if integrated else 2 * gib)
    assert setup._free_memory("cpu") == 5 * gib
    with pytest.raises(ConfigError, match="free on the GPU"):
        setup.check_resident_fits(DEMO_MODEL, "cuda", "bf16", free=1 << 20)
