"""The HTTP API answers real clients (requests, the official openai client): completions and chat
completions, SSE streaming, stop strings, A/B with `speculative: false`, 4xx on bad requests while
serving on, queued concurrent clients, metrics, and the server's limits (body, time, queue, connections)."""
import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from conftest import DEVICE
from provision.engine.loading import load_engine
from provision.engine.serve import make_server

PROMPT = "the quick cat watches the"


def serving(**kw):
    httpd = make_server(load_engine(device=DEVICE, dtype="float32", max_seq_len=256), port=0, **kw)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


@pytest.fixture(scope="module")
def url():
    httpd, u = serving()
    yield u
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
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and all("usage" not in c for c in chunks)
    r = requests.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                                     "stream": True, "stream_options": {"include_usage": True}},
                      stream=True, timeout=120)
    events = [line[6:] for line in r.iter_lines(decode_unicode=True) if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]         # asked for: usage null until a last chunk without choices
    assert [c["usage"] for c in chunks[:-1]] == [None] * (len(chunks) - 1) and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 40 and chunks[-1]["usage"]["accept_length"] > 1


def test_margins_of_plain_greedy(url):
    """`margins: true`: each returned token's top-1 minus top-2 logit, max |logit| and largest logits (id, gap
    below the top-1) at its step, as one forward over the prompt and the output computes them; the output itself
    is the plain greedy one."""
    body = dict(prompt=PROMPT, max_tokens=24, temperature=0, speculative=False)
    r = complete(url, margins=True, **body).json()
    m, ids = r["margins"], r["choices"][0]["token_ids"]
    plain = complete(url, **body).json()
    assert ids == plain["choices"][0]["token_ids"] and "margins" not in plain
    assert m["dtype"] == "float32" and len(m["gaps"]) == len(m["scales"]) == len(ids) == 24
    e = load_engine(device=DEVICE, dtype="float32", max_seq_len=256)
    prompt = [256] + list(PROMPT.encode())
    assert m["layers"] == e.target.args.n_layer
    with torch.inference_mode():
        logits = e._prefill(prompt + ids[:-1], False)[0, len(prompt) - 1:].float()     # [24, V]: token t's step
    top = logits.topk(4)
    assert logits.argmax(-1).tolist() == ids
    assert torch.allclose(torch.tensor(m["gaps"]), top.values[:, 0] - top.values[:, 1], atol=1e-3)
    assert torch.allclose(torch.tensor(m["scales"]), logits.abs().max(-1).values, atol=1e-3)
    assert [[c[0] for c in t] for t in m["top"]] == top.indices.tolist()
    below = torch.tensor([[c[1] for c in t] for t in m["top"]])
    assert torch.allclose(below, top.values[:, :1] - top.values, atol=1e-3) and (below[:, 1] == torch.tensor(m["gaps"])).all()


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


