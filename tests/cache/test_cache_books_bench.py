"""benchmarks/cache_books.py runs by hand: its timed paths must stay runnable and count alike."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cache_books.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("cache_books", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("policy", ["lfu", "lru"])
def test_books_and_the_null_cache_count_the_same_misses(bench, policy):
    """The cache over a reader that does nothing decides as its books alone, with prefetch or
    without (prefetch never changes hits and misses)."""
    routes = bench.zipf_routes(30)
    preds = bench.predictions(routes)
    _, books = bench.time_books(routes, 16, policy, warm=10)
    _, cache = bench.time_cache(routes, None, 16, policy, warm=10)
    _, ahead = bench.time_cache(routes, preds, 16, policy, warm=10)
    assert books == cache == ahead > 0
