"""Train edgerun's demo model: a tiny ``qwen3_5_moe`` on the King James Bible.

The exact recipe behind ``edgerun/demo`` (docs/demo-model.md records the run):

    python scripts/prepare_demo_data.py --heldout-slice tests/data/kjv_heldout.txt
    python scripts/train_demo_model.py --out OUT --steps 1441 --dropout 0.2   # the shipped weights
    python scripts/train_demo_model.py --mtp-from OUT --out HEAD --steps 2500 --batch-size 16 \
        --warmup 100 --eval-every 250 --mtp-tokens 262144 --mtp-generated 2048  # + the MTP head
    python scripts/train_demo_model.py --mtp-from HEAD --out DEMO --mtp-init --steps 1000 \
        --batch-size 16 --lr 1e-3 --warmup 50 --eval-every 250 --mtp-tokens 262144 \
        --mtp-generated 2048 --mtp-chain 1  # its second drafts

Training uses Hugging Face ``transformers`` (``Qwen3_5MoeForCausalLM``); the edgerun runtime never
imports it. Recipe: random windows of ``--seq-len`` + 1 tokens from the packed train split
(seeded generator), next-token cross-entropy plus ``--aux-coef`` x the Switch load-balancing
loss, dropout (training only, through forward hooks) on the embeddings and on every token
mixer's and MoE block's output, AdamW, linear warm-up then cosine decay to ``--min-lr-ratio``,
bf16 autocast on CUDA (fp32 on CPU). The validation loss (non-overlapping windows) picks the
checkpoint; the test loss is only reported. The kept weights are rounded to bf16 and saved with
``save_pretrained``, then the tokenizer files and generation config are written beside them.

``--steps 0`` sizes the run from ``--time-budget`` (seconds): it times the first steps and one
evaluation, then fixes the step count (logged as ``resolved steps``, capped by ``--max-epochs``);
rerun with that ``--steps`` to repeat the recipe. ``--tiny`` shrinks the model for a CPU smoke test.

``--mtp-from DIR`` trains only a multi-token-prediction head (``mtp.*``, the layout of the Qwen3.5/3.6
checkpoints; edgerun's ``models/base.py`` MtpHead) on the frozen model in DIR, on the CPU in fp32
(deterministic): the frozen model's final normed hidden states h over ``--mtp-tokens`` train tokens
(windows of ``--seq-len``) are computed once; the head maps (embedding of t_{p+1}, h_p) to a
prediction of t_{p+2} and is trained to match the frozen model's own distribution there (soft
cross-entropy against softmax(lm_head(h_{p+1}))): what a draft must match to be accepted. Its
decoder layer starts as a copy of DIR's last full-attention layer (``--mtp-init``: DIR's own
head). ``--mtp-generated N`` adds N windows of the frozen model's own greedy continuations (each
after ``--mtp-prompt`` tokens from a random place in the train split): the text a speculative
request verifies, where the head is scored too ("on greedy continuations", from validation
prompts). DIR's files are copied to ``--out`` with the head's tensors added (bf16) and
``mtp_num_hidden_layers`` 1 in config.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# hidden 256, 6 layers (DeltaNet x2, full attention, DeltaNet x2, full attention), 16 experts top-2.
DEMO_CONFIG = dict(
    hidden_size=256,
    num_hidden_layers=6,
    layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=256,
    # trained on short sequences; longer positions run (rope needs no table) so that long prompts can be
    # tried on a fresh machine, with the quality of a model never trained there
    max_position_embeddings=32768,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
)
TINY_OVERRIDES = dict(
    hidden_size=64,
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
)


def log(msg: str) -> None:
    print(msg, flush=True)


def load_tokens(tok: Tokenizer, path: Path) -> torch.Tensor:
    return torch.tensor(tok.encode(path.read_text()).ids, dtype=torch.long)


def add_dropout(model, p: float) -> None:
    """Dropout on the embeddings and on each token mixer's and MoE block's output (residual
    branches), active only in train mode. The saved model has no dropout: hooks are not saved."""
    if p <= 0:
        return

    def hook(mod, _inp, out):
        if isinstance(out, tuple):
            return (F.dropout(out[0], p, mod.training), *out[1:])
        return F.dropout(out, p, mod.training)

    model.model.embed_tokens.register_forward_hook(hook)
    for layer in model.model.layers:
        mixer = layer.self_attn if hasattr(layer, "self_attn") else layer.linear_attn
        mixer.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def lr_at(step: int, total: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    t = min(1.0, (step - args.warmup) / max(1, total - args.warmup))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def autocast(device: torch.device, enabled: bool = True):
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=enabled and device.type == "cuda")


@torch.no_grad()
def eval_loss(model, tokens: torch.Tensor, seq_len: int, device, batch: int = 64, amp: bool = True) -> float:
    """Mean next-token loss over non-overlapping windows: inputs [s, s+L), targets [s+1, s+L+1)
    for s = 0, L, 2L, ...; each target is scored once, the last (len - 1) % L are not scored."""
    model.eval()
    n = (len(tokens) - 1) // seq_len
    x_all = tokens[: n * seq_len].view(n, seq_len)
    y_all = tokens[1 : n * seq_len + 1].view(n, seq_len)
    total = 0.0
    for i in range(0, n, batch):
        x, y = x_all[i : i + batch].to(device), y_all[i : i + batch].to(device)
        with autocast(device, amp):
            logits = model(input_ids=x, use_cache=False).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
    model.train()
    return total / (n * seq_len)


@torch.no_grad()
def sample(model, tok: Tokenizer, prompt: str, n: int, device) -> str:
    """Greedy continuation without a cache (the model is tiny; this keeps it version-proof)."""
    model.eval()
    ids = tok.encode(prompt).ids
    for _ in range(n):
        x = torch.tensor([ids[-512:]], device=device)
        ids.append(int(model(input_ids=x, use_cache=False).logits[0, -1].float().argmax()))
        if ids[-1] == tok.token_to_id(EOT):
            break
    model.train()
    return tok.decode(ids, skip_special_tokens=False)


def pick_experts_impl(model, want: str, device, vocab: int) -> str:
    """Use ``want`` if one forward+backward runs; else eager (logged, never silent)."""
    for impl in dict.fromkeys((want, "eager")):
        try:
            if hasattr(model, "set_experts_implementation"):
                model.set_experts_implementation(impl)
            else:
                model.config._experts_implementation = impl
            x = torch.randint(0, vocab, (2, 16), device=device)
            with autocast(device):
                out = model(input_ids=x, use_cache=False, output_router_logits=True)
            (out.logits.float().mean() + out.aux_loss).backward()
            model.zero_grad(set_to_none=True)
            return impl
        except Exception as exc:  # any failure: fall back to the reference path
            log(f"experts implementation {impl!r} failed ({type(exc).__name__}: {exc}); trying eager")
    raise RuntimeError("no experts implementation runs")


def write_tokenizer_files(out: Path, tokenizer_json: Path, max_len: int) -> None:
    shutil.copyfile(tokenizer_json, out / "tokenizer.json")
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


class MtpHead(torch.nn.Module):
    """The training twin of edgerun's MtpHead (same parameter names under ``mtp.``): both inputs
    RMS-normed, concatenated (embedding first), ``fc`` 2D -> D, one full-attention MoE decoder
    layer, a final norm; the frozen model's lm_head scores it."""

    def __init__(self, config, template) -> None:
        super().__init__()
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M

        D = config.hidden_size
        self.pre_fc_norm_embedding = M.Qwen3_5MoeRMSNorm(D, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = M.Qwen3_5MoeRMSNorm(D, eps=config.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * D, D, bias=False)
        torch.nn.init.normal_(self.fc.weight, std=config.initializer_range)
        layer = M.Qwen3_5MoeDecoderLayer(config, config.layer_types.index("full_attention"))
        layer.load_state_dict(template.state_dict())
        self.layers = torch.nn.ModuleList([layer])
        self.norm = M.Qwen3_5MoeRMSNorm(D, eps=config.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope, mask=None) -> torch.Tensor:
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
        return self.norm(self.layers[0](x, attention_mask=mask, position_embeddings=rope))


@torch.no_grad()
def greedy_windows(
    model, tokens: torch.Tensor, n: int, prompt: int, seq_len: int, gen, batch: int = 64
) -> torch.Tensor:
    """``n`` windows [n, seq_len] of the frozen model's own greedy continuations: each starts with
    ``prompt`` tokens from a random place in ``tokens`` (``gen``), the rest is what greedy decoding
    writes after them: the text a speculative request verifies."""
    starts = torch.randint(0, len(tokens) - prompt, (n,), generator=gen)
    prompts = torch.stack([tokens[s : s + prompt] for s in starts.tolist()])
    out = []
    for i in range(0, n, batch):
        p = prompts[i : i + batch]
        seqs = model.generate(
            p, attention_mask=torch.ones_like(p), max_new_tokens=seq_len - prompt, min_new_tokens=seq_len - prompt,
            do_sample=False, pad_token_id=0,
        )  # fmt: skip
        out.append(seqs[:, :seq_len])
    return torch.cat(out)


@torch.no_grad()
def frozen_hidden(model, tokens: torch.Tensor, seq_len: int, batch: int = 16) -> torch.Tensor:
    """The frozen model's final normed hidden states [W, L, D] (bf16) over non-overlapping windows
    [W, L] of ``tokens``."""
    n = len(tokens) // seq_len
    windows = tokens[: n * seq_len].view(n, seq_len)
    return torch.cat(
        [
            model.model(input_ids=windows[i : i + batch], use_cache=False).last_hidden_state.bfloat16()
            for i in range(0, n, batch)
        ]
    )


def second_draft_mask(first: int, second: int) -> torch.Tensor:
    """bool [T, T] (T = first + second), query by key: the ``first`` rows (first drafts at
    positions 0..first-1) causal among themselves; second-draft row r (at position r + 1) sees the
    first drafts 0..r, what the head's state holds when it drafts there, and itself."""
    i = torch.arange(first + second)
    is_first, row = i < first, torch.where(i < first, i, i - first)
    return (is_first[None, :] & (row[None, :] <= row[:, None])) | (i[None, :] == i[:, None])


def second_drafts(model, head, windows: torch.Tensor, h: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The head's second drafts [B, L-2, D] over ``windows`` [B, L]: at position p + 1 (p =
    0..L-3), fed its own first-draft output g_p [B, L-1, D] with t_{p+2}, attending to the first
    drafts' positions up to p and itself (``second_draft_mask``), in one masked pass that
    recomputes the first drafts beside them; each predicts t_{p+3}. ``h``: the model's final
    hidden states [B, L, D]."""
    B, L = windows.shape
    n = L - 2
    emb = model.model.embed_tokens(windows[:, 1:])
    both_e = torch.cat([emb, model.model.embed_tokens(windows[:, 2:])], 1)
    both_h = torch.cat([h[:, :-1], g[:, :n]], 1)
    pos = torch.arange(L - 1)[None].expand(B, -1)
    pos2 = torch.cat([pos, pos[:, :n] + 1], 1)
    see = second_draft_mask(L - 1, n)
    mask = torch.zeros(see.shape).masked_fill(~see, float("-inf"))[None, None].expand(B, 1, -1, -1)
    return head(both_e, both_h, model.model.rotary_emb(both_e, pos2), mask)[:, L - 1 :]


def soft_cross_entropy(target: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits`` against the distribution softmax(``target``)."""
    return -(torch.softmax(target, -1) * torch.log_softmax(logits, -1)).sum(-1).mean()


def mtp_loss(
    model, head, windows: torch.Tensor, hidden: torch.Tensor, chain: float = 0.0
) -> tuple[torch.Tensor, float]:
    """Soft cross-entropy of the head's predictions of t_{p+2} (from t_{p+1} and h_p, p = 0..L-2)
    against the frozen model's distribution there, and the top-1 agreement (greedy acceptance of
    a first draft). ``chain`` > 0 adds that weight x the same loss of a second draft, as drafting
    K > 1 runs it: the head fed its own output g_p with t_{p+2} at position p + 1, attending to
    the first drafts' positions up to p (what the head's state holds then) and itself,
    predicting t_{p+3}."""
    h = hidden.float()
    B, L = windows.shape
    emb = model.model.embed_tokens(windows[:, 1:])
    pos = torch.arange(L - 1)[None].expand(B, -1)
    rope = model.model.rotary_emb(emb, pos)
    g = head(emb, h[:, :-1], rope)
    logits = model.lm_head(g)
    with torch.no_grad():
        target = model.lm_head(h[:, 1:])
    loss = soft_cross_entropy(target, logits)
    agree = (logits.argmax(-1) == target.argmax(-1)).float().mean().item()
    if chain > 0:
        logits2 = model.lm_head(second_drafts(model, head, windows, h, g))
        with torch.no_grad():
            target2 = model.lm_head(h[:, 2:])
        loss = loss + chain * soft_cross_entropy(target2, logits2)
    return loss, agree


def train_mtp(args) -> None:
    """``--mtp-from``: an MTP head for the frozen model in ``args.mtp_from`` (module docstring)."""
    import safetensors.torch as st
    import transformers as tf

    t0 = time.time()
    torch.manual_seed(args.seed)
    log(f"argv: {' '.join(sys.argv[1:])}")
    log(
        f"torch {torch.__version__}, transformers {tf.__version__}, device cpu, {torch.get_num_threads()} threads"
    )
    model = tf.Qwen3_5MoeForCausalLM.from_pretrained(args.mtp_from, dtype=torch.float32).eval()
    model.requires_grad_(False)
    model.set_experts_implementation("eager")
    config = model.config
    tok = Tokenizer.from_file(str(args.mtp_from / "tokenizer.json"))
    train, val = (load_tokens(tok, args.data / f"{s}.txt") for s in ("train", "val"))
    full = [i for i, t in enumerate(config.layer_types) if t == "full_attention"]
    head = MtpHead(config, model.model.layers[full[-1]])
    if args.mtp_init:  # go on from the head DIR ships
        import safetensors.torch as st

        shipped = st.load_file(str(args.mtp_from / "model.safetensors"))
        own = {n[len("mtp.") :]: t.float() for n, t in shipped.items() if n.startswith("mtp.")}
        if not own:
            raise SystemExit(f"--mtp-init: {args.mtp_from / 'model.safetensors'} has no mtp.* tensors")
        head.load_state_dict(own)
        log(f"head initialised from the {len(own)} mtp.* tensors of {args.mtp_from}")
    n_params = sum(p.numel() for p in head.parameters())
    log(f"MTP head params: {n_params} ({n_params / 1e6:.2f} M), from layer {full[-1]}")

    L = args.seq_len
    tr_tokens = train[: args.mtp_tokens]
    tr_windows = tr_tokens[: len(tr_tokens) // L * L].view(-1, L)
    va_windows = val[: len(val) // L * L].view(-1, L)
    gen_va = None
    if args.mtp_generated:
        g = torch.Generator().manual_seed(args.seed + 1)
        gen_tr = greedy_windows(model, train, args.mtp_generated, args.mtp_prompt, L, g)
        gen_va = greedy_windows(model, val, max(32, args.mtp_generated // 16), args.mtp_prompt, L, g)
        tr_windows = torch.cat([tr_windows, gen_tr])
        log(
            f"greedy continuations: train {tuple(gen_tr.shape)}, val {tuple(gen_va.shape)}, {time.time() - t0:.0f}s"
        )
    tr_hidden, va_hidden = (
        frozen_hidden(model, tr_windows.flatten(), L),
        frozen_hidden(model, va_windows.flatten(), L),
    )
    gen_va_hidden = None if gen_va is None else frozen_hidden(model, gen_va.flatten(), L)
    log(
        f"frozen hidden states: train {tuple(tr_hidden.shape)}, val {tuple(va_hidden.shape)}, {time.time() - t0:.0f}s"
    )

    def evaluate() -> tuple[float, float, float | None]:
        """Validation: loss and top-1 agreement on the text, and the agreement on the frozen
        model's greedy continuations of validation prompts (None without ``--mtp-generated``)."""

        def over(windows, hidden):
            parts = [
                mtp_loss(model, head, windows[i : i + 16], hidden[i : i + 16])
                for i in range(0, len(windows), 16)
            ]
            return sum(float(p[0]) for p in parts) / len(parts), sum(p[1] for p in parts) / len(parts)

        head.eval()
        with torch.no_grad():
            v, a = over(va_windows, va_hidden)
            g = None if gen_va is None else over(gen_va, gen_va_hidden)[1]
        head.train()
        return v, a, g

    def shown(g) -> str:
        return "" if g is None else f", on greedy continuations {g:.3f}"

    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed)
    total = args.steps
    v, a, g = evaluate()
    log(f"step 0: val loss {v:.4f} top-1 agreement {a:.3f}{shown(g)}")
    for step in range(1, total + 1):
        idx = torch.randint(0, len(tr_windows), (args.batch_size,), generator=gen)
        for group in opt.param_groups:
            group["lr"] = lr_at(step - 1, total, args)
        loss, agree = mtp_loss(model, head, tr_windows[idx], tr_hidden[idx], args.mtp_chain)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 25 == 0 or step == 1:
            log(f"step {step}/{total} loss {loss.item():.4f} agree {agree:.3f} {time.time() - t0:.0f}s")
        if step % args.eval_every == 0 or step == total:
            v, a, g = evaluate()
            log(f"eval step {step}: val loss {v:.4f} top-1 agreement {a:.3f}{shown(g)}")
    head.load_state_dict({n: t.bfloat16().float() for n, t in head.state_dict().items()})
    v, a, g = evaluate()
    log(f"final (bf16 weights, fp32 eval): val loss {v:.4f} top-1 agreement {a:.3f}{shown(g)}")

    args.out.mkdir(parents=True, exist_ok=True)
    for f in args.mtp_from.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "train_result.json"):
            shutil.copyfile(f, args.out / f.name)
    tensors = st.load_file(str(args.mtp_from / "model.safetensors"))
    tensors = {n: t for n, t in tensors.items() if not n.startswith("mtp.")}
    tensors.update({f"mtp.{n}": t.bfloat16().contiguous() for n, t in head.state_dict().items()})
    st.save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((args.mtp_from / "config.json").read_text())
    (args.out / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}, indent=2) + "\n")
    result = {
        "argv": sys.argv[1:],
        "mtp_steps": total,
        "mtp_params": n_params,
        "mtp_val_loss": v,
        "mtp_val_top1_agreement": a,
        "mtp_val_greedy_agreement": g,
        "total_seconds": time.time() - t0,
        "torch": torch.__version__,
        "transformers": tf.__version__,
    }
    log(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path(".demodata"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps; 0: size from --time-budget")
    ap.add_argument("--time-budget", type=float, default=300.0, help="seconds, used when --steps is 0")
    ap.add_argument("--max-epochs", type=float, default=1e9, help="caps the resolved steps")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--dropout", type=float, default=0.2)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--experts-impl", default="grouped_mm")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, for a CPU smoke test")
    ap.add_argument("--mtp-from", type=Path, help="train only an MTP head on the frozen model in this dir")
    ap.add_argument("--mtp-tokens", type=int, default=393216, help="train tokens the MTP head sees")
    ap.add_argument(
        "--mtp-generated", type=int, default=0,
        help="also train on this many windows of the frozen model's own greedy continuations",
    )  # fmt: skip
    ap.add_argument("--mtp-prompt", type=int, default=32, help="--mtp-generated: prompt tokens a window")
    ap.add_argument("--mtp-init", action="store_true", help="start from the MTP head --mtp-from ships")
    ap.add_argument("--mtp-chain", type=float, default=0.0, help="weight of a second draft's loss (K > 1)")
    args = ap.parse_args()
    if args.mtp_from:
        if not args.steps:
            raise SystemExit("--mtp-from needs --steps")
        return train_mtp(args)
    if not args.steps and args.warmup < 60:
        raise SystemExit("--steps 0 times steps 10..60 inside the warm-up: use --warmup >= 60")

    import transformers as tf  # training-only dependency

    t0 = time.time()
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    log(f"argv: {' '.join(sys.argv[1:])}")
    log(f"torch {torch.__version__}, transformers {tf.__version__}, device {device}")

    tok = Tokenizer.from_file(str(args.data / "tokenizer.json"))
    eot = tok.token_to_id(EOT)
    train, val, test = (load_tokens(tok, args.data / f"{s}.txt") for s in ("train", "val", "test"))
    log(f"tokens: train {len(train)}, val {len(val)}, test {len(test)}")

    cfg_kw = {**DEMO_CONFIG, **(TINY_OVERRIDES if args.tiny else {})}
    config = tf.Qwen3_5MoeTextConfig(
        vocab_size=tok.get_vocab_size(),
        router_aux_loss_coef=args.aux_coef,
        output_router_logits=False,
        bos_token_id=None,
        eos_token_id=eot,
        pad_token_id=eot,
        **cfg_kw,
    )
    model = tf.Qwen3_5MoeForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"params: {n_params} ({n_params / 1e6:.2f} M)")
    impl = pick_experts_impl(model, args.experts_impl, device, config.vocab_size)
    log(f"experts implementation: {impl}")
    add_dropout(model, args.dropout)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )
    gen = torch.Generator().manual_seed(args.seed)
    tokens_per_step = args.batch_size * args.seq_len
    epoch_cap = int(args.max_epochs * len(train) / tokens_per_step)
    total = min(args.steps, epoch_cap) if args.steps else None
    best = (float("inf"), -1, None)  # (val loss, step, state_dict on CPU)
    t_train, t_mark = time.time(), None
    model.train()
    step = 0
    while total is None or step < total:
        starts = torch.randint(0, len(train) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.stack([train[s : s + args.seq_len + 1] for s in starts.tolist()]).to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total or 10**9, args)
        with autocast(device):
            out = model(input_ids=batch[:, :-1], use_cache=False, output_router_logits=True)
        ce = F.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss = ce + args.aux_coef * out.aux_loss
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if not args.steps and total and step < total and time.time() - t_train > 1.2 * args.time_budget:
            log(f"time stop: {time.time() - t_train:.0f}s > 1.2 x --time-budget; ending at step {step}")
            total = step

        if step == 10:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t_mark = time.time()
        if total is None and step == 60:
            if device.type == "cuda":
                torch.cuda.synchronize()
            per_step = (time.time() - t_mark) / 50
            te = time.time()
            eval_loss(model, val, args.seq_len, device)
            per_eval = time.time() - te
            left = args.time_budget - (time.time() - t_train)
            total = step + int(left / (per_step + per_eval / args.eval_every))
            log(
                f"timing: {per_step * 1e3:.1f} ms/step, {per_eval:.2f} s/eval -> resolved steps {total}"
                + (f" (capped at {epoch_cap} by --max-epochs)" if epoch_cap < total else "")
            )
            total = min(total, epoch_cap)
        if step % 50 == 0 or step == 1:
            el = time.time() - t_train
            log(
                f"step {step}/{total or '?'} ce {ce.item():.4f} aux {out.aux_loss.item():.4f} "
                f"gnorm {gnorm.item():.2f} lr {opt.param_groups[0]['lr']:.2e} "
                f"epoch {step * tokens_per_step / len(train):.2f} {step * tokens_per_step / el:.0f} tok/s {el:.0f}s"
            )
        if total is not None and (step % args.eval_every == 0 or step == total):
            v = eval_loss(model, val, args.seq_len, device)
            if v < best[0]:
                state = {k: t.detach().to("cpu", copy=True) for k, t in model.state_dict().items()}
                best = (v, step, state)
            log(f"eval step {step}: val loss {v:.4f} ppl {math.exp(v):.2f} (best {best[0]:.4f} @ {best[1]})")
    train_s = time.time() - t_train

    # Keep the best-validation weights, rounded to bf16 (what ships); evaluate them in fp32.
    model.load_state_dict(best[2])
    final = copy.deepcopy(model).to(torch.bfloat16)
    model.load_state_dict({k: v.float() for k, v in final.state_dict().items()})
    v = eval_loss(model, val, args.seq_len, device, amp=False)
    t = eval_loss(model, test, args.seq_len, device, amp=False)
    log(f"final (bf16 weights, fp32 eval, best step {best[1]}): val loss {v:.4f} ppl {math.exp(v):.3f}")
    log(f"final (bf16 weights, fp32 eval): TEST loss {t:.4f} ppl {math.exp(t):.3f}")
    for prompt in ("And God said", "Blessed are", "The LORD is my"):
        log(f"sample: {sample(model, tok, prompt, 60, device)!r}")

    args.out.mkdir(parents=True, exist_ok=True)
    final.generation_config.eos_token_id = [eot, tok.token_to_id(IM_END)]
    final.generation_config.pad_token_id = eot
    final.generation_config.bos_token_id = None
    final.save_pretrained(args.out)  # transformers v5 always writes safetensors
    if not (args.out / "model.safetensors").is_file():
        raise SystemExit(f"{args.out}: save_pretrained wrote no model.safetensors")
    write_tokenizer_files(args.out, args.data / "tokenizer.json", config.max_position_embeddings)
    result = {
        "argv": sys.argv[1:],
        "steps": total,
        "best_step": best[1],
        "epochs": total * tokens_per_step / len(train),
        "tokens_seen": total * tokens_per_step,
        "params": n_params,
        "val_loss": v,
        "test_loss": t,
        "val_ppl": math.exp(v),
        "test_ppl": math.exp(t),
        "train_seconds": train_s,
        "total_seconds": time.time() - t0,
        "experts_implementation": impl,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": tf.__version__,
    }
    (args.out / "train_result.json").write_text(json.dumps(result, indent=1) + "\n")
    log(json.dumps(result))


if __name__ == "__main__":
    main()
