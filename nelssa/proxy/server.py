"""The length-routing OpenAI proxy in front of prefill (P) and decode (D) vLLM instances.

Per request (``/v1/completions``, ``/v1/chat/completions``):
  1. validate the body (400 with a reason), the model (404), the length (400 past max_model_len);
  2. count the prompt with the model's tokenizer and decide short/long once (``router.Router``);
  3. P: the body with ``max_tokens=1``, ``stream=false`` and ``kv_transfer_params =
     {"do_remote_decode": true, ..., "nelssa": decision}`` to the least-loaded healthy P;
  4. D: the original body with P's returned ``kv_transfer_params`` (+ the same ``nelssa`` decision)
     to the least-loaded healthy D; D's answer (streamed or not) goes back to the client as is.
P and D get the same ``X-Request-Id``; a client disconnect cancels the handler (aiohttp
``handler_cancellation``), which closes the upstream connections, and vLLM aborts the requests there
(P's blocks held for D are released by NixlConnector's lease when D never reads them).
With ``--off`` (stock P/D baseline, ``NELSSA_OFF=1``) the decision is still made and counted but not
sent to the engines. See ``nelssa/proxy/__init__.py`` for the data paths of short and long requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from nelssa.proxy.router import BadRequest, Decision, Router

log = logging.getLogger("nelssa.proxy")

ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


class ProxyError(Exception):
    """An error answered to the client in OpenAI's error format."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


class _ClientGone(Exception):
    """The client closed the connection while its answer was streamed."""


class UpstreamStatus(Exception):
    """An upstream answered with an error status: passed to the client as is."""

    def __init__(self, status: int, body: bytes, content_type: str):
        super().__init__(status)
        self.status, self.body, self.content_type = status, body, content_type


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   headers: dict | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": type_, "param": param, "code": status}},
                             status=status, headers=headers)


@dataclass(eq=False)
class Upstream:
    url: str
    role: str            # "prefill" | "decode"
    healthy: bool = False
    timeouts: int = 0    # consecutive health checks it did not answer in time
    inflight: int = 0
    long_inflight: int = 0
    models: list[dict] = field(default_factory=list)


