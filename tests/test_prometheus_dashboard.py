"""The Grafana dashboard against a real Prometheus scraping the real server.

Prometheus (Debian's package; .ci/run installs it) runs with the shipped scrape config retargeted at a
server on loopback, scraping every second.  After some load, every PromQL expression of
docker/grafana/moe-offload.json is evaluated through Prometheus's HTTP API, with the dashboard's template
variables resolved the way Grafana would.  Every expression must return data, so a panel whose metric is
renamed or no longer exported fails here.  Grafana itself is not run (no package for it here).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from server_fixtures import RunningServer, free_port, serve

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "docker" / "grafana" / "moe-offload.json"
PROM_CONFIG = REPO / "docker" / "prometheus" / "prometheus.yml"
RATE_WINDOW = (
    "30s"  # stands in for Grafana's $__rate_interval; covers the whole load at evaluation time
)

# What an operator of an offloading server must be able to see (the panel list): each metric must
# be queried by some panel.
REQUIRED_METRICS = {
    "moe_offload_requests_running",
    "moe_offload_requests_waiting",
    "moe_offload_time_to_first_token_seconds_bucket",
    "moe_offload_inter_token_latency_seconds_bucket",
    "moe_offload_generation_tokens_total",
    "moe_offload_expert_cache_hits_total",
    "moe_offload_expert_cache_misses_total",
    "moe_offload_expert_stall_seconds_total",
    "moe_offload_expert_bytes_transferred_total",
    "moe_offload_expert_transfers_total",
    "moe_offload_expert_substitutions_total",
    "moe_offload_expert_substituted_gate_mass_total",
    "moe_offload_expert_prefetches_issued_total",
    "moe_offload_expert_prefetches_used_total",
    "moe_offload_expert_prefetches_wasted_total",
    "moe_offload_spec_accepted_tokens_total",
    "moe_offload_spec_draft_tokens_total",
    "moe_offload_spec_drafts_total",
    "moe_offload_requests_finished_total",
    "moe_offload_prefix_cache_hit_tokens_total",
    "moe_offload_prefix_cache_query_tokens_total",
    "moe_offload_prefix_cache_bytes",
}
# Panels whose numbers this load must move (a quality-first policy at cache 0.25 misses, fetches and
# substitutes).  The others must return series, possibly 0 or NaN: the running/waiting gauges read 0 once
# the load is over, and prefetch and speculation are not exercised in this configuration.
MUST_BE_POSITIVE = (
    "Generation tokens per second",
    "Finished requests by reason",
    "Time to first token",
    "Inter-token latency",
    "End-to-end request latency",
    "Expert cache hit ratio",
    "Expert cache hit ratio per layer",
    "Stall seconds per second",
    "Expert bytes transferred per second, by kind",
    "Substitutions",
)


def dashboard_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])  # collapsed rows hold their panels


def panel_queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in dashboard_panels(dash) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\bmoe_offload_[a-z0-9_]+", expr))


def test_dashboard_covers_the_operator_panels() -> None:
    """Cheap structural check (no Prometheus): every panel queries something, and the metrics are covered."""
    dash = json.loads(DASHBOARD.read_text())
    graphs = [p for p in dashboard_panels(dash) if p["type"] != "row"]
    assert len(graphs) >= 11
    for p in graphs:
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
    queried = set().union(*(metric_names(e) for _, e in panel_queries(dash)))
    assert REQUIRED_METRICS <= queried, (
        f"not on the dashboard: {sorted(REQUIRED_METRICS - queried)}"
    )
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance", "model"} <= names
    for _, expr in panel_queries(dash):  # every query honours both template variables
        for sel in re.findall(r"moe_offload_[a-z0-9_]+(\{[^}]*\})?", expr):
            assert 'instance=~"$instance"' in sel and 'model=~"$model"' in sel, expr


def exported_metric_names() -> set[str]:
    """Every metric /metrics exposes, as Prometheus names them (counters with _total)."""
    from server.metrics import ServerMetrics

    return {
        f.name + ("_total" if f.type == "counter" else "")
        for f in ServerMetrics().registry.collect()
    }


def test_readme_monitor_table_lists_every_exported_metric() -> None:
    readme = (REPO / "docs" / "operations.md").read_text()  # the section moved there from README.md
    section = readme.split("## Monitor", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(moe_offload_[a-z0-9_]+)` \|", section, re.M))
    exported = exported_metric_names()
    assert documented == exported, (
        f"undocumented: {sorted(exported - documented)}; not exported: {sorted(documented - exported)}"
    )


def test_dashboard_queries_only_exported_metrics() -> None:
    """Without Prometheus: a query naming a metric the server does not export can never return data."""
    exported = exported_metric_names()
    exported |= {n + s for n in exported for s in ("_bucket", "_sum", "_count")}
    queried = set().union(
        *(metric_names(e) for _, e in panel_queries(json.loads(DASHBOARD.read_text())))
    )
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


def need_prometheus() -> None:
    if shutil.which("prometheus") and shutil.which("promtool"):
        return
    msg = "Prometheus is not installed (apt-get install prometheus); .ci/run installs it"
    if os.environ.get("CI"):
        pytest.fail(msg)  # CI must run this test, not skip it
    pytest.skip(msg)


def test_shipped_prometheus_config_is_valid() -> None:
    need_prometheus()
    r = promtool("check", "config", str(PROM_CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr


def send_load(srv: RunningServer) -> None:
    """12 requests, 4 at a time: chat and completions, streamed and not, some ending on a stop string."""

    def one(i: int) -> None:
        body: dict[str, Any] = {
            "model": "target",
            "max_tokens": 24,
            "temperature": 0 if i % 2 else 0.8,
            "seed": i,
        }
        if i % 3 == 0:
            body["messages"] = [{"role": "user", "content": f"Tell me about kings, number {i}."}]
            path = "/chat/completions"
        else:
            body["prompt"] = f"{i}: To be, or not to be, that is"
            path = "/completions"
        if i % 4 == 0:
            body["stop"] = [" "]
        body["stream"] = i % 2 == 0
        with httpx.Client(timeout=60) as c:
            r = c.post(srv.v1 + path, json=body)
            assert r.status_code == 200, r.text

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(12)))


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def get(self, path: str, **params: Any) -> Any:
        r = httpx.get(self.url + path, params=params, timeout=10)
        body = r.json()
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        return self.get("/api/v1/query", query=expr, time=at)["result"]

    def label_values(self, query: str) -> list[str]:
        """Grafana's label_values(selector, label) template query."""
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert m, query
        series = self.get("/api/v1/series", **{"match[]": m.group(1)})
        return sorted({s[m.group(2)] for s in series if m.group(2) in s})


