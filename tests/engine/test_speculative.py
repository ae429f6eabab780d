"""Speculative decoding with the MTP head on the CPU (issue 17): a verify window's rows are the
one-row decode step's bits; a rolled-back state is plain decoding's state; greedy output with
K = 1, 2, 3 drafts equals plain greedy (resident checkpoint, resident bundle, streamed bundle);
sampling acceptance keeps the target distribution (chi-square); bad settings are named errors."""

import copy

import pytest
import torch

from edgerun.bundle.convert import ConvertOptions, convert
from edgerun.config import CacheConfig
from edgerun.engine import speculative as S
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import Sampler, SamplingParams
from edgerun.errors import CheckpointError, ConfigError, EdgerunError
from edgerun.models.layers import DeltaState, KVCache, exact_rows

PROMPT = [5, 17, 3, 44, 9, 12, 60, 2, 31, 8, 22]
MTP = S.SpeculativeConfig("mtp", 1)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A tiny qwen3_5_moe with an MTP head: the HF checkpoint (per-expert, as save_pretrained
    writes it), and bf16 / int4 bundles converted from its fused rewrite."""
    from tokenizers import Tokenizer, models

    from hf_fixtures import add_mtp, build_hf

    root = tmp_path_factory.mktemp("mtp")
    build_hf("qwen3_5_moe", root / "hf", seed=7, hidden_size=64, moe_intermediate_size=32)
    out = {"hf": add_mtp(root / "hf", root / "hf-mtp", seed=3)}
    fused = add_mtp(root / "hf", root / "fused-mtp", seed=3, fused=True)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t0")).save(
        str(fused / "tokenizer.json")
    )
    for quant, group in (("bf16", None), ("int4", 16)):
        convert(fused, root / quant, ConvertOptions(quant, group))
        out[quant] = root / quant
    return out


def _states_equal(a, b, upto: int) -> bool:
    assert a.pos == b.pos == upto
    for x, y in zip(a.layers, b.layers):
        if isinstance(x, KVCache):
            if not (
                torch.equal(x.k[:, :, :upto], y.k[:, :, :upto])
                and torch.equal(x.v[:, :, :upto], y.v[:, :, :upto])
            ):
                return False
        elif isinstance(x, DeltaState):
            if not (torch.equal(x.conv, y.conv) and torch.equal(x.recurrent, y.recurrent)):
                return False
    return True


def check_device_steps(runner, state, prompt: list[int], kepts, reset):
    """Device-decided steps of K = 2 (engine/spec_steps.py) over ``runner``'s decoder, from
    ``prompt`` prefilled again after ``reset()`` each time, whose drafts match plain greedy's
    for each of ``kepts`` rows: each reports the kept rows, emits plain greedy's tokens, leaves
    the state (KV to the kept rows, every DeltaNet state) equal to plain decoding's after the
    same tokens, and sets the next step's inputs (the positions after the kept rows, the token
    that row chose, the drafts). Returns the steps."""
    from edgerun.engine.spec_steps import SpecSteps

    d, V = runner.decoder, runner.args.vocab_size
    first = int(runner.prefill(state, prompt).argmax())
    start, tokens, after = state.pos, [first], {}
    for i in range(3):
        tokens.append(int(runner.decode_step(state, tokens[-1]).argmax()))
        after[i + 1] = copy.deepcopy(state)
    chain = SpecSteps(d, d.draft_step(), 2)
    for kept in kepts:
        reset()
        runner.prefill(state, prompt)
        d.draft_step().reset()
        chain.start(state.pos, first, tokens[1 : 1 + kept] + [(t + 1) % V for t in tokens[1 + kept : 3]])
        a, emitted = chain.result(chain.launch())
        assert (a, emitted) == (kept, tokens[1 : kept + 2])
        state.pos = start + kept + 1
        assert _states_equal(state, after[kept + 1], start + kept + 1), kept
        v = chain.verify
        assert v.indices[1].tolist() == list(range(start + kept + 1, start + kept + 4))
        assert int(v.indices[2, 0]) == tokens[kept + 1]
        assert torch.equal(v.indices[2, 1:], chain.drafts)
    return chain


@pytest.mark.parametrize("source", ["hf", "int4"])
def test_verify_rows_are_one_row_steps_and_rollback_is_plain_decodings_state(sources, source):
    runner = Runner.load(sources[source], device="cpu")
    model = runner.model
    state = runner.new_state(32)
    runner.prefill(state, PROMPT)
    rows = [7, 70, 33, 1, 50]
    plain = copy.deepcopy(state)
    with torch.inference_mode():
        steps, after = [], {}
        for i, t in enumerate(rows):
            steps.append(runner.decode_step(plain, t))
            after[i + 1] = copy.deepcopy(plain)
        for kept in range(1, len(rows) + 1):
            window = copy.deepcopy(state)
            start = window.pos
            hidden = model.hidden(torch.tensor([rows]), window, rows=True)
            with exact_rows():
                logits = model.lm_head(hidden)[0]
            for i in range(len(rows)):
                assert torch.equal(logits[i], steps[i]), (kept, i)
            window.rollback(start, kept)
            assert _states_equal(window, after[kept], start + kept), kept
            # decoding on from the rolled-back state is decoding on from plain's
            assert torch.equal(runner.decode_step(window, 9), runner.decode_step(after[kept], 9))


def test_speculative_counts_are_the_tokens_a_request_takes():
    """A request that ends inside a verify window (its text's stop string) counts only the tokens
    it took as emitted; one cancelled mid-decode still adds its verify steps to the totals."""
    spec = Runner.load(None, device="cpu", speculative=S.SpeculativeConfig("mtp", 3))
    free = list(spec.generate(spec.request(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))))
    text = "".join(e.text for e in free)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    events = list(
        spec.generate(spec.request(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,))))
    )
    stats = events[-1].stats
    assert events[-1].finish_reason == "stop" and stats.generated_tokens < 40
    assert stats.speculative.emitted == stats.generated_tokens - 1
    before = spec.spec_totals.steps
    gen = spec.generate(spec.request(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True)))
    taken = [next(gen) for _ in range(12)]
    gen.close()  # the client went away
    assert sum(e.token_id is not None for e in taken) > 1 and spec.spec_totals.steps > before


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("source", ["hf", "bf16", "streamed", "demo"])
def test_greedy_with_mtp_drafts_equals_plain_greedy(sources, source, k):
    path = None if source == "demo" else sources["int4" if source == "streamed" else source]
    # a streamed layer's quota holds a verify window's experts: top_k x (k + 1), at most the 6 there are
    cache = CacheConfig(min(6, 2 * (k + 1))) if source == "streamed" else None
    plain = Runner.load(path, device="cpu", cache=cache)
    spec = Runner.load(path, device="cpu", cache=cache, speculative=S.SpeculativeConfig("mtp", k))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = plain.generate_ids(PROMPT, params)
    events = list(spec.generate(spec.request(PROMPT, params)))
    got = [e.token_id for e in events if e.token_id is not None]
    assert torch.equal(torch.tensor(got), torch.tensor(want))
    stats = events[-1].stats.speculative
    assert stats.emitted == len(want) - 1 and stats.drafted >= stats.accepted >= 0
    assert stats.steps < len(want) - 1 or stats.accepted == 0
    line = events[-1].stats.line()
    assert "MTP acceptance" in line and "tok/step" in line and "speed-up" in line
    assert events[-1].stats.row_step_s > 0 and events[-1].stats.speedup > 0
    if source == "demo":  # its MTP head is trained (scripts/train_demo_model.py --mtp-from)
        assert stats.accepted / stats.drafted > 0.3, stats
    if source == "streamed":  # each window's union of experts is counted, per MoE layer
        layers = len(spec.args.moe_layers)  # (the last step may draft nothing: one row, no window)
        assert stats.windows % layers == 0 and stats.steps - 1 <= stats.windows // layers <= stats.steps
        assert 2 <= stats.window_experts / stats.windows <= min(6, 2 * (k + 1))
        assert "experts/layer a verify window" in line


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """An int4 bundle of a tiny qwen3_5_moe with an MTP head and 16 experts (top 2): a streamed
    quota below 16 holds a window of K + 1 rows' experts and still evicts."""
    from tokenizers import Tokenizer, models

    from hf_fixtures import add_mtp, build_hf

    root = tmp_path_factory.mktemp("mtp-wide")
    build_hf("qwen3_5_moe", root / "hf", seed=11, hidden_size=64, moe_intermediate_size=32, num_experts=16)
    fused = add_mtp(root / "hf", root / "fused-mtp", seed=5, fused=True)
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t0")).save(
        str(fused / "tokenizer.json")
    )
    convert(fused, root / "int4", ConvertOptions("int4", 16))
    return root / "int4"


