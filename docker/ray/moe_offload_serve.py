"""Ray Serve deployment: replicas of the whole moe-offload server behind Ray's HTTP proxy.

Each replica is one `moe-offload serve`: the same FastAPI app (OpenAI routes, SSE streaming, /health,
/metrics) and its own engine process with its own expert cache.  Ray's proxy routes /v1/* to the replicas;
streamed responses stay streamed.  Every response carries an `x-moe-offload-replica` header naming the
replica that served it.

    # a local Ray instance, 2 replicas of the embedded model, the proxy on 127.0.0.1:8000:
    python docker/ray/moe_offload_serve.py --replicas 2 --port 8000
    # flags after `--` are `moe-offload serve` flags, for every replica:
    python docker/ray/moe_offload_serve.py --replicas 4 --gpus-per-replica 1 -- --model /models/X --cache-fraction 0.25
    # on an existing cluster (config file or `serve run`): `serve run moe_offload_serve:app_builder replicas=4`
    #   with docker/ray on the import path; the same settings as builder arguments (see app_builder).

Needs `pip install -e ".[ray]"`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx
import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REPLICA_HEADER = "x-moe-offload-replica"
# The server's own drain timeout: Ray waits this long for in-flight requests before stopping a replica.
DRAIN_TIMEOUT_S = 30.0


def build_server_app(serve_argv: Sequence[str]) -> FastAPI:
    """The app that `moe-offload serve SERVE_ARGV` runs, built by the CLI itself, so flags, defaults and
    validation are exactly the CLI's; only the listening socket is left to Ray (the CLI's run_server is
    swapped out while it runs)."""
    from cli.main import main as cli_main
    from server import launch

    built: list[FastAPI] = []

    def keep_app(app: FastAPI, *args: Any, **kwargs: Any) -> int:
        # The real run_server never returns (it ends the process); this one keeps the app and
        # returns the CLI's success code, so the CLI's `return run_server(...)` says 0.
        built.append(app)
        return 0

    real_run_server = launch.run_server
    launch.run_server = keep_app  # type: ignore[assignment]
    try:
        rc = cli_main(["serve", *serve_argv])
    finally:
        launch.run_server = real_run_server
    if rc != 0 or len(built) != 1:
        raise RuntimeError(
            f"moe-offload serve {' '.join(serve_argv)} failed (exit {rc}); see the replica's log"
        )
    return built[0]


class ReplicaHeader:
    """Pure ASGI middleware (streaming-safe, unlike BaseHTTPMiddleware): names the serving replica."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.replica = replica.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {
                    **message,
                    "headers": [
                        *message.get("headers", []),
                        (REPLICA_HEADER.encode(), self.replica),
                    ],
                }
            await send(message)

        await self.app(scope, receive, send_with_header if scope["type"] == "http" else send)


def wait_until_ready(app: FastAPI, timeout_s: float) -> None:
    """Ray marks a replica ready when the app's lifespan startup returns, but the engine is still loading
    then.  Extend the startup until /health says ready, so Ray routes nothing to a replica that would 503."""
    original = app.router.lifespan_context

    def lifespan(a: FastAPI) -> Any:
        from contextlib import asynccontextmanager

        @asynccontextmanager
        async def ctx() -> Any:
            async with original(a) as state:
                transport = httpx.ASGITransport(app=a)  # the public /health contract, in-process
                async with httpx.AsyncClient(
                    transport=transport, base_url="http://replica"
                ) as client:
                    deadline = time.monotonic() + timeout_s
                    while True:
                        r = await client.get("/health")
                        if r.status_code == 200:
                            break
                        if r.json().get("status") == "dead" or time.monotonic() > deadline:
                            raise RuntimeError(f"engine not ready: {r.text}")
                        await asyncio.sleep(0.2)
                yield state

        return ctx()

    app.router.lifespan_context = lifespan