@pytest.fixture(scope="module")
def prometheus_and_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Prometheus, RunningServer]]:
    need_prometheus()
    tmp = tmp_path_factory.mktemp("prometheus")
    args = ["--cache-fraction", "0.25", "--policy", "quality-first"]
    with serve(args, tmp / "server.log") as srv:
        # The shipped config, retargeted: same job and labels, our server's port, one scrape a second.
        cfg = yaml.safe_load(PROM_CONFIG.read_text())
        cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = "1s"
        (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "moe-offload"]
        job["static_configs"][0]["targets"] = [srv.base_url.removeprefix("http://")]
        cfg_path = tmp / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        r = promtool("check", "config", str(cfg_path))
        assert r.returncode == 0, r.stdout + r.stderr
        port = free_port()
        log = open(tmp / "prometheus.log", "wb")
        proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={cfg_path}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            prom = Prometheus(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 30
            while True:  # ready, and the server's target scraped at least once
                assert proc.poll() is None, (tmp / "prometheus.log").read_text()
                try:
                    targets = prom.get("/api/v1/targets")["activeTargets"]
                    if targets and all(t["health"] == "up" for t in targets):
                        break
                except (httpx.HTTPError, ValueError, AssertionError):
                    pass
                assert time.monotonic() < deadline, (
                    f"target never up: {(tmp / 'prometheus.log').read_text()}"
                )
                time.sleep(0.5)
            yield prom, srv
        finally:
            proc.terminate()
            proc.wait(20)
            log.close()


def test_every_dashboard_query_returns_data(
    prometheus_and_server: tuple[Prometheus, RunningServer],
) -> None:
    prom, srv = prometheus_and_server
    dash = json.loads(DASHBOARD.read_text())
    send_load(srv)
    at = time.time() + 3.0
    time.sleep(3.0)  # at least two more scrapes, so the last counter values are in

    # Template variables, resolved through Prometheus as Grafana resolves them.
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    instances = prom.label_values(variables["instance"]["query"]["query"])
    assert instances == [srv.base_url.removeprefix("http://")]
    models = prom.label_values(
        variables["model"]["query"]["query"].replace("$instance", instances[0])
    )
    assert models == ["target"]  # the scrape config's model label

    empty, not_positive = [], []
    for title, expr in panel_queries(dash):
        q = (
            expr.replace("$__rate_interval", RATE_WINDOW)
            .replace("$instance", instances[0])
            .replace("$model", models[0])
        )
        assert "$" not in q, f"unresolved variable in {title!r}: {q}"
        result = prom.query(q, at)
        if not result:
            empty.append(f"{title}: {q}")
            continue
        values = [float(s["value"][1]) for s in result]
        if title in MUST_BE_POSITIVE and not any(math.isfinite(v) and v > 0 for v in values):
            not_positive.append(f"{title}: {q} -> {values}")
    assert not empty, "dashboard queries with no data:\n" + "\n".join(empty)
    assert not not_positive, "queries the load should have moved:\n" + "\n".join(not_positive)
