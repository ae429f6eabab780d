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


def _edit_manifest(path, fn, stamp=True):
    """Edit the manifest; ``stamp``: record its own hash again (an edit made on purpose, which
    the checks after that hash must catch), else leave the hash as convert wrote it."""
    m = json.loads((path / F.MANIFEST).read_text())
    fn(m)
    if stamp:
        m[F.MANIFEST_HASH] = F.manifest_fingerprint(m)
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


def manifest_edited_in_place(p, bundles):  # a valid manifest for another model: its hash says so
    _edit_manifest(p, lambda m: m["model_config"].update(rms_norm_eps=0.5), stamp=False)


def expert_file_linked_outside(p, bundles):
    outside = p.parent / "elsewhere.bin"
    (p / "experts/L02.bin").rename(outside)
    (p / "experts/L02.bin").symlink_to(outside)


def two_layers_one_file(p, bundles):
    _edit_manifest(p, lambda m: m["layers"][0].update(file=m["layers"][1]["file"]))


def checksum_not_hex(p, bundles):
    _edit_manifest(p, lambda m: m["layers"][1]["block_xxh3"].__setitem__(2, "z" * 16))


def tokenizer_file_not_a_name(p, bundles):
    _edit_manifest(p, lambda m: m["tokenizer"]["files"].append(7))


def float_version(p, bundles):
    _edit_manifest(p, lambda m: m.update(version=2.0))


def nested_too_deep(p, bundles):
    (p / F.MANIFEST).write_text("[" * 100_000 + "]" * 100_000)


def dense_offsets_not_integers(p, bundles):
    raw = (p / F.DENSE).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    lo, hi = header["model.norm.weight"]["data_offsets"]
    header["model.norm.weight"]["data_offsets"] = [float(lo), float(hi)]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (n - len(text))
    assert len(text) == n
    (p / F.DENSE).write_bytes(raw[:8] + text + raw[8 + n :])


CASES = {
    manifest_edited_in_place: (False, r"do not match its key 'manifest_blake2b': the manifest was edited"),
    expert_file_linked_outside: (False, r"path 'experts/L02.bin' leads outside the bundle .*symbolic link"),
    two_layers_one_file: (False, r"names 'experts/L02.bin' twice for two roles"),
    checksum_not_hex: (False, r"key 'block_xxh3\[2\]' must be 16 hex digits, got 'zzzzzzzzzzzzzzzz'"),
    tokenizer_file_not_a_name: (False, r"\[tokenizer\]: key 'files' must be a list of file names"),
    float_version: (False, r"unknown bundle format version 2.0 "),
    nested_too_deep: (False, r"manifest.json: not valid JSON \(RecursionError"),
    dense_offsets_not_integers: (False, r"tensor 'model.norm.weight' has a malformed header entry"),
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
