"""Attach the explorer to an engine service (`python -m engine serve`) instead of loading a model.

`RemoteEngine(url)` has the surface the app uses from `engine.api.Engine`: `cfg`, `plan`, `source`,
`identity`, `numerics`, `encode`, `token_strings`, `run(...) -> result with .to_json(), .layers and (on
request) .logits`. Input errors
come back as `engine.api.EngineError` (the same message as in-process); a service that cannot be
reached, or that dies during a run, raises `EngineUnreachable` with a message written for the user.

`attached_engine()` reads `EXPLORER_ENGINE_URL`; the app calls it before loading a model itself.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import urllib.error
import urllib.request
import uuid
from functools import lru_cache
from typing import TYPE_CHECKING

from engine.config import ConfigError, ModelConfig, config_from_dict
from engine.roles import role_plan

if TYPE_CHECKING:
    from engine.run.probes import LayerResult

ENV_URL = "EXPLORER_ENGINE_URL"
DEFAULT_TIMEOUT = 3600.0   # a long prompt on a big model, behind other users' runs
INFO_TIMEOUT = 10.0


class RemoteEngineError(RuntimeError):
    """A problem with the engine service (not with the input); the message says what to do."""


class EngineUnreachable(RemoteEngineError):
    """The service is not running, not reachable, or stopped answering."""


class EngineBusy(RemoteEngineError):
    """The service refused to queue another run for this client."""


class RunGone(RemoteEngineError):
    """The service no longer keeps the run whose probes were asked for."""


class RemoteRun:
    """One run's result from the service: `to_json()` is exactly the engine's `RunResult.to_json()`;
    `layers` maps layer -> LayerResult (tensors), as on the in-process result; `logits` the prompt's
    logits [T, vocab] when the run asked for them (None otherwise), as `RunResult.logits`.

    A run the service keeps (`run_id`) arrives without its layers' probes: each layer is fetched the
    first time it is asked for, so a click moves one layer's probes, not the whole model's. If the
    service has dropped the run meanwhile, the prompt is run again (the engine is deterministic)."""

    def __init__(self, data: dict, queue: dict | None = None, engine: RemoteEngine | None = None,
                 request: dict | None = None):
        packed = data.pop("logits", None)   # not part of RunResult.to_json()
        self._data = data
        self.queue = queue or {}   # position when queued, wait_s, run_s
        self._engine, self._request = engine, request
        self._probed = [int(v) for v in data.get("probed_layers", [])] if data.get("run_id") else None
        for key in ("tokens", "token_ids", "image_mask", "cache_bytes", "kv_bytes_formula", "time_s",
                    "generated_ids", "generated_text", "prefill", "replay", "prefill_s", "numerics"):
            setattr(self, key, data.get(key))
        if packed is not None:
            from engine.run.probes import unpack_tensor
            self.logits = unpack_tensor(packed)
        else:
            self.logits = None
        self._layers: dict[int, LayerResult] | None = None

    def to_json(self, layers=None) -> dict:
        """The run's JSON, as RunResult.to_json(); `layers` keeps only those layers' probes. The probes
        are shared with this object, not copied (a release-size layer is ~100 MB): read, don't change."""
        self._fetch(self._probed if layers is None else layers)
        data = {k: v for k, v in self._data.items() if k not in ("run_id", "probed_layers")}
        if layers is not None and "layers" in data:
            keep = {str(int(v)) for v in layers}
            data["layers"] = {k: v for k, v in data["layers"].items() if k in keep}
        return data

    @property
    def layers(self) -> dict[int, LayerResult]:
        if self._layers is None:
            self._fetch(self._probed)
            self._layers = {int(k): layer_from_json(v) for k, v in self._data["layers"].items()}
        return self._layers

    def _fetch(self, layers) -> None:
        """Bring the probes of these layers from the service, where it keeps them."""
        if self._probed is None or layers is None:
            return
        missing = [L for L in layers if L in self._probed and str(L) not in self._data["layers"]]
        if not missing:
            return
        try:
            got = self._engine.probes(self._data["run_id"], missing)
        except RunGone:
            again = self._engine.run(**self._request)
            self._data["run_id"] = again._data["run_id"]
            got = self._engine.probes(self._data["run_id"], missing)
        self._data["layers"].update(got)


