"""Driving an OpenAI-compatible endpoint (``nelssa serve`` now, the P/D proxy later): starting and
stopping ``nelssa serve`` for a mode, scraping vLLM's Prometheus ``/metrics`` over time, and replaying a
request plan with streaming clients.

Each request goes through vLLM's own benchmark client (``vllm.benchmarks.lib.endpoint_request_func.
async_request_openai_completions``, the one ``vllm bench serve`` uses: streaming, TTFT, inter-token
latencies, ``ignore_eos``), with the prompt given as exact token ids and greedy sampling. What
``vllm bench serve`` itself does not do and this module does: arrivals from a plan with request
classes (short / long / growing), several sweep points per server, and ``/metrics`` sampled over time.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any, Callable

from nelssa.bench.common import metric_key

# vLLM gauges/counters sampled over time (summed over label sets and instances, the KV-use fraction the
# fullest instance's: combine_metrics); every nelssa:* sample is kept too
METRICS = {
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "kv_usage": "vllm:kv_cache_usage_perc",
    "preemptions": "vllm:num_preemptions_total",
    "generation_tokens": "vllm:generation_tokens_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
}


# gauges that are a fraction of one instance's capacity: over several instances (P/D: P's and D's
# /metrics) the fullest one's, not the sum (a P/D run reported "KV max 152%")
FRACTIONS = ("vllm:kv_cache_usage_perc",)


def _merge(m: dict[str, float], k: str, v: float) -> None:
    """One more instance's (or label set's) value of sample ``k`` into ``m``: summed, FRACTIONS the largest."""
    m[k] = max(m[k], v) if k in FRACTIONS and k in m else m.get(k, 0.0) + v


def combine_metrics(per_url: list[dict[str, float]]) -> dict[str, float]:
    """Several instances' parsed /metrics -> one sample: counts summed, FRACTIONS the largest."""
    m: dict[str, float] = {}
    for one in per_url:
        for k, v in one.items():
            _merge(m, k, v)
    return m


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value summed over label sets (engines), FRACTIONS the largest}
    for vllm:* and nelssa:*, keyed as the in-process scrape keys them (common.metric_key: a "part", "path",
    "outcome" or "beside" label kept as name{part})."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(("vllm:", "nelssa:")) and not s.name.endswith(("_bucket", "_created")):
                _merge(out, metric_key(s.name, s.labels), float(s.value))
    return out


def sample_of(m: dict[str, float]) -> dict[str, float]:
    d = {k: m.get(v, 0.0) for k, v in METRICS.items()}
    d.update({k: v for k, v in m.items() if k.startswith("nelssa:")})
    return d


def sample_names(text: str) -> list[str]:
    """The sample names of a full /metrics text that a sample keeps — METRICS' and every nelssa:* one but
    histogram buckets and ``_created`` — also of families with no sample yet (a labelled counter before its
    first increment), from their TYPE lines. Later scrapes ask for these alone (``metrics_url``): a full
    /metrics is ~900 lines with NELSSA, whose generation blocks the server's event loop and whose parsing
    blocked the benchmark's (9 and 25 ms on the 2-vCPU box against 5.5 and 15 for stock vLLM; on the H100
    host every request of a growth run saw a 35-45 ms gap at each 0.5-s sample, 2026-12-05)."""
    keep = set(METRICS.values())
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) < 4 or not parts[2].startswith("nelssa:"):
                continue
            name, kind = parts[2], parts[3]
            if kind == "counter":
                names.add(name if name.endswith("_total") else name + "_total")
            elif kind in ("histogram", "summary"):
                names.update((name + "_sum", name + "_count"))
            else:
                names.add(name)
        elif line and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if (name.startswith("nelssa:") or name in keep) and not name.endswith(("_bucket", "_created")):
                names.add(name)
    return sorted(names | keep)


def metrics_url(url: str, names: list[str] | None) -> str:
    """``url`` asking for these samples only: prometheus_client's ``name[]`` parameters. vLLM 0.26 serves
    /metrics twice — its instrumentator's route, which ignores them, and prometheus_client's ASGI app
    mounted at /metrics (``instrumentator/metrics.py``), which honours them and which /metrics/ reaches.
    An endpoint without them answers in full (parse_metrics filters anyway); one that refuses the URL
    is scraped in full from then on (_fetch)."""
    if not names:
        return url
    from urllib.parse import urlencode, urlsplit, urlunsplit
    u = urlsplit(url)
    path = u.path + "/" if u.path.endswith("/metrics") else u.path
    q = "&".join(x for x in (u.query, urlencode([("name[]", n) for n in names])) if x)
    return urlunsplit((u.scheme, u.netloc, path, q, u.fragment))


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - local benchmark endpoints
        return r.read().decode()


