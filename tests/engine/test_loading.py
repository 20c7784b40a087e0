"""Checkpoints: our target matches transformers' LlamaForCausalLM on the same random weights;
HF layouts (safetensors, sharded .bin) and the published EAGLE-3 draft layout load; bad ones
give one clear EngineError naming the key or file."""
import json

import pytest
import torch

from conftest import DEVICE, random_pair
from provision.engine.errors import EngineError
from provision.engine.loading import load_draft, load_engine, load_target, read_weights, save_draft, save_target
from provision.engine.model import ModelArgs, Transformer

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _forward(model, ids):
    model.setup_caches(64)
    pos = torch.arange(ids.shape[1], device=ids.device)
    with torch.inference_mode():
        return model(ids, pos, torch.arange(64, device=ids.device)[None] <= pos[:, None], pos, capture=True)


@pytest.mark.parametrize("scaling,tie", [(None, False), (LLAMA3, True)])
def test_hf_parity(tmp_path, scaling, tie):
    transformers = pytest.importorskip("transformers")   # test-only dependency, installed in CI
    torch.manual_seed(0)
    a = ModelArgs(vocab_size=128, dim=64, n_layer=6, n_head=4, n_local_heads=2, intermediate_size=96,
                  rope_base=50000.0, rope_scaling=scaling, max_position_embeddings=256, tie_word_embeddings=tie)
    ours = Transformer(a)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if tie:
        ours.output.weight = ours.tok_embeddings.weight
    save_target(ours, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path), torch_dtype=torch.float32).to(DEVICE).eval()
    ours = load_target(tmp_path, DEVICE)
    ids = torch.randint(0, 128, (1, 40), device=DEVICE)
    logits, aux = _forward(ours, ids)
    with torch.inference_mode():
        out = hf(ids, output_hidden_states=True)
    torch.testing.assert_close(logits, out.logits, atol=2e-4, rtol=2e-4)
    want = torch.cat([out.hidden_states[i] for i in (2, 3, 3)], -1)   # inputs of layers [2, N//2, N-3]
    torch.testing.assert_close(aux, want, atol=2e-4, rtol=2e-4)


def test_sharded_bin_and_draft_layout(tmp_path):
    target, draft = random_pair(vocab=64, draft_vocab=32, device="cpu")
    save_target(target, tmp_path / "t")
    tensors, _ = read_weights(tmp_path / "t")
    keys = sorted(tensors)
    shards = {"pytorch_model-00001-of-00002.bin": keys[: len(keys) // 2],
              "pytorch_model-00002-of-00002.bin": keys[len(keys) // 2:]}
    (tmp_path / "b").mkdir()
    for name, ks in shards.items():
        torch.save({k: tensors[k] for k in ks}, tmp_path / "b" / name)
    (tmp_path / "b" / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {k: n for n, ks in shards.items() for k in ks}}))
    (tmp_path / "b" / "config.json").write_text((tmp_path / "t" / "config.json").read_text())
    t2 = load_target(tmp_path / "b")
    for k, v in target.state_dict().items():
        torch.testing.assert_close(t2.state_dict()[k], v)
    save_draft(draft, tmp_path / "d", aux_layer_ids=[1, 2, 3])
    d2 = load_draft(tmp_path / "d", t2)
    assert t2.args.aux_layers == [2, 3, 4]
    assert torch.equal(d2.d2t, draft.d2t) and torch.equal(d2.fc.weight, draft.fc.weight)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 32
    assert {"fc.weight", "d2t", "t2d", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight"} \
        <= set(read_weights(tmp_path / "d")[0])


def test_bad_checkpoints(tmp_path):
    target, draft = random_pair(vocab=64, draft_vocab=32, device="cpu")
    save_target(target, tmp_path / "t")
    save_draft(draft, tmp_path / "d")
    from safetensors.torch import load_file, save_file
    f = tmp_path / "d" / "model.safetensors"
    sd = load_file(str(f))
    save_file({**sd, "fc.weight": sd["fc.weight"][:, :10].contiguous()}, str(f))
    with pytest.raises(EngineError, match=r"key 'fc.weight' has shape \[64, 10\], expected \[64, 192\]"):
        load_draft(tmp_path / "d", load_target(tmp_path / "t"))
    del sd["midlayer.hidden_norm.weight"]
    save_file(sd, str(f))
    with pytest.raises(EngineError, match="missing key 'midlayer.hidden_norm.weight'"):
        load_draft(tmp_path / "d", load_target(tmp_path / "t"))
    f = tmp_path / "t" / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.3.mlp.up_proj.weight"]
    save_file(sd, str(f))
    with pytest.raises(EngineError, match="missing key 'model.layers.3.mlp.up_proj.weight'"):
        load_target(tmp_path / "t")
    (tmp_path / "t" / "config.json").write_text("{not json")
    with pytest.raises(EngineError, match="config.json:1: not valid JSON"):
        load_target(tmp_path / "t")
    with pytest.raises(EngineError, match="no config.json"):
        load_target(tmp_path / "nowhere")
    with pytest.raises(EngineError, match="device 'nope'"):
        load_engine(device="nope")


def test_tiny_pair_size():
    from provision.engine import TINY_DIR
    total = sum(p.stat().st_size for p in TINY_DIR.rglob("*.safetensors"))
    assert total <= 10 * 2**20
