"""The decoder-only causal LM shell both architectures share: embeddings, a stack of decoder
layers, final norm and lm_head, plus the decode state and the tensor inventory."""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from edgerun.models import args as A
from edgerun.models.args import ModelArgs, TensorSpec
from edgerun.models.inventory import categorize
from edgerun.models.layers import (
    MLP,
    Attention,
    DecodeState,
    GatedDeltaNet,
    QLinear,
    RMSNorm,
    Rotary,
    SparseMoe,
    StaticStep,
    exact_rows,
    int8_worth,
    verify_window,
)

PLANES_MIN_VALUES = 2048 * 4096  # a projection this large or larger goes on the tensor-core GEMV in a batch
PROBE_ROWS = 4096  # the dense probe runs a projection of more rows at this many (plus the tail)


class DecoderLayer(nn.Module):
    """Pre-norm block: token mixer (attention or DeltaNet), then MoE (or dense MLP)."""

    def __init__(self, args: ModelArgs, index: int | None) -> None:
        """``index`` None: the MTP head's layer (full attention and MoE)."""
        super().__init__()
        self.kind = A.FULL_ATTENTION if index is None else args.layer_types[index]
        if self.kind == A.FULL_ATTENTION:
            self.self_attn = Attention(args)
        else:
            self.linear_attn = GatedDeltaNet(args)
        if index is None or index in args.moe_layers:
            self.mlp = SparseMoe(args)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_unit_offset)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_unit_offset)

    def forward(self, x, rope, state, start: int, rows: bool = False, valid=None) -> torch.Tensor:
        """``valid`` [T] bool: see :meth:`CausalLM.hidden`; attention needs nothing for it (a
        padded row is causal after every prompt row, its KV past the position is never read)."""
        if self.kind == A.FULL_ATTENTION:
            return self._block(x, lambda h: self.self_attn(h, rope, state, start, rows))
        return self._block(x, lambda h: self.linear_attn(h, state, rows, valid))

    def decode_rows(self, x, rope, states: list, starts: list[int]) -> torch.Tensor:
        """One token of each of B sequences (x [B, 1, D]; row b's state ``states[b]`` at position
        ``starts[b]``): the token mixer per sequence, the MLP over all rows."""
        if self.kind == A.FULL_ATTENTION:
            return self._block(x, lambda h: self.self_attn.decode_rows(h, rope, states, starts))
        return self._block(x, lambda h: self.linear_attn.decode_rows(h, states))

    def _block(self, x: torch.Tensor, mix) -> torch.Tensor:
        x = x + mix(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def fuse(self) -> None:
        (self.self_attn if self.kind == A.FULL_ATTENTION else self.linear_attn).fuse()
        self.mlp.fuse()

    def mix_static(self, x: torch.Tensor, state, step: StaticStep, trail=None) -> None:
        """The first half of one decode step over static buffers (``engine/graphs.py``): the token
        mixer on input_layernorm(x), its output added into x [N, D] in place (in its output
        projection's epilogue; the norm runs in its input projection's prologue). The MLP half,
        on post_attention_layernorm(x), is the caller's: its routed experts may need the expert
        cache between the router and the expert kernel. ``trail``: a DeltaNet layer's states
        after each row of a verify window (``GatedDeltaNet.decode``)."""
        norm = self.input_layernorm
        if self.kind == A.FULL_ATTENTION:
            self.self_attn.decode_static(x, step, state, residual=x, norm=norm)
        else:
            self.linear_attn.decode(
                x, state, step.fused, residual=x, norm=norm, slots=step.slots, trail=trail
            )


class _Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        # built on the meta device and loaded after: given a weight, nn.Embedding skips its
        # random init, whose meta-device normal_ imports torch's compiler stack (dynamo, triton:
        # ~125 MiB of RSS and a second of start-up on the CPU)
        weight = torch.empty(args.vocab_size, args.hidden_size)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, args.norm_unit_offset)