# ------------------------------------------------------------------ servers

class ServerError(RuntimeError):
    pass


class Server:
    """``nelssa serve`` for one mode (``on``: NELSSA with ``nelssa`` config, ``off``: NELSSA_OFF=1) on a
    port, its log in ``log_path``, ``env`` as defaults under the caller's environment; a context manager
    that stops the whole process group."""

    def __init__(self, mode: str, model: str, nelssa: dict, args: list[str], port: int, log_path: str,
                 start_timeout: float = 600.0, env: dict[str, str] | None = None) -> None:
        self.mode, self.port, self.log_path, self.start_timeout = mode, port, log_path, start_timeout
        self.cmd = [sys.executable, "-m", "nelssa.cli", "serve", "--model", model, "--nelssa",
                    json.dumps(nelssa if mode == "on" else {}), "--port", str(port), *args]
        self.env = {**(env or {}), **{k: v for k, v in os.environ.items() if k != "NELSSA_OFF"}}  # caller's env wins
        if mode == "off":
            self.env["NELSSA_OFF"] = "1"
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "Server":
        self.log = open(self.log_path, "w")
        self.log.write(("NELSSA_OFF=1 " if self.mode == "off" else "") + " ".join(self.cmd) + "\n")
        self.log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"server ({self.mode}) exited with {self.proc.returncode} while starting; "
                                  f"log {self.log_path}:\n{self.tail()}")
            try:
                if http_get(self.url + "/health", 2.0) is not None:
                    break
            except OSError:
                pass
            if time.time() - t0 > self.start_timeout:
                self.stop()
                raise ServerError(f"server ({self.mode}) not healthy after {self.start_timeout:.0f} s; "
                                  f"log {self.log_path}:\n{self.tail()}")
            time.sleep(1.0)
        print(f"[bench] server {self.mode} up on :{self.port} after {time.time() - t0:.0f} s", file=sys.stderr,
              flush=True)
        return self

    def tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path) as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, 30), (signal.SIGTERM, 15), (signal.SIGKILL, 10)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log.close()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def endpoint_model(base_url: str) -> tuple[str, str | None]:
    """(model id to send, its path/root if the server names one) from GET /v1/models."""
    d = json.loads(http_get(base_url.rstrip("/") + "/v1/models"))["data"][0]
    return d["id"], d.get("root")


# ------------------------------------------------------------------ replay

def _fetch(url: str, names: dict[str, list[str] | None]) -> dict[str, float]:
    """One instance's /metrics, parsed (on an executor thread: the replay's event loop, which stamps the
    streamed tokens, never parses); the first scrape of a URL is full and names the samples for the rest
    (None: the endpoint refused the restricted URL, full scrapes from then on)."""
    import urllib.error
    if names.get(url):
        try:
            return parse_metrics(http_get(metrics_url(url, names[url]), 5.0))
        except urllib.error.HTTPError:
            names[url] = None
    txt = http_get(url, 5.0)
    if url not in names:
        names[url] = sample_names(txt)
    return parse_metrics(txt)


async def _sample(urls: list[str], t0: float, samples: list, point: str | None,
                  names: dict[str, list[str] | None]) -> None:
    """One /metrics sample of every instance, combined, appended to ``samples``; ``names``: per URL, the
    samples to ask for (sample_names of its first scrape, filled by _fetch)."""
    loop = asyncio.get_running_loop()
    per_url = []
    for u in urls:
        try:
            per_url.append(await loop.run_in_executor(None, _fetch, u, names))
        except OSError:
            continue
    m = combine_metrics(per_url)
    if m:
        samples.append({"t": time.perf_counter() - t0, "point": point, **sample_of(m)})


async def _sampler(urls: list[str], t0: float, samples: list, stop: asyncio.Event, interval: float,
                   point: list[str], names: dict[str, list[str] | None]) -> None:
    while True:
        await _sample(urls, t0, samples, point[0], names)
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass


def _record(r: dict, out: Any, t0: float, point: str) -> dict:
    start = out.start_time - t0
    stamps: list[float] = []
    if out.success:
        t = start + out.ttft
        stamps.append(t)
        for d in out.itl:
            t += d
            stamps.append(t)
    return {**r, "point": point, "start": start, "success": bool(out.success), "error": out.error[-2000:],
            "ttft_s": out.ttft if out.success else None, "output_tokens": out.output_tokens or 0,
            "prompt_len": out.prompt_len, "stamps": stamps}


async def replay(base_url: str, model_id: str, points: list[tuple[str, list[dict]]], prompts: dict[str, list[int]],
                 metrics_urls: list[str] | None = None, interval: float = 0.5, label: str = "bench",
                 gap_s: float = 2.0, on_point: Callable[[dict], None] | None = None) -> dict:
    """Send every point's plan (arrival times relative to the point's start) to the endpoint, points
    one after the other; sample /metrics meanwhile. Returns {requests, samples, points: {name: [t0, t1]}};
    ``on_point`` gets that dict (so far) after each point, so a run stopped later keeps what it finished."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_completions

    from nelssa.bench.common import Progress
    api = base_url.rstrip("/") + "/v1/completions"
    urls = metrics_urls or [base_url.rstrip("/") + "/metrics"]
    total = sum(len(p) for _, p in points)
    prog = Progress(total, label)
    recs: list[dict] = []
    samples: list[dict] = []
    spans: dict[str, list[float]] = {}
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    # idle connections dropped before the server closes them (vLLM's keep-alive, 5 s by default): a request
    # sent on one the server is closing fails with ServerDisconnectedError (H200 mixed sweep: one per mode)
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as sess:
        def inp(r: dict, rid: str) -> Any:
            return RequestFuncInput(prompt=prompts[r["id"]], api_url=api, prompt_len=r["n_in"], output_len=r["n_out"],
                                    model=model_id, ignore_eos=True, extra_body={"temperature": 0.0},
                                    request_id=rid)
        # warm-up (not recorded): the first request's prompt, 2 tokens
        first = points[0][1][0]
        warm = await async_request_openai_completions(
            RequestFuncInput(prompt=prompts[first["id"]][:64], api_url=api, prompt_len=64, output_len=2, model=model_id,
                             ignore_eos=True, extra_body={"temperature": 0.0}, request_id=f"warmup-{time.time_ns()}"),
            sess)
        if not warm.success:
            raise RuntimeError(f"warm-up request to {api} failed: {warm.error[-1000:]}")
        t0 = time.perf_counter()
        # the counters before any request: the first point's baseline (point_stats differences counters
        # between samples, which a point whose tokens all stream between two samples still moves)
        names: dict[str, list[str] | None] = {}
        await _sample(urls, t0, samples, None, names)
        stop = asyncio.Event()
        cur = [points[0][0]]
        smp = asyncio.create_task(_sampler(urls, t0, samples, stop, interval, cur, names))
        for name, plan in points:
            cur[0] = name
            p0 = time.perf_counter() - t0
            spans[name] = [p0, p0]

            async def one(r: dict) -> None:
                out = await async_request_openai_completions(inp(r, f"{r['id']}-{time.time_ns()}"), sess)
                recs.append(_record(r, out, t0, name))
                last = samples[-1] if samples else {}
                prog.update(extra=f"[{name}] running {last.get('running', 0):.0f} waiting "
                                  f"{last.get('waiting', 0):.0f} kv {100 * last.get('kv_usage', 0):.0f}%")
            tasks = []
            for r in sorted(plan, key=lambda x: x["at"]):
                await asyncio.sleep(max(0.0, p0 + r["at"] - (time.perf_counter() - t0)))
                tasks.append(asyncio.create_task(one(r)))
            await asyncio.gather(*tasks)
            spans[name][1] = time.perf_counter() - t0
            if on_point is not None:
                on_point({"requests": recs, "samples": samples, "points": {k: v for k, v in spans.items()}})
            await asyncio.sleep(gap_s)  # let the gauges settle between points
        stop.set()
        await smp
    prog.update(0, force=True)
    return {"requests": recs, "samples": samples, "points": spans}
