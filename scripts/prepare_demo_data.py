"""Prepare the demo model's data: the King James Bible, split by chapter, and a byte-level BPE.

Source: Debian's ``bible-kjv-text`` (public domain text; ``apt-get install -y bible-kjv-text``).
Its ``/usr/lib/bible.data`` is a compressed random-access format, read through the ``bible``
program of ``bible-kjv`` (a dependency): ``bible -f Gen1:1-Rev22:21`` prints one verse a line,
``Ge1:1 In the beginning ...``. ``--kjv-text`` takes such a dump instead of running it.

Split (deterministic, by whole chapters): chapters are numbered 0..1188 in canonical order;
chapter i is held out as **test** when i % 20 == 10 and as **validation** when i % 20 == 15
(about 5% each); the rest (90%) is train. Validation picks the checkpoint, test is reported.

Text format, the same for every split: one verse per line (reference dropped), the chapters of
a book in order; in the ``.txt`` files each book ends with ``<|endoftext|>``. The tokenizer is
trained on the train split alone. Writes to ``--out`` (default ``.demodata/``, git-ignored):
train.txt, val.txt, test.txt, tokenizer.json, split.json; and with ``--heldout-slice`` the first
test chapters, up to 60 000 bytes, as plain verse lines (the test file of tests/test_demo_model.py).

    python scripts/prepare_demo_data.py --heldout-slice tests/data/kjv_heldout.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOT = SPECIAL_TOKENS[0]
VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.+)$")
# Qwen2's pre-tokenizer split (words with their leading space, single digits, newline runs).
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEST_MOD, TEST_REM, VAL_REM = 20, 10, 15
SLICE_BYTES = 60_000


@dataclass
class Chapter:
    index: int  # canonical order, 0..1188
    book: str
    number: int
    verses: list[str] = field(default_factory=list)

    @property
    def split(self) -> str:
        r = self.index % TEST_MOD
        return "test" if r == TEST_REM else "val" if r == VAL_REM else "train"

    def text(self) -> str:
        return "".join(v + "\n" for v in self.verses)


def read_kjv(dump: Path | None) -> str:
    if dump is not None:
        return dump.read_text()
    try:
        out = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True)
    except FileNotFoundError as exc:
        raise SystemExit(
            "`bible` not found: apt-get install -y bible-kjv-text (it pulls in bible-kjv)"
        ) from exc
    return out.stdout


def parse(raw: str) -> list[Chapter]:
    chapters: list[Chapter] = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        m = VERSE.match(line)
        if m is None:
            raise SystemExit(f"line {n}: not a 'BookC:V text' verse line: {line[:60]!r}")
        book, chap, text = m.group(1), int(m.group(2)), " ".join(m.group(4).split())
        if not chapters or (chapters[-1].book, chapters[-1].number) != (book, chap):
            chapters.append(Chapter(len(chapters), book, chap))
        chapters[-1].verses.append(text)
    if len(chapters) != 1189:
        raise SystemExit(f"expected the 1189 chapters of the KJV, parsed {len(chapters)}")
    return chapters


def split_text(chapters: list[Chapter], split: str) -> str:
    """The split's text: each book's chapters (of that split) in order, then <|endoftext|>."""
    books: dict[str, list[str]] = {}
    for c in chapters:
        if c.split == split:
            books.setdefault(c.book, []).append(c.text())
    return "".join("".join(parts) + EOT for parts in books.values())


def train_tokenizer(train_text: str, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = train_text.replace(EOT, "").splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(".demodata"))
    ap.add_argument("--kjv-text", type=Path, default=None, help="a `bible -f Gen1:1-Rev22:21` dump")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--heldout-slice", type=Path, default=None, help="write the test slice here")
    args = ap.parse_args()

    raw = read_kjv(args.kjv_text)
    chapters = parse(raw)
    args.out.mkdir(parents=True, exist_ok=True)
    texts = {s: split_text(chapters, s) for s in ("train", "val", "test")}
    for s, t in texts.items():
        (args.out / f"{s}.txt").write_text(t)

    tok = train_tokenizer(texts["train"], args.vocab_size)
    tok.save(str(args.out / "tokenizer.json"))
    meta = {
        "source": "Debian bible-kjv-text (bible -f Gen1:1-Rev22:21)",
        "source_sha256": hashlib.sha256(raw.encode()).hexdigest(),
        "rule": f"chapter i (0-based, canonical order): test if i % {TEST_MOD} == {TEST_REM}, "
        f"val if i % {TEST_MOD} == {VAL_REM}, else train",
        "vocab_size": tok.get_vocab_size(),
        "special_tokens": {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
    }
    for s, t in texts.items():
        picked = [c for c in chapters if c.split == s]
        meta[s] = {
            "chapters": len(picked),
            "verses": sum(len(c.verses) for c in picked),
            "bytes": len(t.encode()),
            "tokens": len(tok.encode(t).ids),
        }
    meta["test_chapters"] = [f"{c.book} {c.number}" for c in chapters if c.split == "test"]
    meta["val_chapters"] = [f"{c.book} {c.number}" for c in chapters if c.split == "val"]

    if args.heldout_slice is not None:
        parts, size = [], 0
        for c in chapters:
            if c.split != "test":
                continue
            t = c.text()
            if size + len(t.encode()) > SLICE_BYTES:
                break
            parts.append(t)
            size += len(t.encode())
        args.heldout_slice.parent.mkdir(parents=True, exist_ok=True)
        args.heldout_slice.write_text("".join(parts))
        meta["heldout_slice"] = {"path": str(args.heldout_slice), "chapters": len(parts), "bytes": size}
    (args.out / "split.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps({k: v for k, v in meta.items() if not k.endswith("_chapters")}, indent=1))


if __name__ == "__main__":
    main()
