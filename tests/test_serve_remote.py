"""The engine service (engine/serve/service.py, `python -m engine serve`) and its client (explorer/remote.py):
same JSON and views as the in-process engine, readable errors when the service is down or dies
mid-run, and a queue that does not let one client starve another."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from engine.run.api import EngineError, load
from engine.run.probes import LayerResult, pack_tensor, unpack_tensor
from engine.roles import role_plan
from engine.serve import service as serve
from engine.serve.service import EngineService, FairQueue, QueueFull, host_warning, make_server
from explorer import layer_views as lv
from explorer import remote
from explorer.remote import EngineBusy, EngineUnreachable, RemoteEngine
from tests.engine_helpers import tiny_config, write_tiny_checkpoint

IDS = [0] + list(range(20, 80))


def no_time(x):
    """A run's JSON without the wall-clock fields (they differ between any two runs)."""
    if isinstance(x, dict):
        return {k: no_time(v) for k, v in x.items() if k not in ("time_s", "prefill_s")}
    if isinstance(x, list):
        return [no_time(v) for v in x]
    return x


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny_serve"), 2, 2, engram_layer_ids=(),
                                 engram_num_embeddings=())


@pytest.fixture(scope="module")
def engine(checkpoint):
    return load(checkpoint)


class Served:
    """A service on a free local port, in this process."""

    def __init__(self, engine, per_client=4):
        self.service = EngineService(engine, per_client=per_client)
        self.server = make_server(self.service, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.service.start()
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.service.stop()


@pytest.fixture(scope="module")
def served(engine):
    s = Served(engine)
    yield s
    s.close()


def post(url, path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_run_endpoint_answers_the_in_process_json(served, engine):
    status, reply = post(served.url, "/run", {"ids": IDS, "layers": [5, 7, 3], "image_spans": [[4, 9]]})
    assert status == 200
    local = engine.run(IDS, layers=[5, 7, 3], image_spans=[(4, 9)]).to_json()
    assert no_time(reply["result"]) == no_time(local)
    assert set(reply["result"]["layers"]) == {"3", "5", "7"}
    assert reply["queue"]["position"] == 0 and reply["queue"]["run_s"] > 0


def test_info_and_tokenize(served, engine):
    with urllib.request.urlopen(served.url + "/info", timeout=30) as r:
        info = json.loads(r.read())
    assert info["identity"] == engine.identity and info["world_size"] == 1
    assert info["config"]["n_layers"] == 8 and len(info["plan"]) == len(engine.plan)
    assert info["plan"][7]["role"] == "reindex"
    status, reply = post(served.url, "/tokenize", {"prompt": [0, 5, 6]})
    assert status == 200 and reply == {"ids": [0, 5, 6], "tokens": ["0", "5", "6"]}


@pytest.mark.parametrize("body, status, message", [
    ({"ids": [0, 99999]}, 400, "outside the vocabulary"),
    ({"ids": [0, 1], "layers": [41]}, 400, "layer 41 does not exist"),
    ({"ids": [0, 1], "prompt": "x"}, 400, "exactly one of"),
    ({"ids": [0, 1], "colour": 3}, 400, "unknown fields ['colour']"),
])
def test_bad_runs_are_one_clear_message(served, body, status, message):
    got, reply = post(served.url, "/run", body)
    assert got == status and reply["kind"] == "EngineError" and message in reply["error"]


def test_client_gives_the_in_process_views(served, engine):
    client = RemoteEngine(served.url)
    assert client.cfg == engine.cfg and [r.to_dict() for r in client.plan] == [r.to_dict() for r in engine.plan]
    assert client.encode([0, 7]) == [0, 7] and client.token_strings([0, 7]) == ["0", "7"]
    remote_run, local_run = client.run(IDS, layers=[5, 7]), engine.run(IDS, layers=[5, 7])
    a, b = remote_run.to_json(), local_run.to_json()
    assert no_time(a) == no_time(b)
    for layer in (5, 7):
        pa, pb = lv.layer_probe(a, layer), lv.layer_probe(b, layer)
        assert lv.topk_map(lv.topk_model(a, pa)) == lv.topk_map(lv.topk_model(b, pb))
        ra, rb = lv.routing_model(a, pa, engine.cfg.n_routed_experts), lv.routing_model(b, pb, engine.cfg.n_routed_experts)
        assert lv.token_routes(ra, a["tokens"]) == lv.token_routes(rb, b["tokens"])
        assert lv.mhc_token(pa, 10) == lv.mhc_token(pb, 10)
        # .layers carries tensors, like the in-process RunResult
        la, lb = remote_run.layers[layer], local_run.layers[layer]
        assert torch.equal(la.topk, lb.topk) and torch.equal(la.candidate_pool, lb.candidate_pool)
        assert torch.equal(la.routing["experts"], lb.routing["experts"])
        torch.testing.assert_close(la.mhc["ffn"]["comb"], lb.mhc["ffn"]["comb"], rtol=0, atol=0)
    assert no_time(remote_run.to_json(layers=[7])) == no_time(local_run.to_json(layers=[7]))
    with pytest.raises(EngineError, match="outside the vocabulary"):
        client.run([0, 99999])


def test_a_run_of_every_layer_stays_on_the_service_and_comes_layer_by_layer(engine, monkeypatch):
    monkeypatch.setattr(serve, "KEPT_RUNS", 2)
    s = Served(engine)
    try:
        client = RemoteEngine(s.url)
        asked: list[list[int]] = []
        fetch = client.probes
        monkeypatch.setattr(client, "probes", lambda run_id, layers: asked.append(list(layers)) or fetch(run_id, layers))
        remote_run, local_run = client.run(IDS), engine.run(IDS)      # every layer, as the app asks
        assert remote_run._data["layers"] == {} and len(s.service.kept) == 1   # nothing moved yet
        # a click: one layer (and the one it borrows from) comes over, equal to the in-process probes
        assert no_time(remote_run.to_json(layers=[7, 5])) == no_time(local_run.to_json(layers=[7, 5]))
        assert no_time(remote_run.to_json(layers=[5])) == no_time(local_run.to_json(layers=[5]))
        assert asked == [[7, 5]]                                   # layer 5 was not fetched twice
        # the service drops the oldest runs; a click on a new layer then runs the prompt again
        client.run(IDS[:20], layers=None)
        client.run(IDS[:30], layers=None)
        assert len(s.service.kept) == 2 and remote_run._data["run_id"] not in s.service.kept
        assert no_time(remote_run.to_json(layers=[3])) == no_time(local_run.to_json(layers=[3]))
        assert remote_run._data["run_id"] in s.service.kept
        assert torch.equal(remote_run.layers[6].topk, local_run.layers[6].topk)     # .layers fetches the rest
        assert no_time(remote_run.to_json()) == no_time(local_run.to_json())
        # /probes without "packed" answers plain JSON, the same probes
        status, reply = post(s.url, "/probes", {"run_id": remote_run._data["run_id"], "layers": [4]})
        assert status == 200 and no_time(reply["layers"]) == no_time(local_run.to_json(layers=[4])["layers"])
        # /probes: bad requests and a dropped run are clear answers
        status, reply = post(s.url, "/probes", {"run_id": "nope", "layers": [3]})
        assert status == 404 and reply["kind"] == "RunGone" and "last 2" in reply["error"]
        status, reply = post(s.url, "/probes", {"run_id": remote_run._data["run_id"], "layers": "3"})
        assert status == 400 and "list of layer numbers" in reply["error"]
        status, reply = post(s.url, "/probes", {"run_id": remote_run._data["run_id"], "layers": [3, 99]})
        assert status == 400 and "no probes of layers [99]" in reply["error"]
        status, reply = post(s.url, "/run", {"ids": IDS, "keep": "yes"})
        assert status == 400 and "'keep' must be true or false" in reply["error"]
    finally:
        s.close()


@pytest.mark.parametrize("tensor", [
    torch.randn(5, 3), torch.tensor([[3, -1], [2**40, 0]]), torch.tensor([[3, -1], [7, 0]]), torch.rand(33, 7) > 0.5,
    torch.randn(4, 2).bfloat16(), torch.zeros(0, 4, dtype=torch.long), torch.tensor([float("-inf"), float("nan"), 2.5]),
])
def test_packed_tensors_come_back_equal(tensor):
    packed = json.loads(json.dumps(pack_tensor(tensor)))     # through JSON, as on the wire
    back = unpack_tensor(packed)
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back.isnan(), tensor.isnan()) if tensor.is_floating_point() else True
    assert torch.equal(torch.nan_to_num(back.float(), nan=7.0), torch.nan_to_num(tensor.float(), nan=7.0))


@pytest.mark.parametrize("tensor", [
    torch.randn(6, 5), torch.randint(-9, 9, (4, 3)), torch.randn(3, 2).bfloat16(), torch.randn(2, 2, dtype=torch.float64),
    torch.rand(3, 4) > 0.5, torch.zeros(0, 2),
])
def test_probe_json_is_torchs_own_tolist(tensor):
    from engine.run.probes import _finite, _plain
    assert json.dumps(_plain(tensor)) == json.dumps(tensor.tolist())
    if tensor.is_floating_point() and tensor.numel():
        padded = tensor.float().clone()
        padded[0, -1], padded[-1, 0] = float("-inf"), float("nan")
        want = padded.tolist()
        want[0][-1] = want[-1][0] = None
        assert _finite(padded) == want


def test_a_layer_on_the_wire_is_the_same_layer(engine):
    run = engine.run(IDS)
    for layer, result in run.layers.items():
        wire = json.loads(json.dumps(result.to_wire()))
        assert no_time(LayerResult.from_wire(wire).to_json()) == no_time(result.to_json()), layer
    packed = len(json.dumps(run.layers[7].to_wire()))
    assert packed < len(json.dumps(run.layers[7].to_json()))


def test_unreachable_service_is_a_clear_message(monkeypatch):
    with pytest.raises(EngineUnreachable, match=r"cannot reach the engine service at http://127.0.0.1:9 "
                                                 r"\(connection refused\)"):
        RemoteEngine("127.0.0.1:9")
    monkeypatch.delenv(remote.ENV_URL, raising=False)
    assert remote.attached_engine() is None
    monkeypatch.setenv(remote.ENV_URL, "http://127.0.0.1:9")
    with pytest.raises(EngineUnreachable, match="unset EXPLORER_ENGINE_URL"):
        remote.attached_engine()


def test_attached_engine_from_the_env(served, monkeypatch):
    monkeypatch.setenv(remote.ENV_URL, served.url + "/")
    attached = remote.attached_engine()
    assert isinstance(attached, RemoteEngine) and attached.url == served.url


def test_engine_killed_mid_run_gives_a_clear_message(checkpoint):
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--checkpoint", str(checkpoint), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("engine service on http://127.0.0.1:"), line + proc.stderr.read()
        url = line.split()[3]
        client = RemoteEngine(url)
        outcome = {}

        def long_run():
            try:
                client.run(list(range(5, 300)) * 8, layers=[7])
            except Exception as err:  # what the app would show
                outcome["error"] = err

        worker = threading.Thread(target=long_run)
        worker.start()
        deadline = time.monotonic() + 60
        while not client.health()["queue"]["running"]:
            assert time.monotonic() < deadline, "the run never started"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        # SIGKILL is delivered asynchronously: until the process is gone its listening socket still
        # accepts (and then drops) connections, so the "refused" check below waits for it
        proc.wait(timeout=30)
        worker.join(60)
        err = outcome["error"]
        assert isinstance(err, EngineUnreachable)
        assert "stopped answering during the run" in str(err) and "Traceback" not in str(err)
        with pytest.raises(EngineUnreachable, match="connection refused"):
            client.run(IDS)
    finally:
        proc.kill()
        proc.wait()


# -- the queue ----------------------------------------------------------------------------------------

class GatedEngine:
    """Stands in for an engine: each run records its order and waits for the test to let it finish."""

    def __init__(self):
        self.cfg = tiny_config()
        self.plan = role_plan(self.cfg)
        self.identity, self.source, self.tokenizer, self.numerics = "gated", "test", None, "fp32"
        self.order: list[str] = []
        self.gate = threading.Semaphore(0)

    def encode(self, prompt):
        return list(prompt)

    def check_layers(self, layers):
        return layers

    def token_strings(self, ids):
        return [str(i) for i in ids]

    def run(self, prompt, **_):
        self.order.append(f"{prompt[0]}")
        assert self.gate.acquire(timeout=30)
        return type("R", (), {"to_json": lambda self, layers=None: {"tag": prompt[0]}, "layers": {}, "logits": None})()


def test_one_client_with_many_runs_does_not_starve_another():
    fake = GatedEngine()
    s = Served(fake, per_client=3)
    try:
        greedy, polite = RemoteEngine(s.url, client_id="greedy"), RemoteEngine(s.url, client_id="polite")
        replies, errors = {}, []

        def submit(client, tag):
            try:
                replies[tag] = client.run([tag])
            except EngineBusy as err:
                errors.append(str(err))

        threads = []
        for n, tag in enumerate([101, 102, 103, 104]):
            threads.append(threading.Thread(target=submit, args=(greedy, tag)))
            threads[-1].start()
            # let the service register each one before the next: 101 runs, 102-104 wait
            while s.service.queue.snapshot()["waiting"] + s.service.queue.snapshot()["running"] < n + 1:
                time.sleep(0.005)
        over = threading.Thread(target=submit, args=(greedy, 105))  # a 4th waiting run: over the cap
        over.start()
        over.join(10)
        assert errors and "at most 3 per client" in errors[0] and "busy" in errors[0]
        threads.append(threading.Thread(target=submit, args=(polite, 201)))
        threads[-1].start()
        while s.service.queue.snapshot()["waiting"] < 4:
            time.sleep(0.005)
        for _ in range(5):
            fake.gate.release()
        for t in threads:
            t.join(30)
        # round-robin: greedy's running run, one more of greedy's, then polite's; not after all of greedy's
        assert fake.order == ["101", "102", "201", "103", "104"]
        assert replies[201].queue["position"] == 2 and replies[201].to_json() == {"tag": 201}
        assert replies[104].queue["position"] == 3
    finally:
        for _ in range(5):
            fake.gate.release()
        s.close()


def test_fair_queue_positions_and_turns():
    q = FairQueue(per_client=5)
    a = [q.submit("a", {"n": i}) for i in range(3)]
    b = [q.submit("b", {"n": i}) for i in range(2)]
    c = q.submit("c", {})
    assert [t.position for t in a] == [0, 1, 2]
    assert [t.position for t in b] == [1, 3]  # after a's first; then after a's second
    assert c.position == 2
    served = [q.next(0) for _ in range(6)]
    assert [(t.client, t.request.get("n")) for t in served] == [
        ("a", 0), ("b", 0), ("c", None), ("a", 1), ("b", 1), ("a", 2)]
    assert q.next(0) is None
    q2 = FairQueue(per_client=1)
    q2.submit("a", {})
    with pytest.raises(QueueFull, match="at most 1 per client"):
        q2.submit("a", {})


def test_listening_beyond_this_machine_warns():
    assert host_warning("127.0.0.1") is None and host_warning("localhost") is None
    assert "anyone who can reach this machine" in host_warning("0.0.0.0")


def test_cli_serve_bad_arguments_are_one_line(checkpoint, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "engine", "serve", "--checkpoint", str(tmp_path / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no such checkpoint folder" in proc.stderr and "Traceback" not in proc.stderr


# -- numerics, prefill, replay and logits through the service (issues 15 and 20) ------------------------

def test_info_and_the_client_say_which_numerics_the_service_runs(served, engine):
    with urllib.request.urlopen(served.url + "/info", timeout=30) as r:
        info = json.loads(r.read())
    assert info["numerics"] == engine.numerics == "reference"
    assert RemoteEngine(served.url).numerics == "reference"


def test_ced_prefill_replay_and_logits_pass_through(served, engine):
    """A CED run asked over HTTP and through the client equals the in-process one: the same JSON
    (prefill, replay, the decoder's first_position), the same logits bits."""
    local = engine.run(IDS, layers=[3, 7], prefill="ced", replay=12, generate=2, logits=True)
    assert local.prefill == "ced" and local.layers[7].first_position == len(IDS) - 12
    status, reply = post(served.url, "/run", {"ids": IDS, "layers": [3, 7], "prefill": "ced", "replay": 12,
                                              "generate": 2, "logits": True})
    assert status == 200
    packed = reply["result"].pop("logits")
    assert torch.equal(unpack_tensor(packed), local.logits)
    assert no_time(reply["result"]) == no_time(local.to_json())
    client = RemoteEngine(served.url)
    got = client.run(IDS, layers=[3, 7], prefill="ced", replay=12, generate=2, logits=True)
    assert got.prefill == "ced" and got.replay == 12 and got.numerics == "reference"
    assert torch.equal(got.logits, local.logits) and got.logits.shape == (12, engine.cfg.vocab_size)  # ced: the replay's rows
    assert no_time(got.to_json()) == no_time(local.to_json())
    assert got.layers[7].first_position == len(IDS) - 12 and got.layers[3].first_position == 0
    # a kept run (every layer) carries them too; without asking, no logits come
    kept = client.run(IDS, prefill="ced", replay=12, logits=True)
    assert torch.equal(kept.logits, local.logits) and kept.to_json()["replay"] == 12
    assert torch.equal(kept.layers[7].topk, local.layers[7].topk)
    plain = client.run(IDS, layers=[3])
    assert plain.logits is None and plain.prefill == "full" and plain.replay is None


@pytest.mark.parametrize("body, message", [
    ({"ids": IDS, "prefill": "half"}, "'prefill' must be one of ['full', 'ced']"),
    ({"ids": IDS, "prefill": "ced", "replay": 0}, "'replay' must be a whole number"),
    ({"ids": IDS, "prefill": "ced", "replay": True}, "'replay' must be a whole number"),
    ({"ids": IDS, "replay": 8}, "'replay' applies only to"),
    ({"ids": IDS, "logits": "yes"}, "'logits' must be true or false"),
])
def test_bad_prefill_replay_or_logits_fields_are_one_clear_message(served, body, message):
    status, reply = post(served.url, "/run", body)
    assert status == 400 and reply["kind"] == "EngineError" and message in reply["error"], reply


def test_cli_serve_numerics(checkpoint):
    """`python -m engine serve --numerics fp32` serves fp32 numerics and says so (banner, /info, runs)."""
    proc = subprocess.Popen([sys.executable, "-m", "engine", "serve", "--checkpoint", str(checkpoint), "--port", "0",
                             "--numerics", "fp32"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("engine service on http://127.0.0.1:") and "fp32 numerics" in line, line
        client = RemoteEngine(line.split()[3])
        assert client.numerics == "fp32" and client.info["numerics"] == "fp32"
        assert client.run(IDS[:10], layers=[2]).numerics == "fp32"
    finally:
        proc.kill()
        proc.wait()


def test_the_serving_prefill_comparison_runs_through_the_client(served, engine):
    """What the app's serving-prefill switch asks (explorer/screens/serving_prefill.py): a full run probed
    at its generated tokens, then a CED run teacher-forced on them; through the client as in process."""
    kw = dict(layers=[7], probes=("topk", "routing"), generated_probes=True)
    client = RemoteEngine(served.url)
    full, local_full = client.run(IDS, generate=3, **kw), engine.run(IDS, generate=3, **kw)
    assert no_time(full.to_json()) == no_time(local_full.to_json()) and full.to_json()["generated_layers"]
    ced = client.run(IDS, prefill="ced", replay=8, continuation=full.generated_ids, **kw)
    local = engine.run(IDS, prefill="ced", replay=8, continuation=local_full.generated_ids, **kw)
    assert no_time(ced.to_json()) == no_time(local.to_json()) and ced.to_json()["generated_layers"]["7"]["topk"]
    status, reply = post(served.url, "/run", {"ids": IDS, "continuation": "1,2"})
    assert status == 400 and "'continuation' must be a list of token ids" in reply["error"]
    status, reply = post(served.url, "/run", {"ids": IDS, "generated_probes": 1})
    assert status == 400 and "'generated_probes' must be true or false" in reply["error"]
