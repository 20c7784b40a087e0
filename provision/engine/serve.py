"""The OpenAI-compatible HTTP API (stdlib): /v1/completions and /v1/chat/completions (SSE streaming, stop
strings), /v1/models[/{id}], /health, /metrics. Bounded connections and queue; a whole request (headers and
body) must arrive within the read time, and a connection still sending its request gives its slot to a new one
when all are taken. Handler threads validate and queue; one worker owns the model.
    python -m provision.engine.serve [--model DIR] [--draft DIR] [--port N] [--device cuda]"""
from __future__ import annotations

import argparse
import json
import os
import queue
import select
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .errors import EngineError
from .generate import Engine

MAX_BODY = 1 << 20
READ_TIMEOUT = 30.0         # seconds a client may take to send its whole request (headers and body)
MAX_CONNECTIONS = 64        # concurrent connections handled; more are answered 503 at once
MAX_QUEUED = 32             # requests waiting for the model; more are answered 503
BACKLOG = 1024              # listen backlog: bursts wait in the kernel instead of being reset
MAX_STOP = 4
FIELDS = {  # request field → accepted types (bool is excluded from numbers below)
    "prompt": (str, list), "messages": (list,), "max_tokens": (int,), "max_completion_tokens": (int,),
    "temperature": (int, float), "top_p": (int, float), "stream": (bool,), "speculative": (bool,),
    "seed": (int, type(None)), "model": (str,), "stop": (str, list, type(None)), "n": (int,),
    "logprobs": (bool, int, type(None)), "echo": (bool,), "top_logprobs": (int, type(None)),
    "best_of": (int,), "presence_penalty": (int, float), "frequency_penalty": (int, float),
    "stream_options": (dict, type(None)), "user": (str,), "margins": (bool,),
}
# accepted only at their neutral value; anything else is refused by name
NEUTRAL = {"n": (1,), "logprobs": (None, False, 0), "echo": (False,), "top_logprobs": (None, 0), "best_of": (1,),
           "presence_penalty": (0,), "frequency_penalty": (0,), "tools": (None, []), "tool_choice": (None, "none"),
           "response_format": (None, {"type": "text"}), "logit_bias": (None, {}), "functions": (None, [])}


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _depth_ok(body: bytes, limit: int = 64) -> bool:
    """JSON nesting at most `limit` deep (brackets inside strings may over-count: still bounded)."""
    depth = 0
    for c in body:
        if c in b"[{":
            depth += 1
            if depth > limit:
                return False
        elif c in b"]}":
            depth -= 1
    return True


class StopText:
    """Cuts generated text at the first stop string; holds back a possible stop prefix while streaming. Fed token
    by token, it also says which ids the text sent so far accounts for: each token that produced at least one
    character of it (a token that ends the kept text and starts the stop string counts; later ones do not)."""

    def __init__(self, stops: list):
        self.stops, self.text, self.sent = stops, "", 0
        self.hold = max((len(x) for x in stops), default=1) - 1
        self.held: list = []             # (id, where its text starts) of tokens none of whose text is sent yet

    def feed(self, delta: str) -> tuple[str, bool]:
        """New text safe to emit, and whether a stop string was reached."""
        self.text += delta
        hits = [i for i in (self.text.find(x, max(self.sent - len(x), 0)) for x in self.stops) if i >= 0]
        if hits:
            out, self.sent = self.text[self.sent:min(hits)], min(hits)
            return out, True
        safe = max(len(self.text) - self.hold, self.sent)
        out, self.sent = self.text[self.sent:safe], safe
        return out, False

    def feed_token(self, tid: int, piece: str) -> tuple[str, list, bool]:
        """One token and its text → (new text safe to emit, the ids it accounts for, stop string reached)."""
        self.held.append((tid, len(self.text)))
        out, hit = self.feed(piece)
        n = sum(1 for _, start in self.held if start < self.sent)
        ids, self.held = [t for t, _ in self.held[:n]], [] if hit else self.held[n:]
        return out, ids, hit

    def flush(self) -> tuple[str, list]:
        """The rest of the text and of the ids (no stop string came)."""
        out, ids, self.sent, self.held = self.text[self.sent:], [t for t, _ in self.held], len(self.text), []
        return out, ids


