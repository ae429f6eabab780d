"""Runs interpreted_moe.py (the expert kernels), interpreted_dense.py (the dense decode
kernels), interpreted_qlinear.py (the projection GEMV), interpreted_qlinear_mma.py and
interpreted_qlinear_planes.py (its tensor-core variants), interpreted_qlinear_w4a8.py (its W4A8 experiment), interpreted_decode.py (router top-k, attention),
interpreted_sample.py (the device sampler),
engine/interpreted_fused_decode.py (a whole fused decode step, a batch's steps) and
engine/interpreted_speculative.py (the CUDA path's verify windows) on CPU, through
Triton's interpreter, each in a child process with TRITON_INTERPRET=1
set for that process only: Triton reads it at import.

The interpreter runs a kernel's Python and never compiles it, so a kernel can pass here and not
build for a GPU. Each script's launches are therefore recorded (tests/launch_recorder.py) and the
distinct kinds (a kernel and its flag constexprs; sizes aside) compiled here for an H200
(sm_90) as the CUDA engine launches them (decode kernels with programmatic dependent launch, the
prefill GEMMs with tensor-core bf16 products, not the interpreter's fp32 stand-in): Triton compiles
to PTX and a cubin on a machine without a GPU."""

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

FLAGS = {
    "QUANT",
    "EPILOGUE",
    "CODE",
    "NORM",
    "ACT",
    "G",
    "FAR",
    "SLOTS",
    "SLICE",  # the DeltaNet step's: a head's columns in one program, or split (its norm a launch after)
    "EARLY_P",  # kernels/launch.py's EARLY_PARAMS: small weights loaded before the wait, or after
    "EARLY_N",  # its EARLY_NORMS: a normed GEMV's first norm weights before the wait, or after
    "KEYS",  # sample_triton.GREEDY_KEYS: a greedy tile by one maximum of order keys, or three reductions
    "DIRECT",  # sample_triton.greedy's direct: the pick also into the host slot, the position advanced
}  # constexprs that pick code paths, not sizes


# The scripts run as child processes, os.cpu_count() at a time, all started with the session's
# first test (tests/conftest.py's ``interpreter_pool``) and niced: each is one single-threaded
# interpreter, and the rest of the suite runs on one thread (conftest.py), so on the 2-core CI
# machine the children take the core the suite leaves idle, then both once these tests, run last,
# wait for them. Longest first, so the pool never ends on a long one started late. The fused
# decode script runs as two halves by -k (a test added to it falls in the second).
FUSED = "../engine/interpreted_fused_decode.py"
BATCH = "batch"  # its batch tests (a step's rows; rows running a step ahead)
SCRIPTS = [  # in the order of their times on a 2-core VM (2026-12-06: 372, 184, 183, 162, 150, 111 s, ...)
    ("../engine/interpreted_speculative.py", None),
    ("interpreted_decode.py", None),
    (FUSED, f"not {BATCH}"),
    ("interpreted_qlinear.py", None),
    ("interpreted_moe.py", None),
    (FUSED, BATCH),
    ("interpreted_qlinear_mma.py", None),
    ("interpreted_qlinear_planes.py", None),
    ("interpreted_dense.py", None),
    ("interpreted_sample.py", None),
    ("interpreted_qlinear_w4a8.py", None),
]


def _run_script(script: str, select: str | None, record: Path) -> subprocess.CompletedProcess:
    here = Path(__file__).parent
    path = os.pathsep.join(filter(None, [str(here.parent), os.environ.get("PYTHONPATH")]))  # the plugin
    env = {**os.environ, "TRITON_INTERPRET": "1", "EDGERUN_RECORD_LAUNCHES": str(record), "PYTHONPATH": path}
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "launch_recorder",
        "-p",
        "interpreter_calls",  # helpers' calls skip the interpreter's repeated patching (its docstring)
        str(here / script),
        *(["-k", select] if select else []),
    ]
    if STOPPING.is_set():  # the session ended before this case started
        return subprocess.CompletedProcess(cmd, -1, "", "not run: the session ended first")
    child = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=here.parent.parent,
        preexec_fn=lambda: os.nice(10),  # the suite's own tests first; the children take what is left
    )
    CHILDREN.append(child)
    try:
        out, err = child.communicate(timeout=1200)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
        err += "\n(killed after 1200 s)"
    return subprocess.CompletedProcess(cmd, child.returncode, out, err)


RUNS: dict = {}  # (script, select) -> (future of its child's result, its launch record)
CHILDREN: list[subprocess.Popen] = []
STOPPING = threading.Event()