@pytest.mark.parametrize("k", [2, 3])
def test_streamed_windows_that_evict_keep_greedy_output(wide, k):
    """A quota of exactly a window's experts (top_k x (K + 1) of 16): windows miss and evict
    inside a request, and the output is still plain greedy's at the same quota."""
    cache = CacheConfig(2 * (k + 1))
    plain = Runner.load(wide, device="cpu", cache=cache)
    spec = Runner.load(wide, device="cpu", cache=cache, speculative=S.SpeculativeConfig("mtp", k))
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    want = plain.generate_ids(PROMPT, params)
    events = list(spec.generate(spec.request(PROMPT, params)))
    assert [e.token_id for e in events if e.token_id is not None] == want
    totals = spec.cache.totals()
    assert totals.evictions > 0 and totals.misses > 2 * (k + 1) * len(spec.args.moe_layers), totals
    stats = events[-1].stats.speculative
    assert stats.windows and 2 <= stats.window_experts / stats.windows <= 2 * (k + 1)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_every_acceptance_length_keeps_greedy_output(sources, k, monkeypatch):
    """Drafts that are plain greedy's own tokens, some corrupted: every accepted-prefix length
    from 0 to k occurs, and the output is still plain greedy's."""
    plain = Runner.load(sources["hf"], device="cpu")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    want = plain.generate_ids(PROMPT, params)
    g = torch.Generator().manual_seed(k)

    def draft(self, seq, n, choose):
        i = len(seq) - len(PROMPT)  # seq's next token is want[i]
        out = [want[i + j] if i + j < len(want) else 0 for j in range(n)]
        bad = int(torch.randint(0, n + 1, (), generator=g))  # corrupt from this draft on
        out = out[:bad] + [(t + 1) % 97 for t in out[bad:]]
        self.catch_up(seq)
        return out, [torch.zeros(97)] * n

    monkeypatch.setattr(S.MtpDrafter, "draft", draft)
    spec = Runner.load(sources["hf"], device="cpu", speculative=S.SpeculativeConfig("mtp", k))
    events = list(spec.generate(spec.request(PROMPT, params)))
    assert [e.token_id for e in events if e.token_id is not None] == want
    stats = events[-1].stats.speculative
    assert stats.accepted > 0 and stats.tokens_per_step > 1.0


