"""One request never stops the service, and the network edges a device meets are closed.

Faults: a request whose sampling numpy cannot take, a backend that raises or returns non-finite
logits in the middle of a batch, a scheduler thread that dies anyway, a scheduler that hangs (the
systemd watchdog). Edges: TCP_NODELAY, the Host and Content-Type checks, connection exhaustion,
oversized prompts, the drain, streams' logged status. And a storm of all of it at once, checked
against the model run alone. A real server subprocess on 127.0.0.1 (tests/test_serve.py's
`Server`) or an in-process `Scheduler` over a real exported model; the only stand-ins are a
backend wrapper that injects the fault (the real backend underneath) and a notify socket in
place of systemd's.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient
from test_serve import JSON_HEADERS, KEY, Server, chat_body, run_alone
from test_tokenizer import ONE_MB

from kvedge.errors import ContextOverflow, ModelFault
from kvedge.runtime.generate import Event, SamplingConfig, sample
from kvedge.runtime.model import Model
from kvedge.serve.app import api_error, create_app, host_allowed
from kvedge.serve.config import load_service_config
from kvedge.serve.metrics import Metrics
from kvedge.serve.scheduler import Job, Scheduler
from kvedge.serve.service import listening_socket
from kvedge.serve.systemd import Notifier, render_unit

MAX_PROMPT = 3000
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def artifact(served_artifact) -> Path:
    return served_artifact  # conftest: max_len 512


@pytest.fixture(scope="module")
def reference(artifact) -> Model:
    return Model(artifact, slots=1)


@pytest.fixture(scope="module")
def server(artifact, tmp_path_factory):
    config = dict(slots=2, queue_size=8, warmup_tokens=2, max_prompt_tokens=MAX_PROMPT, threads=1)
    with Server(
        artifact, tmp_path_factory.mktemp("server"), max_connections=16, header_timeout_s=3.0, **config
    ) as srv:
        yield srv


def greedy_text(reference: Model, text: str, n: int = GREEDY["max_tokens"]) -> str:
    return run_alone(reference, [{"role": "user", "content": text}], max_new_tokens=n)[0]


def reply_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


# -- 1. one request never stops the service -------------------------------------------------------


def test_sampling_numpy_cannot_take_is_greedy_or_refused_and_the_service_keeps_serving(server, reference):
    """temperature 1e-308 made numpy raise "Probabilities contain NaN" in the scheduler thread, which
    died: every later request got 503 for good. Below GREEDY_BELOW it is greedy now."""
    want = greedy_text(reference, "What is the capital of France?")
    body = chat_body("What is the capital of France?", max_tokens=12, temperature=1e-308)
    assert reply_text(server.http.post("/v1/chat/completions", json=body)) == want
    for penalty in (1e-307, 0.0):  # dividing a logit by it overflowed as the temperature did
        bad = chat_body("hi", max_tokens=4, temperature=1.0, repetition_penalty=penalty)
        response = server.http.post("/v1/chat/completions", json=bad)
        assert response.status_code == 400, response.text
        assert "[0.01, 10]" in response.json()["error"]["message"]
    again = chat_body("What is the capital of France?", **GREEDY)
    assert reply_text(server.http.post("/v1/chat/completions", json=again)) == want
    assert server.http.get("/health").json() == {"status": "ready"}


def test_sampling_refuses_a_distribution_it_cannot_draw_from():
    rng = np.random.default_rng(0)
    logits = np.array([1.0, 2.0, 3.0], np.float32)
    assert sample(logits, SamplingConfig(temperature=1e-300), rng, []) == 2  # greedy, not NaN
    with pytest.raises(ModelFault, match="not finite"):
        sample(np.full(3, -np.inf, np.float32), SamplingConfig(temperature=0.5), rng, [])


class FaultyBackend:
    """The real backend, but its first decode call of two rows or more raises, or (`nan_row`)
    returns row 0's logits as NaN (a decode range starts at a busy slot): the faults a broken
    model, file or device produces in the middle of a batch."""

    def __init__(self, backend, nan_row: bool) -> None:
        self._backend, self.nan_row, self.faulted = backend, nan_row, False

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def run(self, input_ids, *args, **kwargs):
        fault = not self.faulted and input_ids.shape[0] >= 2 and input_ids.shape[1] == 1
        self.faulted |= fault
        if fault and not self.nan_row:
            raise RuntimeError("injected: the device stopped answering")
        out = self._backend.run(input_ids, *args, **kwargs)
        if fault:
            out.logits[0] = np.nan
        return out


def ready_scheduler(model: Model, **kwargs) -> Scheduler:
    scheduler = Scheduler(lambda: model, queue_size=8, metrics=Metrics(), **kwargs)
    scheduler.start()
    deadline = time.monotonic() + 60
    while scheduler.state != "ready":
        assert scheduler.state in ("loading", "warming") and time.monotonic() < deadline, scheduler.state
        time.sleep(0.01)
    return scheduler


def run_scheduler(scheduler: Scheduler, conversations, max_new: int) -> list[list[Event]]:
    """Every conversation through the scheduler at once: each one's events."""
    delivered: list[list[Event]] = [[] for _ in conversations]
    ended = [threading.Event() for _ in conversations]
    for i, text in enumerate(conversations):

        def deliver(event: Event, i=i) -> None:
            delivered[i].append(event)
            if event.finish_reason is not None:
                ended[i].set()

        ids = scheduler.model.tokenizer.encode_chat([{"role": "user", "content": text}])
        scheduler.submit(Job(ids, SamplingConfig(max_new_tokens=max_new), deliver))
    assert all(done.wait(60) for done in ended), delivered
    return delivered


