"""Tokenizer wrapper, streaming detokenization, chat template and stop strings."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from edgerun.engine.runner import _TextStream
from edgerun.errors import ConfigError
from edgerun.tokenizer import StreamDecoder, Tokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(
        ["In the beginning God created the heaven and the earth. ünïcødé ✓ 中文"] * 20, trainer
    )
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": TEMPLATE})
    )
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return d


def test_eos_ids_from_generation_config_and_eos_token(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    assert tok.eos_token_ids == (0, 2)


def test_chat_template_renders(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_chat_template_raise_exception_is_a_config_error(tmp_path, tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ConfigError, match="roles must alternate"):
        tok.apply_chat_template([])


def test_stream_decoder_never_splits_characters(tok_dir):
    tok = Tokenizer.from_dir(tok_dir)
    text = "ünïcødé ✓ 中文 the earth"
    ids = tok.encode(text)
    # byte-level tokens: force single-byte pieces so multi-byte characters span tokens
    byte_ids = [tok.tok.token_to_id(c) for c in "".join(tok.tok.id_to_token(i) for i in ids)]
    assert None not in byte_ids and len(byte_ids) > len(text)
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in byte_ids] + [dec.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


class _CharTok:
    """A tokenizer stand-in: token i is chr(i)."""

    def decode(self, ids, skip_special=True):
        return "".join(chr(i) for i in ids)


def _run(stream, text):
    out, stopped = [], False
    for ch in text:
        delta, stopped = stream.push(ord(ch))
        out.append(delta)
        if stopped:
            break
    if not stopped:
        out.append(stream.flush())
    return "".join(out), stopped


def test_stop_string_cuts_output_before_it():
    text, stopped = _run(_TextStream(_CharTok(), ("END",)), "hello wENorld ENDafter")
    assert stopped and text == "hello wENorld "


def test_stop_string_text_is_held_back_until_it_cannot_match():
    stream = _TextStream(_CharTok(), ("xyz",))
    assert stream.push(ord("a")) == ("a", False)  # cannot start "xyz": sent at once
    assert stream.push(ord("x")) == ("", False)  # may start it: held
    assert stream.push(ord("y")) == ("", False)
    assert stream.push(ord("q")) == ("xyq", False)  # no longer can: released
    assert stream.push(ord("x")) == ("", False)
    assert stream.flush() == "x"


def test_earliest_of_several_stop_strings_wins():
    text, stopped = _run(_TextStream(_CharTok(), ("cd", "bcde")), "abcdef")
    assert stopped and text == "ab"
