"""benchmarks/cache_books.py runs by hand: its timed paths must stay runnable and count alike."""

import bench_scripts
import pytest


@pytest.fixture(scope="module")
def bench():
    return bench_scripts.load("cache_books")


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
