"""The engine as a small HTTP/JSON service (`python -m engine serve`), so the explorer can attach to
an engine running elsewhere (for example the release-size model spread over several GPUs).

Endpoints (JSON in, JSON out; errors are `{"error": message, "kind": ...}` with a 4xx/5xx status):
- `GET  /info`           engine version, identity, source, numerics, config, role plan, world size, tokenizer
- `GET  /health`         liveness and the queue: running, waiting per client
- `POST /tokenize`       `{"prompt": text | [ids]}` -> `{"ids", "tokens"}`
- `POST /token_strings`  `{"ids": [...]}` -> `{"tokens"}`
- `POST /run`            `{"prompt" | "ids", "layers", "probes", "image_spans", "generate", "keep",
                         "detail_layers", "prefill", "replay", "logits", "generated_probes",
                         "continuation"}` ->
                         `{"result": RunResult.to_json(), "queue": {"position", "wait_s", "run_s"}}`;
                         `"prefill": "ced"` (and `"replay": R`), `"generated_probes"` and `"continuation"`
                         (token ids fed after the prompt) as engine.run; with `"logits": true` the
                         result also holds `"logits"`, the prompt's [T, vocab] logits as `pack_tensor`;
                         with `"keep": true` the result holds no layer probes but a `run_id`, and the
                         service keeps the run (the last KEPT_RUNS of them) for
- `POST /probes`         `{"run_id", "layers": [...], "packed"}` -> `{"layers": {layer: LayerResult.to_json()}}`
                         (`"packed": true`: `LayerResult.to_wire()`, tensors as binary blocks):
                         a click asks for one layer's probes (at release size one layer of a 4,096-token
                         prompt is ~100 MB of JSON, all 40 layers would be GBs); 404 `RunGone` when evicted

Runs go one at a time through a `FairQueue`: clients (header `X-Client-Id`, else the peer address)
take turns, each client's own requests in order, and a client may have at most `per_client` waiting,
so one user cannot starve the others. With several processes (torchrun), rank 0 answers HTTP and
broadcasts each run to the other ranks; every rank computes its shard (`follow`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import traceback
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ..run.api import ENGINE_VERSION, EngineError
from ..run.ced import PREFILLS
from ..run.probes import pack_tensor

MAX_BODY = 4 << 20        # the longest prompt (max_seq_len tokens as text or ids) is well under 1 MB of JSON
READ_TIMEOUT_S = 30.0     # a connection silent this long is closed (a stalled client holds no thread)
BODY_DEADLINE_S = 60.0    # the whole request body must arrive within this
MAX_GENERATE = 1024       # default cap on generated tokens per request (--max-generate)
RUN_TIMEOUT_S = 600.0     # default: a client waits at most this for its run (--run-timeout)
KEPT_RUNS = 4        # runs whose probes the service keeps for /probes (a release-size run holds ~2 GB)
HEARTBEAT_S = 30.0   # an idle rank 0 pings the others so their waiting broadcast never times out
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class QueueFull(Exception):
    """This client already has as many runs waiting as the service allows."""


class RunGone(Exception):
    """The run asked for is no longer kept (the service keeps the last KEPT_RUNS)."""


class BadRequest(Exception):
    """A request refused before it reaches the engine: (status, kind, message); the connection closes
    when `close` (the body was not read, so the stream cannot be trusted)."""

    def __init__(self, status: int, kind: str, message: str, close: bool = False):
        super().__init__(message)
        self.status, self.kind, self.close = status, kind, close


# -- the queue ---------------------------------------------------------------------------------------

@dataclass
class Ticket:
    client: str
    request: dict
    submitted: float = field(default_factory=time.monotonic)
    position: int = 0            # runs ahead of this one when it was queued (the running one included)
    started: float | None = None
    finished: float | None = None
    result: dict | None = None
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)
    abandoned: bool = False      # the client stopped waiting (run timeout): drop the result
    timed_out: bool = False      # not finished within the run timeout of its submission

    def queue_info(self) -> dict:
        started = self.started if self.started is not None else time.monotonic()
        finished = self.finished if self.finished is not None else started
        return {"position": self.position, "wait_s": round(started - self.submitted, 4),
                "run_s": round(finished - started, 4)}


class FairQueue:
    """Runs one at a time. Clients with waiting runs take turns (round-robin in order of arrival);
    each client's own runs keep their order; at most `per_client` waiting runs per client."""

    def __init__(self, per_client: int = 4, max_waiting: int = 256):
        self.per_client, self.max_waiting = per_client, max_waiting
        self._waiting: dict[str, deque[Ticket]] = {}
        self._turns: deque[str] = deque()   # clients with waiting runs, next turn first
        self._cond = threading.Condition()
        self.running: Ticket | None = None
        self.served = 0
        self.closed = False

    def submit(self, client: str, request: dict) -> Ticket:
        with self._cond:
            mine = self._waiting.get(client)
            if mine is not None and len(mine) >= self.per_client:
                raise QueueFull(f"you already have {len(mine)} runs waiting (at most {self.per_client} per "
                                "client); wait for one to finish")
            if sum(len(q) for q in self._waiting.values()) >= self.max_waiting:
                raise QueueFull(f"the engine has {self.max_waiting} runs waiting; try again later")
            ticket = Ticket(client, request)
            if mine is None:
                mine = self._waiting[client] = deque()
                self._turns.append(client)
            mine.append(ticket)
            ticket.position = self._ahead(ticket)
            self._cond.notify_all()
            return ticket

    def _ahead(self, ticket: Ticket) -> int:
        """Runs that go before `ticket` if nobody else arrives: its client's earlier runs, and in
        each round before (and the part of its own round ahead of) its client's turn, one run of
        every other client."""
        order = list(self._turns)
        me = order.index(ticket.client)
        depth = self._waiting[ticket.client].index(ticket)
        ahead = depth + (1 if self.running is not None else 0)
        for i, client in enumerate(order):
            if client != ticket.client:
                ahead += min(len(self._waiting[client]), depth + (1 if i < me else 0))
        return ahead

    def next(self, timeout: float | None = None) -> Ticket | None:
        """The next run (blocks up to `timeout`; None when nothing came). It is `running` until done()."""
        with self._cond:
            if not self._cond.wait_for(lambda: bool(self._turns) or self.closed, timeout) or self.closed:
                return None
            client = self._turns.popleft()
            mine = self._waiting[client]
            ticket = mine.popleft()
            if mine:
                self._turns.append(client)
            else:
                del self._waiting[client]
            ticket.started = time.monotonic()
            self.running = ticket
            return ticket

    def cancel(self, ticket: Ticket) -> bool:
        """Take a waiting run out of the queue (True), or mark a running one abandoned (False)."""
        with self._cond:
            ticket.abandoned = True
            mine = self._waiting.get(ticket.client)
            if mine is None or ticket not in mine:
                return False
            mine.remove(ticket)
            if not mine:
                del self._waiting[ticket.client]
                self._turns.remove(ticket.client)
            return True

    def done(self, ticket: Ticket) -> None:
        with self._cond:
            ticket.finished = time.monotonic()
            self.running = None
            self.served += 1
        ticket.done.set()

    def close(self) -> None:
        """Wake the worker for good (the service is stopping)."""
        with self._cond:
            self.closed = True
            for mine in self._waiting.values():
                for ticket in mine:
                    ticket.error = RuntimeError("the engine service is stopping")
                    ticket.done.set()
            self._waiting.clear()
            self._turns.clear()
            self._cond.notify_all()

    def snapshot(self) -> dict:
        with self._cond:
            return {"running": self.running is not None,
                    "running_for_s": None if self.running is None else round(time.monotonic() - self.running.started, 3),
                    "waiting": sum(len(q) for q in self._waiting.values()),
                    "waiting_by_client": {c: len(q) for c, q in self._waiting.items()},
                    "served": self.served, "per_client": self.per_client}


