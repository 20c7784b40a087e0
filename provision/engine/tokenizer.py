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

    def encode(self, text: str, bos: bool = True) -> list[int]:
        return ([self.bos_id] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def stream_decoder(self):
        """A function ids → newly completed text (multi-byte characters wait for their last byte)."""
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        return lambda ids: dec.decode(bytes(i for i in ids if i < 256))


class HFTokenizer:
    def __init__(self, path: Path, bos_id, eos_id):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise EngineError(f"{path}: reading tokenizer.json needs the `tokenizers` package; "
                              "send token ids instead") from None
        self.tok = Tokenizer.from_file(str(path))
        self.bos_id, self.eos_id = bos_id, eos_id

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))

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


def load_tokenizer(d) -> ByteTokenizer | HFTokenizer | None:
    """The tokenizer a model directory ships, or None (token ids only)."""
    d = Path(d)
    if (d / "byte_tokenizer.json").exists():
        cfg = json.loads((d / "byte_tokenizer.json").read_text())
        return ByteTokenizer(cfg.get("bos_id", 256), cfg.get("eos_id", 257))
    if (d / "tokenizer.json").exists():
        cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").exists() else {}
        eos = cfg.get("eos_token_id")
        return HFTokenizer(d / "tokenizer.json", cfg.get("bos_token_id"), eos[0] if isinstance(eos, list) else eos)
    return None
