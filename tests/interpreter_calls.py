"""pytest plugin for the interpreter's children (tests/kernels/test_interpret.py runs each script
with ``-p interpreter_calls``): Triton's interpreter (3.6) patches triton.language again at every
call of a @triton.jit helper inside a kernel (``InterpretedFunction.__call__`` ->
``_patch_lang``: an ``inspect.getmembers`` of four modules, about 0.25 ms), although the launch
(``GridExecutor.__call__``) patched the same modules, the same way, before its first program ran.
The decode kernels call dozens of helpers a program, so that was most of a program's time (a
qgemv program of a tiny weight: 44 ms, 146 patches). Inside a launch a helper's call now patches
only language modules the launch has not patched yet (a helper of triton.language.standard sees
triton.language.core, which the kernel's module may not name); what the launch patched is
restored when it ends, as before, and a module a helper patched stays patched, as before. Nothing
changes where the interpreter's internals are not these (another Triton version)."""

import inspect

import triton.language as tl
import triton.runtime.interpreter as interp

_launch = {"open": False, "patched": frozenset()}  # in a launch; the language modules patched in it


def _langs(fn) -> frozenset:
    """The language modules ``_patch_lang(fn)`` patches: triton.language and triton.language.core
    where fn's globals name them (a kernel's module names tl; triton.language.standard, core)."""
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def _skip_helper_patches() -> bool:
    if not all(hasattr(interp, name) for name in ("_patch_lang", "GridExecutor", "_LangPatchScope")):
        return False
    patch_lang, grid_call = interp._patch_lang, interp.GridExecutor.__call__

    def patch_lang_once(fn):
        langs = _langs(fn)
        if _launch["open"] and langs <= _launch["patched"]:
            return interp._LangPatchScope()  # nothing to restore: the launch's patches stand
        scope = patch_lang(fn)
        if _launch["open"]:
            _launch["patched"] |= langs
        return scope

    def launch(self, *args, **kwargs):
        outer = dict(_launch)
        _launch.update(open=True, patched=frozenset())
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _launch.update(outer)

    interp._patch_lang = patch_lang_once
    interp.GridExecutor.__call__ = launch
    return True


def pytest_configure(config):
    _skip_helper_patches()
