"""The OpenAI-compatible HTTP API (stdlib ThreadingHTTPServer): /v1/completions (SSE streaming),
/v1/models, /health, /metrics. Handler threads validate and queue; one worker owns the model.
    python -m provision.engine.serve [--model DIR] [--draft DIR] [--port N] [--device cuda]"""
from __future__ import annotations

import argparse
import json
import queue
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from .errors import EngineError
from .generate import Engine

MAX_BODY = 1 << 20
FIELDS = {  # request field → accepted types (bool is excluded from numbers below)
    "prompt": (str, list), "max_tokens": (int,), "temperature": (int, float), "top_p": (int, float),
    "stream": (bool,), "speculative": (bool,), "seed": (int, type(None)), "model": (str,),
}


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Metrics:
    """Counters and the acceptance-length histogram, rendered as Prometheus text."""

    def __init__(self, max_accept: int):
        self.lock = threading.Lock()
        self.c = {"requests": 0, "errors": 0, "prompt_tokens": 0, "generation_tokens": 0, "spec_steps": 0}
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

    def render(self, queued: int) -> str:
        with self.lock:
            c, n = dict(self.c), self.c["spec_steps"]
            lines = []
            for key, name, help_ in (("requests", "engine_requests_total", "completed requests"),
                                     ("errors", "engine_request_errors_total", "rejected or failed requests"),
                                     ("prompt_tokens", "engine_prompt_tokens_total", "prompt tokens processed"),
                                     ("generation_tokens", "engine_generation_tokens_total", "tokens generated"),
                                     ("spec_steps", "engine_speculative_steps_total", "verification steps")):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {c[key]}"]
            lines += ["# HELP engine_queue_depth requests waiting for the model", "# TYPE engine_queue_depth gauge",
                      f"engine_queue_depth {queued}",
                      "# HELP engine_accept_length tokens accepted per verification (bonus included)",
                      "# TYPE engine_accept_length histogram"]
            lines += [f'engine_accept_length_bucket{{le="{b}"}} {h}' for b, h in zip(self.buckets, self.hist)]
            lines += [f'engine_accept_length_bucket{{le="+Inf"}} {n}', f"engine_accept_length_sum {self.hist_sum}",
                      f"engine_accept_length_count {n}"]
        return "\n".join(lines) + "\n"


class Job:
    def __init__(self, ids, params):
        self.ids, self.params = ids, params
        self.out: queue.Queue = queue.Queue()     # lists of ids, then ("done", stats) or ("error", exc)
        self.cancelled = False


class Service:
    """The queue and the single model worker."""

    def __init__(self, engine: Engine, name: str = "provision-tiny"):
        self.engine, self.name = engine, name
        self.jobs: queue.Queue = queue.Queue()
        self.metrics = Metrics(engine.steps + 1)
        threading.Thread(target=self._work, daemon=True, name="engine-worker").start()

    def _work(self):
        while True:
            job = self.jobs.get()
            stats: list = []
            try:
                for chunk in self.engine.stream(job.ids, stats=stats, **job.params):
                    if job.cancelled:
                        break
                    job.out.put(chunk)
                job.out.put(("done", stats))
            except Exception as e:  # reported to the waiting handler, the worker keeps serving
                job.out.put(("error", e))

    def submit(self, ids, params) -> Job:
        job = Job(ids, params)
        self.jobs.put(job)
        return job

    def parse(self, body: bytes):
        """Request body → (prompt ids, engine params, stream); BadRequest on anything malformed."""
        try:
            req = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(400, f"malformed JSON: {e}") from None
        if not isinstance(req, dict):
            raise BadRequest(400, "the request body must be a JSON object")
        for k, types in FIELDS.items():
            v = req.get(k)
            if k in req and (not isinstance(v, types) or (isinstance(v, bool) and bool not in types)):
                raise BadRequest(400, f"field {k!r} has the wrong type ({type(v).__name__})")
        if "prompt" not in req:
            raise BadRequest(400, "field 'prompt' is required")
        S, tok, p = self.engine.max_seq_len, self.engine.tokenizer, req["prompt"]
        if isinstance(p, list):
            if len(p) == 1 and isinstance(p[0], str):
                p = p[0]
            elif not p or not all(isinstance(i, int) and not isinstance(i, bool) for i in p):
                raise BadRequest(400, "field 'prompt' must be a string or a non-empty list of token ids")
        if isinstance(p, str):
            if tok is None:
                raise BadRequest(400, "this model has no tokenizer: send 'prompt' as token ids")
            ids = tok.encode(p)
        else:
            ids = p
        V = self.engine.target.args.vocab_size
        if not all(0 <= i < V for i in ids):
            raise BadRequest(400, f"prompt token ids must lie in [0, {V})")
        if len(ids) >= S:
            raise BadRequest(400, f"prompt of {len(ids)} tokens does not fit the context of {S} tokens")
        mt = req.get("max_tokens", 16)
        if not 1 <= mt <= S:
            raise BadRequest(400, f"max_tokens must lie in [1, {S}]")
        t, tp = float(req.get("temperature", 1.0)), float(req.get("top_p", 1.0))
        if not 0.0 <= t <= 100.0 or not 0.0 < tp <= 1.0:
            raise BadRequest(400, "temperature must lie in [0, 100] and top_p in (0, 1]")
        params = {"max_new_tokens": mt, "temperature": t, "top_p": tp,
                  "speculative": req.get("speculative", True), "seed": req.get("seed")}
        return ids, params, req.get("stream", False)


