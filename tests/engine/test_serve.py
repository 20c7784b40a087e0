"""The HTTP API answers a real client (requests): completions, SSE streaming, A/B with
`speculative: false`, 4xx on bad requests while serving on, queued concurrent clients, metrics."""
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import DEVICE
from provision.engine.loading import load_engine
from provision.engine.serve import make_server

PROMPT = "the quick cat watches the"


@pytest.fixture(scope="module")
def url():
    httpd = make_server(load_engine(device=DEVICE, max_seq_len=256), port=0)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def complete(url, **body):
    return requests.post(f"{url}/v1/completions", json=body, timeout=120)


def test_health_and_models(url):
    assert requests.get(f"{url}/health", timeout=10).json()["status"] == "ok"
    models = requests.get(f"{url}/v1/models", timeout=10).json()
    assert models["object"] == "list" and models["data"][0]["max_model_len"] == 256


def test_completion_greedy_ab(url):
    spec = complete(url, prompt=PROMPT, max_tokens=48, temperature=0).json()
    plain = complete(url, prompt=PROMPT, max_tokens=48, temperature=0, speculative=False).json()
    assert spec["choices"][0]["text"] == plain["choices"][0]["text"] and spec["choices"][0]["text"]
    assert spec["usage"]["completion_tokens"] == 48 and spec["usage"]["accept_length"] > 1.5
    assert plain["usage"]["accept_length"] == 1.0
    ids = complete(url, prompt=[256] + list(PROMPT.encode()), max_tokens=48, temperature=0).json()
    assert ids["choices"][0]["token_ids"] == spec["choices"][0]["token_ids"]
    sampled = complete(url, prompt=PROMPT, max_tokens=20, temperature=0.9, top_p=0.95, seed=7).json()
    assert sampled == {**sampled, "object": "text_completion"} and sampled["usage"]["completion_tokens"] <= 20


def test_streaming(url):
    whole = complete(url, prompt=PROMPT, max_tokens=40, temperature=0).json()
    r = requests.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                                     "stream": True}, stream=True, timeout=120)
    assert r.status_code == 200 and r.headers["Content-Type"] == "text/event-stream"
    events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) > 3
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["usage"]["accept_length"] > 1


@pytest.mark.parametrize("body,status,words", [
    (b"{not json", 400, "malformed JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (json.dumps({"prompt": "x", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "max_tokens": True}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x", "temperature": "hot"}).encode(), 400, "temperature"),
    (json.dumps({"prompt": "x", "stream": 1}).encode(), 400, "stream"),
    (json.dumps({"prompt": "x", "max_tokens": 100000}).encode(), 400, "max_tokens"),
    (json.dumps({"prompt": "x" * 400}).encode(), 400, "does not fit the context"),
    (json.dumps({"prompt": [1, 99999]}).encode(), 400, "token ids"),
    (json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
])
def test_bad_requests_then_serving_on(url, body, status, words):
    r = requests.post(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status and words in r.json()["error"]["message"]
    assert complete(url, prompt="the", max_tokens=2, temperature=0).status_code == 200


def test_unknown_route(url):
    assert requests.get(f"{url}/nope", timeout=10).status_code == 404
    assert requests.post(f"{url}/v1/chat", json={}, timeout=10).status_code == 404


def test_concurrent_clients_are_queued(url):
    prompts = [PROMPT, "alice helps the", "there are 3 ", "every dog finds a", "the old", "grace says that"]
    want = [complete(url, prompt=p, max_tokens=24, temperature=0).json()["choices"][0]["text"] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: complete(url, prompt=p, max_tokens=24, temperature=0), prompts * 2))
    assert [r.status_code for r in got] == [200] * len(got)
    assert [r.json()["choices"][0]["text"] for r in got] == want * 2


def test_metrics(url):
    complete(url, prompt=PROMPT, max_tokens=16, temperature=0)
    text = requests.get(f"{url}/metrics", timeout=10).text
    vals = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert int(vals["engine_requests_total"]) >= 1 and int(vals["engine_generation_tokens_total"]) >= 16
    assert int(vals["engine_speculative_steps_total"]) == int(vals['engine_accept_length_bucket{le="+Inf"}']) > 0
    assert int(vals["engine_request_errors_total"]) >= 0 and "engine_accept_length_sum" in vals
