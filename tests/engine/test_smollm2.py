"""A real published model: SmolLM2-135M-Instruct imported from its GGUF loads with the right RoPE,
tokenizes and renders its chat template as its authors' tools do, and decodes exactly as
transformers does on the same weights."""
import json
import os
import subprocess
import sys

import pytest
import torch

from smollm2 import REPO, checkpoint, wheel
from provision.engine.loading import load_engine
from provision.engine.tokenizer import load_tokenizer

CHAT = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def ckpt():
    return checkpoint()


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "provision.cli", *map(str, args)], capture_output=True, text=True,
                       cwd=REPO, env={**os.environ, "COLUMNS": "200"})
    assert "Traceback" not in p.stderr, p.stderr
    return p


def test_import_writes_a_checkpoint(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (576, 30, 9, 3, 49152, True)
    tc = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and "<|im_start|>" in tc["chat_template"]


def test_tokenizer_and_chat_template(ckpt):
    tok = load_tokenizer(ckpt)
    text = tok.chat_template.render(CHAT)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, bos=False)
    assert ids[0] == 1 and ids.count(2) == 2                                   # special tokens are single ids
    assert tok.tok.decode(ids, skip_special_tokens=False) == text and "<|im_end|>" not in tok.decode(ids)
    assert tok.encode("2024") == [tok.encode(d)[0] for d in "2024"]            # digits split one by one
    s = "Héllo,  wörld!\n\tthe 日本 <b>x</b>"
    assert tok.decode(tok.encode(s)) == s
    with pytest.raises(Exception, match="chat template"):
        tok.chat_template.render([{"role": "user"}])


def test_greedy_matches_transformers(ckpt):
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(2)
    eng = load_engine(ckpt, max_seq_len=256, speculative=False, dtype="float32")   # as transformers runs it here
    ids = eng.tokenizer.encode(eng.tokenizer.chat_template.render(CHAT), bos=False)
    ours = eng.generate(ids, 12, speculative=False)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    assert ours.tokens == want
    assert eng.tokenizer.decode(ours.tokens).startswith("The answer to this question")


def test_cli_import(tmp_path, ckpt):
    p = cli("engine", "import", wheel(), tmp_path / "bf16", "--dtype", "bfloat16", "--json")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["layers"] == 30 and r["chat_template"] and r["dtype"] == "bfloat16"
    from safetensors import safe_open
    key = "model.layers.7.self_attn.k_proj.weight"
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as a, \
            safe_open(str(ckpt / "model.safetensors"), "pt") as b:
        assert torch.equal(a.get_tensor(key), b.get_tensor(key).to(torch.bfloat16))
    for args, words in [((tmp_path / "missing.gguf", tmp_path / "x"), "missing.gguf: no such file"),
                        ((wheel(), tmp_path / "bf16"), "exists and is not empty"),
                        ((ckpt / "config.json", tmp_path / "y"), "not a readable GGUF file")]:
        p = cli("engine", "import", *args)
        assert p.returncode == 2 and words in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.skipif(os.environ.get("PROVISION_TEST_DEVICE", "cpu") != "cpu", reason="shared rows are the CPU path")
def test_bfloat16_speculative_equals_plain(ckpt):
    """bfloat16 on CPU with the shipped draft: greedy speculation emits exactly plain greedy decoding. On the two
    held-out chat prompts used here, verification in the usual tree layout diverges from plain at token 34."""
    from provision.engine.bench import encode_prompts
    eng = load_engine(ckpt, REPO / "bench" / "smollm2-135m-instruct-eagle3", dtype="bfloat16", max_seq_len=256,
                      steps=5, topk=4, num_draft_tokens=16)
    assert eng.shared_rows
    enc = encode_prompts(eng, True, 3)
    accepts = []
    for ids in (enc[0], enc[2]):
        plain = eng.generate(ids, 48, speculative=False).tokens
        spec = eng.generate(ids, 48)
        assert spec.tokens == plain and len(plain) == 48
        accepts += spec.accept_lengths
    assert sum(accepts) / len(accepts) > 2.0