class MtpHead(nn.Module):
    """Qwen3.5/3.6 multi-token prediction: from the main model's final (normed) hidden state h_p
    at position p and the embedding of token p+1, a prediction of token p+2. Both inputs are
    RMS-normed, concatenated (embedding first) and projected 2D -> D by ``fc``; then one decoder
    layer (full attention with its own KV cache, MoE), the head's own final norm, and the main
    model's lm_head. Drafting k > 1 tokens feeds the head its own output hidden state back."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        D, eps, unit = args.hidden_size, args.rms_norm_eps, args.norm_unit_offset
        self.pre_fc_norm_embedding = RMSNorm(D, eps, unit)
        self.pre_fc_norm_hidden = RMSNorm(D, eps, unit)
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(args, None) for _ in range(args.mtp_num_hidden_layers))
        self.norm = RMSNorm(D, eps, unit)

    def fuse(self) -> None:
        self.fc = QLinear.of(self.fc)
        for layer in self.layers:
            layer.fuse()

    def new_state(self, max_len: int, device, dtype) -> DecodeState:
        return DecodeState(
            [layer.self_attn.new_state(1, max_len, device, dtype) for layer in self.layers], max_len
        )

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, rotary: Rotary, state: DecodeState
    ) -> torch.Tensor:
        """embeds, hidden [B, T, D] at positions state.pos.. -> the head's hidden [B, T, D]
        (normed; the lm_head's input, and the next draft's ``hidden``). The first layer drafts."""
        B, T, _ = embeds.shape
        start = state.pos
        if start + T > state.max_len:
            raise ValueError(
                f"MTP sequence of {start + T} tokens exceeds its state's max_len {state.max_len}"
            )
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        rope = rotary(torch.arange(start, start + T, device=embeds.device), x.dtype)
        x = self.layers[0](x, rope, state.layers[0], start)
        state.pos += T
        return self.norm(x)


class CausalLM(nn.Module):
    """Parameter names are the canonical HF text names (``model.layers.N...``, ``lm_head.weight``);
    with ``mtp``, the MTP head's are the checkpoints' ``mtp.*``."""

    def __init__(self, args: ModelArgs, mtp: bool = False) -> None:
        super().__init__()
        self.args = args
        self.model = _Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(args.rotary_dim, args.rope_theta)
        if mtp and not args.mtp_num_hidden_layers:
            raise ValueError("the model declares no MTP layer (mtp_num_hidden_layers is 0)")
        self.mtp = MtpHead(args) if mtp else None

    def fuse(self) -> None:
        """After the weights are loaded: the projections that read one input become one
        QLinear each (q/k/v; DeltaNet qkv/z/b/a; MLP gate/up; router + shared-expert gate), the
        rest QLinears of their own. Every forward and decode path runs the fused model."""
        for layer in self.model.layers:
            layer.fuse()
        self.lm_head = QLinear.of(self.lm_head)
        if self.mtp is not None:
            self.mtp.fuse()

    def use_kernels(self, gemv: bool, delta_chunk: bool = False, cpu_dense: bool = False) -> int:
        """Select (or not) the Triton GEMV for every projection's decode-sized inputs, fla-core's
        chunked delta rule for prompts in DeltaNet layers, and the CPU weight-only kernels for
        the int4 / int8 projections they take: the engine's choices, made once after their probes
        ran on the device. Returns how many projections the CPU kernels took."""
        from edgerun.kernels import qlinear_cpu

        packed = 0
        for m in self.modules():
            if isinstance(m, QLinear):
                if not gemv:
                    m.use_planes(False)  # its bytes back in QWeight's order for the reference
                m.gemv = gemv
                take = cpu_dense and m.scheme != "plain" and qlinear_cpu.unsupported(m.qweight()) is None
                m.cpu = qlinear_cpu.pack(m.qweight()) if take else None
                packed += take
            elif isinstance(m, GatedDeltaNet):
                m.chunk_fla = delta_chunk
        for m in self.modules():  # a shared expert's down projection on the expert kernel's tile
            if isinstance(m, SparseMoe) and m.has_shared:
                m.shared_expert.down_proj.tile = (
                    _shared_down_tile(m.shared_expert.down_proj) if gemv else None
                )
        return packed

    def use_planes(self, on: bool) -> list[QLinear]:
        """Put (``on``) every projection the tensor-core GEMV takes and is worth it for (int4 in
        a bf16 model, at least PLANES_MIN_VALUES weights: smaller ones are latency-bound, where
        ``qgemv`` is faster at any row count) on it, or take every one off it. Returns those on it."""
        from edgerun.kernels.qlinear_planes import planes_unsupported

        dtype = self.model.embed_tokens.weight.dtype
        taken = []
        for m in self.modules():
            if isinstance(m, QLinear):
                worth = m.gemv and m.out_features * m.in_features >= PLANES_MIN_VALUES
                take = on and worth and planes_unsupported(m.qweight(), dtype) is None
                m.use_planes(take)
                if take:
                    taken.append(m)
        return taken

    def use_int8_activations(self, on: bool) -> list[QLinear]:
        """Give (``on``) every projection that gains from int8 activations (``int8_worth``) x
        quantized to int8 per 32 columns in its decode GEMV (W4A8), or take it from every one.
        Returns those that take it. More rows than a GEMV takes (a prompt's chunk: a GEMM over the
        dequantized weight) keep bf16 x."""
        taken = []
        for m in self.modules():
            if isinstance(m, QLinear):
                m.act = "int8" if on and int8_worth(m) else "bf16"
                if m.act == "int8":
                    taken.append(m)
        return taken

    def share_rows(self, on: bool, above: int = 0) -> int:
        """Within ``exact_rows`` (a batch's step, a speculative verify window), run each projection's rows in one GEMV
        (``on``: the weight read once for all rows, each row in accumulators of its own) or each
        row by programs of its own (the weight read per row). Either way a row's bits are meant
        to be the one-row call's; the start-up probes check it on the device
        (``Runner.probe_batch``, ``Runner._probe_windows``) and turn ``on`` off if not.
        ``above``: only projections whose stored weight takes more bytes share (a smaller one's
        rows, each by programs of its own, read it again mostly from L2, and run in parallel
        where one pass would run them one after another). Returns how many projections share."""
        shared = 0
        for m in self.modules():
            if isinstance(m, QLinear):
                m.shared_rows = on and m.nbytes() > above
                shared += m.shared_rows
        return shared

    def gemv_cases(self) -> list[tuple]:
        """What the dense probe runs the GEMV on for this model: every projection's (scheme,
        rows, cols, group) with no epilogue (rows capped at PROBE_ROWS plus the remainder of a
        64-row tile, so the largest are probed at a size the start-up can afford), and each
        epilogue, and the RMSNorm prologue (normalised x written out too), once per (scheme, cols,
        group); and a DeltaNet layer's in_proj at its own rows with the conv in its launch
        (epilogue "conv": ``QLinear.folds_conv``, checked against the conv's own launch)."""
        shapes, kinds = set(), set()
        for m in self.modules():
            if isinstance(m, QLinear):
                rows = m.out_features if m.out_features <= PROBE_ROWS else PROBE_ROWS + m.out_features % 64
                shapes.add((m.scheme, rows, m.in_features, m.group, "none"))
                kinds.add((m.scheme, m.in_features, m.group))
        norm = "unit" if self.args.norm_unit_offset else "plain"  # the decoder's RMSNorms, in GEMV prologues
        for scheme, cols, group in kinds:
            shapes.update((scheme, 128, cols, group, e) for e in ("silu_mul", "residual", "gated"))
            shapes.update((scheme, 128, cols, group, e, norm) for e in ("none", "silu_mul"))
        for layer in self.model.layers:
            if layer.kind != A.FULL_ATTENTION:
                m = layer.linear_attn.in_proj
                shapes.add((m.scheme, m.out_features, m.in_features, m.group, "conv", norm))
        return sorted(shapes)

    def new_state(
        self, batch: int, max_len: int, device=None, dtype=None, zero_kv: bool = True
    ) -> DecodeState:
        ref = self.model.embed_tokens.weight
        device = device or ref.device
        dtype = dtype or ref.dtype
        entries = []
        for layer in self.model.layers:
            if layer.kind == A.FULL_ATTENTION:
                entries.append(layer.self_attn.new_state(batch, max_len, device, dtype, zero_kv))
            else:
                entries.append(layer.linear_attn.new_state(batch, device, dtype))
        return DecodeState(entries, max_len)

    def forward(
        self, tokens: torch.Tensor, state: DecodeState | None = None, last_only: bool = False
    ) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, V] (or [B, 1, V] with ``last_only``). With a state, the
        tokens continue the sequence the state holds and the state advances by T."""
        x = self.hidden(tokens, state)
        if last_only:
            x = x[:, -1:]
        return self.lm_head(x)

    def decode_rows(self, tokens: torch.Tensor, states: list[DecodeState]) -> torch.Tensor:
        """One decode step of B sequences at once: tokens [B] (row b continues ``states[b]``, at
        its own position) -> logits [B, V]. Each row is computed as that sequence's one-row
        decode step computes it, bit for bit (``exact_rows``: a projection's rows one at a
        time where BLAS would sum them otherwise; attention and the DeltaNet state per
        sequence; the routed experts of all rows in one pass, each expert's rows padded to a
        fixed tile), so a sequence's tokens do not depend on which others share its steps.
        Every state advances by one."""
        starts = [s.pos for s in states]
        for b, s in enumerate(states):
            if s.pos + 1 > s.max_len:
                raise ValueError(
                    f"row {b}: sequence of {s.pos + 1} tokens exceeds its state's max_len {s.max_len}"
                )
        x = self.model.embed_tokens(tokens[:, None])  # [B, 1, D]
        rope = self.rotary(torch.tensor(starts, device=tokens.device), x.dtype)  # [B, R]
        with exact_rows():
            for i, layer in enumerate(self.model.layers):
                x = layer.decode_rows(x, rope, [s.layers[i] for s in states], starts)
            logits = self.lm_head(self.model.norm(x))[:, 0]
        for s in states:
            s.pos += 1
        return logits

    def hidden(
        self,
        tokens: torch.Tensor,
        state: DecodeState | None = None,
        rows: bool = False,
        valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, T] -> the final normed hidden states [B, T, D] (the lm_head's input, and
        the MTP head's). ``rows`` (a speculative verify window): every row is computed as the
        one-row decode step at its position computes it, bit for bit, and the DeltaNet layers
        keep each row's state for ``DecodeState.rollback``. ``valid`` [T] bool, true for a
        first run of rows (a chunk padded to a captured length): the state ends as after those
        rows alone, except ``state.pos``, which advances by T (the caller sets it)."""
        B, T = tokens.shape
        start = 0 if state is None else state.pos
        if state is not None and start + T > state.max_len:
            raise ValueError(f"sequence of {start + T} tokens exceeds the state's max_len {state.max_len}")
        x = self.model.embed_tokens(tokens)
        positions = torch.arange(start, start + T, device=tokens.device)
        rope = self.rotary(positions, x.dtype)
        with verify_window() if rows else nullcontext():
            for i, layer in enumerate(self.model.layers):
                x = layer(x, rope, None if state is None else state.layers[i], start, rows, valid)
        if state is not None:
            state.pos += T
        return self.model.norm(x)


def tensor_specs(model_cls: type[CausalLM], args: ModelArgs) -> list[TensorSpec]:
    """Every tensor a model class holds, read off a meta-device instance (no memory allocated).
    Built-in architectures list theirs without torch (``models/inventory.py``, tested equal);
    a provider's architecture may use this."""
    with torch.device("meta"):
        model = model_cls(args)
    specs = []
    for name, p in model.named_parameters():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        specs.append(TensorSpec(name, tuple(p.shape), categorize(name), layer))
    return specs


def _shared_down_tile(down: QLinear):
    """``moe_triton.shared_down_tile`` of a shared expert's down projection (imported only where
    the Triton kernels run)."""
    from edgerun.kernels.moe_triton import shared_down_tile

    return shared_down_tile(down.qweight())