# -- running a request -----------------------------------------------------------------------------

RUN_KEYS = {"prompt", "ids", "layers", "probes", "image_spans", "generate", "keep", "detail_layers",
            "prefill", "replay", "logits", "generated_probes", "continuation"}


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _flag(body: dict, name: str) -> bool:
    """A true/false field of a /run body (false when absent)."""
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise EngineError(f"'{name}' must be true or false")
    return value


def run_args(body: dict, max_generate: int | None = None) -> dict:
    """Check a /run body and turn it into engine.run keyword arguments (EngineError when bad)."""
    if not isinstance(body, dict):
        raise EngineError("the request body must be a JSON object")
    unknown = set(body) - RUN_KEYS
    if unknown:
        raise EngineError(f"unknown fields {sorted(unknown)}; known: {sorted(RUN_KEYS)}")
    if ("prompt" in body) == ("ids" in body):
        raise EngineError("give exactly one of 'prompt' (text) and 'ids' (token ids)")
    prompt = body.get("prompt", body.get("ids"))
    if "ids" in body and not (isinstance(prompt, list) and all(_whole(i) for i in prompt)):
        raise EngineError("'ids' must be a list of integers")
    if "prompt" in body and not (isinstance(prompt, str) or isinstance(prompt, list) and all(_whole(i) for i in prompt)):
        raise EngineError("'prompt' must be text (or a list of integer token ids)")
    args: dict = {"prompt": prompt}
    layers = body.get("layers")
    if layers is not None:
        if not (isinstance(layers, list) and all(_whole(v) for v in layers)):
            raise EngineError("'layers' must be a list of layer numbers")
        args["layers"] = layers
    if body.get("probes") is not None:
        if not (isinstance(body["probes"], list) and all(isinstance(v, str) for v in body["probes"])):
            raise EngineError("'probes' must be a list of probe kinds")
        args["probes"] = tuple(body["probes"])
    detail = body.get("detail_layers")
    if detail is not None:
        if not (isinstance(detail, list) and all(_whole(v) for v in detail)):
            raise EngineError("'detail_layers' must be a list of layer numbers")
        args["detail_layers"] = detail
    spans = body.get("image_spans") or []
    if not (isinstance(spans, list) and all(isinstance(p, list) and len(p) == 2 and all(_whole(v) for v in p)
                                            for p in spans)):
        raise EngineError("'image_spans' must be a list of [start, end] pairs of integers")
    args["image_spans"] = [(a, b) for a, b in spans]
    generate = body.get("generate", 0)
    if not _whole(generate) or generate < 0:
        raise EngineError("'generate' must be a non-negative integer")
    if max_generate is not None and generate > max_generate:
        raise EngineError(f"'generate' asks for {generate} tokens; this service generates at most {max_generate} "
                          "per request (--max-generate)")
    args["generate"] = generate
    _flag(body, "keep")   # read by the service itself (a kept run), not by engine.run
    prefill = body.get("prefill", "full")
    if prefill not in PREFILLS:
        raise EngineError(f"'prefill' must be one of {list(PREFILLS)}, got {str(prefill)[:40]!r}")
    replay = body.get("replay")
    if replay is not None and (not _whole(replay) or replay < 1):
        raise EngineError("'replay' must be a whole number of prompt tokens >= 1")
    if replay is not None and prefill != "ced":
        raise EngineError("'replay' applies only to \"prefill\": \"ced\"")
    args["prefill"], args["replay"] = prefill, replay
    args["logits"], args["generated_probes"] = _flag(body, "logits"), _flag(body, "generated_probes")
    continuation = body.get("continuation")
    if continuation is not None:
        if not (isinstance(continuation, list) and all(_whole(i) for i in continuation)):
            raise EngineError("'continuation' must be a list of token ids")
        if max_generate is not None and len(continuation) > max_generate:
            raise EngineError(f"'continuation' has {len(continuation)} tokens; this service generates at most "
                              f"{max_generate} per request (--max-generate)")
        args["continuation"] = continuation
    return args


