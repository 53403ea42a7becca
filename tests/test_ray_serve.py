"""Ray Serve (docker/ray/moe_offload_serve.py): 2 CPU replicas of the embedded model behind Ray's HTTP proxy.

8 concurrent streamed requests go through the proxy on 127.0.0.1; both replicas must serve some, and every
output must equal a direct run of the server at temperature 0.  Needs `pip install -e ".[ray]"` (skipped
without Ray); slow: starting Ray and two engines takes about a minute on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_fixtures import free_port, serve

pytestmark = pytest.mark.slow  # and it needs Ray (`pip install -e ".[ray]"`): see ray_proxy
REPO = Path(__file__).resolve().parents[1]
SERVE_ARGS = ["--cache-fraction", "0.5", "--max-running", "8"]
PROMPTS = [
    f"{i}. {p}"
    for i, p in enumerate(
        [
            "To be, or not to be",
            "The os module provides",
            "Friends, Romans, countrymen",
            "A list comprehension",
            "Now is the winter of our discontent",
            "The json module",
            "All the world's a stage",
            "Exceptions are raised",
        ]
    )
]


def load_module():  # docker/ is not a package: load the deployment file by path
    spec = importlib.util.spec_from_file_location(
        "moe_offload_serve", REPO / "docker" / "ray" / "moe_offload_serve.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def stream_completion(base_url: str, prompt: str) -> tuple[str, str | None, int]:
    """(text, serving replica, number of SSE chunks) of one streamed completion."""
    body = {"model": "target", "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
    text, chunks = [], 0
    with (
        httpx.Client(timeout=120) as c,
        c.stream("POST", base_url + "/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        replica = r.headers.get("x-moe-offload-replica")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text), replica, chunks


def run_concurrently(base_url: str) -> list[tuple[str, str | None, int]]:
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda p: stream_completion(base_url, p), PROMPTS))


@pytest.fixture(scope="module")
def ray_proxy() -> Iterator[str]:
    ray = pytest.importorskip(
        "ray"
    )  # in the fixture: the default (not slow) run never collects a skip
    pytest.importorskip("ray.serve")
    mod = load_module()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        # max_ongoing_requests=4: 8 concurrent requests cannot all fit one replica, so both must serve.
        mod.start(
            SERVE_ARGS, "127.0.0.1", port, replicas=2, cpus_per_replica=1, max_ongoing_requests=4
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        from ray import serve as ray_serve

        ray_serve.shutdown()
        ray.shutdown()


def test_two_replicas_stream_and_match_a_direct_run(ray_proxy: str, tmp_path: Path) -> None:
    through_ray = run_concurrently(ray_proxy)
    replicas = {r for _, r, _ in through_ray}
    assert None not in replicas, "a response without the replica header"
    assert len(replicas) == 2, f"served by {replicas}"
    assert all(chunks > 1 for _, _, chunks in through_ray), (
        "responses were not streamed chunk by chunk"
    )

    with serve(SERVE_ARGS, tmp_path / "direct.log") as srv:
        direct = run_concurrently(srv.base_url)
    assert [t for t, _, _ in through_ray] == [t for t, _, _ in direct]
    assert all(t for t, _, _ in direct)


def test_openai_sdk_chat_through_the_proxy(ray_proxy: str) -> None:
    """The OpenAI SDK, as a client of the scaled-out server: chat (plain and streamed), /v1/models,
    and an error object (an unknown model's 404) that passes Ray's proxy unchanged."""
    import openai

    c = openai.OpenAI(base_url=ray_proxy + "/v1", api_key="x", max_retries=0, timeout=120)
    assert [m.id for m in c.models.list()] == ["target"]
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = c.chat.completions.create(model="target", messages=msgs, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage is not None
    finish = None
    for ch in c.chat.completions.create(
        model="target", messages=msgs, max_tokens=8, temperature=0, stream=True
    ):
        finish = next((x.finish_reason for x in ch.choices if x.finish_reason), finish)
    assert finish in ("stop", "length")
    with pytest.raises(openai.NotFoundError) as e:
        c.chat.completions.create(model="no-such-model", messages=msgs, max_tokens=4)
    assert e.value.code == "model_not_found", e.value.body
