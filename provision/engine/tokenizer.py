"""Tokenizers: the bundled byte-level one (ids 0-255 are bytes, then bos/eos), or a model's
tokenizer.json through the optional `tokenizers` package; chosen by what the model directory holds."""
from __future__ import annotations

import codecs
import json
from pathlib import Path

from .errors import EngineError


class ByteTokenizer:
    def __init__(self, bos_id: int = 256, eos_id: int = 257):
        self.bos_id, self.eos_id = bos_id, eos_id
        self.chat_template = None

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos_id] if bos else []) + list(text.encode("utf-8"))

    def encode_chat(self, text: str) -> list[int]:
        return self.encode(text, bos=True)     # BOS has no text: the template cannot render it

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def stream_decoder(self):
        """A function ids → newly completed text (multi-byte characters wait for their last byte)."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda ids: dec.decode(bytes(i for i in ids if i < 256))


class HFTokenizer:
    """A model's tokenizer.json (HF `tokenizers`); its post-processor decides about BOS, as in transformers."""

    def __init__(self, path: Path, bos_id, eos_id, chat_template=None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise EngineError(f"{path}: reading tokenizer.json needs the `tokenizers` package; "
                              "send token ids instead") from None
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception subclasses
            raise EngineError(f"{path}: not a tokenizer.json ({str(e).splitlines()[0][:200]})") from None
        self.bos_id, self.eos_id, self.chat_template = bos_id, eos_id, chat_template

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=bos).ids

    def encode_chat(self, text: str) -> list[int]:
        return self.encode(text, bos=False)    # the template renders any BOS itself

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))

    def token(self, i) -> str | None:
        return self.tok.id_to_token(i) if isinstance(i, int) else None

    def stream_decoder(self):
        seen: list[int] = []
        sent = [0]

        def step(ids):
            seen.extend(ids)
            text = self.decode(seen)
            if text.endswith("\ufffd"):
                return ""
            new, sent[0] = text[sent[0]:], len(text)
            return new
        return step


class ChatTemplate:
    """The model's Jinja chat template, rendered in a sandbox (as transformers' apply_chat_template)."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        try:
            from jinja2 import TemplateError
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise EngineError("rendering the chat template needs the `jinja2` package") from None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = self._raise
        self._errors = TemplateError
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise EngineError(f"chat template does not parse: {e}") from None
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    @staticmethod
    def _raise(message):
        raise EngineError(f"chat template refused the messages: {message}")

    def render(self, messages: list, add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except self._errors as e:
            raise EngineError(f"chat template failed on these messages: {e}") from None


def _read_json(f: Path) -> dict:
    try:
        v = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"{f}: cannot read ({e})") from None
    if not isinstance(v, dict):
        raise EngineError(f"{f}: must hold a JSON object")
    return v


def _token_text(v) -> str:
    """tokenizer_config.json spells special tokens as strings or as {"content": ...}."""
    return v.get("content", "") if isinstance(v, dict) else (v if isinstance(v, str) else "")


def stop_ids(d) -> list[int]:
    """End-of-turn ids: config.json's eos_token_id and generation_config.json's (either may be a list)."""
    out = []
    for name in ("config.json", "generation_config.json"):
        f = Path(d) / name
        eos = _read_json(f).get("eos_token_id") if f.exists() else None
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and not isinstance(i, bool) and i not in out:
                out.append(i)
    return out


def load_chat_template(d) -> ChatTemplate | None:
    """chat_template.jinja, or tokenizer_config.json's `chat_template` (a string or the named default)."""
    d = Path(d)
    tc = _read_json(d / "tokenizer_config.json") if (d / "tokenizer_config.json").exists() else {}
    src = (d / "chat_template.jinja").read_text() if (d / "chat_template.jinja").exists() else tc.get("chat_template")
    if isinstance(src, list):
        src = next((t.get("template") for t in src if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(src, str) or not src:
        return None
    return ChatTemplate(src, _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token")))


def load_tokenizer(d) -> ByteTokenizer | HFTokenizer | None:
    """The tokenizer a model directory ships, or None (token ids only)."""
    d = Path(d)
    if (d / "byte_tokenizer.json").exists():
        cfg = _read_json(d / "byte_tokenizer.json")
        tok = ByteTokenizer(cfg.get("bos_id", 256), cfg.get("eos_id", 257))
        tok.chat_template = load_chat_template(d)
        return tok
    if (d / "tokenizer.json").exists():
        cfg = _read_json(d / "config.json") if (d / "config.json").exists() else {}
        stops = stop_ids(d)
        return HFTokenizer(d / "tokenizer.json", cfg.get("bos_token_id"), stops[0] if stops else None,
                           load_chat_template(d))
    return None
