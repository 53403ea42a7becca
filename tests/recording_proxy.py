"""A loopback HTTP proxy that records each request a client sends and the status it got back,
streaming the answer through unchanged (server-sent events included).  The agent-client tests
put it between a real CLI and the server to see what the CLI sent."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding"}


@dataclass
class Exchange:
    method: str
    path: str
    body: Any  # the request's JSON (None if it had none)
    status: int


@dataclass
class Recording:
    url: str
    exchanges: list[Exchange] = field(default_factory=list)

    def posts(self, prefix: str) -> list[Exchange]:
        return [e for e in self.exchanges if e.method == "POST" and e.path.startswith(prefix)]


@contextmanager
def recording_proxy(upstream: str) -> Iterator[Recording]:
    client = httpx.Client(base_url=upstream, timeout=httpx.Timeout(300, connect=10))
    lock = threading.Lock()
    rec = Recording("")

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the answer ends when the connection closes

        def _forward(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP | {"host"}}
            headers["accept-encoding"] = "identity"
            with client.stream(self.command, self.path, content=raw, headers=headers) as r:
                with lock:
                    body = json.loads(raw) if raw else None
                    rec.exchanges.append(Exchange(self.command, self.path, body, r.status_code))
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.end_headers()
                for chunk in r.iter_raw():
                    self.wfile.write(chunk)
                    self.wfile.flush()

        do_GET = do_POST = do_DELETE = _forward

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    rec.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield rec
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
        client.close()
