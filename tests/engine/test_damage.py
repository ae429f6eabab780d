"""A damaged bundle never yields a token: every expert block read (streamed, O_DIRECT and
buffered; preloaded; resident) is checked against its manifest checksum, a block that fails is
named and never cached, a repaired file is read again; an older bundle without checksums is read
as a counted fallback, and logits that are not finite stop the request (host loop and the
decoder's queued greedy path)."""

import json
import re
import shutil

import pytest
import torch

from edgerun.bundle.reader import Bundle, load_bundle_model
from edgerun.config import CacheConfig
from edgerun.engine.graphs import DecodeGraphs
from edgerun.engine.provenance import provenance
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import NonFiniteLogits, Sampler, SamplingParams
from edgerun.errors import ChecksumError

PROMPT = list(range(3, 20))
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
NAMED = re.compile(
    r"L(\d+)\.bin: layer (\d+) expert (\d+)'s block \(bytes \[(\d+), (\d+)\)\) fails its checksum"
)


@pytest.fixture
def bundle(bundles, tmp_path):
    dst = tmp_path / "bundle"
    shutil.copytree(bundles[("qwen3_moe", "int4")], dst)
    return dst


def _damage(path, layer: int, component: str, value: int) -> bytes:
    """Overwrite ``component`` of every block of ``layer`` in place; returns the file's old bytes."""
    b = Bundle.open(path)
    f, lay = b.expert_path(layer), b.layouts[layer]
    old = f.read_bytes()
    c = next(c for c in lay.components if c.name == component)
    with open(f, "r+b") as out:
        for e in range(b.args.num_experts):
            out.seek(e * lay.block_bytes + c.offset)
            out.write(bytes([value]) * c.nbytes)
    return old


@pytest.mark.parametrize("mode", ["direct", "buffered"])
def test_a_corrupt_block_is_named_not_cached_and_read_again_once_repaired(bundle, mode):
    runner = Runner.load(bundle, device="cpu", cache=CacheConfig(quotas=4, read_mode=mode))
    want = runner.generate_ids(PROMPT, GREEDY)
    layer = runner.args.moe_layers[-1]
    old = _damage(bundle, layer, "down.weight", 0x77)
    with pytest.raises(ChecksumError) as info:
        runner.generate_ids([9, *PROMPT], GREEDY)  # another prompt: the cache holds other experts
    m = NAMED.search(str(info.value))
    assert m, info.value
    e, start, end = int(m.group(3)), int(m.group(4)), int(m.group(5))
    lay = runner.cache.bundle.layouts[layer]
    assert int(m.group(2)) == layer and (start, end) == (e * lay.block_bytes, (e + 1) * lay.block_bytes)
    assert e not in runner.cache.slots[layer].slot_of  # the damaged block was not cached
    faults = runner.cache.read_faults()
    assert faults["checksum"] >= 1 and faults["reread"] >= faults["checksum"] and faults["io"] == 0

    runner.cache.bundle.expert_path(layer).write_bytes(old)  # repaired in place
    assert runner.generate_ids(PROMPT, GREEDY) == want


@pytest.mark.parametrize("how", ["resident", "preloaded"])
def test_loading_refuses_a_corrupt_block(bundle, how):
    layer = Bundle.open(bundle).args.moe_layers[0]
    _damage(bundle, layer, "gate_up.scales", 0x7F)
    with pytest.raises(ChecksumError, match=rf"layer {layer} expert 0's block \(bytes \[0, "):
        if how == "resident":
            load_bundle_model(bundle, dtype=torch.float32)
        else:  # a quota of every expert reads them all at load
            Runner.load(bundle, device="cpu", cache=CacheConfig(quotas=64))


def test_a_damaged_sidecar_is_refused(bundle):
    b = Bundle.open(bundle)
    side = bundle / b.manifest.layer(b.args.moe_layers[0]).sidecar.file
    side.write_bytes(b"\xff" * side.stat().st_size)  # NaN global scales, the size unchanged
    with pytest.raises(ChecksumError, match=r"L\d+\.scales: layer \d+'s sidecar .* does not match"):
        Runner.load(bundle, device="cpu", cache=CacheConfig(quotas=4))


def _without_checksums(path) -> None:
    doc = json.loads((path / "manifest.json").read_text())
    for rec in doc["layers"]:
        del rec["block_xxh3"]
    doc.pop("manifest_blake2b", None)  # an older bundle: no hash of its own either
    (path / "manifest.json").write_text(json.dumps(doc))


def test_an_older_bundle_reads_unchecked_as_a_counted_fallback_and_nan_logits_stop(bundle):
    _without_checksums(bundle)
    runner = Runner.load(bundle, device="cpu", cache=CacheConfig(quotas=4))
    assert "no block_xxh3" in runner.fallbacks()["unchecked_blocks"]
    assert "unchecked_blocks: " in provenance(runner, bundle)
    runner.generate_ids(PROMPT, GREEDY)
    assert runner.fallback_counts()["unchecked_blocks"] == runner.cache.totals().misses
    resident = Runner.load(bundle, device="cpu")
    E, layers = resident.args.num_experts, len(resident.args.moe_layers)
    assert resident.fallback_counts()["unchecked_blocks"] == E * layers

    _damage(bundle, runner.args.moe_layers[0], "gate_up.scales", 0x7F)  # NaN scale codes, unchecked
    runner = Runner.load(bundle, device="cpu", cache=CacheConfig(quotas=4))
    events = runner.generate(runner.request(PROMPT, GREEDY))
    with pytest.raises(NonFiniteLogits, match=r"of 97 logits are NaN or infinite"):
        for _ in events:  # prefill chunks yield too; the first token's logits stop the request
            pass
    assert runner.nonfinite_logits == 1


def test_sampling_refuses_nonfinite_logits():
    logits = torch.tensor([0.0, 1.0, float("nan"), 2.0])
    for params in (SamplingParams(), SamplingParams(temperature=0.7, seed=1)):
        with pytest.raises(NonFiniteLogits, match="1 of 4 logits"):
            Sampler(params)(logits)
    assert Sampler(SamplingParams())(torch.tensor([0.0, 3.0, 1.0])) == 1


def test_the_queued_greedy_path_refuses_nonfinite_logits(bundles, monkeypatch):
    """The CUDA decoder picks greedy tokens on the device and queues the next step before the
    host reads one (run uncaptured on the CPU here): the chosen logit comes back with its token
    (argmax takes a NaN as the largest, so one NaN anywhere is chosen), and a bad step is
    refused, not emitted. One NaN among the logits, then one +inf."""
    for bad in (float("nan"), float("inf")):
        runner = Runner.load(bundles[("qwen3_moe", "int4")], device="cpu", cache=CacheConfig(quotas=64))
        runner.decoder = DecodeGraphs(
            runner.model, runner.args, runner.cache, runner.kernels, torch.device("cpu"), 64, runner.steps
        )
        head, plain = runner.model.lm_head, runner.model.lm_head.forward

        def one_bad_logit(
            x, *a, out=None, plain=plain, bad=bad, **kw
        ):  # the decoder's head writes into ``out``
            y = plain(x, *a, out=out, **kw)
            if out is not None:
                out[..., 41] = bad
            return y

        monkeypatch.setattr(head, "forward", one_bad_logit)
        state = runner.decoder.reset()
        with torch.no_grad():
            tokens = runner._tokens(state, runner.prefill(state, PROMPT), Sampler(GREEDY), 5)
            assert next(tokens) >= 0  # the prefill's token: its logits are finite
            with pytest.raises(NonFiniteLogits, match=r"NaN or infinite"):
                next(tokens)