class Handler(BaseHTTPRequestHandler):
    service: Service
    server_version = "provision-engine/0.1"

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
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send(status, {"error": {"message": message, "type": kind, "code": status}})

    def do_GET(self):
        svc = self.service
        if self.path == "/health":
            self._send(200, {"status": "ok", "queued": svc.jobs.qsize()})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": svc.name, "object": "model", "owned_by": "provision",
                                                          "max_model_len": svc.engine.max_seq_len}]})
        elif self.path == "/metrics":
            self._send(200, svc.metrics.render(svc.jobs.qsize()), "text/plain; version=0.0.4")
        else:
            self._error(404, f"no route GET {self.path}")

    def do_POST(self):
        if self.path != "/v1/completions":
            return self._error(404, f"no route POST {self.path}")
        try:
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY:
                raise BadRequest(413, f"request body over {MAX_BODY} bytes")
            ids, params, stream = self.service.parse(self.rfile.read(n))
        except BadRequest as e:
            return self._error(e.status, str(e))
        except ValueError:
            return self._error(400, "bad Content-Length")
        job = self.service.submit(ids, params)
        (self._stream if stream else self._complete)(job)

    def _results(self, job):
        while True:
            item = job.out.get()
            if isinstance(item, tuple):
                if item[0] == "error":
                    raise item[1]
                return item[1]
            yield item

    def _body(self, cid, text, ids, finish, usage=None):
        b = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": self.service.name,
             "choices": [{"index": 0, "text": text, "token_ids": ids, "logprobs": None, "finish_reason": finish}]}
        if usage is not None:
            b["usage"] = usage
        return b

    def _usage(self, job, out, stats):
        u = {"prompt_tokens": len(job.ids), "completion_tokens": len(out), "total_tokens": len(job.ids) + len(out),
             "accept_length": round(sum(stats) / len(stats), 4) if stats else 1.0}
        self.service.metrics.record(len(job.ids), len(out), stats)
        return u

    def _finish(self, out):
        return "stop" if out and out[-1] in self.service.engine.stop_ids else "length"

    def _complete(self, job):
        out = []
        try:
            gen = self._results(job)
            while True:
                out.extend(next(gen))
        except StopIteration as stop:
            stats = stop.value
        except EngineError as e:
            return self._error(400, str(e))
        except Exception as e:  # a bug: answer 500, keep serving
            return self._error(500, f"{type(e).__name__}: {e}")
        tok = self.service.engine.tokenizer
        text = tok.decode(out) if tok else ""
        self._send(200, self._body(f"cmpl-{uuid.uuid4().hex[:24]}", text, out, self._finish(out),
                                   self._usage(job, out, stats)))

    def _stream(self, job):
        cid, tok, out = f"cmpl-{uuid.uuid4().hex[:24]}", self.service.engine.tokenizer, []
        dec = tok.stream_decoder() if tok else (lambda ids: "")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        try:
            gen = self._results(job)
            try:
                while True:
                    chunk = next(gen)
                    out.extend(chunk)
                    self._event(self._body(cid, dec(chunk), chunk, None))
            except StopIteration as stop:
                stats = stop.value
            except Exception as e:
                self.service.metrics.error()
                self._event({"error": {"message": str(e), "type": "server_error"}})
                return
            self._event(self._body(cid, "", [], self._finish(out), self._usage(job, out, stats)))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            job.cancelled = True

    def _event(self, obj):
        self.wfile.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
        self.wfile.flush()


def make_server(engine: Engine, host: str = "127.0.0.1", port: int = 8000, name: str = "provision-tiny"):
    """A ready, not yet serving, ThreadingHTTPServer (port 0 picks a free port)."""
    handler = type("BoundHandler", (Handler,), {"service": Service(engine, name)})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    return httpd


def main(argv=None):
    from .bench import add_engine_args
    from .loading import load_engine

    ap = argparse.ArgumentParser(description=__doc__)
    add_engine_args(ap)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--name", default="provision-tiny")
    a = ap.parse_args(argv)
    try:
        eng = load_engine(a.model, a.draft, a.device, a.dtype, a.max_seq_len, a.steps, a.topk, a.num_draft_tokens)
        httpd = make_server(eng, a.host, a.port, a.name)
    except (EngineError, OSError) as e:
        raise SystemExit(f"error: {e}")
    print(f"serving {a.name} on http://{a.host}:{httpd.server_address[1]}", flush=True)
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