def deployment(
    serve_argv: Sequence[str],
    replicas: int = 2,
    cpus_per_replica: float = 1.0,
    gpus_per_replica: float = 0.0,
    max_ongoing_requests: int = 32,
    ready_timeout_s: float = 1200.0,
) -> Any:
    """A bound Ray Serve application: `replicas` copies of the server, each with its own engine.

    max_ongoing_requests caps what Ray's router sends one replica at once; the engine batches up to its
    --max-running sequences, so the cap should not be far below that, or replicas idle while Ray queues.
    """
    serve_argv = list(serve_argv)

    def build() -> FastAPI:  # runs in each replica, so each builds its own app and engine
        app = build_server_app(serve_argv)
        wait_until_ready(app, ready_timeout_s)
        app.add_middleware(ReplicaHeader, replica=serve.get_replica_context().replica_id.unique_id)
        return app

    @serve.deployment(
        name="moe-offload",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S,
        health_check_period_s=10,
        ray_actor_options={
            "num_cpus": cpus_per_replica,
            "num_gpus": gpus_per_replica,
            # One torch thread per CPU given to the replica; two replicas must not fight over the same cores.
            "runtime_env": {
                "env_vars": {
                    "OMP_NUM_THREADS": str(max(1, int(cpus_per_replica))),
                    "TOKENIZERS_PARALLELISM": "false",
                }
            },
        },
    )
    @serve.ingress(build)
    class MoeOffloadReplica:
        pass

    return MoeOffloadReplica.bind()


def app_builder(args: dict[str, str]) -> Any:
    """For `serve run moe_offload_serve:app_builder replicas=2 serve_args="--cache-fraction 0.25"` and Serve
    config files (every value arrives as a string)."""
    return deployment(
        args.get("serve_args", "").split(),
        replicas=int(args.get("replicas", 2)),
        cpus_per_replica=float(args.get("cpus_per_replica", 1)),
        gpus_per_replica=float(args.get("gpus_per_replica", 0)),
        max_ongoing_requests=int(args.get("max_ongoing_requests", 32)),
    )


def start(
    serve_argv: Sequence[str], host: str = "127.0.0.1", port: int = 8000, **kwargs: Any
) -> DeploymentHandle:
    """Deploy on the connected Ray instance (a new local one if none), with the HTTP proxy on host:port."""
    # Ship this module's code with the deployment, so workers need not import it from docker/ray.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    serve.start(http_options={"host": host, "port": port})
    return serve.run(deployment(serve_argv, **kwargs), name="moe-offload", route_prefix="/")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(
        description="Serve moe-offload replicas behind Ray Serve's HTTP proxy on a local (or RAY_ADDRESS) Ray instance. "
        "Arguments after `--` are `moe-offload serve` flags, applied to every replica."
    )
    p.add_argument(
        "--replicas",
        type=int,
        default=2,
        help="server replicas, each with its own engine and expert cache (default 2)",
    )
    p.add_argument(
        "--cpus-per-replica",
        type=float,
        default=1.0,
        help="CPUs Ray reserves per replica (default 1)",
    )
    p.add_argument(
        "--gpus-per-replica",
        type=float,
        default=0.0,
        help="GPUs Ray reserves per replica (default 0; 1 on a GPU cluster)",
    )
    p.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=32,
        help="requests Ray's router sends one replica at once (default 32)",
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address of Ray's HTTP proxy (default 127.0.0.1)"
    )
    p.add_argument("--port", type=int, default=8000, help="port of Ray's HTTP proxy (default 8000)")
    a = p.parse_args(own)
    ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    start(
        serve_argv,
        a.host,
        a.port,
        replicas=a.replicas,
        cpus_per_replica=a.cpus_per_replica,
        gpus_per_replica=a.gpus_per_replica,
        max_ongoing_requests=a.max_ongoing_requests,
    )
    print(
        f"moe-offload: {a.replicas} replica(s) behind http://{a.host}:{a.port}/v1 (Ctrl-C stops)",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