def layer_from_json(d: dict) -> LayerResult:
    """A LayerResult (tensors) from its JSON form: the engine's own `LayerResult.from_json`, so every
    field (first_position of a CED decoder, ties, runner-ups) comes back as in process."""
    from engine.run.probes import LayerResult   # here, not at import: the page draws without torch

    return LayerResult.from_json(d)


class RemoteEngine:
    """An engine service at `url` (e.g. http://127.0.0.1:8765), used like engine.api.Engine."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, client_id: str | None = None):
        url = url.strip().rstrip("/")
        if not url.startswith(("http://", "https://")):
            url = "http://" + url
        self.url, self.timeout = url, timeout
        self.client_id = client_id or uuid.uuid4().hex[:12]
        self.info = self._call("GET", "/info", timeout=INFO_TIMEOUT)
        try:
            self.cfg: ModelConfig = config_from_dict(self.info["config"], where=f"{url}/info")
        except (ConfigError, KeyError) as err:
            raise RemoteEngineError(f"the engine service at {url} sent a config this explorer cannot read: {err}") \
                from None
        self.plan = role_plan(self.cfg)
        self.identity = f"{self.info.get('identity', '')}@{self.info.get('world_size', 1)}"
        self.source = f"{url} ({self.info.get('source', '')})"
        self.engine_version = self.info.get("engine_version")
        self.numerics = self.info.get("numerics")   # None: a service from before /info said it
        self.world_size = self.info.get("world_size", 1)

    def __repr__(self) -> str:
        return f"RemoteEngine({self.url!r})"

    # -- the Engine surface ----------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        return self._call("POST", "/tokenize", {"prompt": prompt}, INFO_TIMEOUT * 6)["ids"]

    def token_strings(self, ids: list[int]) -> list[str]:
        return self._call("POST", "/token_strings", {"ids": [int(i) for i in ids]}, INFO_TIMEOUT * 6)["tokens"]

    def run(self, prompt: str | list[int], layers=None, probes=None, image_spans=(), generate: int = 0,
            keep: bool | None = None, detail_layers=(), prefill: str = "full", replay: int | None = None,
            logits: bool = False, generated_probes: bool = False, continuation=None) -> RemoteRun:
        """Run on the service. A run of every layer (`layers=None`) is kept there by default and its
        probes come layer by layer as they are asked for (`keep=False`: all at once). prefill, replay,
        logits, generated_probes and continuation as engine.run (sent only when not the defaults, so an
        older service still answers the rest)."""
        request = dict(prompt=prompt, layers=layers, probes=probes, image_spans=image_spans, generate=generate,
                       keep=layers is None if keep is None else keep, detail_layers=detail_layers,
                       prefill=prefill, replay=replay, generated_probes=generated_probes, continuation=continuation)
        body: dict = {"prompt": prompt} if isinstance(prompt, str) else {"ids": [int(i) for i in prompt]}
        if layers is not None:
            body["layers"] = [int(v) for v in layers]
        if probes is not None:
            body["probes"] = list(probes)
        body["image_spans"] = [[int(a), int(b)] for a, b in image_spans]
        body["generate"] = int(generate)
        body["keep"] = request["keep"]
        if detail_layers:
            body["detail_layers"] = [int(v) for v in detail_layers]
        if prefill != "full":
            body["prefill"] = prefill
        if replay is not None:
            body["replay"] = replay
        if logits:
            body["logits"] = True
        if generated_probes:
            body["generated_probes"] = True
        if continuation is not None:
            body["continuation"] = [int(i) for i in continuation]
        reply = self._call("POST", "/run", body, self.timeout, during="the run")
        return RemoteRun(reply["result"], reply.get("queue"), engine=self, request=request)

    def probes(self, run_id: str, layers: list[int]) -> dict:
        """Some layers' probes of a kept run: {"layer": LayerResult.to_json()} (RunGone when dropped).
        They travel packed (tensors as binary blocks) and are turned into JSON here, by the engine's own
        LayerResult.to_json, so they equal what the engine in this process would give."""
        from engine.run.probes import LayerResult

        reply = self._call("POST", "/probes", {"run_id": run_id, "layers": [int(v) for v in layers], "packed": True},
                           self.timeout, during="fetching the layer's probes")
        return {k: LayerResult.from_wire(v).to_json() for k, v in reply["layers"].items()}

    def health(self) -> dict:
        return self._call("GET", "/health", timeout=INFO_TIMEOUT)

    # -- HTTP ------------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict | None = None, timeout: float = INFO_TIMEOUT,
              during: str | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json", "X-Client-Id": self.client_id})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            raise self._http_error(err) from None
        except urllib.error.URLError as err:
            raise self._unreachable(err.reason, during) from None
        except (http.client.HTTPException, ConnectionError, socket.timeout, TimeoutError, OSError) as err:
            raise self._unreachable(err, during) from None
        except json.JSONDecodeError:
            raise RemoteEngineError(f"the engine service at {self.url} answered {path} with something that is "
                                    "not JSON (is that URL an engine service?)") from None

    def _http_error(self, err: urllib.error.HTTPError) -> Exception:
        try:
            payload = json.loads(err.read())
            message, kind = payload["error"], payload.get("kind")
        except (ValueError, KeyError, TypeError, OSError):
            return RemoteEngineError(f"the engine service at {self.url} answered HTTP {err.code} ({err.reason}); "
                                     "is that URL an engine service?")
        if kind == "EngineError":
            from engine.run.api import EngineError
            return EngineError(message)
        if kind == "QueueFull":
            return EngineBusy(f"the engine service is busy: {message}")
        if kind == "RunGone":
            return RunGone(message)
        return RemoteEngineError(f"the engine service at {self.url} failed: {message}")

    def _unreachable(self, reason, during: str | None) -> EngineUnreachable:
        if isinstance(reason, (socket.timeout, TimeoutError)):
            what = f"did not answer within {self.timeout if during else INFO_TIMEOUT:g} s"
            return EngineUnreachable(f"the engine service at {self.url} {what}" + (f" during {during}" if during else ""))
        if during and not isinstance(reason, ConnectionRefusedError):
            return EngineUnreachable(
                f"the engine service at {self.url} stopped answering during {during} "
                f"({_reason(reason)}): it may have crashed or been stopped. Restart it "
                "(python -m engine serve --checkpoint DIR) and run again.")
        return EngineUnreachable(
            f"cannot reach the engine service at {self.url} ({_reason(reason)}). Start it with "
            f"`python -m engine serve --checkpoint DIR`, or unset {ENV_URL} to load the model in this process.")


def _reason(reason) -> str:
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, (http.client.RemoteDisconnected, ConnectionResetError, http.client.IncompleteRead)):
        return "the connection was closed"
    if isinstance(reason, socket.gaierror):
        return "unknown host"
    text = getattr(reason, "strerror", None) or str(reason)
    return text or type(reason).__name__


def engine_url() -> str | None:
    """The engine service URL from EXPLORER_ENGINE_URL (None when unset or blank)."""
    url = os.environ.get(ENV_URL, "").strip()
    return url or None


def attached_engine() -> RemoteEngine | None:
    """The engine service named by EXPLORER_ENGINE_URL, or None to load the model in-process.
    Raises EngineUnreachable (a readable message) when the URL is set but nobody answers."""
    url = engine_url()
    return None if url is None else _connect(url)


@lru_cache(maxsize=4)
def _connect(url: str) -> RemoteEngine:
    return RemoteEngine(url)