CONVERSATIONS = ["Hello!", "What is a KV cache?", "Tell me about the quick brown fox."]


@pytest.mark.parametrize("fault", ["raises", "nan_row"])
def test_a_backend_fault_mid_batch_ends_only_the_requests_it_touched(artifact, reference, fault):
    """A decode call of several turns that raises ends the turns in it with a 500 (their slots
    reset); a NaN row ends that row's turn only. Either way the scheduler stays ready, the turns
    the fault did not touch and every later request equal the model run alone."""
    model = Model(artifact, slots=3)
    model.backend = FaultyBackend(model.backend, nan_row=fault == "nan_row")
    alone = [greedy_text(reference, text, 24) for text in CONVERSATIONS]
    scheduler = ready_scheduler(model)
    try:
        delivered = run_scheduler(scheduler, CONVERSATIONS, 24)
        assert model.backend.faulted
        finals = [events[-1] for events in delivered]
        failed = [i for i, final in enumerate(finals) if final.finish_reason == "error"]
        assert failed and all(api_error(finals[i].error).status == 500 for i in failed)
        if fault == "nan_row":
            assert len(failed) == 1 and isinstance(finals[failed[0]].error, ModelFault)
        for i in set(range(len(CONVERSATIONS))) - set(failed):
            assert "".join(e.text for e in delivered[i]) == alone[i]
        assert scheduler.state == "ready"
        again = run_scheduler(scheduler, CONVERSATIONS, 24)
        assert ["".join(e.text for e in events) for events in again] == alone
    finally:
        scheduler.stop()


def test_an_engine_thread_that_dies_anyway_ends_every_request_and_stops_the_service(artifact):
    """A fault in the fault handling itself (here: a client callback that raises every time,
    so even the error cannot be delivered) ends the thread: the jobs still waiting get an error
    event instead of hanging, state is "failed" and `on_failure` stops the service, which then
    exits non-zero (`serve`) for its service manager to restart."""
    stopped = threading.Event()
    scheduler = ready_scheduler(Model(artifact, slots=1), on_failure=stopped.set)
    ids = scheduler.model.tokenizer.encode_chat([{"role": "user", "content": "Hello!"}])

    def broken(event: Event) -> None:
        raise RuntimeError("injected: the client callback is broken")

    waiting: list[Event] = []
    scheduler.submit(Job(ids, SamplingConfig(max_new_tokens=50), broken))
    scheduler.submit(Job(ids, SamplingConfig(max_new_tokens=50), waiting.append))  # queued: 1 slot
    assert stopped.wait(30), scheduler.state
    assert scheduler.state == "failed" and "scheduler thread failed" in scheduler.failure
    assert waiting and waiting[-1].finish_reason == "error"
    assert api_error(waiting[-1].error).status == 500
    with pytest.raises(Exception, match="failed"):
        scheduler.submit(Job(ids, SamplingConfig(), waiting.append))  # NotReady: the app's 503


