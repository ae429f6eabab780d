"""A pytest plugin for the interpreted kernel scripts (``-p launch_recorder``): records each
distinct Triton launch (kernel, argument types, constexpr values) to the JSON file named by
EDGERUN_RECORD_LAUNCHES, so tests/kernels/test_interpret.py can compile the very launches the
interpreter ran for a real GPU target on the CPU (the interpreter never compiles)."""

import inspect
import json
import os

import torch

TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.uint8: "u8", torch.int8: "i8", torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
}  # fmt: skip
_seen: dict[str, dict] = {}


def _signature(fn, args, kwargs) -> tuple[dict, dict]:
    params = inspect.signature(fn).parameters
    bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
    sig, const = {}, {}
    for name, p in params.items():
        v = bound.get(name)
        if "constexpr" in str(p.annotation):
            sig[name], const[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[name] = "*" + TYPES[v.dtype]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:  # ints (bools are constexpr here)
            sig[name] = "i64" if isinstance(v, int) and abs(v) >= 2**31 else "i32"
    return sig, const


def pytest_configure(config):
    if not os.environ.get("EDGERUN_RECORD_LAUNCHES"):
        return
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        sig, const = _signature(self.fn, args, kwargs)
        row = dict(module=self.fn.__module__, name=self.fn.__name__, sig=sig, const=const,
                   num_warps=kwargs.get("num_warps", 4),
                   enable_fp_fusion=kwargs.get("enable_fp_fusion", True))  # fmt: skip
        _seen.setdefault(json.dumps(row, sort_keys=True), row)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run


def pytest_unconfigure(config):
    path = os.environ.get("EDGERUN_RECORD_LAUNCHES")
    if path:
        with open(path, "w") as f:
            json.dump(list(_seen.values()), f)