def test_sampling_acceptance_keeps_the_target_distribution():
    """One draft from q, accepted or resampled against p: the emitted token is distributed as p
    (chi-square, 6 tokens, 20000 seeded trials; the 0.1% critical value for 5 dof is 20.5)."""
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    q_logits = torch.tensor([0.0, 2.0, 1.0, 1.0, 0.5, -1.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1234))
    choose = S.draft_chooser(sampler)
    n, counts = 20000, torch.zeros(6)
    for _ in range(n):
        d = choose(q_logits)
        counts[S.accept(sampler, p_logits[None].repeat(2, 1), [d], [q_logits])[0]] += 1
    expected = torch.softmax(p_logits, 0) * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts, expected)
    # and the draft distribution alone is far from p: the test can fail
    drafts = torch.bincount(torch.tensor([choose(q_logits) for _ in range(n)]), minlength=6).float()
    assert float(((drafts - expected) ** 2 / expected).sum()) > 1000


def test_sampled_speculative_decoding_runs_and_is_seeded(sources):
    spec = Runner.load(
        sources["hf"], device="cpu", speculative=S.SpeculativeConfig("mtp", 2, sampled="verify")
    )
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    first, second = spec.generate_ids(PROMPT, params), spec.generate_ids(PROMPT, params)
    assert first == second and len(first) == 20
    assert spec.spec_totals.steps > 0 and spec.spec_plain_requests == 0