# -- the systemd watchdog ---------------------------------------------------------------------------


class NotifySocket:
    """A stand-in for systemd's notify socket: a datagram socket collecting (time, message)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.1)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def times(self, message: str) -> list[float]:
        return [t for t, text in list(self.messages) if message in text.split("\n")]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def test_the_unit_is_type_notify_with_a_watchdog():
    unit = render_unit(
        "/usr/bin/python3", Path("/etc/kvedge/default.yaml"), Path("/opt/kvedge"), "kvedge", 10
    )
    lines = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert (lines["Type"], lines["NotifyAccess"], lines["Restart"]) == ("notify", "main", "on-failure")
    assert int(lines["WatchdogSec"]) >= 10 and int(lines["TimeoutStartSec"]) >= 300


def test_ready_only_once_warm_then_watchdog_pings_then_stopping(artifact, tmp_path):
    notify = NotifySocket(tmp_path / "notify")
    os.environ["NOTIFY_SOCKET"], os.environ["WATCHDOG_USEC"] = str(notify.path), "3000000"
    try:
        srv = Server(artifact, tmp_path, slots=1, warmup_tokens=300, threads=1)
    finally:
        del os.environ["NOTIFY_SOCKET"], os.environ["WATCHDOG_USEC"]
    try:
        warming = []  # when a /health request that found the service warming was sent
        deadline = time.monotonic() + 60
        while True:
            assert srv.process.poll() is None and time.monotonic() < deadline, srv.output()
            sent = time.monotonic()
            try:
                health = srv.http.get("/health")
            except httpx.TransportError:
                time.sleep(0.02)
                continue
            if health.status_code == 200:
                break
            warming.append(sent)
            time.sleep(0.02)
        time.sleep(0.2)
        ready = notify.times("READY=1")
        assert len(ready) == 1 and warming and max(warming) < ready[0], notify.messages
        time.sleep(5.0)
        pings = [t for t in notify.times("WATCHDOG=1") if t > ready[0]]
        assert len(pings) >= 2, notify.messages  # at half WATCHDOG_USEC (1.5 s), idle or not
        assert max(np.diff([ready[0], *pings])) < 3.0  # never as long as the watchdog's timeout
        srv.process.send_signal(signal.SIGTERM)
        assert srv.process.wait(20) in (0, -signal.SIGTERM)
        assert notify.times("STOPPING=1")
    finally:
        srv.stop()
        notify.close()


def test_the_watchdog_pings_stop_while_the_engine_hangs(artifact, tmp_path):
    """Pings come from the scheduler loop, not a timer: a round that never ends (here: a client
    callback that blocks, which must not) stops them, so systemd restarts a hung scheduler."""
    notify = NotifySocket(tmp_path / "notify")
    notifier = Notifier({"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"})
    scheduler = ready_scheduler(
        Model(artifact, slots=1), heartbeat=notifier.watchdog, heartbeat_s=notifier.heartbeat_s
    )
    release, blocked = threading.Event(), threading.Event()
    try:
        model = scheduler.model

        def stuck(event: Event) -> None:
            blocked.set()
            release.wait(10)

        ids = model.tokenizer.encode_chat([{"role": "user", "content": "Hello!"}])
        scheduler.submit(Job(ids, SamplingConfig(max_new_tokens=30), stuck))
        assert blocked.wait(30)
        hung_at = time.monotonic()
        time.sleep(2.0)
        during = [t for t in notify.times("WATCHDOG=1") if t > hung_at + 0.05]
        release.set()
        time.sleep(1.5)
        after = [t for t in notify.times("WATCHDOG=1") if t > hung_at + 2.0]
        assert during == [] and after, notify.messages
    finally:
        release.set()
        scheduler.stop()
        notify.close()


# -- 2. TCP_NODELAY ------------------------------------------------------------------------------


def test_kept_alive_requests_do_not_wait_for_delayed_acks(server):
    """Without TCP_NODELAY every request after the first on a kept-alive connection waited for the
    client's delayed ACK: about 44 ms each, against 3-4 ms on a fresh connection."""
    assert listening_socket("127.0.0.1", 0).proto == socket.IPPROTO_TCP
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}) as client:
        client.get("/v1/models")
        seconds = []
        for _ in range(12):
            started = time.perf_counter()
            assert client.get("/v1/models").status_code == 200
            seconds.append(time.perf_counter() - started)
    # Nagle + delayed ACK held every one of them 40 ms or more; a loaded machine slows a few
    assert sorted(seconds)[3] < 0.035, seconds