def execute(engine, request: dict):
    """Run one request on this process's engine (every rank does the same): the RunResult."""
    return engine.run(**request)


def follow(engine, parallel) -> None:
    """The loop of ranks other than 0: take each broadcast request and compute its share."""
    parallel.bind_thread()
    while True:
        message = parallel.broadcast(None)
        if message["op"] == "stop":
            return
        if message["op"] == "run":
            try:
                execute(engine, message["args"])
            except EngineError:
                pass  # rank 0 hit the same input error and reports it


# -- the service -----------------------------------------------------------------------------------

class EngineService:
    """An engine (and, with several processes, its group) behind a fair queue; `start` launches the
    one worker thread that runs everything that touches the model."""

    def __init__(self, engine, parallel=None, per_client: int = 4, max_waiting: int = 256,
                 max_generate: int = MAX_GENERATE, run_timeout: float = RUN_TIMEOUT_S):
        self.engine, self.parallel = engine, parallel
        self.max_generate, self.run_timeout = max_generate, run_timeout
        self.queue = FairQueue(per_client, max_waiting)
        self.kept: OrderedDict[str, object] = OrderedDict()   # run_id -> RunResult, oldest first
        self._kept_lock = threading.Lock()
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None

    def info(self) -> dict:
        e = self.engine
        return {"engine_version": ENGINE_VERSION, "identity": e.identity, "source": e.source,
                "numerics": e.numerics, "config": e.cfg.to_dict(), "plan": [r.to_dict() for r in e.plan],
                "world_size": 1 if self.parallel is None else self.parallel.world,
                "device": "cpu" if self.parallel is None else str(self.parallel.device),
                "tokenizer": e.tokenizer is not None}

    def start(self) -> None:
        self._worker = threading.Thread(target=self._work, name="engine-worker", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        self._stop.set()
        self.queue.close()
        if self._worker is not None:
            self._worker.join(timeout=60)

    def _work(self) -> None:
        if self.parallel is not None:
            self.parallel.bind_thread()
        while not self._stop.is_set():
            ticket = self.queue.next(timeout=HEARTBEAT_S if self.parallel is not None else 0.5)
            if ticket is None:
                if self.parallel is not None:
                    self.parallel.broadcast({"op": "idle"})
                continue
            try:
                args = run_args(ticket.request, self.max_generate)
                self.engine.encode(args["prompt"])           # input errors before any rank starts
                self.engine.check_layers(args.get("layers"))
                if self.parallel is not None:
                    self.parallel.broadcast({"op": "run", "args": args})
                result = execute(self.engine, args)
                if not ticket.abandoned:   # nobody waits for an abandoned run's (possibly large) JSON
                    ticket.result = self._keep(result) if ticket.request.get("keep") else result.to_json()
                    if result.logits is not None:   # JSON numbers would be ~20x the packed bytes
                        ticket.result["logits"] = pack_tensor(result.logits)
            except EngineError as err:
                ticket.error = err
            except Exception as err:  # a fault of the engine, not of the request: log it, report one line
                traceback.print_exc()
                ticket.error = RuntimeError(f"the engine failed: {type(err).__name__}: {err}")
            finally:
                self.queue.done(ticket)
        if self.parallel is not None:
            self.parallel.broadcast({"op": "stop"})

    def _keep(self, result) -> dict:
        """Keep the run for /probes; its JSON without the layer probes, with the run's id and layers."""
        run_id = uuid.uuid4().hex
        with self._kept_lock:
            self.kept[run_id] = result
            while len(self.kept) > KEPT_RUNS:
                self.kept.popitem(last=False)
        return {**result.to_json(layers=[]), "run_id": run_id, "probed_layers": sorted(result.layers)}

    def probes(self, body: dict) -> dict:
        """A kept run's probes of some layers (RunGone: no longer kept; EngineError: a bad request)."""
        layers = body.get("layers")
        if not (isinstance(layers, list) and all(_whole(v) for v in layers)):
            raise EngineError("'layers' must be a list of layer numbers")
        with self._kept_lock:
            result = self.kept.get(str(body.get("run_id")))
        if result is None:
            raise RunGone(f"the service no longer keeps that run (it keeps the last {KEPT_RUNS})")
        missing = sorted(set(layers) - set(result.layers))
        if missing:
            raise EngineError(f"the run has no probes of layers {missing}; it probed {sorted(result.layers)}")
        if body.get("packed"):
            return {"layers": {str(L): result.layers[L].to_wire() for L in layers}}
        return {"layers": result.to_json(layers=layers)["layers"]}

    def run(self, client: str, body: dict, timeout: float | None = None) -> Ticket:
        """Queue a run and wait for it (EngineError at once for a bad body). After `timeout` (default the
        service's run timeout) the ticket comes back not done: taken out of the queue if still waiting,
        abandoned if running (its result is dropped)."""
        run_args(body, self.max_generate)
        ticket = self.queue.submit(client, body)
        limit = self.run_timeout if timeout is None else timeout
        ticket.done.wait(limit)
        # judged by the run's own finish time, not by this thread's wake-up, which other threads holding
        # the GIL (a run, a large reply being written) can delay past the deadline
        if not ticket.done.is_set() or (ticket.finished is not None and ticket.finished - ticket.submitted > limit):
            ticket.timed_out = True
            self.queue.cancel(ticket)
        return ticket


class _Handler(BaseHTTPRequestHandler):
    service: EngineService  # set on the subclass made by make_server
    protocol_version = "HTTP/1.1"
    timeout = READ_TIMEOUT_S  # socket timeout: a stalled connection is closed, not kept forever

    def handle_one_request(self):
        try:
            super().handle_one_request()
        except (TimeoutError, ConnectionError):  # a client that stalled or went away: nothing to answer
            self.close_connection = True

    def log_message(self, fmt, *args):  # one line per request on stderr, without the default noise
        if getattr(self.server, "verbose", False):
            sys.stderr.write(f"{self.address_string()} {fmt % args}\n")

    def _send(self, status: int, payload: dict) -> None:
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _error(self, status: int, kind: str, message: str) -> None:
        self._send(status, {"error": message, "kind": kind})

    def _check_caller(self) -> None:
        """Only this machine's own clients: a web page the user opens elsewhere can make the browser
        send requests here (a plain-text POST needs no CORS preflight; DNS rebinding changes the Host)."""
        origin = self.headers.get("Origin")
        if origin is not None and origin not in self.server.own_origins:
            raise BadRequest(403, "ForeignOrigin", f"requests from web pages of other sites are refused (Origin {origin[:100]!r})",
                             close=True)
        if self.server.own_hosts is not None and (self.headers.get("Host") or "").lower() not in self.server.own_hosts:
            raise BadRequest(403, "ForeignHost", "the Host header does not name this service's address", close=True)

    def _body(self) -> dict:
        """The request's JSON object (BadRequest otherwise), read within BODY_DEADLINE_S."""
        self._check_caller()
        ctype = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise BadRequest(415, "UnsupportedMediaType", "requests must be JSON with Content-Type: application/json",
                             close=True)
        if self.headers.get("Transfer-Encoding"):
            raise BadRequest(411, "LengthRequired", "send the body with a Content-Length (no chunked encoding)", close=True)
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if n < 0:
            raise BadRequest(400, "BadRequest", "the Content-Length is not a byte count", close=True)
        if n > MAX_BODY:
            raise BadRequest(413, "TooLarge", f"the request body is {n:,} bytes; at most {MAX_BODY:,} are accepted "
                             "(a prompt longer than the model's max_seq_len is refused anyway)", close=True)
        raw = self._read(n)
        try:
            body = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BadRequest(400, "BadRequest", f"the request body is not JSON ({err})") from None
        except RecursionError:
            raise BadRequest(400, "BadRequest", "the request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest(400, "BadRequest", "the request body must be a JSON object")
        return body

    def _read(self, n: int) -> bytes:
        deadline = time.monotonic() + BODY_DEADLINE_S
        parts, left = [], n
        while left:
            if time.monotonic() > deadline:
                raise BadRequest(408, "Timeout", f"the request body did not arrive within {BODY_DEADLINE_S:.0f} s",
                                 close=True)
            chunk = self.rfile.read1(min(left, 1 << 16))
            if not chunk:
                raise ConnectionError("the client closed the connection mid-body")
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    def _client(self) -> str:
        return self.headers.get("X-Client-Id") or self.client_address[0]

    def do_GET(self):
        self._answer(self._get)

    def do_POST(self):
        self._answer(self._post)

    def _answer(self, handle) -> None:
        """Every bad request: a 4xx with one JSON line; every fault: a 500 with one JSON line and one log
        line. Either way the service answers the next request."""
        try:
            handle()
        except BadRequest as err:
            if err.close:
                self.close_connection = True
            self._error(err.status, err.kind, str(err))
        except EngineError as err:
            self._error(400, "EngineError", str(err))
        except (TimeoutError, ConnectionError):
            raise
        except Exception as err:  # a fault of the service itself: one line in the log, one in the answer
            sys.stderr.write(f"engine service: {self.command} {self.path[:100]} failed: {type(err).__name__}: {err}\n")
            self.close_connection = True
            self._error(500, "ServerError", f"the service failed on this request ({type(err).__name__}); "
                        "it goes on answering others")

    def _get(self):
        self._check_caller()
        path = self.path.split("?")[0]
        if path == "/info":
            self._send(200, self.service.info())
        elif path == "/health":
            self._send(200, {"ok": True, "queue": self.service.queue.snapshot()})
        else:
            self._error(404, "NotFound", f"no endpoint GET {path} (try /info, /health)")

    def _post(self):
        path = self.path.split("?")[0]
        body = self._body()
        engine = self.service.engine
        if path == "/tokenize":
            prompt = body.get("prompt", "")
            if not (isinstance(prompt, str) or isinstance(prompt, list) and all(_whole(i) for i in prompt)):
                raise EngineError("'prompt' must be text (or a list of integer token ids)")
            ids = engine.encode(prompt)
            self._send(200, {"ids": ids, "tokens": engine.token_strings(ids)})
        elif path == "/token_strings":
            ids = body.get("ids")
            if not (isinstance(ids, list) and all(_whole(i) for i in ids)):
                raise EngineError("'ids' must be a list of integers")
            bad = [i for i in ids if not 0 <= i < engine.cfg.vocab_size]
            if bad:
                raise EngineError(f"token id {bad[0]} is outside the vocabulary (0..{engine.cfg.vocab_size - 1})")
            self._send(200, {"tokens": engine.token_strings(ids)})
        elif path == "/run":
            self._run(body)
        elif path == "/probes":
            try:
                self._send(200, self.service.probes(body))
            except RunGone as err:
                self._error(404, "RunGone", str(err))
        else:
            self._error(404, "NotFound", f"no endpoint POST {path} (try /run, /probes, /tokenize, /token_strings)")

    def _run(self, body: dict) -> None:
        try:
            ticket = self.service.run(self._client(), body)
        except QueueFull as err:
            self._error(429, "QueueFull", str(err))
            return
        if ticket.timed_out:
            self._error(504, "RunTimeout", f"the run did not finish within {self.service.run_timeout:g} s "
                        "(--run-timeout); ask for fewer tokens or a shorter prompt")
        elif isinstance(ticket.error, EngineError):
            self._error(400, "EngineError", str(ticket.error))
        elif ticket.error is not None:
            self._error(500, "EngineFailed", str(ticket.error))
        else:
            self._send(200, {"result": ticket.result, "queue": ticket.queue_info()})


def make_server(service: EngineService, host: str = "127.0.0.1", port: int = 8765,
                verbose: bool = False, read_timeout: float = READ_TIMEOUT_S) -> ThreadingHTTPServer:
    """An HTTP server for the service (port 0: any free port; see `server.server_address`);
    `read_timeout`: seconds a connection may stay silent before it is closed."""
    handler = type("Handler", (_Handler,), {"service": service, "timeout": read_timeout})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    server.verbose = verbose
    port = server.server_address[1]
    names = {host, *LOOPBACK} if host in LOOPBACK else {host}
    shown = {f"[{n}]" if ":" in n else n for n in names}
    server.own_origins = {f"http://{n}:{port}" for n in shown}
    # Host checked only on a loopback bind (beyond it, the names clients use are not known here)
    server.own_hosts = {f"{n}:{port}".lower() for n in shown} if host in LOOPBACK else None
    return server


def host_warning(host: str) -> str | None:
    """The warning printed when the service listens beyond this machine."""
    if host in LOOPBACK:
        return None
    return (f"warning: listening on {host}: anyone who can reach this machine on that address can run prompts "
            "through the engine (there is no authentication); use the default 127.0.0.1 unless you mean it")
