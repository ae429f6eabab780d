"""What importing a module pulls in. Each check runs in a fresh interpreter, so modules an earlier
test imported cannot hide (or cause) a dependency.

- kernels never import model code (models depend on kernels, not the reverse);
- the planner, the cache simulator and the convert/verify parsers import without torch;
- the server never imports the command line (``edgerun.cli`` is the top of the tree);
- ``edgerun plan`` runs with torch blocked.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK_TORCH = "import sys; sys.modules['torch'] = None  # any import of torch now fails\n"


def submodules(package: str) -> list[str]:
    """The modules directly in ``package``, found on disk without importing any of them."""
    paths = importlib.util.find_spec(package).submodule_search_locations
    return sorted(f"{package}.{m.name}" for m in pkgutil.iter_modules(paths))


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)


def loaded_after_import(module: str, prefix: str, setup: str = "") -> list[str]:
    """The modules named ``prefix`` or ``prefix.*`` in sys.modules after importing ``module``
    in a fresh interpreter (after running ``setup``)."""
    code = (
        f"{setup}import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m == {prefix!r} or m.startswith({prefix + '.'!r}))))\n"
    )
    proc = run_python(code)
    assert proc.returncode == 0, f"importing {module}:\n{proc.stderr}"
    return json.loads(proc.stdout)


# ---- kernels do not import models ----------------------------------------------------------

TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("module", submodules("edgerun.kernels"))
def test_kernels_import_no_model_code(module):
    if module.endswith("_triton") and not TRITON:
        pytest.skip(f"{module} needs triton, which is not installed")
    assert loaded_after_import(module, "edgerun.models") == []


def test_kernel_modules_are_found():
    """The parametrization above is not vacuous."""
    names = set(submodules("edgerun.kernels"))
    expected = {"moe", "moe_reference", "dense_reference", "probe", "dense_probe"}
    assert {f"edgerun.kernels.{n}" for n in expected} <= names


# ---- planning needs no torch ---------------------------------------------------------------


@pytest.mark.parametrize(
    "module", [*submodules("edgerun.budget"), "edgerun.tools.simulate", "edgerun.bundle.cli"]
)
def test_imports_without_torch(module):
    # `import torch` raises in there, so the import succeeding is the check; "torch" is the blocker
    assert loaded_after_import(module, "torch", setup=BLOCK_TORCH) == ["torch"]


def test_plan_runs_without_torch():
    argv = [
        "plan", "--profile", "configs/orin.yaml", "--model", "configs/models/qwen3.6-35b-a3b.json",
        "--context", "8192",
    ]  # fmt: skip
    proc = run_python(f"{BLOCK_TORCH}from edgerun.cli import main\nsys.exit(main({argv!r}))\n")
    assert proc.returncode == 0, proc.stderr
    assert "edgerun plan: qwen3.6-35b-a3b (qwen3_5_moe) on Jetson AGX Orin" in proc.stdout
    assert "expert quota:" in proc.stdout


# ---- the demo runs without Triton -----------------------------------------------------------

BLOCK_TRITON = "import sys; sys.modules['triton'] = None  # any import of triton now fails\n"


def test_demo_generates_without_triton():
    """``make demo`` installs no Triton (a CPU machine): loading the demo model and generating
    must not import it (a projection turned off the tensor-core GEMV it never used did, once)."""
    argv = ["generate", "--max-tokens", "4", "--seed", "1", "--device", "cpu", "In the beginning"]
    proc = run_python(f"{BLOCK_TRITON}from edgerun.cli import main\nsys.exit(main({argv!r}))\n")
    assert proc.returncode == 0, proc.stderr
    assert "generated 4 tok" in proc.stdout + proc.stderr


# ---- the server does not import the command line -------------------------------------------


def cli_imports(path: Path, package: str) -> list[str]:
    """Every import of ``edgerun.cli`` (absolute, relative, ``from edgerun import cli`` or
    ``importlib.import_module``) anywhere in the file, inside functions too, as 'line: source'."""
    source = path.read_text()
    found = []
    for node in ast.walk(ast.parse(source, str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        if any(n == "edgerun.cli" or n.startswith("edgerun.cli.") for n in names):
            found.append(f"{node.lineno}: {ast.get_source_segment(source, node)}")
    return found


def test_cli_import_finder_sees_every_form(tmp_path):
    """The source check below can fail: each way of importing edgerun.cli is found."""
    forms = [
        "import edgerun.cli",
        "from edgerun.cli import main",
        "from edgerun import cli",
        "from .. import cli",
        "from ..cli import provenance",
        "importlib.import_module('edgerun.cli')",
    ]
    for form in forms:
        path = tmp_path / "mod.py"
        path.write_text(f"def later():\n    {form}\n")
        assert cli_imports(path, "edgerun.server") == [f"2: {form}"], form
    path.write_text("import edgerun.client\nfrom . import cli\nfrom edgerun import clip\n")
    assert cli_imports(path, "edgerun.server") == []  # edgerun.server.cli is not edgerun.cli


@pytest.mark.parametrize("module", ["edgerun.server", *submodules("edgerun.server")])
def test_server_does_not_import_the_command_line(module):
    spec = importlib.util.find_spec(module)
    package = module if spec.submodule_search_locations else module.rpartition(".")[0]
    assert cli_imports(Path(spec.origin), package) == []
    assert loaded_after_import(module, "edgerun.cli") == []


# ---- the benchmark scripts import what exists ----------------------------------------------


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")))
def test_benchmark_scripts_import_names_that_exist(script):
    """Benchmarks run only on a GPU or by hand, so a renamed function would break them unseen:
    every ``from edgerun... import name`` they hold must name something that exists (checked
    without running the script)."""
    tree = ast.parse((ROOT / "benchmarks" / script).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgerun"):
            if node.module.endswith("_triton") and not TRITON:
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                sub = hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{alias.name}")
                assert hasattr(module, alias.name) or sub, (
                    f"benchmarks/{script}: {node.module} has no {alias.name}"
                )


def test_loading_a_model_on_the_cpu_leaves_torchs_compiler_stack_unimported():
    """Building the model on the meta device and generating on the CPU, a prompt in several
    chunks among it, never import torch._dynamo (a meta-device arange or normal_ does, through
    torch._refs, and so does torch.nn.attention.bias: ~125 MiB of RSS and a second, for nothing;
    in a request's prefill, a second without a watchdog ping)."""
    code = (
        "import sys\n"
        "from edgerun.engine.setup import runtime\n"
        "from edgerun.engine.params import SamplingParams\n"
        "r = runtime('cpu', 'auto', 1, None, None, None, None).load(None, prefill_chunk=4)\n"
        "r.generate_ids(list(range(5, 40)), SamplingParams(max_tokens=3))  # later chunks too\n"
        "print(sorted(m for m in ('torch._dynamo', 'triton', 'sympy') if m in sys.modules))\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_cpu_shape_caches_are_bounded_before_the_first_cpu_op():
    """runtime() bounds oneDNN's and ideep's per-shape caches (a user's own setting wins), set
    before any CPU op: the libraries read them once, at their first primitive."""
    code = (
        "import os\n"
        "os.environ['LRU_CACHE_CAPACITY'] = '7'\n"
        "from edgerun.engine.setup import runtime, SHAPE_CACHE_ENTRIES\n"
        "runtime('cpu', 'auto', 1, None, None, None, None)\n"
        "print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'] == str(SHAPE_CACHE_ENTRIES), os.environ['LRU_CACHE_CAPACITY'])\n"
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "7"]