class Metrics:
    """Counters and the acceptance-length histogram, rendered as Prometheus text."""

    def __init__(self, max_accept: int):
        self.lock = threading.Lock()
        self.c = {"requests": 0, "errors": 0, "cancelled": 0, "prompt_tokens": 0, "generation_tokens": 0,
                  "spec_steps": 0}
        self.buckets = list(range(1, max_accept + 1))
        self.hist = [0] * len(self.buckets)
        self.hist_sum = 0

    def record(self, prompt: int, generated: int, accepts: list):
        with self.lock:
            self.c["requests"] += 1
            self.c["prompt_tokens"] += prompt
            self.c["generation_tokens"] += generated
            self.c["spec_steps"] += len(accepts)
            for a in accepts:
                self.hist_sum += a
                for i, b in enumerate(self.buckets):
                    self.hist[i] += a <= b

    def error(self):
        with self.lock:
            self.c["errors"] += 1

    def cancel(self):
        with self.lock:
            self.c["cancelled"] += 1

    def render(self, queued: int) -> str:
        with self.lock:
            c, n = dict(self.c), self.c["spec_steps"]
            lines = []
            for key, name, help_ in (("requests", "engine_requests_total", "completed requests"),
                                     ("errors", "engine_request_errors_total", "rejected or failed requests"),
                                     ("cancelled", "engine_requests_cancelled_total",
                                      "requests stopped because their client went away"),
                                     ("prompt_tokens", "engine_prompt_tokens_total", "prompt tokens processed"),
                                     ("generation_tokens", "engine_generation_tokens_total", "tokens generated"),
                                     ("spec_steps", "engine_speculative_steps_total", "verification steps")):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {c[key]}"]
            lines += ["# HELP engine_queue_depth requests waiting for the model", "# TYPE engine_queue_depth gauge",
                      f"engine_queue_depth {queued}",
                      "# HELP engine_accept_length tokens emitted per speculative step (accepted, bonus included)",
                      "# TYPE engine_accept_length histogram"]
            lines += [f'engine_accept_length_bucket{{le="{b}"}} {h}' for b, h in zip(self.buckets, self.hist)]
            lines += [f'engine_accept_length_bucket{{le="+Inf"}} {n}', f"engine_accept_length_sum {self.hist_sum}",
                      f"engine_accept_length_count {n}"]
        return "\n".join(lines) + "\n"


class Job:
    def __init__(self, ids, params):
        self.ids, self.params = ids, params
        self.out: queue.Queue = queue.Queue()     # lists of ids, then ("done", stats) or ("error", exc)
        self.stats: list = []                     # accept length of each verification step, as the engine runs
        self.steps: list = []                     # per list of ids sent: verification steps done by then
        self.cancelled = False                    # stop computing: the client went away, or ...
        self.finished = False                     # ... the answer is complete (a stop string): not a cancel


