"""nelssa-proxy against fake OpenAI backends (real HTTP on loopback, no vLLM): routing, the P/D
protocol, streaming, usage, errors, timeouts, upstream failures, client disconnects, load balancing."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
from aiohttp import web

from nelssa.proxy.router import BadRequest, Router, chat_messages, completion_prompt
from nelssa.proxy.server import Proxy

MODEL = "fake-model"
MAX_LEN = 200
T_INPUT = 20


class WordTokenizer:
    """One token per whitespace-separated word; a toy chat template."""

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [1] * len(text.split())

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True,
                            continue_final_message=False, **kw):
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise ValueError("unknown role")
        text = " ".join(f"<{m['role']}> {m['content'] or ''}" for m in messages)
        return text + (" <assistant>" if add_generation_prompt else "")


class Fake:
    """A fake vLLM OpenAI server: P behaviour when kv_transfer_params asks for remote decode, D otherwise."""

    def __init__(self, name: str):
        self.name = name
        self.seen: list[tuple[str, dict, dict]] = []
        self.healthy = True
        self.health_delay = 0.0    # seconds before /health answers
        self.status = 200          # answer status for generation requests
        self.delay = 0.0           # seconds before answering
        self.tokens = 5            # streamed / generated tokens
        self.token_delay = 0.0
        self.break_stream = False  # close the connection mid-stream
        self.aborted = 0           # requests whose client went away
        self.active = 0
        self.max_active = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        return app

    async def health(self, request):
        if self.health_delay:
            await asyncio.sleep(self.health_delay)
        return web.Response(status=200 if self.healthy else 503)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL,
                                                               "max_model_len": MAX_LEN}]})

    async def generate(self, request):
        body = await request.json()
        self.seen.append((request.path, body, {k.lower(): v for k, v in request.headers.items()}))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.status != 200:
                return web.json_response({"error": {"message": f"{self.name} says no", "type": "BadRequestError",
                                                    "param": None, "code": self.status}}, status=self.status)
            ktp = body.get("kv_transfer_params") or {}
            chat = request.path.endswith("chat/completions")
            usage = {"prompt_tokens": 7, "completion_tokens": self.tokens if not ktp.get("do_remote_decode") else 1,
                     "total_tokens": 0}
            usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            if ktp.get("do_remote_decode"):  # P
                return web.json_response({"id": "p", "object": "text_completion", "model": MODEL, "choices": [],
                                          "usage": usage, "kv_transfer_params": {
                                              "do_remote_prefill": True, "do_remote_decode": False,
                                              "remote_block_ids": [[1, 2]], "remote_engine_id": self.name,
                                              "remote_request_id": "cmpl-p-0", "remote_host": "127.0.0.1",
                                              "remote_port": 5600, "tp_size": 1}})
            words = [f"w{i} " for i in range(self.tokens)]
            if not body.get("stream"):
                if chat:
                    choice = {"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                              "finish_reason": "length"}
                    obj = "chat.completion"
                else:
                    choice = {"index": 0, "text": "".join(words), "finish_reason": "length", "logprobs": None}
                    obj = "text_completion"
                return web.json_response({"id": "d", "object": obj, "created": 0, "model": MODEL,
                                          "choices": [choice], "usage": usage})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            obj = "chat.completion.chunk" if chat else "text_completion"
            for i, w in enumerate(words):
                if self.break_stream and i == 2:
                    request.transport.close()
                    return resp
                choice = ({"index": 0, "delta": {"content": w}, "finish_reason": None} if chat
                          else {"index": 0, "text": w, "finish_reason": None, "logprobs": None})
                await resp.write(b"data: " + json.dumps({"id": "d", "object": obj, "created": 0, "model": MODEL,
                                                         "choices": [choice]}).encode() + b"\n\n")
                await asyncio.sleep(self.token_delay)
            if (body.get("stream_options") or {}).get("include_usage"):
                await resp.write(b"data: " + json.dumps({"id": "d", "object": obj, "created": 0, "model": MODEL,
                                                         "choices": [], "usage": usage}).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.active -= 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    """Fake P and D servers and the proxy, on loopback, in a background event loop."""

    def __init__(self, n_prefill=1, n_decode=1, nelssa=True, timeout=30.0):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.P = [Fake(f"p{i}") for i in range(n_prefill)]
        self.D = [Fake(f"d{i}") for i in range(n_decode)]
        self.runners = []
        p_urls = [self._serve(f.app()) for f in self.P]
        d_urls = [self._serve(f.app()) for f in self.D]
        self.proxy = Proxy(p_urls, d_urls, T_input=T_INPUT, nelssa=nelssa,
                           router=Router(WordTokenizer(), T_INPUT), timeout=timeout, health_interval=0.2)
        self.url = self._serve(self.proxy.app())
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=20)

    def _serve(self, app) -> str:
        port = _free_port()

        async def start():
            runner = web.AppRunner(app, handler_cancellation=True)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            return runner

        self.runners.append(asyncio.run_coroutine_threadsafe(start(), self.loop).result(10))
        return f"http://127.0.0.1:{port}"

    def wait_health(self, ok=True, timeout=5.0):
        t = time.monotonic() + timeout
        while time.monotonic() < t:
            if (httpx.get(self.url + "/health").status_code == 200) == ok:
                return
            time.sleep(0.05)
        raise AssertionError("proxy health did not change")

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics").text

    def close(self):
        for r in reversed(self.runners):
            asyncio.run_coroutine_threadsafe(r.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def stack():
    s = Stack()
    s.wait_health()
    yield s
    s.close()


def metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            got = dict(kv.split("=", 1) for kv in line[line.find("{") + 1:line.find("}")].split(",")) if "{" in line else {}
            if all(got.get(k) == f'"{v}"' for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


# ------------------------------------------------------------------ router (no servers)
def test_router_counts_and_rejects():
    r = Router(WordTokenizer(), 5)
    d = r.decide("completions", {"prompt": "a b c d"})
    assert (d.prompt_tokens, d.long) == (5, True)  # 4 words + the special token
    assert r.decide("completions", {"prompt": "a b c d", "add_special_tokens": False}).long is False
    assert r.decide("completions", {"prompt": [[5, 6, 7]]}).prompt_tokens == 3
    assert r.decide("completions", {"prompt": ["a b"]}).prompt_tokens == 3
    # chat: the template with a generation prompt; text parts joined; no special tokens by default
    d = r.decide("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x y"}]}]})
    assert d.prompt_tokens == len("<user> x y <assistant>".split())
    assert d.params() == {"long": False, "prompt_tokens": 4, "T_input": 5}
    for bad in ({"prompt": ["a", "b"]}, {"prompt": 3}, {}, {"prompt": []}, {"prompt": [1, "a"]}):
        with pytest.raises(BadRequest):
            completion_prompt(bad)
    for bad in ({"messages": []}, {"messages": [{"content": "x"}]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}):
        with pytest.raises(BadRequest):
            chat_messages(bad)
    with pytest.raises(BadRequest, match="chat template failed"):
        r.count("chat", {"messages": [{"role": "robot", "content": "x"}]})


# ------------------------------------------------------------------ P/D protocol, routing, usage
def test_short_completion_pd_protocol(stack):
    r = httpx.post(stack.url + "/v1/completions", headers={"X-Request-Id": "abc"},
                   json={"model": MODEL, "prompt": "one two three", "max_tokens": 5, "min_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.headers["X-Request-Id"] == "abc"
    assert r.json()["choices"][0]["text"] == "w0 w1 w2 w3 w4 "
    assert r.json()["usage"]["completion_tokens"] == 5
    (path, pb, ph), = stack.P[0].seen
    (_, db, dh), = stack.D[0].seen
    assert path == "/v1/completions"
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "min_tokens" not in pb
    assert pb["kv_transfer_params"]["do_remote_decode"] is True and pb["kv_transfer_params"]["do_remote_prefill"] is False
    decision = {"long": False, "prompt_tokens": 4, "T_input": T_INPUT}
    assert pb["kv_transfer_params"]["nelssa"] == decision
    # D: the original body, P's params and the same decision
    assert db["max_tokens"] == 5 and db["min_tokens"] == 2 and db["prompt"] == "one two three"
    assert db["kv_transfer_params"]["remote_engine_id"] == "p0" and db["kv_transfer_params"]["do_remote_prefill"]
    assert db["kv_transfer_params"]["nelssa"] == decision
    assert ph["x-request-id"] == dh["x-request-id"] == "abc"
    m = stack.metrics()
    assert metric(m, "nelssa_proxy_requests_total", route="short", endpoint="completions", status="200") == 1
    assert metric(m, "nelssa_proxy_prompt_tokens_total", route="short") == 4
    assert metric(m, "nelssa_proxy_completion_tokens_total", route="short") == 5
    assert metric(m, "nelssa_proxy_prompt_token_mismatch_total", route="short") == 1  # the fake says 7


def test_long_chat_streaming_with_openai_client(stack):
    words = " ".join(["w"] * 30)
    s = stack.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}],
                                             max_tokens=5, stream=True)
    chunks = list(s)
    assert "".join(c.choices[0].delta.content for c in chunks) == "w0 w1 w2 w3 w4 "
    assert all(c.usage is None for c in chunks)  # the usage chunk the proxy asked for is not forwarded
    (_, pb, _), = stack.P[0].seen
    (_, db, _), = stack.D[0].seen
    assert pb["kv_transfer_params"]["nelssa"]["long"] is True and db["kv_transfer_params"]["nelssa"]["long"] is True
    assert pb["stream"] is False and "stream_options" not in pb
    assert db["stream"] is True and db["stream_options"] == {"include_usage": True}
    # asked for: usage comes through
    s = stack.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": words}],
                                             max_tokens=5, stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in s if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 5
    m = stack.metrics()
    assert metric(m, "nelssa_proxy_requests_total", route="long", endpoint="chat", status="200") == 2
    assert metric(m, "nelssa_proxy_completion_tokens_total", route="long") == 10
    assert metric(m, "nelssa_proxy_ttft_seconds_count", route="long") == 2
    # non-streaming chat through the client
    r = stack.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert r.choices[0].message.content == "w0 w1 w2 w3 w4 " and r.usage.completion_tokens == 5
    assert stack.client.models.list().data[0].id == MODEL


def test_off_sends_no_decision():
    s = Stack(nelssa=False)
    try:
        s.wait_health()
        assert httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a"}).status_code == 200
        (_, pb, _), = s.P[0].seen
        (_, db, _), = s.D[0].seen
        assert "nelssa" not in pb["kv_transfer_params"] and "nelssa" not in db["kv_transfer_params"]
        assert metric(s.metrics(), "nelssa_proxy_requests_total", route="short", endpoint="completions",
                      status="200") == 1
    finally:
        s.close()


# ------------------------------------------------------------------ client errors
@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"model": "other", "prompt": "a"}).encode(), 404, "does not exist"),
    (json.dumps({"model": MODEL, "prompt": " ".join(["w"] * MAX_LEN)}).encode(), 400, "maximum context length"),
    (json.dumps({"model": MODEL, "prompt": "a b", "max_tokens": MAX_LEN}).encode(), 400, "maximum context length"),
    (json.dumps({"model": MODEL, "prompt": ["a", "b"]}).encode(), 400, "one prompt per request"),
    (json.dumps({"model": MODEL}).encode(), 400, "'prompt' is required"),
    (json.dumps({"model": MODEL, "prompt": "a", "kv_transfer_params": {}}).encode(), 400, "set by the proxy"),
    (json.dumps({"model": MODEL, "prompt": "a", "n": 2}).encode(), 400, "n=1"),
    (json.dumps({"model": MODEL, "prompt": "a", "stream": "yes"}).encode(), 400, "boolean"),
    (json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 0}).encode(), 400, "max_tokens"),
])
def test_bad_requests_are_4xx_and_the_proxy_keeps_serving(stack, body, status, needle):
    r = httpx.post(stack.url + "/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == status
    assert not stack.P[0].seen and not stack.D[0].seen  # rejected before any engine work
    assert httpx.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "a"}).status_code == 200


def test_bad_chat_is_4xx(stack):
    r = httpx.post(stack.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "robot",
                                                                                           "content": "x"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        stack.client.chat.completions.create(model=MODEL, messages=[], max_tokens=3)


# ------------------------------------------------------------------ upstream failures
def test_upstream_status_is_propagated(stack):
    stack.P[0].status = 400
    r = httpx.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "p0 says no"
    assert not stack.D[0].seen
    stack.P[0].status, stack.D[0].status = 200, 500
    with pytest.raises(openai.InternalServerError):
        stack.client.completions.create(model=MODEL, prompt="a", stream=True)
    assert metric(stack.metrics(), "nelssa_proxy_upstream_errors_total", role="decode", kind="status") == 1


def test_engine_down_is_503_then_back():
    s = Stack()
    try:
        s.wait_health()
        s.D[0].healthy = False
        s.wait_health(ok=False)
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 503 and "no healthy decode instance" in r.json()["error"]["message"]
        assert httpx.get(s.url + "/health").json()["decode"] == {s.proxy.D.members[0].url: False}
        s.D[0].healthy = True
        s.wait_health()
        assert httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a"}).status_code == 200
        # a prefill instance that refuses connections: out of rotation at once, 503 with a message
        asyncio.run_coroutine_threadsafe(s.runners[0].cleanup(), s.loop).result(10)
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a"})
        assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
        assert metric(s.metrics(), "nelssa_proxy_upstream_healthy", role="prefill", url=s.proxy.P.members[0].url) == 0
    finally:
        s.close()


def test_a_slow_health_check_keeps_an_instance_in_rotation():
    """A busy engine's /health may answer late: one or two unanswered checks in a row keep the instance in
    rotation (requests still go there); HEALTH_TIMEOUTS in a row take it out; an answer brings it back."""
    from nelssa.proxy.server import HEALTH_TIMEOUTS
    s = Stack()
    try:
        s.wait_health()
        up = s.proxy.P.members[0]
        s.P[0].health_delay = 1.5  # past the check's 1-s timeout (health_interval 0.2)
        t = time.monotonic() + 10
        while up.timeouts < HEALTH_TIMEOUTS - 1 and time.monotonic() < t:
            time.sleep(0.05)
        assert up.timeouts == HEALTH_TIMEOUTS - 1 and up.healthy
        assert httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a"}).status_code == 200
        s.wait_health(ok=False)
        assert up.timeouts >= HEALTH_TIMEOUTS and not up.healthy
        s.P[0].health_delay = 0.0
        s.wait_health()
        assert up.timeouts == 0
    finally:
        s.close()


def test_timeouts_and_broken_streams():
    s = Stack(timeout=0.5)
    try:
        s.wait_health()
        s.D[0].delay = 2.0
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a"}, timeout=10)
        assert r.status_code == 504 and "did not answer" in r.json()["error"]["message"]
        s.D[0].delay, s.D[0].break_stream = 0.0, True
        with pytest.raises(openai.APIError):
            list(s.client.completions.create(model=MODEL, prompt="a", stream=True))
        m = s.metrics()
        assert metric(m, "nelssa_proxy_upstream_errors_total", role="decode", kind="timeout") == 1
        assert metric(m, "nelssa_proxy_upstream_errors_total", role="decode", kind="broken") == 1
    finally:
        s.close()


def test_client_disconnect_closes_upstream(stack):
    d = stack.D[0]
    d.tokens, d.token_delay = 50, 0.1
    with httpx.stream("POST", stack.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "stream": True,
                                                                   "max_tokens": 50}) as r:
        it = r.iter_bytes()
        next(it)
    t = time.monotonic() + 5
    while d.aborted == 0 and time.monotonic() < t:
        time.sleep(0.05)
    assert d.aborted == 1, "the decode instance's request was not closed when the client left"
    # a client that leaves during prefill closes the prefill request too
    stack.P[0].delay = 3.0
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(stack.url + "/v1/completions", json={"model": MODEL, "prompt": "a"}, timeout=0.5)
    t = time.monotonic() + 5
    while stack.P[0].aborted == 0 and time.monotonic() < t:
        time.sleep(0.05)
    assert stack.P[0].aborted == 1
    assert metric(stack.metrics(), "nelssa_proxy_client_disconnects_total", route="short") == 2


def test_least_loaded_and_dead_instance_skipped():
    s = Stack(n_prefill=2, n_decode=2)
    try:
        s.wait_health()
        for f in s.D:
            f.delay = 0.5

        async def burst():
            import aiohttp
            async with aiohttp.ClientSession() as c:
                async def one():
                    async with c.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a"}) as r:
                        return r.status
                return await asyncio.gather(*(one() for _ in range(6)))

        assert asyncio.run(burst()) == [200] * 6
        assert [len(f.seen) for f in s.D] == [3, 3]  # least loaded: spread evenly
        assert all(f.max_active <= 3 for f in s.D)
        assert sum(len(f.seen) for f in s.P) == 6
        # one decode instance down: every request goes to the other one
        s.D[0].healthy = False
        t = time.monotonic() + 5
        while s.proxy.D.members[0].healthy and time.monotonic() < t:
            time.sleep(0.05)
        for f in s.D:
            f.delay = 0.0
        for _ in range(3):
            assert httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "a"}).status_code == 200
        assert [len(f.seen) for f in s.D] == [3, 6]
    finally:
        s.close()


# ------------------------------------------------------------------ launcher helpers (no engine started)
def test_engine_commands():
    import json as _json

    from nelssa.proxy.pd import engine_command

    def kv(cmd):
        return _json.loads(cmd[cmd.index("--kv-transfer-config") + 1])

    p, penv = engine_command("prefill", 8100, model="m", nelssa={}, cuda=False, extra=["--dtype", "float32"])
    d, denv = engine_command("decode", 8200, model="m", nelssa={"T_input": 512}, cuda=False,
                             extra=["--dtype", "float32", "--enforce-eager"])
    assert p[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--additional-config" not in p
    assert kv(p) == {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_device": "cpu",
                     "kv_connector_extra_config": {"kv_lease_duration": 120}}  # CPU: longer than vLLM's 30 s
    assert "--disable-hybrid-kv-cache-manager" in p  # NIXL's handshake hash must match D's
    assert d[1:3] == ["-m", "nelssa.proxy.engine"] and d[-2:] == ["float32", "--enforce-eager"]
    assert d.count("--dtype") == 1
    k = kv(d)
    assert k["kv_connector"] == "MultiConnector" and k["kv_role"] == "kv_consumer"
    names = [c["kv_connector"] for c in k["kv_connector_extra_config"]["connectors"]]
    assert names == ["NixlConnector", "NelssaConnector"]  # NIXL first: it loads the remote KV
    assert _json.loads(d[d.index("--additional-config") + 1]) == {"nelssa": {"T_input": 512}}
    assert d[d.index("--worker-cls") + 1].endswith("NelssaCPUWorker") and penv == denv == {}
    # stock baseline: NixlConnector alone on both, nothing of NELSSA
    for role in ("prefill", "decode"):
        c, _ = engine_command(role, 1, model="m", nelssa=None, cuda=False, extra=["--dtype", "float32"])
        assert kv(c)["kv_connector"] == "NixlConnector" and "--disable-hybrid-kv-cache-manager" not in c
        assert "--worker-cls" not in c and c[2] == "vllm.entrypoints.openai.api_server"
    g, genv = engine_command("decode", 1, model="m", nelssa={}, cuda=True, extra=[])
    assert kv(g)["kv_connector_extra_config"]["connectors"][0] == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cuda"}  # vLLM's lease
    p2, _ = engine_command("prefill", 1, model="m", nelssa=None, cuda=True, extra=[], lease_s=45)
    assert kv(p2)["kv_connector_extra_config"] == {"kv_lease_duration": 45}
    p3, _ = engine_command("prefill", 1, model="m", nelssa=None, cuda=True, extra=[],
                           nixl_connector="NixlPushConnector")
    assert kv(p3)["kv_connector"] == "NixlPushConnector"
    with pytest.raises(ValueError, match="NIXL connector"):
        engine_command("prefill", 1, model="m", nelssa=None, cuda=True, extra=[], nixl_connector="Nixl")
    assert genv == {"VLLM_USE_V2_MODEL_RUNNER": "0"} and "--dtype" not in g
    with pytest.raises(ValueError, match="budget"):
        engine_command("decode", 1, model="m", nelssa={"budget": 2}, cuda=False, extra=[])
    # P with the hand-over (through nelssa-node): the plugin beside NixlConnector, as D
    ho = {"T_input": 512, "engine": "node", "handover": True}
    h, _ = engine_command("prefill", 1, model="m", nelssa=ho, cuda=False, extra=["--dtype", "float32"])
    assert h[1:3] == ["-m", "nelssa.proxy.engine"] and "--disable-hybrid-kv-cache-manager" not in h
    assert kv(h)["kv_role"] == "kv_producer" and [c["kv_connector"] for c in kv(h)["kv_connector_extra_config"][
        "connectors"]] == ["NixlConnector", "NelssaConnector"]
    assert _json.loads(h[h.index("--additional-config") + 1]) == {"nelssa": ho}
    with pytest.raises(ValueError, match="handover .* needs engine 'node'"):
        engine_command("prefill", 1, model="m", nelssa={"handover": True}, cuda=False, extra=[])


@pytest.mark.parametrize("args, needle", [(["--port", "99999"], "--port must be in [0, 65535]"),
                                          (["--prefill", "localhost:8100"], "must be http(s)://host:port"),
                                          (["--timeout", "0"], "must be > 0")])
def test_bad_arguments_are_usage_errors(capsys, args, needle):
    from nelssa.proxy.server import main
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_a_port_in_use_is_a_one_line_error(capsys):
    from nelssa.proxy.server import main
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(SystemExit) as e:
            main(["--port", str(s.getsockname()[1])])
    assert e.value.code == 1 and "cannot listen on 127.0.0.1" in capsys.readouterr().err


def test_listening_ports():
    from nelssa.proxy.pd import listening
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listening([port, _free_port()]) == [port]
    assert listening([port]) == []


def test_connector_name_registered_for_multiconnector_stats():
    """D's API process rebuilds MultiConnector child stats by class name; unregistered, it crashed."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    from nelssa.proxy.engine import register_connector
    from nelssa.vllm_plugin.connector import NelssaStats
    register_connector()
    register_connector()  # idempotent
    stats = MultiConnector.build_kv_connector_stats({"NelssaConnector": {"data": {"long_requests": 1}}})
    assert isinstance(stats["NelssaConnector"], NelssaStats)
    assert stats["NelssaConnector"].data == {"long_requests": 1}


def test_nixl_probe_moves_and_checks_every_byte(tmp_path):
    """benchmarks/bench_nixl_local.py (the transport probe behind the P/D stack's UCX setting) on DRAM:
    two real NIXL agents in two processes, a READ and a WRITE of 1 MiB in 32-KiB descriptors, every
    byte checked on the receiving side."""
    import subprocess
    import sys
    from pathlib import Path
    pytest.importorskip("nixl")
    out = tmp_path / "probe.json"
    r = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "bench_nixl_local.py"),
                        "--device", "cpu", "--mib", "1", "--env", "UCX_WARN_UNUSED_ENV_VARS=n", "--out", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (res,) = json.loads(out.read_text())["results"]
    assert res["descriptors"] == 32 and res["bytes"] == 1 << 20
    assert res["READ"]["data_ok"] is True and res["WRITE"]["data_ok"] is True
    assert len(res["READ"]["seconds"]) == 3 and res["READ"]["GBps_best"] > 0