class Pool:
    """Instances of one role; least-loaded selection among the healthy ones."""

    def __init__(self, role: str, urls: list[str]):
        self.role = role
        self.members = [Upstream(u.rstrip("/"), role) for u in urls]
        self._turn = 0

    def pick(self, long: bool, exclude: list[Upstream]) -> Upstream | None:
        cands = [u for u in self.members if u.healthy and u not in exclude]
        if not cands:
            return None
        self._turn += 1
        n = len(self.members)
        # long requests spread by their own count first; ties rotate
        return min(cands, key=lambda u: (u.long_inflight if long else 0, u.inflight,
                                         (self.members.index(u) - self._turn) % n))


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.requests = Counter("nelssa_proxy_requests", "Requests answered, by route, endpoint and HTTP status",
                                ["route", "endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("nelssa_proxy_prompt_tokens", "Prompt tokens (proxy's count) by route",
                                     ["route"], registry=r)
        self.completion_tokens = Counter("nelssa_proxy_completion_tokens",
                                         "Completion tokens (decode instance's usage) by route", ["route"], registry=r)
        self.routing = Histogram("nelssa_proxy_routing_seconds", "Tokenization and routing decision per request",
                                 buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0), registry=r)
        self.latency = Histogram("nelssa_proxy_request_seconds", "End-to-end request time by route", ["route"],
                                 buckets=lat, registry=r)
        self.prefill = Histogram("nelssa_proxy_prefill_seconds", "Prefill instance call by route", ["route"],
                                 buckets=lat, registry=r)
        self.ttft = Histogram("nelssa_proxy_ttft_seconds", "Time to the first streamed token by route", ["route"],
                              buckets=lat, registry=r)
        self.upstream_errors = Counter("nelssa_proxy_upstream_errors",
                                       "Upstream failures by role and kind (connect, timeout, status, broken)",
                                       ["role", "kind"], registry=r)
        self.disconnects = Counter("nelssa_proxy_client_disconnects", "Clients gone before the answer, by route",
                                   ["route"], registry=r)
        self.mismatch = Counter("nelssa_proxy_prompt_token_mismatch",
                                "Answers whose usage.prompt_tokens differ from the proxy's count", ["route"], registry=r)
        self.inflight = Gauge("nelssa_proxy_inflight", "Requests in flight per upstream", ["role", "url"], registry=r)
        self.healthy = Gauge("nelssa_proxy_upstream_healthy", "1 if the upstream passes its health check",
                             ["role", "url"], registry=r)


HEALTH_TIMEOUTS = 3  # consecutive unanswered health checks that take an instance out of rotation


class Proxy:
    def __init__(self, prefill: list[str], decode: list[str], *, T_input: int, nelssa: bool = True,
                 tokenizer: str | None = None, router: Router | None = None, timeout: float = 600.0,
                 connect_timeout: float = 5.0, health_interval: float = 2.0):
        self.P, self.D = Pool("prefill", prefill), Pool("decode", decode)
        self.T_input, self.nelssa = T_input, nelssa
        self.tokenizer_path, self.router = tokenizer, router
        self.timeout, self.connect_timeout, self.health_interval = timeout, connect_timeout, health_interval
        self.m = Metrics()
        self._tok_pool = ThreadPoolExecutor(2, thread_name_prefix="nelssa-proxy-tok")
        self._router_task: asyncio.Task | None = None
        self._health_task: asyncio.Task | None = None
        self.session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------------ app
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.handle_generate)
        app.router.add_post("/v1/chat/completions", self.handle_generate)
        app.router.add_get("/v1/models", self.handle_models)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/metrics", self.handle_metrics)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, app) -> None:
        # idle upstream connections are dropped before vLLM's server closes them (its keep-alive, 5 s by
        # default): reusing one the server is closing fails the request (ServerDisconnectedError)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0))
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def _cleanup(self, app) -> None:
        for t in (self._health_task, self._router_task):
            if t is not None:
                t.cancel()
        await self.session.close()
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ health, models, tokenizer
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 - keep checking
                log.exception("health check")

    async def check_health(self) -> None:
        await asyncio.gather(*(self._check(u) for u in self.P.members + self.D.members))
        if self.router is None and self._router_task is None:
            path = self.tokenizer_path or next((c.get("root") or c.get("id") for u in self.D.members + self.P.members
                                                for c in u.models), None)
            if path:
                self._router_task = asyncio.create_task(self._load_router(path))

    async def _load_router(self, path: str) -> None:
        try:
            self.router = await asyncio.get_running_loop().run_in_executor(
                self._tok_pool, Router.from_pretrained, path, self.T_input)
            log.info("tokenizer for routing: %s (T_input %d)", path, self.T_input)
        except Exception as e:  # noqa: BLE001
            log.error("cannot load the tokenizer %s: %s", path, e)
            self.tokenizer_path = None
            self._router_task = None  # retried on the next health check

    async def _check(self, u: Upstream) -> None:
        """An instance that answers its health check with an error, or refuses the connection, leaves the
        rotation at once; one that does not answer in time only after HEALTH_TIMEOUTS checks in a row (a
        busy engine's API server can be slow to answer: on a loaded 2-vCPU box single checks timed out
        while both instances were serving, and one request found no prefill instance in rotation)."""
        ok = False
        t = aiohttp.ClientTimeout(total=max(1.0, self.health_interval))
        slow = False
        try:
            async with self.session.get(u.url + "/health", timeout=t) as r:
                ok = r.status == 200
            if ok and not u.models:
                async with self.session.get(u.url + "/v1/models", timeout=t) as r:
                    if r.status == 200:
                        u.models = list((await r.json()).get("data") or [])
        except asyncio.TimeoutError:
            slow = True
        except (aiohttp.ClientError, ValueError):
            ok = False
        u.timeouts = u.timeouts + 1 if slow else 0
        if slow and u.healthy and u.timeouts < HEALTH_TIMEOUTS:
            log.info("%s %s did not answer its health check in %.1f s (%d in a row); kept in rotation", u.role,
                     u.url, t.total, u.timeouts)
            return
        if ok != u.healthy:
            log.log(logging.INFO if ok else logging.WARNING, "%s %s is %s", u.role, u.url,
                    "healthy" if ok else "down: out of rotation" + (
                        f" ({u.timeouts} health checks in a row unanswered)" if slow else ""))
        u.healthy = ok
        self.m.healthy.labels(u.role, u.url).set(1 if ok else 0)

    def models(self) -> list[dict]:
        seen, out = set(), []
        for u in self.D.members:
            if u.healthy:
                for c in u.models:
                    if c.get("id") not in seen:
                        seen.add(c.get("id"))
                        out.append(c)
        return out

    def max_model_len(self) -> int | None:
        lens = [c.get("max_model_len") for u in self.P.members + self.D.members if u.healthy for c in u.models
                if c.get("max_model_len")]
        return min(lens) if lens else None

    async def handle_models(self, request: web.Request) -> web.Response:
        models = self.models()
        if not models:
            return error_response(503, "no healthy decode instance", "service_unavailable")
        return web.json_response({"object": "list", "data": models})

    async def handle_health(self, request: web.Request) -> web.Response:
        state = {role: {u.url: u.healthy for u in pool.members} for role, pool in (("prefill", self.P),
                                                                                   ("decode", self.D))}
        ok = any(state["prefill"].values()) and any(state["decode"].values()) and self.router is not None
        state.update(status="ok" if ok else "unavailable", tokenizer=self.router is not None)
        return web.json_response(state, status=200 if ok else 503)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        for pool in (self.P, self.D):
            for u in pool.members:
                self.m.inflight.labels(u.role, u.url).set(u.inflight)
        return web.Response(body=generate_latest(self.m.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ------------------------------------------------------------------ requests
    async def _validate(self, request: web.Request, endpoint: str) -> tuple[dict, Decision]:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge as e:
            raise ProxyError(413, f"request body too large: {e.text}") from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ProxyError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ProxyError(400, "request body must be a JSON object")
        if "kv_transfer_params" in body:
            raise ProxyError(400, "kv_transfer_params is set by the proxy, not by clients", param="kv_transfer_params")
        if not isinstance(body.get("stream", False), bool):
            raise ProxyError(400, "'stream' must be a boolean", param="stream")
        if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
            raise ProxyError(400, "only n=1 (and best_of=1) is supported through the P/D proxy", param="n")
        key = "max_completion_tokens" if endpoint == "chat" and body.get("max_completion_tokens") is not None \
            else "max_tokens"
        mt = body.get(key)
        if mt is not None and (not isinstance(mt, int) or isinstance(mt, bool) or mt < 1):
            raise ProxyError(400, f"'{key}' must be an integer >= 1", param=key)
        models = self.models()
        if not models:
            raise ProxyError(503, "no healthy decode instance", "service_unavailable")
        names = [c.get("id") for c in models]
        model = body.get("model")
        if model is None:
            body["model"] = names[0]
        elif model not in names:
            raise ProxyError(404, f"The model `{model}` does not exist (served: {', '.join(map(str, names))}).",
                             "NotFoundError", "model")
        if self.router is None:
            raise ProxyError(503, "the router's tokenizer is not loaded yet", "service_unavailable")
        t = time.perf_counter()
        try:
            dec = await asyncio.get_running_loop().run_in_executor(self._tok_pool, self.router.decide, endpoint, body)
        except BadRequest as e:
            raise ProxyError(400, str(e), param=e.param) from None
        self.m.routing.observe(time.perf_counter() - t)
        limit = self.max_model_len()
        if limit is not None:
            n = dec.prompt_tokens
            if n >= limit or (mt is not None and n + mt > limit):
                raise ProxyError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                 f"{n + (mt or 0)} tokens ({n} in the prompt, {mt or 0} for the completion). Please "
                                 "reduce the length of the prompt or the completion.", param="messages"
                                 if endpoint == "chat" else "prompt")
        return body, dec

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        endpoint = ENDPOINTS[request.path]
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        hdrs = {"X-Request-Id": rid}
        route = "none"
        try:
            body, dec = await self._validate(request, endpoint)
            route = dec.route
            self.m.prompt_tokens.labels(route).inc(dec.prompt_tokens)
            resp = await self._generate(request, endpoint, body, dec, rid, t0)
            status = resp.status
        except ProxyError as e:
            status = e.status
            resp = error_response(e.status, e.message, e.type, e.param, hdrs)
        except UpstreamStatus as e:
            status = e.status
            resp = web.Response(status=e.status, body=e.body, headers={**hdrs, "Content-Type": e.content_type})
        except (asyncio.CancelledError, _ClientGone) as e:
            # the upstream responses were closed on the way out (vLLM aborts those requests)
            self.m.disconnects.labels(route).inc()
            self.m.requests.labels(route, endpoint, "499").inc()
            log.info("request %s (%s): client disconnected, upstream requests closed", rid, route)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise asyncio.CancelledError() from None  # nothing left to answer: end the handler like a cancel
        self.m.requests.labels(route, endpoint, str(status)).inc()
        if route != "none":
            self.m.latency.labels(route).observe(time.perf_counter() - t0)
        return resp

    def _headers(self, request: web.Request, rid: str) -> dict:
        h = {"X-Request-Id": rid, "Content-Type": "application/json"}
        if "Authorization" in request.headers:
            h["Authorization"] = request.headers["Authorization"]
        return h

    async def _open(self, pool: Pool, path: str, body: dict, headers: dict, long: bool,
                    timeout: aiohttp.ClientTimeout, tried: list[Upstream]):
        """POST to the least-loaded healthy instance of ``pool``; an instance that refuses the connection
        is taken out of rotation and the next one is tried. Returns (instance, response)."""
        data = json.dumps(body).encode()
        while True:
            u = pool.pick(long, tried)
            if u is None:
                why = f" ({len(tried)} tried)" if tried else ""
                raise ProxyError(503, f"no healthy {pool.role} instance{why}", "service_unavailable")
            tried.append(u)
            try:
                r = await self.session.post(u.url + path, data=data, headers=headers, timeout=timeout)
                return u, r
            except aiohttp.ClientConnectorError as e:
                self.m.upstream_errors.labels(pool.role, "connect").inc()
                log.warning("%s %s unreachable (%s): out of rotation", pool.role, u.url, e)
                u.healthy = False
                self.m.healthy.labels(u.role, u.url).set(0)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise self._upstream_failure(pool.role, u, e) from None

    def _upstream_failure(self, role: str, u: Upstream, e: BaseException) -> ProxyError:
        if isinstance(e, asyncio.TimeoutError):
            self.m.upstream_errors.labels(role, "timeout").inc()
            return ProxyError(504, f"{role} instance {u.url} did not answer within {self.timeout:g} s", "timeout")
        self.m.upstream_errors.labels(role, "broken").inc()
        return ProxyError(502, f"{role} instance {u.url} failed: {type(e).__name__}: {e}", "bad_gateway")

    async def _prefill(self, request, endpoint, body, dec, rid) -> dict | None:
        pb = dict(body)
        pb["max_tokens"] = 1
        if "max_completion_tokens" in pb:
            pb["max_completion_tokens"] = 1
        pb["stream"] = False
        for k in ("stream_options", "min_tokens"):
            pb.pop(k, None)
        ktp = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}
        if self.nelssa:
            ktp["nelssa"] = dec.params()
        pb["kv_transfer_params"] = ktp
        t = time.perf_counter()
        timeout = aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout)
        u, r = await self._open(self.P, "/v1/" + _path(endpoint), pb, self._headers(request, rid), dec.long,
                                timeout, [])
        u.inflight += 1
        u.long_inflight += dec.long
        try:
            async with r:
                raw = await r.read()
                if r.status != 200:
                    self.m.upstream_errors.labels("prefill", "status").inc()
                    raise UpstreamStatus(r.status, raw, r.headers.get("Content-Type", "application/json"))
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise self._upstream_failure("prefill", u, e) from None
        finally:
            u.inflight -= 1
            u.long_inflight -= dec.long
        self.m.prefill.labels(dec.route).observe(time.perf_counter() - t)
        try:
            return json.loads(raw).get("kv_transfer_params")
        except (ValueError, AttributeError):
            self.m.upstream_errors.labels("prefill", "broken").inc()
            raise ProxyError(502, f"prefill instance {u.url} answered with a body that is not a JSON object",
                             "bad_gateway") from None

    async def _generate(self, request, endpoint, body, dec, rid, t0) -> web.StreamResponse:
        ktp = await self._prefill(request, endpoint, body, dec, rid)
        db = dict(body)
        if ktp is not None or self.nelssa:
            db["kv_transfer_params"] = dict(ktp or {})
            if self.nelssa:
                db["kv_transfer_params"]["nelssa"] = dec.params()
        if ktp is None:
            log.warning("request %s: the prefill instance returned no kv_transfer_params; decode prefills itself", rid)
        stream = bool(body.get("stream"))
        want_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else True
        if stream:  # usage for the metrics; dropped from the answer unless the client asked for it
            db["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout, sock_read=self.timeout)
        else:
            timeout = aiohttp.ClientTimeout(total=self.timeout, sock_connect=self.connect_timeout)
        u, r = await self._open(self.D, "/v1/" + _path(endpoint), db, self._headers(request, rid), dec.long,
                                timeout, [])
        u.inflight += 1
        u.long_inflight += dec.long
        try:
            async with r:
                if r.status != 200 or not stream:
                    try:
                        raw = await r.read()
                    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                        raise self._upstream_failure("decode", u, e) from None
                    if r.status != 200:
                        self.m.upstream_errors.labels("decode", "status").inc()
                        raise UpstreamStatus(r.status, raw, r.headers.get("Content-Type", "application/json"))
                    try:
                        self._usage(json.loads(raw).get("usage"), dec)
                    except (ValueError, AttributeError):
                        pass
                    return web.Response(body=raw, headers={"X-Request-Id": rid, "Content-Type": "application/json"})
                return await self._stream(request, r, u, dec, rid, t0, want_usage)
        finally:
            u.inflight -= 1
            u.long_inflight -= dec.long

    def _usage(self, usage, dec: Decision) -> None:
        if not isinstance(usage, dict):
            return
        self.m.completion_tokens.labels(dec.route).inc(int(usage.get("completion_tokens") or 0))
        if usage.get("prompt_tokens") is not None and usage["prompt_tokens"] != dec.prompt_tokens:
            self.m.mismatch.labels(dec.route).inc()
            log.warning("prompt tokens: proxy counted %d, decode instance %s (routing used the proxy's count)",
                        dec.prompt_tokens, usage["prompt_tokens"])

    async def _stream(self, request, r, u: Upstream, dec: Decision, rid: str, t0: float,
                      want_usage: bool) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                          "X-Request-Id": rid})
        await out.prepare(request)

        async def send(data: bytes) -> None:
            try:
                await out.write(data)
            except ConnectionResetError:  # the client went away (aiohttp's reset error is also a ClientError)
                raise _ClientGone() from None

        buf, first, done = b"", True, False
        try:
            async for chunk in r.content.iter_any():
                buf += chunk
                while b"\n\n" in buf and not done:
                    ev, buf = buf.split(b"\n\n", 1)
                    keep = self._event(ev, dec, want_usage)
                    if keep and first and ev.startswith(b"data: {"):
                        first = False
                        self.m.ttft.labels(dec.route).observe(time.perf_counter() - t0)
                    if keep:
                        await send(ev + b"\n\n")
                    # the answer is complete: the client may close now, before the upstream's end of stream
                    # reaches us (a loaded host showed such answers as disconnects)
                    done = ev.strip() == b"data: [DONE]"
                if done:
                    break
            if buf.strip() and not done:
                await send(buf)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            err = self._upstream_failure("decode", u, e)
            log.error("request %s: stream broken: %s", rid, err.message)
            msg = {"error": {"message": err.message, "type": err.type, "param": None, "code": err.status}}
            await send(b"data: " + json.dumps(msg).encode() + b"\n\n")
        try:
            await out.write_eof()
        except ConnectionResetError:
            if not done:
                raise _ClientGone() from None  # (after [DONE] the client had everything)
        return out

    def _event(self, ev: bytes, dec: Decision, want_usage: bool) -> bool:
        """Record an SSE event's usage; False to drop it (the usage-only chunk the client did not ask for)."""
        if not ev.startswith(b"data: {"):
            return True
        try:
            d = json.loads(ev[6:])
        except ValueError:
            return True
        if "error" in d:
            self.m.upstream_errors.labels("decode", "stream").inc()
            return True
        if isinstance(d.get("usage"), dict) and not d.get("choices"):
            self._usage(d["usage"], dec)
            return want_usage
        return True