class Service:
    """The bounded queue and the single model worker."""

    def __init__(self, engine: Engine, name: str = "provision-tiny", max_queued: int = MAX_QUEUED):
        self.engine, self.name = engine, name
        self.jobs: queue.Queue = queue.Queue(maxsize=max_queued)
        self.metrics = Metrics(engine.max_emit)
        self.created = int(time.time())
        threading.Thread(target=self._work, daemon=True, name="engine-worker").start()

    def _work(self):
        while True:
            job = self.jobs.get()
            stats = job.stats
            if job.cancelled:                               # abandoned while it waited
                self.metrics.cancel()
                continue
            try:
                for chunk in self.engine.stream(job.ids, stats=stats, **job.params):
                    if job.cancelled:                       # its client went away (or it ended on a stop string)
                        if not job.finished:
                            self.metrics.cancel()
                        break
                    job.steps.append(len(stats))
                    job.out.put(chunk)
                job.out.put(("done", stats))
            except Exception as e:  # reported to the waiting handler, the worker keeps serving
                job.out.put(("error", e))

    def submit(self, ids, params) -> Job:
        job = Job(ids, params)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise BadRequest(503, f"server busy: {self.jobs.maxsize} requests already wait for the model") from None
        return job

    def model_card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "provision",
                "max_model_len": self.engine.max_seq_len}

    def parse(self, body: bytes, chat: bool = False):
        """Request body → (prompt ids, engine params, stream, stop strings); BadRequest on anything malformed."""
        if not _depth_ok(body):
            raise BadRequest(400, "malformed JSON: nested more than 64 levels deep")
        try:
            req = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            raise BadRequest(400, f"malformed JSON: {e}") from None
        if not isinstance(req, dict):
            raise BadRequest(400, "the request body must be a JSON object")
        for k, types in FIELDS.items():
            v = req.get(k)
            if k in req and (not isinstance(v, types) or (isinstance(v, bool) and bool not in types)):
                raise BadRequest(400, f"field {k!r} has the wrong type ({type(v).__name__})")
        bad = sorted(k for k, ok in NEUTRAL.items() if k in req and req[k] not in ok)
        if bad:
            raise BadRequest(400, f"unsupported parameter(s): {', '.join(bad)} (this server returns one choice, "
                                  "without logprobs, echo, penalties or tools)")
        if "model" in req and req["model"] != self.name:
            raise BadRequest(404, f"model {req['model']!r} not found (this server serves {self.name!r})")
        ids = self._chat_ids(req) if chat else self._prompt_ids(req)
        S = self.engine.max_seq_len
        V = self.engine.target.args.vocab_size
        if not all(0 <= i < V for i in ids):
            raise BadRequest(400, f"prompt token ids must lie in [0, {V})")
        if len(ids) >= S:
            raise BadRequest(400, f"prompt of {len(ids)} tokens does not fit the context of {S} tokens")
        mt = req.get("max_completion_tokens", req.get("max_tokens", 16 if not chat else S - len(ids)))
        if not 1 <= mt <= S:
            raise BadRequest(400, f"max_tokens must lie in [1, {S}]")
        t, tp = float(req.get("temperature", 1.0)), float(req.get("top_p", 1.0))
        if not 0.0 <= t <= 2.0:
            raise BadRequest(400, f"field 'temperature' must lie in [0, 2] (got {t:g})")
        if not 0.0 < tp <= 1.0:
            raise BadRequest(400, f"field 'top_p' must lie in (0, 1] (got {tp:g})")
        seed = req.get("seed")
        if seed is not None and not 0 <= seed < 2 ** 63:
            raise BadRequest(400, "seed must lie in [0, 2^63)")
        stop = req.get("stop")
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if len(stop) > MAX_STOP or not all(isinstance(x, str) and 0 < len(x) <= 256 for x in stop):
            raise BadRequest(400, f"stop must be a string or a list of at most {MAX_STOP} non-empty strings")
        if stop and self.engine.tokenizer is None:
            raise BadRequest(400, "this model has no tokenizer: stop strings cannot be matched")
        opts = req.get("stream_options") or {}
        if opts and (not req.get("stream", False) or set(opts) - {"include_usage"}
                     or not isinstance(opts.get("include_usage", False), bool)):
            raise BadRequest(400, "stream_options: only {\"include_usage\": true|false}, and only with stream: true")
        params = {"max_new_tokens": mt, "temperature": t, "top_p": tp,
                  "speculative": req.get("speculative", True), "seed": seed}
        if req.get("margins"):
            self._check_margins(req, chat, t)
            params["margins"] = []          # filled by the engine, a margin per token (Engine.stream)
        stream = "usage" if opts.get("include_usage") else req.get("stream", False)
        return ids, params, stream, stop

    def _check_margins(self, req, chat: bool, temperature: float):
        """`margins: true` asks a plain greedy completion for each token's top-1 minus top-2 logit."""
        if chat or req.get("stream", False):
            raise BadRequest(400, "margins: only on /v1/completions without streaming")
        if temperature > 0 or (req.get("speculative", True) and self.engine.draft is not None):
            raise BadRequest(400, "margins: reported for plain greedy decoding only (send temperature 0 and "
                                  "speculative false)")

    def margins_report(self, margins: list, n: int) -> dict:
        """The response's `margins`: the model's dtype and layers; per returned token its top-2 gap, max |logit|,
        and the largest logits' [id, gap below the top-1 logit]."""
        t, m = self.engine.target, margins[:n]
        return {"dtype": str(t.output.weight.dtype).removeprefix("torch."), "layers": t.args.n_layer,
                "gaps": [x[0] for x in m], "scales": [x[1] for x in m], "top": [[list(c) for c in x[2]] for x in m]}

    def _prompt_ids(self, req) -> list:
        if "prompt" not in req:
            raise BadRequest(400, "field 'prompt' is required")
        tok, p = self.engine.tokenizer, req["prompt"]
        if isinstance(p, list):
            if len(p) == 1 and isinstance(p[0], str):
                p = p[0]
            elif not p or not all(isinstance(i, int) and not isinstance(i, bool) for i in p):
                raise BadRequest(400, "field 'prompt' must be a string or a non-empty list of token ids")
        if isinstance(p, str):
            if tok is None:
                raise BadRequest(400, "this model has no tokenizer: send 'prompt' as token ids")
            return tok.encode(p)
        return p

    def _chat_ids(self, req) -> list:
        msgs = req.get("messages")
        if not msgs:
            raise BadRequest(400, "field 'messages' is required (a non-empty list)")
        tmpl = getattr(self.engine.tokenizer, "chat_template", None)
        if tmpl is None:
            raise BadRequest(400, "this model has no chat template: use /v1/completions")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(400, f"messages[{i}] must be an object with a string 'role'")
            c = m.get("content")
            if isinstance(c, list):                     # content parts: text only
                if not all(isinstance(x, dict) and x.get("type") == "text" and isinstance(x.get("text"), str)
                           for x in c):
                    raise BadRequest(400, f"messages[{i}].content: only text parts are supported")
                c = "".join(x["text"] for x in c)
            if not isinstance(c, str):
                raise BadRequest(400, f"messages[{i}].content must be a string or a list of text parts")
            clean.append({"role": m["role"], "content": c})
        try:
            text = tmpl.render(clean, add_generation_prompt=True)
        except EngineError as e:
            raise BadRequest(400, str(e)) from None
        return self.engine.tokenizer.encode_chat(text)


