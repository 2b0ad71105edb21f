"""A fault-injecting HTTP proxy on loopback in front of the moto S3 server, for the tests of
transfers (tests/storage/test_s3_*.py) and of training on a flaky store (test_flaky_store)."""

from __future__ import annotations

import http.client
import random
import re
import socket
import struct
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

# What a flaky store does to a request: answer 500 (InternalError) or 503 (SlowDown), answer
# 503 with no body ("down": no throttling code, as a store that is down or a load balancer in
# front of it answers, and as any 503 to a HEAD reads), drop the connection without an answer
# ("reset"), answer after a delay ("delay"), send only part of the body it announced and drop
# the connection ("truncate"), or say nothing for `stall_s` ("stall": a store that hangs).
FAULTS = ("500", "503", "down", "reset", "delay", "truncate", "stall")
# And, planned for a DeleteObjects request ("deletes"): "deny" answers 200 listing every key
# of it as not deleted (AccessDenied, as a bucket policy or an object lock would), deleting none.


class FaultyProxy:
    """Counts requests by kind ("part" for UploadPart, "put" for PutObject, "range" for a
    ranged GET, "deletes" for DeleteObjects, else the method) and fails some of them: the next ones of a kind as `fail`
    says (a fault of FAULTS, or "always": 500 to every one), or, after `flaky`, any request at
    random at the given rates, or past a rate (`limit`)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream).netloc
        self.seen: Counter[str] = Counter()
        self.ranges: list[str] = []  # the Range header of every ranged GET
        self.requests: list[tuple[str, str]] = []  # (kind, path) of every request, in order
        self.listed: list[str] = []  # the prefix of every listing (a GET of the bucket), in order
        self.failed: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()  # by fault, for the random ones
        self._plan: dict[str, list[str]] = {}
        self._rates: dict[str, float] = {}
        self._rng = random.Random(0)
        self._limit: tuple[float, float, float] | None = None  # (rate, tokens, when): `limit`
        self._limited = "/"  # the paths `limit` applies to: those that start so
        self.throttled = 0  # requests answered SlowDown by `limit`
        self.throttled_at: list[tuple[str, float]] = []  # and each one's (path, monotonic time)
        self.delay_s, self.stall_s = (0.05, 0.5), 30.0
        self.range_latency_s = 0.0  # every ranged GET answered this much later: a store farther away
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            # An answer goes out in two writes (headers, then body): with Nagle's algorithm the
            # body waits for the client's delayed ACK of the headers, about 40 ms a request.
            disable_nagle_algorithm = True

            def log_message(self, *args: object) -> None:
                pass

            def do_ANY(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                action = proxy._decide(self)
                if action == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                elif action == "stall":
                    time.sleep(proxy.stall_s)
                    self.close_connection = True
                elif action in ("500", "503", "down"):
                    proxy._fail(self, action)
                elif action == "deny":
                    proxy._deny(self, body)
                else:
                    if action == "delay":
                        time.sleep(proxy._rng.uniform(*proxy.delay_s))
                    if proxy.range_latency_s and self.command == "GET" and "Range" in self.headers:
                        time.sleep(proxy.range_latency_s)
                    proxy._forward(self, body, truncate=action == "truncate")

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = do_ANY

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fail(self, kind: str, *actions: str) -> None:
        self._plan[kind] = list(actions)

    def limit(self, rate: float | None, under: str = "/") -> None:
        """Answer SlowDown (503) to requests beyond `rate` a second (a token bucket of one
        second's worth), as S3 does to a prefix past its request rate; 0: to every request;
        None: no limit. Only requests whose path starts with `under` ("/bucket/key...") count
        and are limited: one prefix of the store throttled, the rest answered."""
        with self._lock:
            self._limit = (rate, rate, time.monotonic()) if rate is not None else None
            self._limited = under

    def flaky(self, seed: int, rates: dict[str, float] | None = None) -> None:
        """From now on, each request meets at most one fault, drawn at these rates (keys of
        FAULTS; "truncate" only hits answers with a body). No arguments: a healthy store."""
        rates = dict(rates or {})
        unknown = set(rates) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {unknown}; known: {FAULTS}")
        with self._lock:
            self._rng, self._rates = random.Random(seed), rates

    def _decide(self, req: BaseHTTPRequestHandler) -> str | None:
        query = urlsplit(req.path).query
        if req.command == "PUT" and "partNumber=" in query:
            kind = "part"
        elif req.command == "PUT" and "uploadId=" not in query:
            kind = "put"
        elif req.command == "POST" and "delete" in query.split("&"):
            kind = "deletes"
        elif req.command == "GET" and "Range" in req.headers:
            kind = "range"
            with self._lock:
                self.ranges.append(req.headers["Range"])
        else:
            kind = req.command.lower()
        with self._lock:
            self.seen[kind] += 1
            self.requests.append((kind, urlsplit(req.path).path))
            if req.command == "GET" and "prefix" in parse_qs(query):
                self.listed.append(parse_qs(query)["prefix"][0])
            plan = self._plan.get(kind, [])
            action = plan[0] if plan else None
            if plan and plan[0] != "always":
                plan.pop(0)
            if action:
                self.failed[kind] += 1
                return "500" if action == "always" else action
            if self._limit is not None and urlsplit(req.path).path.startswith(self._limited):
                rate, tokens, at = self._limit
                now = time.monotonic()
                tokens = min(rate, tokens + (now - at) * rate)
                self._limit = (rate, tokens - 1 if tokens >= 1 else tokens, now)
                if tokens < 1:
                    self.throttled += 1
                    self.throttled_at.append((urlsplit(req.path).path, now))
                    return "503"
            draw = self._rng.random()
            for fault, rate in self._rates.items():
                if draw < rate:
                    if fault == "truncate" and req.command == "HEAD":
                        return None
                    self.injected[fault] += 1
                    return fault
                draw -= rate
        return None

    @staticmethod
    def _fail(req: BaseHTTPRequestHandler, action: str) -> None:
        code = {"500": "InternalError", "503": "SlowDown", "down": None}[action]
        body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode() if code else b""
        req.send_response(503 if action == "down" else int(action))
        req.send_header("Content-Type", "application/xml")
        req.send_header("Content-Length", str(len(body)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(body)

    @staticmethod
    def _deny(req: BaseHTTPRequestHandler, body: bytes) -> None:
        keys = re.findall(rb"<Key>(.*?)</Key>", body)
        errors = b"".join(b"<Error><Key>%s</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>" % k for k in keys)
        answer = b'<?xml version="1.0" encoding="UTF-8"?><DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">' + errors + b"</DeleteResult>"
        req.send_response(200)
        req.send_header("Content-Type", "application/xml")
        req.send_header("Content-Length", str(len(answer)))
        req.end_headers()
        req.wfile.write(answer)

    def _forward(self, req: BaseHTTPRequestHandler, body: bytes, truncate: bool = False) -> None:
        skip = {"connection", "expect", "transfer-encoding", "keep-alive"}
        conn = http.client.HTTPConnection(self.upstream, timeout=30)
        try:
            headers = {k: v for k, v in req.headers.items() if k.lower() not in skip}
            conn.request(req.command, req.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        req.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in skip | {"content-length"}:
                req.send_header(k, v)
        length = resp.getheader("Content-Length") if req.command == "HEAD" else str(len(data))
        req.send_header("Content-Length", length or "0")
        req.end_headers()
        if req.command != "HEAD":
            # A truncated answer: the length announced, half of it sent, the connection gone.
            req.wfile.write(data[: len(data) // 2] if truncate else data)
        if truncate:
            req.close_connection = True

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
