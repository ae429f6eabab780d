"""`edgerun verify`: a good bundle passes; each kind of damage is refused with its own message,
naming the file and the offset or key."""

import json
import os
import re
import shutil

import pytest

from edgerun.bundle import format as F
from edgerun.bundle.cli import main
from edgerun.bundle.reader import BundleError
from edgerun.bundle.verify import verify_bundle
from edgerun.safetensors_io import read_header


def test_good_bundle_passes(bundles, capsys):
    path = bundles("qwen3_moe", "int4", 16)
    assert main(["verify", str(path), "--deep"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "block_bytes 4096" in out and "files hashed" in out
    report = verify_bundle(path, deep=True)
    assert report.bytes_hashed == sum(r.bytes for r in report.manifest.files.values())


def _edit_manifest(path, fn):
    m = json.loads((path / F.MANIFEST).read_text())
    fn(m)
    (path / F.MANIFEST).write_text(json.dumps(m))


def _flip(f, offset):
    data = bytearray(f.read_bytes())
    data[offset] ^= 0x01
    f.write_bytes(bytes(data))


def truncated_expert_file(p, bundles):
    os.truncate(p / "experts/L02.bin", 4096 * 5 + 100)


def truncated_sidecar(p, bundles):
    os.truncate(p / "experts/L00.scales", 44)


def misaligned_block_bytes(p, bundles):
    _edit_manifest(p, lambda m: m["layers"][0].update(block_bytes=4096 + 64))


def unknown_version(p, bundles):
    _edit_manifest(p, lambda m: m.update(version=3))


def manifest_of_another_model(p, bundles):
    shutil.copy(bundles("qwen3_5_moe", "int4", 16) / F.MANIFEST, p / F.MANIFEST)


def missing_tokenizer(p, bundles):
    (p / "tokenizer.json").unlink()


def flipped_expert_byte(p, bundles):
    _flip(p / "experts/L02.bin", 3 * 4096 + 77)


def flipped_dense_byte(p, bundles):
    entries, _ = read_header(p / F.DENSE)
    _flip(p / F.DENSE, entries["model.norm.weight"].start + 5)


CASES = {
    truncated_expert_file: (
        False,
        r"experts/L02.bin: truncated expert file: 20580 bytes, expected 24576 .* expert 5's block at offset 20480",
    ),
    truncated_sidecar: (False, r"experts/L00.scales: truncated sidecar: 44 bytes, expected 48"),
    misaligned_block_bytes: (
        False,
        r"key 'layers\[layer 0\].block_bytes' is 4160, not a positive multiple of 4096",
    ),
    unknown_version: (False, r"unknown bundle format version 3 \(this edgerun reads versions 1, 2\)"),
    manifest_of_another_model: (False, r"manifest.json describes another model than .*dense.safetensors"),
    missing_tokenizer: (False, r"missing tokenizer file .*tokenizer.json"),
    flipped_expert_byte: (
        True,
        r"experts/L02.bin: expert 3's block \(bytes \[12288, 16384\)\) fails its blake2b",
    ),
    flipped_dense_byte: (True, r"dense.safetensors: tensor 'model.norm.weight' \(bytes \[\d+, \d+\)\) fails"),
}


@pytest.mark.parametrize("damage", list(CASES), ids=lambda f: f.__name__)
def test_damage_is_refused_with_its_own_message(damage, bundle_copy, bundles, capsys):
    path = bundle_copy("qwen3_moe", "int4", 16)
    damage(path, bundles)
    deep_only, message = CASES[damage]
    if deep_only:
        verify_bundle(path)  # the cheap checks cannot see a flipped byte
    with pytest.raises(BundleError, match=message):
        verify_bundle(path, deep=True)
    assert main(["verify", str(path), "--deep"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("edgerun verify: FAILED: ")
    others = [m for d, (_, m) in CASES.items() if d is not damage]
    assert not any(re.search(m, err) for m in others)  # its own message, no other case's
