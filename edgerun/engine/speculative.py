"""Speculative decoding with the model's own MTP head: draft k tokens, verify k + 1 positions in
one forward of the main model, keep the accepted prefix, roll the rest back.

One step, the main model having consumed positions 0..n-1 and token t_n chosen:

    drafts   d_1..d_k   the MTP head, from the main model's hidden state at n-1 and t_n, then
                        from its own hidden state and its last draft (``MtpDrafter.draft``)
    verify   rows t_n, d_1..d_k at positions n..n+k (``CausalLM.hidden(rows=True)``: each row
             the bits of a one-row decode step, so a kept token is what plain decoding emits)
    accept   greedy: the drafts that equal the argmax of the row before them, then the argmax
             of the first row not matched (a bonus token); sampling: the standard rejection
             test, which leaves the target distribution unchanged (``accept``)
    rollback the KV positions and DeltaNet states past the kept rows (``DecodeState.rollback``:
             DeltaNet layers keep each row's state during a verify, so nothing runs twice)

The MTP head keeps its own KV cache: position p holds (the main model's hidden state at p, token
p+1). Drafted positions past n-1 are rewritten from the main model's hidden states once the
verify has produced them, so the head's cache always holds what the kept sequence implies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from edgerun.config import SpeculativeConfig  # noqa: F401  (re-exported: the engine's setting)
from edgerun.engine.events import SpeculativeStats  # noqa: F401  (re-exported)
from edgerun.models.layers import DecodeState


class MtpDrafter:
    """The MTP head's side of one request: its KV state, and the main model's hidden rows it has
    not consumed yet (positions ``state.pos``.. of ``seq``, the request's tokens so far)."""

    def __init__(self, model: torch.nn.Module, max_len: int, device, dtype) -> None:
        self.model = model
        self.head = model.mtp
        self.state: DecodeState = self.head.new_state(max_len, device, dtype)
        self.pending: torch.Tensor | None = None  # [1, P, D]

    def extend(self, hidden: torch.Tensor) -> None:
        """The main model's final hidden rows [1, T, D] for the positions after those pending."""
        self.pending = hidden if self.pending is None else torch.cat([self.pending, hidden], dim=1)

    def catch_up(self, seq: list[int]) -> torch.Tensor | None:
        """Feed the head every pending row whose next token ``seq`` knows; returns the head's
        hidden state [1, 1, D] of the last row fed (None if none was)."""
        if self.pending is None:
            return None
        start = self.state.pos
        n = min(self.pending.shape[1], len(seq) - 1 - start)
        if n <= 0:
            return None
        nxt = torch.tensor([seq[start + 1 : start + 1 + n]], device=self.pending.device)
        out = self.head(
            self.model.model.embed_tokens(nxt), self.pending[:, :n], self.model.rotary, self.state
        )
        self.pending = self.pending[:, n:] if n < self.pending.shape[1] else None
        return out[:, -1:]

    def draft(
        self, seq: list[int], k: int, choose: Callable[[torch.Tensor], int]
    ) -> tuple[list[int], list[torch.Tensor]]:
        """k draft tokens after ``seq`` (whose last token the main model has not consumed), each
        chosen by ``choose`` from the head's logits [V], and those logits."""
        h = self.catch_up(seq)
        if h is None:
            raise RuntimeError("MTP drafter: no hidden state to draft from (the prompt was not fed to it)")
        mark = self.state.pos
        tokens, logits = [], []
        for j in range(k):
            lg = self.model.lm_head(h)[0, -1]
            tokens.append(choose(lg))
            logits.append(lg)
            if j + 1 < k:
                emb = self.model.model.embed_tokens(torch.tensor([[tokens[-1]]], device=h.device))
                h = self.head(emb, h, self.model.rotary, self.state)
        self.state.pos = mark  # the drafted positions are rewritten from the main model's rows
        return tokens, logits


def accept(sampler, logits: torch.Tensor, drafts: list[int], draft_logits: list[torch.Tensor]) -> list[int]:
    """The tokens one verify step emits: logits [k+1, V] of the rows t_n, d_1..d_k.

    Greedy: each draft kept while it is the argmax of the row before it, then that row's argmax.
    Sampling: draft d_j (drawn from q_j, the sampler's distribution of its draft logits) is kept
    with probability min(1, p_j(d_j) / q_j(d_j)), p_j being the sampler's distribution of row j;
    the first one refused is replaced by a draw from max(0, p_j - q_j), normalised; all kept, a
    bonus token is drawn from p_k. Each emitted token is then distributed as p (the standard
    speculative-sampling argument), so sampling is unchanged by drafting."""
    out = []
    if sampler.params.greedy:
        for j, d in enumerate(drafts):
            best = sampler(logits[j])
            if best != d:
                return out + [best]
            out.append(d)
        return out + [sampler(logits[len(drafts)])]
    for j, d in enumerate(drafts):
        p, q = sampler.probs(logits[j]), sampler.probs(draft_logits[j])
        if sampler.uniform() * float(q[d]) < float(p[d]):  # u < p/q, without dividing by q
            out.append(d)
            continue
        residual = (p - q).clamp_(min=0)
        return out + [sampler.draw(residual if float(residual.sum()) > 0 else p)]
    return out + [sampler.draw(sampler.probs(logits[len(drafts)]))]


def draft_chooser(sampler) -> Callable[[torch.Tensor], int]:
    """How a draft token is picked from the head's logits: their argmax for a greedy request,
    else a draw from the sampler's distribution of them (the q of ``accept``)."""
    if sampler.params.greedy:
        return lambda lg: int(torch.argmax(lg))
    return lambda lg: sampler.draw(sampler.probs(lg))
