"""Continuous batching: up to B sequences decode together, one multi-row step at a time.

:class:`DecodeBatch` only keeps books and runs the step; the requests' generators
(``Runner.generate``) drive it. Each sequence owns a slot of one state pool (KV and DeltaNet
conv + recurrent state, ``[B, ...]`` per layer, so a step over the pool has fixed shapes) and
prefills into it alone. After each sampled token that does not end its request, a sequence
*feeds* the token to the batch; the first sequence to ask for its next logits runs one step
over every fed row (:meth:`CausalLM.decode_rows`), and the others find theirs waiting. A caller
that advances each generator once per round (the daemon's engine worker) thus gets one step per
round over every sequence that is decoding, while a sequence still in prefill runs its chunk in
between. A sequence leaves (its slot free at once) when its generator ends or is closed.

Each row is computed as the sequence's one-row step computes it (``exact_rows``), so a
request's tokens do not depend on its neighbours (tests/engine/test_batch.py).

On the CPU the step is eager, the token mixer a Python loop over rows with host positions. On
CUDA it is ``engine/graphs.RowSteps``: a CUDA graph per row count over the pool, the rows' slots
and positions device tensors, the fused kernels indexing the pool by slot; its greedy tokens are
chosen on the device and read back with the step (``Row.pick``), so a greedy row costs no
sampling of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgerun.errors import EdgerunError
from edgerun.models.layers import DecodeState, DeltaState, KVCache


@dataclass(eq=False)
class Row:
    slot: int
    state: DecodeState  # views of the pool's slot
    token: int | None = None  # fed: the next step's input
    logits: torch.Tensor | None = None  # the step's output for it, not yet taken
    pick: tuple[int, float] | None = None  # the step's greedy token and its logit, where it chose one
    greedy: bool = False  # its request feeds the step's greedy picks (its step may run ahead)
    ahead: object = None  # the step queued ahead of its feed (graphs.Queued), on CUDA
    ahead_token: int | None = None  # the token that step consumed: the next feed must be it
    left: bool = False  # it left the batch (its slot is free)
    ready: object = None  # CUDA: the event its prefill lane recorded (engine/graphs.PrefillLanes)


@dataclass
class BatchStats:
    steps: int = 0
    rows: int = 0  # summed over steps: rows / steps is the mean batch
    sizes: dict[int, int] = field(default_factory=dict)  # steps by their row count, every key from 1 to B


class DecodeBatch:
    """``size`` slots of ``max_len`` tokens each; the step runs ``step(slots, states, tokens)``
    -> (logits [N, V], the rows' greedy (token, logit) picks or None) (``Runner.batch_step``),
    or, given ``advance``, ``advance(rows)``, which sets each fed row's logits and pick itself
    and returns the row counts of the steps it queued (on CUDA: ``RowSteps.advance``, whose
    greedy rows run a step ahead; a step ahead whose rows then ended counts too), or None to
    have ``step`` run instead."""

    def __init__(self, model, size: int, max_len: int, device, step, advance=None) -> None:
        if size < 1:
            raise EdgerunError(f"batch must be >= 1, got {size}")
        self.size, self.max_len = size, max_len
        # KV uninitialised: slots sized for the longest request commit pages only as they fill
        self.pool = model.new_state(size, max_len, device=device, zero_kv=False)
        self._step = step
        self._advance = advance
        self.free = list(range(size))
        self.rows: list[Row] = []  # joined, in the order they joined
        # every row count a key from the start: /metrics reads the dict from another thread
        self.stats = BatchStats(sizes=dict.fromkeys(range(1, size + 1), 0))

    @property
    def running(self) -> int:
        """Sequences holding a slot (prefilling or decoding)."""
        return len(self.rows)

    def join(self, total_len: int) -> Row:
        """A free slot, its DeltaNet state zeroed (its KV past the position is never read)."""
        if total_len > self.max_len:
            raise EdgerunError(
                f"a sequence of {total_len} tokens exceeds the batch's slots of {self.max_len}"
            )
        if not self.free:
            raise EdgerunError(f"all {self.size} batch slots are taken")
        slot = self.free.pop(0)
        layers = []
        for entry in self.pool.layers:
            if isinstance(entry, KVCache):
                layers.append(KVCache(entry.k[slot : slot + 1], entry.v[slot : slot + 1]))
            elif isinstance(entry, DeltaState):
                view = DeltaState(entry.conv[slot : slot + 1], entry.recurrent[slot : slot + 1])
                view.conv.zero_()
                view.recurrent.zero_()
                layers.append(view)
            else:
                layers.append(None)
        row = Row(slot, DecodeState(layers, total_len))
        self.rows.append(row)
        return row

    def leave(self, row: Row) -> None:
        row.left = True
        if row in self.rows:
            self.rows.remove(row)
            self.free.append(row.slot)
            self.free.sort()

    def feed(self, row: Row, token: int) -> None:
        row.token = token

    def logits(self, row: Row) -> tuple[torch.Tensor, tuple[int, float] | None]:
        """The row's logits [V] for its fed token and the step's greedy pick for it (None where
        the step chose none): from the step that already ran, or one run now over every fed row."""
        if row.logits is None:
            if row.token is None:
                raise EdgerunError("a batch row asked for logits without feeding a token")
            self.step()
        out, row.logits, pick, row.pick = row.logits, None, row.pick, None
        return out, pick

    @torch.inference_mode()
    def step(self) -> None:
        fed = [r for r in self.rows if r.token is not None and r.logits is None]
        sizes = self._advance(fed) if self._advance is not None else None
        if sizes is None:
            logits, picks = self._step([r.slot for r in fed], [r.state for r in fed], [r.token for r in fed])
            for i, r in enumerate(fed):
                r.logits, r.token = logits[i], None
                r.pick = picks[i] if picks is not None else None
            sizes = [len(fed)]
        s = self.stats
        for n in sizes:
            s.steps += 1
            s.rows += n
            s.sizes[n] += 1
