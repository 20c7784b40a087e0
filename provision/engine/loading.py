"""Checkpoints: HF Llama targets (safetensors or .bin, sharded) and the published EAGLE-3 draft
layout, mapped onto our modules with one clear error per wrong key; and saving in both layouts."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .draft import DraftArgs, Eagle3Draft
from .errors import EngineError
from .model import ModelArgs, Transformer
from .settings import DEFAULTS, EngineSettings

DRAFT_ARCHS = ("LlamaForCausalLMEagle3", "LlamaForCausalLM", "Eagle3LlamaForCausalLM")


def read_config(d: Path) -> dict:
    f = Path(d) / "config.json"
    try:
        return json.loads(f.read_text())
    except FileNotFoundError:
        raise EngineError(f"{f}: no config.json (is {d} a checkpoint directory?)") from None
    except json.JSONDecodeError as e:
        raise EngineError(f"{f}:{e.lineno}: not valid JSON: {e.msg}") from None


def _need(cfg: dict, key: str, where: Path):
    if key not in cfg:
        raise EngineError(f"{where}/config.json: missing key {key!r}")
    return cfg[key]


ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(cfg: dict, d: Path) -> tuple[float, dict | None]:
    """(theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (4.x)."""
    rp = cfg.get("rope_parameters")
    if rp is not None:
        if not isinstance(rp, dict):
            raise EngineError(f"{d}/config.json: rope_parameters must be an object")
        if "rope_type" not in rp and all(isinstance(v, dict) for v in rp.values()):
            raise EngineError(f"{d}/config.json: per-layer-type rope_parameters {sorted(rp)} are not supported")
        theta, scaling = rp.get("rope_theta", cfg.get("rope_theta", 10000.0)), rp
    else:
        theta, scaling = cfg.get("rope_theta", 10000.0), cfg.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind not in ROPE_TYPES:
        raise EngineError(f"{d}/config.json: rope type {kind!r} is not supported {ROPE_TYPES}")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise EngineError(f"{d}/config.json: rope_theta {theta!r} must be a positive number")
    return float(theta), (None if kind == "default" else dict(scaling))


def model_args(cfg: dict, d: Path, cls=ModelArgs, **extra) -> ModelArgs:
    """HF Llama config.json → ModelArgs (or DraftArgs); refuses what the engine would compute differently."""
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise EngineError(f"{d}/config.json: attention_bias / mlp_bias are not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise EngineError(f"{d}/config.json: hidden_act {cfg['hidden_act']!r} is not supported (silu)")
    heads = _need(cfg, "num_attention_heads", d)
    theta, scaling = rope_settings(cfg, d)
    try:
        return cls(
            vocab_size=_need(cfg, "vocab_size", d), dim=_need(cfg, "hidden_size", d),
            n_layer=_need(cfg, "num_hidden_layers", d), n_head=heads,
            n_local_heads=cfg.get("num_key_value_heads") or heads, head_dim=cfg.get("head_dim") or 0,
            intermediate_size=_need(cfg, "intermediate_size", d), norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_base=theta, rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)), **extra)
    except (TypeError, ValueError) as e:
        raise EngineError(f"{d}/config.json: {e}") from None


def read_weights(d: Path) -> tuple[dict, dict]:
    """All tensors of a checkpoint directory and, per key, the file it came from."""
    d = Path(d)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (d / index).exists():
            files = sorted(set(json.loads((d / index).read_text())["weight_map"].values()))
            break
    else:
        files = [p.name for p in sorted(d.glob("*.safetensors"))] or [p.name for p in sorted(d.glob("*.bin"))]
    if not files:
        raise EngineError(f"{d}: no *.safetensors or *.bin weights")
    tensors, origin = {}, {}
    for name in files:
        f = d / name
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file   # outside the try: a missing extra is named as such
        try:
            if name.endswith(".safetensors"):
                part = load_file(str(f))
            else:
                part = torch.load(str(f), map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise EngineError(f"{f}: shard named in the index is missing") from None
        except Exception as e:  # corrupt files raise many types
            raise EngineError(f"{f}: cannot read weights ({type(e).__name__}: {e})") from None
        for k, v in part.items():
            tensors[k], origin[k] = v, f
    return tensors, origin


def _take(tensors, origin, d, key, shape):
    """One checkpoint tensor, checked against its expected shape."""
    if key not in tensors:
        raise EngineError(f"{d}: missing key {key!r}")
    t = tensors[key]
    if tuple(t.shape) != tuple(shape):
        raise EngineError(f"{origin[key]}: key {key!r} has shape {list(t.shape)}, expected {list(shape)}")
    return t


LAYER_KEYS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
              "post_attention_layernorm.weight")


def _layer_weights(get, pre: str, a: ModelArgs, in_dim: int) -> dict:
    """HF names of one decoder layer → ours (q/k/v and gate/up fused)."""
    q, kv = a.n_head * a.head_dim, a.n_local_heads * a.head_dim
    return {
        "attention.wqkv.weight": torch.cat([get(f"{pre}self_attn.q_proj.weight", (q, in_dim)),
                                            get(f"{pre}self_attn.k_proj.weight", (kv, in_dim)),
                                            get(f"{pre}self_attn.v_proj.weight", (kv, in_dim))]),
        "attention.wo.weight": get(f"{pre}self_attn.o_proj.weight", (a.dim, q)),
        "feed_forward.w13.weight": torch.cat([get(f"{pre}mlp.gate_proj.weight", (a.intermediate_size, a.dim)),
                                              get(f"{pre}mlp.up_proj.weight", (a.intermediate_size, a.dim))]),
        "feed_forward.w2.weight": get(f"{pre}mlp.down_proj.weight", (a.dim, a.intermediate_size)),
        "ffn_norm.weight": get(f"{pre}post_attention_layernorm.weight", (a.dim,)),
    }


def load_target(d, device="cpu", dtype=torch.float32, aux_layers=None) -> Transformer:
    d = Path(d)
    a = model_args(read_config(d), d, aux_layers=list(aux_layers or []))
    tensors, origin = read_weights(d)
    get = lambda k, s: _take(tensors, origin, d, k, s)  # noqa: E731
    sd = {"tok_embeddings.weight": get("model.embed_tokens.weight", (a.vocab_size, a.dim)),
          "norm.weight": get("model.norm.weight", (a.dim,))}
    sd["output.weight"] = sd["tok_embeddings.weight"] if a.tie_word_embeddings and "lm_head.weight" not in tensors \
        else get("lm_head.weight", (a.vocab_size, a.dim))
    for i in range(a.n_layer):
        pre = f"model.layers.{i}."
        for k, v in _layer_weights(get, pre, a, a.dim).items():
            sd[f"layers.{i}.{k}"] = v
        sd[f"layers.{i}.attention_norm.weight"] = get(pre + "input_layernorm.weight", (a.dim,))
    with torch.device("meta"):
        model = Transformer(a)
    model.load_state_dict(sd, assign=True)
    return model.to(device=device, dtype=dtype)


def _aux_layer_ids(cfg: dict, d: Path, n_layer: int):
    """The target layers whose outputs feed the draft (`eagle_config` or top level), or None."""
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids",
                                                cfg.get("eagle_aux_hidden_state_layer_ids"))
    if ids is not None and (not isinstance(ids, list) or len(ids) != 3
                            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layer
                                       for i in ids)):
        raise EngineError(f"{d}/config.json: eagle_aux_hidden_state_layer_ids {ids} do not fit "
                          f"a {n_layer}-layer target (three layer indices)")
    return ids


def load_draft(d, target: Transformer, device="cpu", dtype=torch.float32) -> Eagle3Draft:
    """The published EAGLE-3 layout and its variants (`model.`/`layers.0.` prefixes, own embeddings,
    `norm_before_residual`); anything else is refused. Sets the target's aux layers from the config."""
    d = Path(d)
    cfg = read_config(d)
    arch = (cfg.get("architectures") or ["LlamaForCausalLMEagle3"])[0]
    if arch not in DRAFT_ARCHS:
        raise EngineError(f"{d}/config.json: architecture {arch!r} is not an EAGLE-3 Llama draft {DRAFT_ARCHS}")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise EngineError(f"{d}/config.json: num_hidden_layers: {cfg['num_hidden_layers']} (an EAGLE-3 draft "
                          "here has exactly one decoder layer)")
    ta = target.args
    th = cfg.get("target_hidden_size") or ta.dim
    if th != ta.dim:
        raise EngineError(f"{d}/config.json: target_hidden_size {th} differs from the target's hidden_size {ta.dim}")
    a = model_args(cfg, d, cls=DraftArgs, draft_vocab_size=cfg.get("draft_vocab_size") or cfg.get("vocab_size"),
                   target_hidden=3 * th, norm_before_residual=bool(cfg.get("norm_before_residual", False)))
    if a.dim != ta.dim:
        raise EngineError(f"{d}/config.json: hidden_size {a.dim} differs from the target's {ta.dim}")
    if a.vocab_size != ta.vocab_size:
        raise EngineError(f"{d}/config.json: vocab_size {a.vocab_size} differs from the target's {ta.vocab_size}")
    ids = _aux_layer_ids(cfg, d, ta.n_layer)
    raw, origin = read_weights(d)
    tensors = {}
    for k, v in raw.items():   # some exports prefix "model." or call the midlayer "layers.0"
        k2 = k[6:] if k.startswith("model.") else k
        k2 = "midlayer." + k2[9:] if k2.startswith("layers.0.") else k2
        if k2 in tensors:
            raise EngineError(f"{origin[k]}: key {k!r} duplicates another spelling of {k2!r}")
        tensors[k2], origin[k2] = v, origin[k]
    get = lambda k, s: _take(tensors, origin, d, k, s)  # noqa: E731
    sd = {"fc.weight": get("fc.weight", (a.dim, a.target_hidden)),
          "norm.weight": get("norm.weight", (a.dim,)),
          "lm_head.weight": get("lm_head.weight", (a.draft_vocab_size, a.dim))}
    for k, v in _layer_weights(get, "midlayer.", a, 2 * a.dim).items():
        sd[f"midlayer.{k}"] = v
    sd["midlayer.input_layernorm.weight"] = get("midlayer.input_layernorm.weight", (a.dim,))
    sd["midlayer.hidden_norm.weight"] = get("midlayer.hidden_norm.weight", (a.dim,))
    used = {"fc.weight", "norm.weight", "lm_head.weight", "midlayer.input_layernorm.weight",
            "midlayer.hidden_norm.weight", "d2t", "t2d"} | {f"midlayer.{k}" for k in LAYER_KEYS}
    if "embed_tokens.weight" in tensors:   # the draft's own embeddings, used instead of the target's
        sd["embed_tokens.weight"] = get("embed_tokens.weight", (a.vocab_size, a.dim))
        used.add("embed_tokens.weight")
    extra = sorted(set(tensors) - used)
    if extra:
        raise EngineError(f"{origin[extra[0]]}: key {extra[0]!r} is not part of an EAGLE-3 draft this engine "
                          f"runs ({len(extra)} unexpected keys)")
    if a.draft_vocab_size != a.vocab_size or "d2t" in tensors:
        d2t = get("d2t", (a.draft_vocab_size,)).long()
        target_ids = torch.arange(a.draft_vocab_size) + d2t
        if target_ids.min() < 0 or target_ids.max() >= a.vocab_size:
            raise EngineError(f"{origin['d2t']}: key 'd2t' maps draft ids outside the target vocabulary")
        if "t2d" in tensors:
            t2d = torch.zeros(a.vocab_size, dtype=torch.bool)
            t2d[target_ids] = True
            if not torch.equal(get("t2d", (a.vocab_size,)).bool(), t2d):
                raise EngineError(f"{origin['t2d']}: key 't2d' disagrees with 'd2t'")
        sd["d2t"] = d2t
    else:
        sd["d2t"] = torch.zeros(a.draft_vocab_size, dtype=torch.long)
    with torch.device("meta"):
        draft = Eagle3Draft(a, own_embed="embed_tokens.weight" in sd)
    draft.load_state_dict(sd, assign=True)
    draft = draft.to(device=device, dtype=dtype)
    draft.d2t = draft.d2t.long()
    if ids:
        ta.aux_layers = [i + 1 for i in ids]   # the output of layer i feeds layer i + 1
    return draft


def hf_config(a: ModelArgs, **extra) -> dict:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab_size,
           "hidden_size": a.dim, "num_hidden_layers": a.n_layer, "num_attention_heads": a.n_head,
           "num_key_value_heads": a.n_local_heads, "head_dim": a.head_dim,
           "intermediate_size": a.intermediate_size, "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_base,
           "rope_scaling": a.rope_scaling, "max_position_embeddings": a.max_position_embeddings,
           "tie_word_embeddings": a.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": "float32"}
    cfg.update(extra)
    return cfg


def _split_layer(sd: dict, ours: str, pre: str, a: ModelArgs) -> dict:
    q, kv = a.n_head * a.head_dim, a.n_local_heads * a.head_dim
    wq, wk, wv = sd[f"{ours}attention.wqkv.weight"].split([q, kv, kv])
    gate, up = sd[f"{ours}feed_forward.w13.weight"].chunk(2)
    return {f"{pre}self_attn.q_proj.weight": wq, f"{pre}self_attn.k_proj.weight": wk,
            f"{pre}self_attn.v_proj.weight": wv, f"{pre}self_attn.o_proj.weight": sd[f"{ours}attention.wo.weight"],
            f"{pre}mlp.gate_proj.weight": gate, f"{pre}mlp.up_proj.weight": up,
            f"{pre}mlp.down_proj.weight": sd[f"{ours}feed_forward.w2.weight"],
            f"{pre}post_attention_layernorm.weight": sd[f"{ours}ffn_norm.weight"]}


def _save(tensors: dict, d: Path, cfg: dict, dtype):
    from safetensors.torch import save_file
    d.mkdir(parents=True, exist_ok=True)
    out = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu() for k, v in tensors.items()}
    save_file(out, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def hf_state(model: Transformer) -> dict:
    """Our target's tensors under HF Llama names (views where the fused ones split)."""
    a, sd = model.args, model.state_dict()
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    if not a.tie_word_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    for i in range(a.n_layer):
        out.update(_split_layer(sd, f"layers.{i}.", f"model.layers.{i}.", a))
        out[f"model.layers.{i}.input_layernorm.weight"] = sd[f"layers.{i}.attention_norm.weight"]
    return out


def save_target(model: Transformer, d, dtype=torch.float32, **cfg_extra):
    """Write an HF Llama checkpoint (config.json + model.safetensors)."""
    _save(hf_state(model), Path(d), hf_config(model.args, **cfg_extra), dtype)


def save_draft(draft: Eagle3Draft, d, aux_layer_ids=None, dtype=torch.float32):
    """Write the published EAGLE-3 layout (config with draft_vocab_size; fc, midlayer.*, d2t, t2d)."""
    a, sd = draft.args, draft.state_dict()
    out = {"fc.weight": sd["fc.weight"], "norm.weight": sd["norm.weight"], "lm_head.weight": sd["lm_head.weight"],
           "midlayer.input_layernorm.weight": sd["midlayer.input_layernorm.weight"],
           "midlayer.hidden_norm.weight": sd["midlayer.hidden_norm.weight"]}
    out.update(_split_layer(sd, "midlayer.", "midlayer.", a))
    d2t = sd["d2t"].long().cpu()
    t2d = torch.zeros(a.vocab_size, dtype=torch.bool)
    t2d[torch.arange(a.draft_vocab_size) + d2t] = True
    out["d2t"], out["t2d"] = d2t, t2d
    cfg = hf_config(a, architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                    draft_vocab_size=a.draft_vocab_size)
    if aux_layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    _save(out, Path(d), cfg, dtype)


# What `auto` means (bench/dtype_bench.py measures both dtypes in one run; docs/engine-dtype.md has the figures):
# bfloat16 on CUDA. On CPU bfloat16 only with bfloat16 instructions and a target whose weights, read whole every
# step, are large: SmolLM2-135M (513 MiB in float32) decodes 2.4x faster in bfloat16 with speculation, while the
# tiny pair (6 MiB), bound by per-step overhead, and any target on a CPU without those instructions run faster in
# float32.
AUTO_BF16_MIB = 64


def step_weights(a: ModelArgs) -> int:
    """Parameters a decoding step reads: every layer and the output head (of the embeddings, one row)."""
    q, kv = a.n_head * a.head_dim, a.n_local_heads * a.head_dim
    layer = a.dim * (q + 2 * kv) + q * a.dim + 3 * a.dim * a.intermediate_size + 2 * a.dim
    return a.n_layer * layer + a.vocab_size * a.dim + a.dim


def cpu_bf16() -> str | None:
    """This CPU's bfloat16 matrix instructions (AMX-BF16, AVX512-BF16), or None."""
    for name, probe in (("AMX-BF16", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported")):
        try:
            if getattr(torch.cpu, probe)():
                return name
        except (AttributeError, RuntimeError):
            pass
    return None


def auto_dtype(device: str, args: ModelArgs | None = None) -> tuple[str, str]:
    """(dtype, why) that `auto` means for a target of `args` on `device` (cpu, cuda, cuda:1, ...)."""
    kind = str(device).split(":")[0]
    if kind == "cuda":
        return "bfloat16", "auto: bfloat16 on CUDA"
    if kind != "cpu":
        return "float32", f"auto: float32 on {kind}"
    isa = cpu_bf16()
    if isa is None:
        return "float32", "auto: this CPU has no bfloat16 instructions (AMX-BF16, AVX512-BF16)"
    if args is None:
        return "float32", "auto: float32 for a target of unknown size"
    mib = step_weights(args) * 4 / 2 ** 20
    if mib < AUTO_BF16_MIB:
        return "float32", (f"auto: a step reads {mib:.0f} MiB of float32 weights, under {AUTO_BF16_MIB} MiB, "
                           "where float32 is faster")
    return "bfloat16", (f"auto: {isa} and a step reads {mib:.0f} MiB of float32 weights, {AUTO_BF16_MIB} MiB "
                        "or more, where bfloat16 is faster")


def torch_dtype(dtype: str, device: str, args: ModelArgs | None = None):
    """The torch dtype a setting names on `device` (`auto`: auto_dtype), or one clear EngineError."""
    name = auto_dtype(device, args)[0] if dtype == "auto" else dtype
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise EngineError(f"unknown dtype {name!r} (auto, float32, bfloat16, float16)")
    return dt


def dtype_of(engine) -> str:
    return str(engine.target.output.weight.dtype).removeprefix("torch.")


def runs_in(engine, device: str) -> str:
    """The dtype and device a server's first line names, and why where `auto` chose the dtype."""
    return f"{dtype_of(engine)} on {device}" + (f"; {engine.dtype_note}" if engine.dtype_note else "")


def load_engine(model=None, draft=None, settings: EngineSettings = DEFAULTS, speculative: bool = True, **changes):
    """Target + draft + tokenizer as one Engine; the bundled tiny pair when no paths are given. `changes`
    override single settings (load_engine(device="cuda", max_seq_len=256)); dtype `auto`: the one the engine is
    fastest in for this target on the device (auto_dtype, its reason kept as `dtype_note`); `threads` is
    start_engine's."""
    from . import TINY_DIR
    from .generate import Engine
    from .tokenizer import load_tokenizer, stop_ids

    s = settings.replace(**changes)
    model = Path(model) if model else TINY_DIR
    draft = Path(draft) if draft else (model / "draft" if (model / "draft").exists() else None)
    args = model_args(read_config(model), model)
    dt = torch_dtype(s.dtype, s.device, args)
    try:
        torch.empty(0, device=s.device)
    except (RuntimeError, AssertionError) as e:
        raise EngineError(f"device {s.device!r} is not usable here: {str(e).splitlines()[0]}") from None
    target = load_target(model, s.device, dt)
    dr = load_draft(draft, target, s.device, dt) if draft is not None and speculative else None
    eng = Engine(target, dr, load_tokenizer(model), max_seq_len=s.max_seq_len, steps=s.steps, topk=s.topk,
                 num_draft_tokens=s.num_draft_tokens, stop_ids=stop_ids(model))
    eng.dtype_note = auto_dtype(s.device, args)[1] if s.dtype == "auto" else ""
    return eng


def start_engine(model=None, draft=None, settings: EngineSettings = DEFAULTS):
    """What a command line runs: torch's CPU threads as `settings` says (0: torch's default), then load_engine."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    return load_engine(model, draft, settings)