class Handler(BaseHTTPRequestHandler):
    service: Service
    server_version = "provision-engine/0.2"
    protocol_version = "HTTP/1.0"
    timeout = READ_TIMEOUT           # per-connection socket timeout (StreamRequestHandler applies it)

    def log_message(self, fmt, *args):  # quiet; errors still reach stderr via send_error paths
        pass

    def _send(self, status: int, body, ctype="application/json"):
        data = (json.dumps(body) if ctype == "application/json" else body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str):
        self.service.metrics.error()
        kind = {404: "not_found_error", 503: "server_busy"}.get(status,
                                                              "invalid_request_error" if status < 500 else "server_error")
        self._send(status, {"error": {"message": message, "type": kind, "code": status}})

    def send_error(self, code, message=None, explain=None):
        """A request its deadline cut short (or whose slot a new client took) is answered 408, whatever the
        parser made of the bytes that had come (a request line cut in two reads as bad syntax)."""
        if code == 400 and self.connection in self.server.cut:
            code, message = 408, f"request not received within {self.server.read_timeout:g} s"
        super().send_error(code, message, explain)

    def _received(self) -> bool:
        """The whole request is in (or its time ran out: 408 sent): from here the connection keeps its slot."""
        if not self.server.received(self.connection):
            self._error(408, f"request not received within {self.server.read_timeout:g} s")
            return False
        return True

    def do_GET(self):
        svc = self.service
        if not self._received():
            return
        if self.path == "/health":
            self._send(200, {"status": "ok", "queued": svc.jobs.qsize()})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [svc.model_card()]})
        elif self.path.startswith("/v1/models/"):
            mid = urllib.parse.unquote(self.path[len("/v1/models/"):])
            if mid == svc.name:
                self._send(200, svc.model_card())
            else:
                self._error(404, f"model {mid!r} not found")
        elif self.path == "/metrics":
            self._send(200, svc.metrics.render(svc.jobs.qsize()), "text/plain; version=0.0.4")
        else:
            self._error(404, f"no route GET {self.path}")

    def _read_body(self) -> bytes:
        raw = self.headers.get("Content-Length")
        if raw is None:
            raise BadRequest(411, "Content-Length is required")
        if not raw.strip().isdigit():
            raise BadRequest(400, f"bad Content-Length {raw[:40]!r}")
        n = int(raw)
        if n > MAX_BODY:
            raise BadRequest(413, f"request body over {MAX_BODY} bytes")
        try:
            body = self.rfile.read(n)
        except (TimeoutError, OSError):
            raise BadRequest(408, f"request body not received within {self.timeout:g} s") from None
        if not self.server.received(self.connection):
            raise BadRequest(408, f"request not received within {self.server.read_timeout:g} s")
        if len(body) != n:
            raise BadRequest(400, f"request body ended after {len(body)} of {n} bytes")
        return body

    def do_POST(self):
        chat = self.path == "/v1/chat/completions"
        if self.path != "/v1/completions" and not chat:
            return self._error(404, f"no route POST {self.path}") if self._received() else None
        try:
            ids, params, stream, stop = self.service.parse(self._read_body(), chat)
            job = self.service.submit(ids, params)
        except BadRequest as e:
            return self._error(e.status, str(e))
        try:
            if stream:
                self._stream(job, chat, stop, with_usage=stream == "usage")
            else:
                self._complete(job, chat, stop)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
        finally:
            job.cancelled = True                 # finished, failed or abandoned: the worker stops either way

    # ---- generation ------------------------------------------------------------------------
    def _gone(self) -> bool:
        """The client closed its side (readable with nothing to read)."""
        try:
            r, _, _ = select.select([self.connection], [], [], 0)
            return bool(r) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _pieces(self, job, stop: list):
        """(text delta, new ids) while generating; returns (finish reason, ids, stats). A stop string ends it before
        the stop string: the ids and their count are those of the returned text (StopText.feed_token), the
        verification steps those up to the token that completed the stop string."""
        tok = self.service.engine.tokenizer
        dec = tok.stream_decoder() if tok else (lambda ids: "")
        cut, out, sent = StopText(stop), [], 0
        while True:
            try:
                item = job.out.get(timeout=0.25)
            except queue.Empty:
                if self._gone():
                    job.cancelled = True
                    raise BrokenPipeError("client went away")
                continue
            if isinstance(item, tuple):
                if item[0] == "error":
                    raise item[1]
                tail, ids = cut.flush()
                out.extend(ids)
                if tail or ids:
                    yield tail, ids
                return self._finish(out), out, item[1]
            steps, sent = job.steps[sent], sent + 1
            if not stop:
                out.extend(item)
                yield cut.feed(dec(item))[0], item
                continue
            text, ids = [], []
            for t in item:
                piece, done, hit = cut.feed_token(t, dec([t]))
                text.append(piece)
                ids += done
                if hit:
                    job.finished = job.cancelled = True      # complete: the worker stops, not a cancel
                    out.extend(ids)
                    if "".join(text) or ids:
                        yield "".join(text), ids
                    return "stop", out, job.stats[:steps]
            out.extend(ids)
            if "".join(text) or ids:
                yield "".join(text), ids

    def _finish(self, out):
        return "stop" if out and out[-1] in self.service.engine.stop_ids else "length"

    def _usage(self, job, out, stats):
        u = {"prompt_tokens": len(job.ids), "completion_tokens": len(out), "total_tokens": len(job.ids) + len(out),
             "accept_length": round(sum(stats) / len(stats), 4) if stats else 1.0}
        self.service.metrics.record(len(job.ids), len(out), stats)
        return u

    def _envelope(self, cid, chat, choice, usage=None, chunk=False):
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        b = {"id": cid, "object": obj, "created": int(time.time()), "model": self.service.name,
             "choices": [{"index": 0, **choice}]}
        if usage is not None:
            b["usage"] = usage
        return b

    def _complete(self, job, chat, stop):
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        text, gen = [], self._pieces(job, stop)
        try:
            while True:
                text.append(next(gen)[0])
        except StopIteration as done:
            finish, out, stats = done.value
        except EngineError as e:
            return self._error(400, str(e))
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as e:  # a bug: answer 500, keep serving
            return self._error(500, f"{type(e).__name__}: {e}")
        body = "".join(text)
        choice = ({"message": {"role": "assistant", "content": body}, "logprobs": None, "finish_reason": finish}
                  if chat else {"text": body, "token_ids": out, "logprobs": None, "finish_reason": finish})
        resp = self._envelope(cid, chat, choice, self._usage(job, out, stats))
        if "margins" in job.params:
            resp["margins"] = self.service.margins_report(job.params["margins"], len(out))
        self._send(200, resp)

    def _stream(self, job, chat, stop, with_usage: bool = False):
        cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        piece = (lambda text, ids, fin: {"delta": {"content": text} if text else {}, "logprobs": None,
                                         "finish_reason": fin}) if chat else \
            (lambda text, ids, fin: {"text": text, "token_ids": ids, "logprobs": None, "finish_reason": fin})
        def chunk(choice):     # asked for usage: every chunk says `usage: null` until the last (OpenAI's shape)
            b = self._envelope(cid, chat, choice, chunk=True)
            return dict(b, usage=None) if with_usage else b

        if chat:
            self._event(chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}))
        gen = self._pieces(job, stop)
        try:
            while True:
                text, ids = next(gen)
                self._event(chunk(piece(text, ids, None)))
        except StopIteration as done:
            finish, out, stats = done.value
        except (BrokenPipeError, ConnectionResetError):
            raise
        except Exception as e:
            self.service.metrics.error()
            self._event({"error": {"message": str(e), "type": "server_error"}})
            return
        usage = self._usage(job, out, stats)      # recorded in /metrics either way; sent when asked for
        self._event(chunk(piece("", [], finish)))
        if with_usage:       # OpenAI's stream_options.include_usage: a last chunk with no choices and the usage
            self._event(dict(self._envelope(cid, chat, {}, usage, chunk=True), choices=[]))
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()

    def _event(self, obj):
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