# -- 3. Host, Content-Type, CORS ------------------------------------------------------------------


def test_host_names_this_service_only():
    names = frozenset({"127.0.0.1", "kiosk.local"})
    for good in (
        "localhost",
        "localhost:8000",
        "127.0.0.1:8000",
        "[::1]:8000",
        "10.0.0.7",
        "kiosk.local:80",
        "",
    ):
        assert host_allowed(good, names), good
    for bad in ("evil.example", "evil.example:8000", "localhost.evil.example", "127.0.0.1.nip.io"):
        assert not host_allowed(bad, names), bad
    assert host_allowed("evil.example", frozenset({"*"}))


def test_a_rebinding_host_and_a_text_plain_cross_origin_post_are_refused(server):
    for path in ("/v1/models", "/metrics", "/health"):
        response = server.http.get(path, headers={"Host": "rebind.attacker.example"})
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_host", path
    assert server.http.get("/v1/models", headers={"Host": f"localhost:{server.port}"}).status_code == 200
    body = json.dumps(chat_body("Hi", max_tokens=2))
    plain = {"Content-Type": "text/plain", "Origin": "http://attacker.example"}
    response = server.http.post("/v1/chat/completions", content=body, headers=plain)
    assert response.status_code == 415 and "application/json" in response.json()["error"]["message"]
    assert "access-control-allow-origin" not in response.headers
    preflight = server.http.options(
        "/v1/chat/completions",
        headers={"Origin": "http://attacker.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in preflight.headers
    ok = server.http.post(
        "/v1/chat/completions", content=body, headers={**JSON_HEADERS, "Origin": "http://x"}
    )
    assert ok.status_code == 200  # the browser, not the server, keeps a cross-origin reader out


def test_cors_only_for_the_configured_origins(artifact, tmp_path):
    path = tmp_path / "svc.yaml"
    path.write_text(f"model: {artifact}\ncors_origins: ['http://kiosk.local:8080']\nallowed_hosts: [kiosk]\n")
    config = load_service_config(path, {})
    scheduler = Scheduler(lambda: Model(artifact), queue_size=1, metrics=Metrics())  # never started
    client = TestClient(create_app(config, scheduler, Metrics()), base_url="http://kiosk:8000")
    asked = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    allowed = client.options("/v1/chat/completions", headers={"Origin": "http://kiosk.local:8080", **asked})
    assert allowed.headers["access-control-allow-origin"] == "http://kiosk.local:8080"
    other = client.options("/v1/chat/completions", headers={"Origin": "http://attacker.example", **asked})
    assert other.headers.get("access-control-allow-origin") != "http://attacker.example"
    assert client.get("/health").status_code == 503  # the Host "kiosk" is allowed; not loaded
    path.write_text(f"model: {artifact}\nallowed_hosts: ['evil.example/x']\n")
    with pytest.raises(Exception, match=r"allowed_hosts.*is not allowed; allowed: a list of host names"):
        load_service_config(path, {})


# -- 4. /health under connection exhaustion -------------------------------------------------------


def test_health_and_chats_are_served_while_slow_heads_exhaust_the_connections(server, reference):
    """Connections beyond max_connections (16) close the oldest one still sending its head:
    a client reopening 60 slow-header connections no longer turns /health and chats into 503."""
    stop = threading.Event()
    opened = [0]

    def slowloris() -> None:
        held: list[socket.socket] = []
        while not stop.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", server.port), timeout=2)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the end
                held.append(sock)
                opened[0] += 1
            except OSError:
                pass
            if len(held) > 60:
                held.pop(0).close()
            time.sleep(0.005)
        for sock in held:
            sock.close()

    attacker = threading.Thread(target=slowloris)
    attacker.start()
    try:
        while opened[0] < 60:
            time.sleep(0.05)
        want = greedy_text(reference, "Hi", 4)
        statuses, replies = [], []
        for _ in range(15):
            with httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30
            ) as c:
                statuses.append(c.get("/health").status_code)
                replies.append(
                    reply_text(
                        c.post("/v1/chat/completions", json=chat_body("Hi", temperature=0, max_tokens=4))
                    )
                )
    finally:
        stop.set()
        attacker.join()
    assert statuses == [200] * 15 and replies == [want] * 15
    assert opened[0] > 60


# -- 5. oversized prompts ------------------------------------------------------------------------


def test_a_1_mb_message_is_refused_before_it_is_tokenized(server, reference):
    text = "word " * 200_000  # 1 MB, ~200k tokens
    started = time.perf_counter()
    with pytest.raises(ContextOverflow, match=f"at least .* tokens .*at most {MAX_PROMPT} prompt tokens"):
        reference.encode_chat([{"role": "user", "content": text}], limit=MAX_PROMPT)
    assert time.perf_counter() - started < 0.05
    body = json.dumps(chat_body(text)).encode()
    elapsed = []
    for _ in range(3):  # the fastest of three: a loaded machine may slow one (tokenizing took 0.8 s)
        started = time.perf_counter()
        response = server.http.post("/v1/chat/completions", content=body, headers=JSON_HEADERS)
        elapsed.append(time.perf_counter() - started)
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert min(elapsed) < 0.1, elapsed
    raw = server.http.post("/v1/completions", json={"model": "tiny", "prompt": text})
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize(
    "text",
    [
        "word " * 1400,
        " " * 5000,
        "\n" * 3000,
        "é" * 2000 + "e\u0301" * 500,
        "日本語のテキスト" * 300,
        "🙂" * 900,
        "x" * 9000,
    ],
)
def test_the_byte_bound_never_refuses_what_fits(reference, text):
    tokens = len(reference.tokenizer.encode(text))
    assert reference.tokenizer.fewest_tokens(text, tokens) <= tokens
    assert len(reference.encode_chat([{"role": "user", "content": text}], limit=tokens + 20)) <= tokens + 20


LONG_LIMIT = 400  # prompt tokens the long-entry server accepts (its max_len: 512)


@pytest.fixture(scope="module")
def long_server(long_entry_artifact, tmp_path_factory):
    """A server whose vocabulary says a token may stand for 1000 bytes (conftest's LONG_ENTRY)."""
    config = dict(slots=1, warmup_tokens=0, max_prompt_tokens=LONG_LIMIT, threads=1, max_body_bytes=4 << 20)
    with Server(long_entry_artifact, tmp_path_factory.mktemp("long-server"), **config) as srv:
        yield srv


def fastest_400(server: Server, path: str, body: dict) -> float:
    """The fastest of three posts of `body`, each refused as over LONG_LIMIT prompt tokens."""
    data = json.dumps(body, ensure_ascii=False).encode()
    elapsed = []
    for _ in range(3):
        started = time.perf_counter()
        response = server.http.post(path, content=data, headers=JSON_HEADERS)
        elapsed.append(time.perf_counter() - started)
        assert response.status_code == 400, response.text
        assert f"at most {LONG_LIMIT} prompt tokens" in response.json()["error"]["message"]
    return min(elapsed)


def lookup_tool(description: str) -> dict:
    parameters = {"type": "object", "properties": {"q": {"type": "string"}}}
    function = {"name": "lookup", "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


@pytest.mark.parametrize("shape", ONE_MB)
def test_1_mb_of_any_shape_gets_its_400_fast_in_a_message_a_tool_or_a_raw_prompt(long_server, shape):
    """Tokenizing 1 MB whole took 0.4-1 s; by its bytes alone it may be 334 tokens here."""
    text = ONE_MB[shape]
    fastest = {
        "message": fastest_400(long_server, "/v1/chat/completions", chat_body(text)),
        "tool": fastest_400(long_server, "/v1/chat/completions", chat_body("Hi", tools=[lookup_tool(text)])),
        "prompt": fastest_400(long_server, "/v1/completions", {"model": "tiny", "prompt": text}),
    }
    assert max(fastest.values()) < 0.1, fastest


def test_a_prompt_of_exactly_the_limit_is_accepted_one_token_more_refused(long_server, long_entry_artifact):
    tokenizer = Model(long_entry_artifact, slots=1).tokenizer

    def count(text: str) -> int:
        return len(tokenizer.encode_chat([{"role": "user", "content": text}]))

    words = max(k for k in range(LONG_LIMIT) if count("word " * k) <= LONG_LIMIT)
    text = next(
        t for t in ("word " * words + "x" * j for j in range(12)) if count(t) == LONG_LIMIT
    )  # 2 KB or so, more characters than the limit: counted in pieces
    response = long_server.http.post("/v1/chat/completions", json=chat_body(text, max_tokens=2))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == LONG_LIMIT
    over = next(t for t in (text + "x" * j for j in range(1, 12)) if count(t) == LONG_LIMIT + 1)
    response = long_server.http.post("/v1/chat/completions", json=chat_body(over, max_tokens=2))
    assert response.status_code == 400
    assert f"the messages take {LONG_LIMIT + 1} tokens" in response.json()["error"]["message"]


# -- 6. drain, stream status --------------------------------------------------------------------


def test_health_says_draining_during_a_drain_and_cut_streams_are_not_counted_200(artifact, tmp_path):
    # under the window policy a reply may run past the cache. The tiny model writes 4000 tokens in
    # about 2.6 s, barely past the 2 s grace: on a loaded machine, where the drain began late, such
    # a reply ended whole ("length") before the grace was over. 200,000 tokens take minutes.
    srv = Server(
        artifact,
        tmp_path,
        slots=1,
        warmup_tokens=0,
        shutdown_grace_s=2,
        threads=1,
        history_policy="window",
        max_reply_tokens=200_000,
    )
    try:
        srv.startup()
        ok = 'kvedge_chat_requests_total{"status": "200"}'
        before = srv.metrics().get(ok, 0)  # startup's probe may have been answered
        body = {**chat_body("A long story please.", max_tokens=200_000, temperature=0), "stream": True}
        with srv.http.stream("POST", "/v1/chat/completions", json=body) as response:  # left unread
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            metrics = srv.metrics()
        assert not any("499" in key for key in metrics)
        gone = srv.wait_idle()
        assert gone['kvedge_chat_requests_total{"status": "499"}'] == 1
        assert gone.get(ok, 0) == before
        with srv.http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            srv.process.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            health = httpx.get(f"{srv.url}/health", timeout=5)  # the port is still open
            assert (health.status_code, health.json()) == (503, {"status": "draining"})
            rest = [line for line in lines if line.startswith("data: ")]
        last = json.loads(rest[-2].removeprefix("data: "))
        assert last.get("error", {}).get("code") == "shutting_down", last
        assert srv.process.wait(20) in (0, -signal.SIGTERM)
    finally:
        srv.stop()
    log = (tmp_path / "server.log").read_text()
    assert "/v1/chat/completions 499" in log and "/v1/chat/completions 503" in log
    prompt = len(Model(artifact).encode_chat(body["messages"]))
    assert f"/v1/chat/completions 200: {prompt} prompt" not in log  # (startup's probe may be)


# -- the storm ---------------------------------------------------------------------------------


def test_storm_of_faults_beside_good_requests(server, reference, capsys):
    """Good greedy requests beside disconnects, slow heads, 1 MB prompts, sampling numpy cannot
    take, text/plain posts and rebinding Hosts, with /health probed all along: every full reply
    equals the model run alone, no slot is left in use and /health never fails."""
    texts = ["Hello!", "What is a KV cache?", "Paris.", "Tell me about the quick brown fox.", "Hi"]
    want = {text: greedy_text(reference, text) for text in texts}
    rng = random.Random(7)
    kinds = ["good"] * 24 + ["disconnect"] * 6 + ["huge"] * 3 + ["tiny_temperature"] * 4 + ["plain"] * 3
    kinds += ["rebind"] * 3 + ["slow_head"] * 4
    rng.shuffle(kinds)
    health_failures, stop = [], threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            while not stop.is_set():
                try:
                    status = client.get("/health").status_code
                except httpx.HTTPError as exc:
                    status = repr(exc)
                if status != 200:
                    health_failures.append(status)
                time.sleep(0.05)

    def one(i: int, kind: str) -> tuple[str, str | None]:
        text = texts[i % len(texts)]
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
            if kind in ("good", "tiny_temperature"):
                fields = GREEDY if kind == "good" else {**GREEDY, "temperature": 1e-308}
                got = reply_text(c.post("/v1/chat/completions", json=chat_body(text, **fields)))
                return kind, None if got == want[text] else f"{text!r}: {got!r} != {want[text]!r}"
            if kind == "disconnect":
                body = {**chat_body(text, max_tokens=200, temperature=0.8, seed=i), "stream": True}
                with c.stream("POST", "/v1/chat/completions", json=body) as response:
                    for _ in zip(range(rng.randint(1, 4)), response.iter_lines(), strict=False):
                        pass
                return kind, None
            if kind == "huge":
                response = c.post("/v1/chat/completions", json=chat_body("word " * 200_000))
                return kind, None if response.status_code == 400 else response.text[:200]
            if kind == "plain":
                response = c.post(
                    "/v1/chat/completions",
                    content=json.dumps(chat_body(text)),
                    headers={"Content-Type": "text/plain"},
                )
                return kind, None if response.status_code == 415 else response.text[:200]
            if kind == "rebind":
                response = c.get("/v1/models", headers={"Host": "rebind.example"})
                return kind, None if response.status_code == 400 else response.text[:200]
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # slow_head
                for byte in b"GET /health HTTP/1.1\r\n":
                    sock.sendall(bytes([byte]))
                    time.sleep(0.05)
            return kind, None

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(len(kinds)), kinds))
    finally:
        stop.set()
        prober.join()
    mismatches = [problem for _, problem in results if problem is not None]
    leaked = server.wait_idle(30)["kvedge_slots_in_use"]
    with capsys.disabled():  # CI's log says what the storm came to, passing or not
        print(
            f"\nstorm: {len(kinds)} requests ({kinds.count('good')} compared), mismatches {len(mismatches)}, "
            f"leaked slots {int(leaked)}, /health failures {len(health_failures)}"
        )
    assert mismatches == [] and leaked == 0 and health_failures == []
    assert server.process.poll() is None


def test_a_request_without_sampling_fields_takes_the_services_greedy_defaults(server, reference):
    """Requests (and the chat page) that give no temperature got 1.0, and the default model
    answered "What is the capital of France?" with nonsense where the CLI (greedy) said Paris: the
    service's defaults are config keys now, greedy unless set, and /v1/models shows them."""
    card = server.http.get("/v1/models").json()["data"][0]
    assert card["sampling_defaults"] == {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.0,
    }
    body = chat_body("What is the capital of France?", max_tokens=12)
    assert reply_text(server.http.post("/v1/chat/completions", json=body)) == greedy_text(
        reference, "What is the capital of France?"
    )