@pytest.fixture(scope="module")
def client(url):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_openai_client_completions_and_chat(client, url):
    openai = pytest.importorskip("openai")
    assert [m.id for m in client.models.list().data] == ["provision-tiny"]
    assert client.models.retrieve("provision-tiny").id == "provision-tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-nope")
    c = client.completions.create(model="provision-tiny", prompt=PROMPT, max_tokens=32, temperature=0)
    assert c.choices[0].text == complete(url, prompt=PROMPT, max_tokens=32, temperature=0).json()["choices"][0]["text"]
    chat = client.chat.completions.create(model="provision-tiny", messages=[{"role": "user", "content": PROMPT}],
                                          max_tokens=32, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content == c.choices[0].text
    assert chat.usage.completion_tokens == 32 and chat.choices[0].finish_reason == "length"
    parts = list(client.chat.completions.create(model="provision-tiny", max_tokens=32, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": PROMPT}]))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    assert parts[-1].choices[0].finish_reason == "length" and len(parts) > 3


def test_stop_strings(client):
    full = client.completions.create(model="provision-tiny", prompt=PROMPT, max_tokens=40, temperature=0)
    text = full.choices[0].text
    stop = text[10:13]                       # a string the greedy output is known to reach
    for stream in (False, True):
        kw = dict(model="provision-tiny", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "zzzz"])
        if stream:
            parts = list(client.completions.create(stream=True, **kw))
            got, finish = "".join(p.choices[0].text for p in parts), parts[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kw)
            got, finish = r.choices[0].text, r.choices[0].finish_reason
        assert got == text[:text.index(stop)] and finish == "stop"


@pytest.mark.parametrize("kw,name", [({"n": 2}, "n"), ({"logprobs": True}, "logprobs"),
                                     ({"presence_penalty": 0.5}, "presence_penalty")])
def test_unsupported_parameters_named(client, kw, name):
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError, match=f"unsupported parameter.*{name}"):
        client.chat.completions.create(model="provision-tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=2, **kw)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="provision-tiny", prompt="x", max_tokens=2, echo=True)


def raw(url, data: bytes, timeout=10) -> bytes:
    host, port = url.rsplit("/", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize("head,body,status", [
    (b"Content-Length: -1", b"{}", b"400"), (b"Content-Length: 1e3", b"{}", b"400"),
    (b"Content-Length: 99999999999", b"{}", b"413"), (b"X-None: 1", b"", b"411"),
])
def test_content_length_checked(url, head, body, status):
    r = raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n" + body)
    assert r.split(b" ")[1] == status


@pytest.mark.parametrize("body,words", [
    ({"prompt": "x", "seed": 2 ** 70}, "seed"),
    ({"prompt": "x", "temperature": 5}, "field 'temperature' must lie in [0, 2] (got 5)"),
    ({"prompt": "x", "temperature": -0.1}, "field 'temperature' must lie in [0, 2]"),
    ({"prompt": "x", "top_p": 0}, "field 'top_p' must lie in (0, 1]"),
    ({"prompt": "x", "max_tokens": 2, "stop": ["a"] * 5}, "stop"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": "hi"}, "messages"),
    ({"prompt": "x", "temperature": 0, "speculative": False, "margins": "yes"}, "margins"),
    ({"prompt": "x", "temperature": 0, "margins": True}, "plain greedy decoding only"),
    ({"prompt": "x", "temperature": 0.7, "speculative": False, "margins": True}, "plain greedy decoding only"),
    ({"prompt": "x", "temperature": 0, "speculative": False, "margins": True, "stream": True}, "without streaming"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 0, "speculative": False, "margins": True},
     "only on /v1/completions"),
])
def test_malformed_fields_are_4xx(url, body, words):
    """Each is refused with a 400 that names the field (temperature: OpenAI's range, 0 to 2)."""
    chat = "messages" in body
    r = requests.post(f"{url}/v1/{'chat/' if chat else ''}completions", json=body, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"]["message"]
    deep = b"[" * 100000 + b"]" * 100000
    r = requests.post(f"{url}/v1/completions", data=deep, timeout=30)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]


def test_limits_timeout_queue_connections_cancel():
    httpd, u = serving(max_queued=1, max_connections=4, read_timeout=0.5)
    try:
        assert httpd.request_queue_size >= 128
        host, port = httpd.server_address
        t0 = time.time()                                   # a client that never sends its body
        r = raw(u, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
        assert r.split(b" ")[1] == b"408" and time.time() - t0 < 5
        long = {"prompt": PROMPT, "max_tokens": 250, "temperature": 0, "stream": True, "speculative": False}
        a = requests.post(f"{u}/v1/completions", json=long, stream=True, timeout=60)
        lines = a.iter_lines()
        next(lines)                                       # the worker is busy with a
        with ThreadPoolExecutor(2) as pool:
            b = pool.submit(requests.post, f"{u}/v1/completions", json={**long, "stream": False}, timeout=60)
            time.sleep(0.2)                               # b waits in the queue (size 1)
            c = requests.post(f"{u}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
            assert c.status_code == 503 and "busy" in c.json()["error"]["message"]
            a.close()                                     # a's client goes away: its work stops
            assert b.result().status_code == 200
        text = requests.get(f"{u}/metrics", timeout=10).text
        assert "engine_requests_cancelled_total 1" in text
        idle = [socket.create_connection((host, port)) for _ in range(4)]    # every slot taken by a silent client
        time.sleep(0.1)
        assert raw(u, b"GET /health HTTP/1.0\r\n\r\n").split(b" ")[1] == b"200"   # the oldest one's slot
        for s in idle:
            s.close()
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_many_clients_at_once(url):
    with ThreadPoolExecutor(64) as pool:
        codes = list(pool.map(lambda _: requests.get(f"{url}/health", timeout=30).status_code, range(64)))
    assert codes == [200] * 64


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


def test_idle_connections_cannot_lock_out_a_new_client():
    """As many silent connections as there are slots, then a new client: it is served (a connection that has not
    sent its request gives its slot to a new one), and the silent one whose slot it took is closed."""
    httpd, u = serving()
    try:
        idle = [socket.create_connection(httpd.server_address) for _ in range(64)]
        time.sleep(0.2)
        for _ in range(3):
            r = requests.get(f"{u}/health", timeout=10)
            assert r.status_code == 200 and r.json()["status"] == "ok"
        idle[0].settimeout(10)
        assert idle[0].recv(1) == b""                     # the oldest silent connection was let go
        for s in idle:
            s.close()
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_request_dripped_byte_by_byte_meets_the_whole_request_deadline():
    """One header byte at a time, each well within the per-read timeout: the deadline for the whole request
    closes it (408) long before the client is done (without it, the drip holds its slot as long as it likes)."""
    httpd, u = serving(read_timeout=1.0)
    try:
        s = socket.create_connection(httpd.server_address)
        head = b"GET /health HTTP/1.0\r\n" + b"".join(b"X-Pad-%d: %s\r\n" % (i, b"y" * 8) for i in range(40))
        sent = 0
        try:
            for b in head:                                # 0.1 s apart: about 8 s for the whole header
                s.send(bytes([b]))
                sent += 1
                time.sleep(0.1)
        except OSError:                                   # the server closed the connection
            pass
        s.settimeout(10)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:                                   # reset: the server had closed before the last bytes
            pass
        assert sent < len(head), "the whole dripped request was read: no deadline for the request as a whole"
        assert answer == b"" or b"408" in answer, answer
        s.close()
        assert requests.get(f"{u}/health", timeout=10).status_code == 200
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_usage_and_metrics_after_a_stop_string(url):
    """A stop string ends the completion before it: completion_tokens and token_ids are those of the returned text,
    accept_length and /metrics count the verification steps up to it, and it is no cancel."""
    full = complete(url, prompt=PROMPT, max_tokens=48, temperature=0).json()["choices"][0]
    ids, text = full["token_ids"], full["text"]
    stop = text[20:23]
    kept = text.index(stop)                       # byte tokens, ASCII text: one token a character
    assert bytes(ids[:kept]).decode() == text[:kept] and kept + len(stop) < 48

    def metric(name):
        lines = requests.get(f"{url}/metrics", timeout=10).text.splitlines()
        return int(next(x for x in lines if x.startswith(name + " ")).split()[1])

    before = {m: metric(m) for m in ("engine_requests_cancelled_total", "engine_speculative_steps_total",
                                     "engine_generation_tokens_total")}
    for stream in (False, True):
        body = dict(prompt=PROMPT, max_tokens=48, temperature=0, stop=[stop])
        if stream:
            r = requests.post(f"{url}/v1/completions", json=dict(body, stream=True, stream_options={
                "include_usage": True}), stream=True, timeout=120)
            chunks = [json.loads(line[6:]) for line in r.iter_lines(decode_unicode=True)
                      if line.startswith("data: {")]
            got = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
            usage, finish = chunks[-1]["usage"], chunks[-2]["choices"][0]["finish_reason"]
        else:
            r = complete(url, **body).json()
            got, usage, finish = r["choices"][0]["token_ids"], r["usage"], r["choices"][0]["finish_reason"]
        assert finish == "stop" and got == ids[:kept], (got, ids, kept)
        assert usage["completion_tokens"] == kept, usage
        assert usage["accept_length"] > 1, usage          # the speculative steps that ran, not a 1.0 stand-in
    after = {m: metric(m) for m in before}
    assert after["engine_requests_cancelled_total"] == before["engine_requests_cancelled_total"]
    assert after["engine_generation_tokens_total"] - before["engine_generation_tokens_total"] == 2 * kept
    assert after["engine_speculative_steps_total"] > before["engine_speculative_steps_total"]


def test_stop_string_token_count_follows_the_returned_text():
    """The ids a stop string leaves are those of the returned text: each token that produced a character of it,
    the one that ends it and starts the stop string included; a token whose text is still pending (part of a
    character) goes with that character; streaming releases ids with their text."""
    from provision.engine.serve import StopText

    def run(pieces, stops):
        cut, text, ids = StopText(stops), "", []
        for i, p in enumerate(pieces):
            t, done, hit = cut.feed_token(i, p)
            text, ids = text + t, ids + done
            if hit:
                return text, ids, True
        t, done = cut.flush()
        return text + t, ids + done, False

    assert run(["Hel", "lo wo", "rld", "!"], ["o w"]) == ("Hell", [0, 1], True)        # token 1 straddles
    assert run(["Hello", " wor", "ld"], [" wor"]) == ("Hello", [0], True)              # stop at a token boundary
    assert run(["ab", "c"], ["a"]) == ("", [], True)                                     # nothing returned
    assert run(["x", "", "é", "EN", "D"], ["END"]) == ("xé", [0, 1, 2], True)           # "" : half a character
    assert run(["x", "y", ""], ["zz"]) == ("xy", [0, 1, 2], False)                      # no stop: every id
    cut = StopText(["\n\nUser"])
    assert cut.feed_token(0, "Hi") == ("", [], False)         # held back: could start the stop string
    assert cut.feed_token(1, " there, friend") == ("Hi there, f", [0, 1], False)