def _path(endpoint: str) -> str:
    return "completions" if endpoint == "completions" else "chat/completions"


def main(argv: list[str] | None = None) -> int:
    from nelssa.config import load_config
    cfg = load_config()  # NELSSA_OFF, NELSSA_T_INPUT (the one place env vars are read)
    ap = argparse.ArgumentParser(prog="nelssa-proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default loopback)")
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--prefill", action="append", help="prefill instance URL (repeatable) [http://127.0.0.1:8100]")
    ap.add_argument("--decode", action="append", help="decode instance URL (repeatable) [http://127.0.0.1:8200]")
    ap.add_argument("--model", "--tokenizer", dest="tokenizer", default=None,
                    help="tokenizer path (default: the decode instance's model)")
    ap.add_argument("--t-input", type=int, default=cfg.T_input, help=f"long from this many prompt tokens "
                    f"[NELSSA_T_INPUT or {cfg.T_input}]")
    ap.add_argument("--off", action="store_true", default=cfg.off,
                    help="stock P/D: do not send the decision to the engines [NELSSA_OFF]")
    ap.add_argument("--timeout", type=float, default=600.0, help="upstream answer / stream-read timeout (s)")
    ap.add_argument("--connect-timeout", type=float, default=5.0)
    ap.add_argument("--health-interval", type=float, default=2.0)
    ap.add_argument("--log-level", default="INFO")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if a.t_input < 1:
        ap.error("--t-input must be >= 1")
    if not 0 <= a.port <= 65535:
        ap.error(f"--port must be in [0, 65535], got {a.port}")
    if min(a.timeout, a.connect_timeout, a.health_interval) <= 0:
        ap.error("--timeout, --connect-timeout and --health-interval must be > 0")
    for url in (a.prefill or []) + (a.decode or []):
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            ap.error(f"an instance URL must be http(s)://host:port, got {url!r}")
    proxy = Proxy(a.prefill or ["http://127.0.0.1:8100"], a.decode or ["http://127.0.0.1:8200"],
                  T_input=a.t_input, nelssa=not a.off, tokenizer=a.tokenizer, timeout=a.timeout,
                  connect_timeout=a.connect_timeout, health_interval=a.health_interval)
    log.info("nelssa-proxy on %s:%d: prefill %s, decode %s, T_input %d, %s", a.host, a.port,
             [u.url for u in proxy.P.members], [u.url for u in proxy.D.members], a.t_input,
             "stock P/D (NELSSA off)" if a.off else "NELSSA decision in kv_transfer_params")
    try:
        web.run_app(proxy.app(), host=a.host, port=a.port, handler_cancellation=True, print=None,
                    access_log=None)
    except OSError as e:  # the port in use, an address not of this host
        ap.exit(1, f"nelssa-proxy: cannot listen on {a.host}:{a.port}: {e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