def test_a_sampled_request_decodes_plainly_by_default_and_is_counted(sources):
    """``SpeculativeConfig.sampled`` plain (the default): a sampled request's tokens are a plain
    runner's with the same seed, no verify step runs, and the request is counted; a greedy one
    still verifies."""
    spec = Runner.load(sources["hf"], device="cpu", speculative=S.SpeculativeConfig("mtp", 2))
    plain = Runner.load(sources["hf"], device="cpu")
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True)
    assert spec.generate_ids(PROMPT, params) == plain.generate_ids(PROMPT, params)
    assert spec.spec_totals.steps == 0 and spec.spec_plain_requests == 1
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    assert spec.generate_ids(PROMPT, greedy) == plain.generate_ids(PROMPT, greedy)
    assert spec.spec_totals.steps > 0 and spec.spec_plain_requests == 1
    assert "sampled requests decode plainly" in spec.speculative.describe()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(method="eagle"), "speculative method 'eagle' is not supported"),
        (dict(draft_tokens=0), "draft tokens must be an integer in 1..4, got 0"),
        (dict(draft_tokens=5), "draft tokens must be an integer in 1..4, got 5"),
        (dict(sampled="host"), "speculative sampled 'host' is not one of plain, verify"),
    ],
)
def test_bad_speculative_settings_are_named(kw, message):
    with pytest.raises(ConfigError, match=message):
        S.SpeculativeConfig(**kw)


def test_a_model_without_an_mtp_head_refuses_speculation(sources, hf_checkpoints):
    with pytest.raises(CheckpointError, match="declares no MTP layer"):
        Runner.load(hf_checkpoints["qwen3_5_moe"][1], device="cpu", speculative=MTP)
    runner = Runner.load(sources["hf"], device="cpu")
    with pytest.raises(EdgerunError, match="MTP head is not loaded"):
        runner.enable_speculative(MTP)


def test_a_checkpoint_with_per_expert_mtp_experts_converts_as_the_stacked_one(sources, tmp_path):
    """Checkpoints store the head's experts either way (stacked gate_up_proj / down_proj, or one
    gate/up/down tensor an expert, as the per-expert main layers): convert stacks the second into
    the first's bytes; the bundle's head is the checkpoint's, and keeps plain greedy's output."""
    import json
    import shutil

    from safetensors import safe_open
    from safetensors.torch import load_file

    src = tmp_path / "per-expert"
    shutil.copytree(sources["hf"], src)
    shutil.copyfile(sources["int4"].parent / "fused-mtp" / "tokenizer.json", src / "tokenizer.json")
    convert(src, tmp_path / "int4", ConvertOptions("int4", 16))
    pieces = load_file(str(src / "model.safetensors"))
    E = json.loads((src / "config.json").read_text())["num_experts"]

    def expert(e: int, p: str) -> torch.Tensor:
        return pieces[f"mtp.layers.0.mlp.experts.{e}.{p}.weight"]

    with safe_open(str(tmp_path / "int4" / "dense.safetensors"), "pt") as got:
        stacked = {
            n[len("mtp.layers.0.mlp.experts.") :]: got.get_tensor(n) for n in got.keys() if ".experts." in n
        }
    assert stacked.keys() == {"gate_up_proj", "down_proj"}
    want = torch.stack([torch.cat([expert(e, "gate_proj"), expert(e, "up_proj")]) for e in range(E)])
    assert torch.equal(stacked["gate_up_proj"], want)
    assert torch.equal(stacked["down_proj"], torch.stack([expert(e, "down_proj") for e in range(E)]))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want_ids = Runner.load(tmp_path / "int4", device="cpu").generate_ids(PROMPT, params)
    spec = Runner.load(tmp_path / "int4", device="cpu", speculative=S.SpeculativeConfig("mtp", 2))
    events = list(spec.generate(spec.request(PROMPT, params)))
    assert [e.token_id for e in events if e.token_id is not None] == want_ids
    # the head the bundle loads is the one the checkpoint loads
    direct = Runner.load(src, device="cpu", speculative=S.SpeculativeConfig("mtp", 2)).model.mtp
    for name, t in direct.state_dict().items():
        assert torch.equal(spec.model.mtp.state_dict()[name], t), name


