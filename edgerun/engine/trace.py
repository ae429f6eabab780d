"""Route traces from a running model: which experts each token routes to, one trace line per
token, tagged with its forward (step).

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

    def __init__(self, model, args, path: str | Path, name: str, seq: int | None = None) -> None:
        self.args = args
        self.writer = RouteTraceWriter(path, TraceHeader.for_model(args, name))
        self.step = 0
        self.seq = seq
        self.runner = None
        self._in_forward = False
        self._ids: dict[int, list[list[int]]] = {}
        self._hooks = []
        for i, layer in enumerate(model.model.layers):
            if i in args.moe_layers:
                self._hooks.append(layer.mlp.gate.register_forward_hook(self._on_route(i)))
        self._hooks.append(model.register_forward_pre_hook(self._on_forward_start))
        self._hooks.append(model.register_forward_hook(self._on_forward))

    @classmethod
    def for_runner(cls, runner, path: str | Path, name: str) -> RouteRecorder:
        """A recorder of everything ``runner`` computes, its decoder's steps included."""
        rec = cls(runner.model, runner.args, path, name)
        rec.runner = runner
        runner.routes = rec
        return rec

    def _on_route(self, layer: int):
        def hook(_module, _inputs, output) -> None:
            if self._in_forward:
                self._ids[layer] = output[1].tolist()

        return hook

    def _on_forward_start(self, _module, _inputs) -> None:
        self._in_forward = True
        self._ids.clear()

    def _on_forward(self, _module, _inputs, _output) -> None:
        self._in_forward = False
        self.add_step(self._ids)

    def add_step(self, ids: dict[int, list[list[int]]]) -> None:
        """One forward's routes: {MoE layer: [token][A] expert ids}."""
        per_layer = [ids[layer] for layer in self.args.moe_layers]
        for t in range(len(per_layer[0])):
            self.writer.add([rows[t] for rows in per_layer], seq=self.seq, step=self.step)
        self.step += 1

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        if self.runner is not None and self.runner.routes is self:
            self.runner.routes = None
        self.writer.close()