@contextmanager
def started(selected: list[tuple[str, str | None]], tmp_path_factory):
    """Submits the ``selected`` (script, select) cases at once to a pool of os.cpu_count()
    workers, longest first; their futures in RUNS until the context ends."""
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(os.cpu_count() or 1, len(selected)))) as pool:
            for case in sorted(selected, key=SCRIPTS.index):
                record = tmp_path_factory.mktemp("launches") / "launches.json"
                RUNS[case] = (pool.submit(_run_script, *case, record), record)
            try:
                yield
            finally:
                STOPPING.set()
                for future, _ in RUNS.values():
                    future.cancel()  # a session stopped early leaves the rest unstarted ...
                for child in CHILDREN:
                    if child.poll() is None:
                        child.kill()  # ... and stops the running ones
    finally:
        RUNS.clear()
        CHILDREN.clear()
        STOPPING.clear()


def selected_cases(items) -> list[tuple[str, str | None]]:
    """The (script, select) cases of this module's selected ``items`` (conftest.py picks them)."""
    return [(item.callspec.params["script"], item.callspec.params["select"]) for item in items]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed here")
@pytest.mark.parametrize(
    "script, select",
    SCRIPTS,
    ids=[Path(s).stem + (f"-k-{k.replace(' ', '-')}" if k else "") for s, k in SCRIPTS],
)
def test_triton_kernels_under_the_interpreter(script, select):
    future, record = RUNS[script, select]  # started with the session (tests/conftest.py)
    out = future.result()
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" not in out.stdout, out.stdout[-2000:]
    compiled = _compile_for_sm90(json.loads(record.read_text()))
    assert compiled, f"{script} launched no kernel of edgerun.kernels"


# kernels with a verify-window variant whose rows must be the one-row kernel's bits: built with
# no FMA contraction (whether Triton or ptxas contracts a mul and an add is its choice per
# compiled kernel, and differed between the DeltaNet window and its one-row kernel on an H200)
UNCONTRACTED = {
    "_delta_conv_kernel",
    "_delta_conv_window_kernel",
    "_delta_decode_kernel",
    "_delta_decode_window_kernel",
    "_attend_kernel",
}


def _assert_uncontracted(name: str, flags: str, row: dict, ptx: str) -> None:
    """Launched with enable_fp_fusion=False (LLVM then forms no fma of its own), and every f32
    mul / add / sub in the PTX is .rn, which ptxas may not contract. The fma.rn that remain are
    written as such (tl.dot's FMA lowering, libdevice's exp and rsqrt): the same in every build."""
    assert row.get("enable_fp_fusion") is False, f"{name} {flags} is launched with FMA contraction on"
    loose = re.findall(r"^\s*(?:mul|add|sub)\.f32\b", ptx, re.M)
    assert not loose, f"{name} {flags}: {len(loose)} contractable f32 ops in its PTX, e.g. {loose[0].strip()}"


def _compile_for_sm90(launches: list[dict]) -> int:
    """Compiles one launch of each kind for sm_90 with PDL; returns how many. A failure names the
    kernel and its constexprs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    kinds = {}
    for row in launches:
        flags = {k: v for k, v in row["const"].items() if isinstance(v, bool) or k in FLAGS}
        kinds.setdefault((row["module"], row["name"], json.dumps(flags, sort_keys=True)), row)
    n = 0
    for (module, name, flags), row in kinds.items():
        pdl = "PDL" in row["const"]
        if not row["module"].startswith("edgerun.kernels"):
            continue  # a test's own kernel
        fn = getattr(importlib.import_module(module), name)
        gpu = {"PDL": True, "INTERPRET": False}  # as the GPU launches it
        const = {(fn.arg_names.index(k),): gpu.get(k, v) for k, v in row["const"].items()}
        src = ASTSource(fn=fn, signature=row["sig"], constexprs=const)
        try:
            kernel = compile(
                src,
                target=GPUTarget("cuda", 90, 32),
                options={
                    "num_warps": row["num_warps"],
                    "launch_pdl": pdl,
                    "enable_fp_fusion": row.get("enable_fp_fusion", True),
                },
            )
        except Exception as e:
            raise AssertionError(f"{name} {flags} does not compile for sm_90: {e}") from None
        if name in UNCONTRACTED:
            _assert_uncontracted(name, flags, row, kernel.asm["ptx"])
        if pdl:
            assert "griddepcontrol.wait" in kernel.asm["ptx"], (
                f"{name} {flags} never waits for its predecessor"
            )
        n += 1
    return n