def test_a_per_expert_mtp_head_missing_an_expert_is_refused_by_name(sources, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tmp_path / "per-expert"
    shutil.copytree(sources["hf"], src)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["mtp.layers.0.mlp.experts.3.up_proj.weight"]
    tensors["mtp.layers.0.mlp.experts.1.down_proj.weight"] = tensors[
        "mtp.layers.0.mlp.experts.1.down_proj.weight"
    ][:, :-1].contiguous()
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        convert(src, tmp_path / "out", ConvertOptions("int4", 16))
    msg = str(err.value)
    assert "missing tensor 'mtp.layers.0.mlp.experts.3.up_proj.weight'" in msg
    assert "tensor 'mtp.layers.0.mlp.experts.1.down_proj.weight' has shape" in msg
    assert not (tmp_path / "out").exists()


def test_generate_cli_speculates_and_says_so(sources, capsys):
    from edgerun.cli import main

    argv = ["generate", "--model", str(sources["bf16"]), "--token-ids", "5,17,3,44", "--max-tokens", "12"]
    assert main([*argv, "--ignore-eos", "--speculative", "mtp", "--draft-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "speculative mtp, 3 draft token(s) a step" in err and "MTP head 19 tensors" in err
    assert "MTP acceptance" in err and "tok/step" in err
    assert main([*argv, "--draft-tokens", "2"]) == 2
    assert "--draft-tokens needs --speculative mtp" in capsys.readouterr().err
    assert main([*argv, "--speculative-sampled", "verify"]) == 2
    assert "--speculative-sampled needs --speculative mtp" in capsys.readouterr().err
    assert main([*argv, "--speculative", "medusa"]) == 2
    assert "speculative method 'medusa' is not supported" in capsys.readouterr().err


def test_the_plan_counts_the_mtp_head_only_when_asked(capsys):
    from edgerun.cli import main

    argv = ["plan", "--profile", "configs/orin.yaml", "--model", "configs/models/qwen3.6-35b-a3b.json"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "\n  mtp " not in out and "MTP head (1 layer) is not loaded and not planned" in out
    assert main([*argv, "--speculative", "mtp", "--draft-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "\n  mtp " in out and "MTP head planned (1 layer, resident), 2 draft token(s)" in out


@pytest.mark.parametrize(
    ("quota", "k", "hint"), [(4, 2, "--draft-tokens 1 fits"), (3, 1, "no draft count fits")]
)
def test_a_streamed_quota_below_a_verify_windows_experts_is_refused(sources, quota, k, hint):
    with pytest.raises(
        ConfigError, match=rf"top_k x \(K \+ 1\) = {min(6, 2 * (k + 1))} experts.*quota is {quota}: {hint}"
    ):
        Runner.load(
            sources["int4"], device="cpu", cache=CacheConfig(quota), speculative=S.SpeculativeConfig("mtp", k)
        )


def test_the_plan_floors_the_quota_at_a_verify_windows_experts(sources, capsys):
    from edgerun.cli import main

    argv = ["plan", "--profile", "configs/orin.yaml", "--model", "configs/models/qwen3.6-35b-a3b.json"]
    assert main([*argv, "--speculative", "mtp", "--draft-tokens", "3"]) == 0
    assert "top_k 8, minimum 32)" in capsys.readouterr().out  # 8 x (3 + 1)
    assert main([*argv, "--speculative", "mtp", "--draft-tokens", "3", "--quota", "20"]) == 2
    err = capsys.readouterr().err
    assert "quota 20 must be in 32..256: at least top_k x batch x (draft tokens + 1) = 32" in err
    assert "--draft-tokens 1 fits this quota" in err
    # generate and serve plan a streamed bundle the same way: the profile's plan counts the head
    run = ["generate", "--model", str(sources["int4"]), "--profile", "configs/cpu.yaml", "--device", "cpu"]
    run += ["--token-ids", "5,17,3", "--max-tokens", "6", "--ignore-eos", "--speculative", "mtp"]
    assert main([*run, "--quota", "4", "--draft-tokens", "2"]) == 2
    assert "quota 4 must be in 6..6" in capsys.readouterr().err
    assert main([*run, "--quota", "4", "--draft-tokens", "1"]) == 0


def test_bench_speculative_compares_with_plain_decoding(sources, tmp_path, capsys):
    import json

    from edgerun.bench.speculative import main

    argv = ["--model", str(sources["bf16"]), "--draft-tokens", "1,3", "--max-tokens", "10"]
    assert main([*argv, "--repeats", "2", "--prompts", "2", "--threads", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "speculative.json").read_text())
    assert result["warmup"] == 1 and result["repeats"] == 2  # an untimed round first, by default
    runs = result["runs"]  # every timed prompt run, in the order it ran, with its wall-clock span
    assert len(runs) == 2 * 2 * 3 * 2 and all(r["start"] <= r["end"] for r in runs)
    assert all(a["end"] <= b["start"] for a, b in zip(runs, runs[1:]))
    # a prompt at a time through every configuration in turn
    assert [r["config"] for r in runs[:6]] == ["plain", "MTP K=1", "MTP K=3"] * 2
    greedy, sampled = result["modes"]["greedy"], result["modes"]["T=0.8"]
    assert [r["config"] for r in greedy] == ["plain", "MTP K=1", "MTP K=3"]
    assert all(r["identical"] for r in greedy) and all(r["identical"] is None for r in sampled)
    for r in greedy[1:] + sampled[1:]:
        assert 0 <= r["acceptance"] <= 1 and 1 <= r["tokens_per_step"] and r["speedup"] > 0
        assert r["min"] <= r["median"] <= r["max"]
        pr = r["paired"]  # each prompt's rate over plain's for it, in the same repeat
        assert 0 < pr["min"] <= pr["median"] <= pr["max"]
    assert greedy[0]["paired"] is None and greedy[0]["speedup"] is None
    # the paired ratios are each prompt's rate over plain's in the same repeat, from the runs
    plain = [r["rate"] for r in runs if r["mode"] == "greedy" and r["config"] == "plain"]
    k1 = [r["rate"] for r in runs if r["mode"] == "greedy" and r["config"] == "MTP K=1"]
    ratios = sorted(a / b for a, b in zip(k1, plain))
    assert (greedy[1]["paired"]["min"], greedy[1]["paired"]["max"]) == (ratios[0], ratios[-1])
    assert "| greedy | MTP K=3 |" in capsys.readouterr().out
    # a bundle through the expert cache (every expert held: as serve runs it)
    argv = ["--model", str(sources["int4"]), "--draft-tokens", "2", "--max-tokens", "8", "--quota", "6"]
    assert (
        main(
            [
                *argv,
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--prompts",
                "1",
                "--temperature",
                "0",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "speculative.json").read_text())
    assert result["quota"] == 6 and all(r["identical"] for r in result["modes"]["greedy"])
    with pytest.raises(SystemExit):
        main([*argv, "--repeats", "0"])
    assert "--repeats must be >= 1" in capsys.readouterr().err


def test_the_plan_holds_the_mtp_heads_kv_and_a_windows_rollback_states(sources):
    """What speculative decoding keeps beyond plain decoding is planned (speculative_state): the
    MTP head's KV for the context and, per DeltaNet layer, the K + 1 states a verify window keeps
    for its rollback; byte for byte the runtime's (the head's state and a window's trail)."""
    from edgerun.budget import inputs
    from edgerun.budget.planner import PlanOptions, plan
    from edgerun.config import load_device_profile

    runner = Runner.load(
        sources["int4"], device="cpu", dtype=torch.bfloat16, speculative=S.SpeculativeConfig("mtp", 2)
    )
    model = inputs.with_mtp(inputs.from_bundle(sources["int4"]), 2)
    context = 64
    p = plan(model.args, model.specs, model.experts, load_device_profile("configs/cpu.yaml"), context, 1,
             PlanOptions(draft_tokens=2, dense_dtype="bf16"))  # the runner's dtype  # fmt: skip
    item = next(it for it in p.items if it.name == "speculative_state")
    head = runner.model.mtp.new_state(context, "cpu", torch.bfloat16)
    state = runner.model.new_state(1, context)
    trail = sum(e.conv.nbytes + e.recurrent.nbytes for e in state.layers if isinstance(e, DeltaState))
    assert item.nbytes == head.nbytes() + 3 * trail
    assert "3 DeltaNet states per layer" in item.detail
    plain = plan(model.args, model.specs, model.experts, load_device_profile("configs/cpu.yaml"), context, 1)
    assert not any(it.name == "speculative_state" for it in plain.items)


@pytest.mark.parametrize("quant", ["int4", "bf16"])
def test_a_streamed_bundles_head_holds_its_experts_as_blocks_and_the_plan_counts_them(sources, quant):
    """On CUDA a bundle served through the expert cache holds the MTP head's routed experts as
    blocks of its layout (``hold_mtp_experts``, run here on the CPU as the CUDA runner runs it),
    quantized by convert's own quantizer: int4 a quarter of bf16's bytes. A CUDA profile's plan
    counts the head's bytes so held, a CPU profile's (the CPU keeps them stacked) the stacked
    bytes: each byte for byte the loaded head's."""
    from edgerun.budget.cli import plan_for_bundle
    from edgerun.bundle.quant import quantize_expert
    from edgerun.engine.streaming import HeldExperts, hold_mtp_experts

    spec = S.SpeculativeConfig("mtp", 2)
    runner = Runner.load(
        sources[quant], device="cpu", dtype=torch.bfloat16, cache=CacheConfig(6), speculative=spec
    )
    stacked = runner.model.mtp.layers[0].mlp.experts
    assert not isinstance(stacked, HeldExperts)  # the CPU's

    def head_bytes() -> int:
        return sum(t.nbytes for t in [*runner.model.mtp.parameters(), *runner.model.mtp.buffers()])

    def planned(profile: str) -> int:
        p = plan_for_bundle(sources[quant], profile, 64, draft_tokens=2, dense_dtype="bf16")
        return next(it for it in p.items if it.name == "mtp")

    assert planned("configs/cpu.yaml").nbytes == head_bytes()
    n = hold_mtp_experts(runner.model, runner.cache, runner.kernels.moe, torch.device("cpu"))
    held = runner.model.mtp.layers[0].mlp.experts
    assert isinstance(held, HeldExperts) and n == held.pool.nbytes + (
        0 if held.scales is None else held.scales.nbytes
    )
    layout = runner.cache.bundle.layouts[runner.args.moe_layers[0]]
    for e in (0, 5):
        block, scales = quantize_expert(layout, stacked.gate_up_proj[e].float(), stacked.down_proj[e].float())
        assert torch.equal(held.pool[e], block)
        assert (held.scales is None) == (scales is None) and (
            scales is None or torch.equal(held.scales[e], scales)
        )
    item = planned("configs/rtx5070.yaml")
    assert item.nbytes == head_bytes(), (item, head_bytes())
    if quant == "int4":
        assert "routed experts int4 blocks" in item.detail and held.pool.nbytes < stacked.gate_up_proj.nbytes
    # the drafts it makes still leave greedy output plain greedy's
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    events = list(runner.generate(runner.request(PROMPT, params)))
    runner.speculative = None
    assert [e.token_id for e in events if e.token_id is not None] == runner.generate_ids(PROMPT, params)


def test_the_kernels_are_chosen_with_the_mtp_head_loaded(sources, monkeypatch):
    """The head loads before the kernel policy is resolved: the dense probe's cases include its
    projections (fc reads 2 x hidden), and the GEMV the policy selects is the head's too (it ran
    torch's reference on CUDA while loaded after: about 78 launches a draft step)."""
    import edgerun.engine.runner as R
    from edgerun.engine.policy import Resolved
    from edgerun.kernels.moe import MoeKernelPolicy
    from edgerun.models.layers import QLinear

    cases = []

    def resolve(request, device, layouts=(), top_k=8, args=None, dtype=None, gemv=()):
        cases.extend(gemv)
        return Resolved(MoeKernelPolicy(), graphs=False, dense="triton")  # as a GPU's probes choose

    monkeypatch.setattr(R, "resolve", resolve)
    monkeypatch.setattr(Runner, "enable_speculative", lambda self, config: None)  # its probes run kernels
    runner = Runner.load(sources["int4"], device="cpu", cache=CacheConfig(6), speculative=MTP)
    head = [m for m in runner.model.mtp.modules() if isinstance(m, QLinear)]
    assert head and all(m.gemv for m in head)
    assert (runner.model.mtp.fc.scheme, runner.model.mtp.fc.in_features) in {(c[0], c[2]) for c in cases}


def test_the_heads_windows_take_the_gemv_for_a_plain_weights_rows(monkeypatch):
    """Outside ``exact_rows`` a plain weight takes the GEMV for at most 2 rows (GEMV_ROWS); within
    ``draft_rows`` (the MTP head's windows, engine/graphs) for up to MAX_GEMV_ROWS: a head window
    of K + 1 >= 3 rows is one launch a projection, not torch's. Its rows run as a verify window's
    do: each by programs of its own, unless the projection shares its rows' GEMV
    (``shared_rows``: the window probe's choice, a weight larger than L2)."""
    from edgerun.kernels import qlinear_triton
    from edgerun.kernels.qweight import QWeight
    from edgerun.models.layers import MAX_GEMV_ROWS, QLinear, draft_rows

    calls = []

    def qgemv(x, w, bias, epilogue, out, gate, alone=False, **kw):  # norm, norm_out, topk, also
        calls.append((x.shape[0], alone))
        return x.new_zeros(x.shape[0], w.rows)

    monkeypatch.setattr(qlinear_triton, "qgemv", qgemv)
    lin = QLinear(QWeight("plain", torch.randn(8, 16)))
    lin.gemv = True
    x = torch.randn(3, 16)
    ref = lin(x)  # 3 rows of a plain weight: torch's reference
    assert calls == [] and torch.equal(ref, x @ lin.weight.T)
    with draft_rows():
        lin(x)
        lin(torch.randn(MAX_GEMV_ROWS, 16))
        lin(torch.randn(MAX_GEMV_ROWS + 1, 16))  # more than the GEMV takes: the reference
        lin.shared_rows = True
        lin(x)
    assert calls == [(3, True), (MAX_GEMV_ROWS, True), (3, False)]


def test_a_resident_checkpoints_plan_counts_the_mtp_head_when_asked():
    """generate / serve with --profile and a checkpoint held whole (the demo): the plan holds the
    MTP head and speculative decoding's state only with --speculative, as the bundle's plan does."""
    from edgerun.budget.cli import plan_resident

    plain, _ = plan_resident(None, "configs/cpu.yaml", 256, device="cpu", dtype="fp32")
    spec, _ = plan_resident(None, "configs/cpu.yaml", 256, device="cpu", dtype="fp32", draft_tokens=2)
    names = {it.name for it in spec.items}
    assert {"mtp", "speculative_state"} <= names and not {"mtp", "speculative_state"} & {
        it.name for it in plain.items
    }
    assert spec.min_quota == min(spec.num_experts, spec.top_k * 3)


def test_a_cuda_plan_counts_the_verify_windows_graph_sets():
    """On CUDA each verify window size 1..K + 1 captures a graph set of its own beside the
    one-row step's (``DecodeGraphs.verify``): the plan's graph pool grows by their rows."""
    from edgerun.budget.cli import plan_resident

    def pool(draft_tokens):
        got, _ = plan_resident(
            None, "configs/rtx5070.yaml", 256, device="cuda", dtype="bf16", draft_tokens=draft_tokens
        )
        return next(it for it in got.items if it.name == "cuda_graph_pool")

    plain, spec = pool(0), pool(3)
    assert spec.nbytes == plain.nbytes * (1 + 1 + 2 + 3 + 4)  # one row, then windows of 1..4 rows
    assert "verify windows of 1..4 rows" in spec.detail


def test_a_verify_window_on_the_decoder_needs_the_triton_dense_kernels(sources):
    """On CUDA a verify window runs the decode step's kernels: without the Triton dense kernels
    (attention and DeltaNet in their window modes) it is refused, naming them (here on the CPU, where
    the decoder's operations run uncaptured)."""
    from edgerun.engine.graphs import DecodeGraphs, rows_unsupported
    from edgerun.engine.policy import Resolved
    from edgerun.kernels.moe import MoeKernelPolicy

    runner = Runner.load(sources["hf"], device="cpu")
    layers = runner.model.model.layers
    torch_dense = Resolved(MoeKernelPolicy(), graphs=False, dense="torch")
    d = DecodeGraphs(runner.model, runner.args, None, torch_dense, torch.device("cpu"), 16)
    with pytest.raises(EdgerunError, match="a verify window's rows need the Triton dense kernels"):
        DecodeGraphs(runner.model, runner.args, None, torch_dense, "cpu", 16, rows=2, window=d.state)
    # resident stacked experts take a window's rows one at a time; a batch's pool refuses them
    assert rows_unsupported(True, {1: "stacked"}, layers, one_sequence=True) is None
    assert "stacked" in rows_unsupported(True, {1: "stacked"}, layers)
