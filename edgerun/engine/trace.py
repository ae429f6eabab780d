"""Route traces from a running model: which experts each token routes to, one trace line per
token, tagged with its forward (step), and which experts the prefetcher predicts for each MoE
layer after the first (its router over the previous MoE layer's residual stream,
``engine/streaming.predicted_rows``), so the simulator replays prefetch exactly.

A model forward (prefill, and decode on the CPU) is seen through hooks on the routers. A CUDA
decode step runs the captured step instead of the forward, so the runner hands each such step's
routes over (:meth:`RouteRecorder.add_step`) from the decoder's static buffers: every decoded
token is traced on every device and graph mode.
"""

from __future__ import annotations

from pathlib import Path

from edgerun.tools.routes import RouteTraceWriter, TraceHeader


class RouteRecorder:
    """Forward hooks on every router of a model; each model forward becomes one trace step.
    Router calls outside a model forward (the decoder's operations, possibly under graph
    capture) are not hooked: those steps arrive through :meth:`add_step`."""

    def __init__(
        self, model, args, path: str | Path, name: str, seq: int | None = None, per_token: bool = False
    ) -> None:
        self.args = args
        self.per_token = per_token  # every token its own step (a text read as decoding it would be)
        self.writer = RouteTraceWriter(path, TraceHeader.for_model(args, name))
        self.step = 0
        self.seq = seq
        self.runner = None
        self._in_forward = False
        self._ids: dict[int, list[list[int]]] = {}
        self._predicted: dict[int, list[list[int]]] = {}
        self._predicted2: dict[int, list[list[int]]] = {}  # two MoE layers ahead
        self._residual: dict[int, object] = {}
        self.model = model
        self._next = dict(zip(args.moe_layers, args.moe_layers[1:], strict=False))
        self._after = dict(zip(args.moe_layers, args.moe_layers[2:], strict=False))
        self._hooks = []
        for i, layer in enumerate(model.model.layers):
            if i in args.moe_layers:
                self._hooks.append(layer.mlp.gate.register_forward_hook(self._on_route(i)))
            if i in self._next:
                self._hooks.append(layer.post_attention_layernorm.register_forward_pre_hook(self._keep(i)))
        self._hooks.append(model.register_forward_pre_hook(self._on_forward_start))
        self._hooks.append(model.register_forward_hook(self._on_forward))

    @classmethod
    def for_runner(cls, runner, path: str | Path, name: str) -> RouteRecorder:
        """A recorder of everything ``runner`` computes, its decoder's steps included."""
        rec = cls(runner.model, runner.args, path, name)
        rec.runner = runner
        runner.routes = rec
        return rec

    def _keep(self, layer: int):
        def hook(_module, inputs) -> None:
            if self._in_forward:
                self._residual[layer] = inputs[0]

        return hook

    def _on_route(self, layer: int):
        from edgerun.engine.streaming import predicted_rows

        def hook(_module, _inputs, output) -> None:
            if self._in_forward:
                self._ids[layer] = output[1].tolist()
                residual = self._residual.pop(layer, None)
                if residual is not None:
                    residual = residual.reshape(-1, residual.shape[-1])
                    nxt = self._next[layer]
                    self._predicted[nxt] = predicted_rows(self.model, nxt, residual)
                    if layer in self._after:
                        after = self._after[layer]
                        self._predicted2[after] = predicted_rows(self.model, after, residual)

        return hook

    def _on_forward_start(self, _module, _inputs) -> None:
        self._in_forward = True
        self._ids.clear()
        self._predicted.clear()
        self._predicted2.clear()

    def _on_forward(self, _module, _inputs, _output) -> None:
        self._in_forward = False
        self.add_step(self._ids, self._predicted, self._predicted2)

    def add_step(
        self,
        ids: dict[int, list[list[int]]],
        predicted: dict[int, list[list[int]]] | None = None,
        predicted2: dict[int, list[list[int]]] | None = None,
    ) -> None:
        """One forward's routes: {MoE layer: [token][A] expert ids}; ``predicted``: the same for
        every MoE layer after the first, as the prefetcher predicts them (None: not known);
        ``predicted2``: for every MoE layer after the second, predicted two MoE layers before."""
        per_layer = [ids[layer] for layer in self.args.moe_layers]

        def rows_of(pred, skip: int):
            later = self.args.moe_layers[skip:]
            return [pred[layer] for layer in later] if pred and all(i in pred for i in later) else None

        pred, pred2 = rows_of(predicted, 1), rows_of(predicted2, 2)
        if len(self.args.moe_layers) < 3:
            pred2 = None  # nothing is two MoE layers ahead
        for t in range(len(per_layer[0])):
            self.writer.add(
                [rows[t] for rows in per_layer],
                seq=self.seq,
                step=self.step,
                predicted=None if pred is None else [rows[t] for rows in pred],
                predicted2=None if pred2 is None or pred is None else [rows[t] for rows in pred2],
            )
            self.step += self.per_token
        self.step += not self.per_token

    def read_text(self, runner, ids: list[int], segment: int) -> None:
        """Route ``ids`` teacher-forced, in sequences of ``segment`` tokens (each a fresh state and
        its own ``seq``), as a prefill computes them: the routes decoding those tokens takes, up
        to rounding. With ``per_token`` each token is its own step, as in decode."""
        if segment < 1:
            raise ValueError(f"segment must be >= 1 token, got {segment}")
        for n, start in enumerate(range(0, len(ids), segment)):
            part = ids[start : start + segment]
            self.seq = n
            runner.prefill(runner.new_state(len(part)), part)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        if self.runner is not None and self.runner.routes is self:
            self.runner.routes = None
        self.writer.close()