class EngineServer(ThreadingHTTPServer):
    """A thread per connection up to `max_connections`, a deep listen backlog. A connection is *reading* until
    its whole request is in: it has `read_timeout` seconds for that in all (not per read), and when every slot
    is taken a new connection takes the slot of the oldest reading one, so idle or slow clients hold none that
    a new client needs. When every slot serves a request, a new connection gets 503 at once."""

    daemon_threads = True
    request_queue_size = BACKLOG

    def __init__(self, addr, handler, max_connections: int = MAX_CONNECTIONS, read_timeout: float = READ_TIMEOUT):
        self.slots = threading.BoundedSemaphore(max_connections)
        self.read_timeout = read_timeout
        self.reading: dict = {}          # connection → when it came, while its request is still arriving
        self.cut: set = set()            # reading connections whose time ran out or whose slot was taken
        self.guard, self.closed = threading.Lock(), threading.Event()
        super().__init__(addr, handler)
        threading.Thread(target=self._reap, daemon=True, name="request-deadline").start()

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            if not (self._cut_oldest() and self.slots.acquire(timeout=2.0)):
                try:
                    request.sendall(b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                    b"Connection: close\r\n\r\n"
                                    b'{"error": {"message": "server busy: too many connections", "type": '
                                    b'"server_busy", "code": 503}}')
                except OSError:
                    pass
                self.shutdown_request(request)
                return
        with self.guard:
            self.reading[request] = time.monotonic()
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self.guard:
                self.reading.pop(request, None)
                self.cut.discard(request)
            self.slots.release()

    def received(self, request) -> bool:
        """The request is in: the connection stops reading (False: its time ran out or its slot was taken)."""
        with self.guard:
            self.reading.pop(request, None)
            return request not in self.cut

    def _cut(self, request) -> None:
        """End a reading connection's request: its reads see end of file; its handler answers 408 or closes."""
        self.reading.pop(request, None)
        self.cut.add(request)
        try:
            request.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def _cut_oldest(self) -> bool:
        with self.guard:
            if not self.reading:
                return False
            self._cut(min(self.reading, key=self.reading.get))
            return True

    def _reap(self) -> None:
        while not self.closed.wait(max(0.05, min(1.0, self.read_timeout / 4))):
            now = time.monotonic()
            with self.guard:
                for request in [r for r, t in self.reading.items() if now - t >= self.read_timeout]:
                    self._cut(request)

    def server_close(self):
        self.closed.set()
        super().server_close()


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 8000, name: str = "provision-tiny",
                max_connections: int = MAX_CONNECTIONS, max_queued: int = MAX_QUEUED,
                read_timeout: float = READ_TIMEOUT):
    """A ready, not yet serving, server (port 0 picks a free port)."""
    handler = type("BoundHandler", (Handler,), {"service": Service(engine, name, max_queued), "timeout": read_timeout})
    return EngineServer((host, port), handler, max_connections, read_timeout)


def main(argv=None):
    from .loading import runs_in, start_engine
    from .settings import add_arguments, from_arguments, kernel_cache

    for k, v in kernel_cache().items():   # the generation's compiled kernels, unless the caller names others
        os.environ.setdefault(k, v)
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--name", default="provision-tiny")
    a = ap.parse_args(argv)
    try:
        eng = start_engine(a.model, a.draft, from_arguments(a))
        httpd = make_server(eng, a.host, a.port, a.name)
    except (EngineError, OSError) as e:
        raise SystemExit(f"error: {e}")
    print(f"serving {a.name} on http://{a.host}:{httpd.server_address[1]} ({runs_in(eng, a.device)})", flush=True)
    serve_until_interrupted(httpd)
    return 0


def serve_until_interrupted(httpd) -> None:
    """Serve until Ctrl-C / SIGINT, then close the listening socket."""
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()


if __name__ == "__main__":
    sys.exit(main())
