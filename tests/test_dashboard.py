"""/dashboard: served as one static page, and — in a real headless Chromium against a live
server under load — it renders the live numbers, and its percentiles equal Prometheus'
histogram_quantile over the same /metrics."""
from __future__ import annotations

import math
import os
import re
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.headless_chromium import HeadlessChromium, find_chromium
from tests.server_fixtures import SERVED_NAME, get_server
from tests.tiny_models import save_tiny_model_dir
from tests.tiny_server import make_client

# set to a path (e.g. benchmarks/dashboard.png) to keep the screenshot taken under load
SCREENSHOT = os.environ.get("TOKENMILL_DASHBOARD_SCREENSHOT")
TILES = ("gen-tps", "prompt-tps", "running", "waiting", "kv-usage", "prefix-hit", "finished", "preemptions")
HISTOGRAMS = {"ttft": "time_to_first_token_seconds", "tpot": "time_per_output_token_seconds",
              "itl": "inter_token_latency_seconds", "e2e": "e2e_request_latency_seconds"}
QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}
# shared by every load prompt: more than one KV block, so the prefix cache has something to hit
SHARED_PREFIX = ("You are a storyteller for children. Every story is short, kind and ends well; it has a "
                 "name for each character and one surprise in the middle. ")


def test_dashboard_is_one_static_page_without_auth(tmp_path):
    model = save_tiny_model_dir(tmp_path / "model")
    with make_client(model) as client:
        r = client.get("/dashboard")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert 'fetch("/metrics"' in r.text and "<script src" not in r.text    # no external assets
        for element in TILES + ("latency", "chart-tps", "chart-reqs", "chart-kv", "spec-accept"):
            assert f'id="{element}"' in r.text


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) pairs: the reference."""
    count = buckets[-1][1] if buckets else 0
    if not count:
        return None
    rank = q * count
    for i, (le, cum) in enumerate(buckets):
        if cum < rank:
            continue
        if math.isinf(le):
            return buckets[i - 1][0] if i else None
        lower, below = (buckets[i - 1] if i else (0.0, 0.0))
        return lower + (le - lower) * (rank - below) / (cum - below) if cum > below else le
    return None


def reference_buckets(metrics_text: str, name: str) -> list[tuple[float, float]]:
    pattern = rf'^tokenmill:{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$'
    pairs = [(float(le), float(v)) for le, v in re.findall(pattern, metrics_text, re.M)]
    return sorted(pairs)


def test_histogram_quantile_reference():
    b = [(0.1, 2.0), (0.5, 6.0), (1.0, 8.0), (math.inf, 10.0)]
    assert histogram_quantile(0.1, b) == pytest.approx(0.05)        # inside the first bucket, from 0
    assert histogram_quantile(0.5, b) == pytest.approx(0.1 + 0.4 * 3 / 4)
    assert histogram_quantile(0.99, b) == 1.0                        # +Inf bucket: highest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


def read_number(browser: HeadlessChromium, element_id: str) -> float | None:
    value = browser.evaluate(f"document.getElementById({element_id!r})?.dataset.value ?? null")
    return None if value is None else float(value)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


class Load:
    """`streams` clients each sending completions back to back until stopped."""

    def __init__(self, url: str, streams: int = 8, max_tokens: int = 48) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.stop = threading.Event()
        self.done = 0
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(streams)]

    def _client(self, i: int) -> None:
        with httpx.Client(timeout=120) as client:
            n = 0
            while not self.stop.is_set():
                body = {"model": SERVED_NAME, "prompt": f"{SHARED_PREFIX}Story {i}.{n}: once upon a time", "max_tokens": self.max_tokens,
                        "temperature": 0.8, "ignore_eos": True}
                client.post(self.url + "/v1/completions", json=body).raise_for_status()
                self.done += 1
                n += 1

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


@pytest.mark.slow
@pytest.mark.skipif(find_chromium() is None, reason="needs Debian's chromium (make test-dashboard installs it)")
def test_dashboard_in_headless_chromium_under_load():
    server = get_server("main")
    browser = HeadlessChromium(find_chromium())
    try:
        with Load(server.url) as load:
            wait_for(lambda: load.done >= 6, 120, "the first completions")
            browser.navigate(server.url + "/dashboard?interval=500")
            # under load: requests running, tokens flowing, every tile a number
            wait_for(lambda: (read_number(browser, "running") or 0) >= 1 and (read_number(browser, "gen-tps") or 0) > 0,
                     30, "running requests and generation throughput on the page")
            time.sleep(20 if SCREENSHOT else 3)      # seconds of chart history
            for tile in TILES:
                assert read_number(browser, tile) is not None, tile
            assert read_number(browser, "ttft-p95") > 0 and read_number(browser, "tpot-p50") > 0
            assert browser.evaluate("document.querySelectorAll('#chart-tps polyline').length") == 2
            assert browser.evaluate("document.getElementById('spec-accept').textContent") == "off"
            assert "model: " + SERVED_NAME == browser.evaluate("document.getElementById('model').textContent")
            if SCREENSHOT:
                browser.screenshot(Path(SCREENSHOT))
        # idle: the page's percentiles equal the reference over the same (now frozen) /metrics
        wait_for(lambda: server.metric("tokenmill:num_requests_running") == 0, 60, "the server to go idle")
        text = httpx.get(server.url + "/metrics", timeout=10).text
        time.sleep(6)      # past the page's 5 s rate window: only idle polls in it
        assert read_number(browser, "running") == 0
        assert read_number(browser, "gen-tps") == 0
        for short, name in HISTOGRAMS.items():
            buckets = reference_buckets(text, name)
            assert read_number(browser, f"{short}-count") == buckets[-1][1]
            for qid, q in QUANTILES.items():
                expected = histogram_quantile(q, buckets)
                assert read_number(browser, f"{short}-{qid}") == pytest.approx(expected * 1000, rel=1e-9), (short, qid)
    finally:
        browser.close()
