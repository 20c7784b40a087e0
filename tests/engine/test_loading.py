"""Checkpoints: our target matches transformers' LlamaForCausalLM on the same random weights;
HF layouts (safetensors, sharded .bin) and the published EAGLE-3 draft layout load; bad ones
give one clear EngineError naming the key or file."""
import json

import pytest
import torch

from conftest import DEVICE, random_pair
from provision.engine.errors import EngineError
from provision.engine.loading import (cpu_bf16, load_draft, load_engine, load_target, read_weights, save_draft,
                                      save_target)
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


def test_transformers5_rope_parameters(tmp_path):
    """A config.json written by transformers 5 keeps RoPE under rope_parameters: same logits as 4.x style."""
    torch.manual_seed(0)
    a = ModelArgs(vocab_size=64, dim=64, n_layer=3, n_head=4, n_local_heads=2, intermediate_size=96,
                  rope_base=500000.0, rope_scaling=LLAMA3, max_position_embeddings=256)
    ours = Transformer(a)
    for p in ours.parameters():
        torch.nn.init.normal_(p, std=0.2)
    save_target(ours, tmp_path)
    ids = torch.randint(0, 64, (1, 48))
    want, _ = _forward(load_target(tmp_path), ids)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg.pop("rope_scaling"), "rope_theta": cfg.pop("rope_theta")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    got, _ = _forward(load_target(tmp_path), ids)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plain, _ = _forward(load_target(tmp_path), ids)
    assert (plain - want).abs().max() > 1e-2          # theta is read, not defaulted
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match="rope type 'yarn' is not supported"):
        load_target(tmp_path)


def _rewrite_draft(d, cfg_update=None, rename=None, add=None, drop=()):
    from safetensors.torch import load_file, save_file
    f = d / "model.safetensors"
    sd = load_file(str(f))
    sd = {(rename(k) if rename else k): v for k, v in sd.items() if k not in drop}
    save_file({**sd, **(add or {})}, str(f))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **(cfg_update or {})}))


def _draft_out(draft, target, n=12):
    draft.setup_caches(64, target.tok_embeddings)
    torch.manual_seed(1)
    idx, hid = torch.randint(0, 64, (1, n)), torch.randn(1, n, 3 * draft.args.dim)
    pos = torch.arange(n)
    with torch.inference_mode():
        return draft(idx, hid, pos, torch.arange(64)[None, :n] <= pos[:, None], pos)[0]


def test_draft_layout_variants(tmp_path):
    """Every variant loads faithfully (same outputs) or is refused with one line naming the key."""
    import shutil
    target, draft = random_pair(vocab=64, draft_vocab=32, device="cpu")
    save_target(target, tmp_path / "t")
    save_draft(draft, tmp_path / "d")
    t = load_target(tmp_path / "t")
    want = _draft_out(load_draft(tmp_path / "d", t), t)

    def variant(name, **kw):
        shutil.copytree(tmp_path / "d", tmp_path / name)
        _rewrite_draft(tmp_path / name, **kw)
        return tmp_path / name
    for d in (variant("prefixed", rename=lambda k: "model." + k),
              variant("layers0", rename=lambda k: k.replace("midlayer.", "layers.0.")),
              variant("no_t2d", drop=("t2d",))):
        torch.testing.assert_close(_draft_out(load_draft(d, t), t), want, atol=0, rtol=0)
    own = torch.randn(64, 64)
    d = variant("own_embed", add={"embed_tokens.weight": own})
    dr = load_draft(d, t)
    assert torch.equal(dr.embed_tokens.weight, own) and (_draft_out(dr, t) - want).abs().max() > 1e-3
    d = variant("nbr", cfg_update={"norm_before_residual": True})
    assert load_draft(d, t).midlayer.norm_before_residual and (_draft_out(load_draft(d, t), t) - want).abs().max() > 1e-3
    for name, kw, msg in [
        ("two_layers", {"cfg_update": {"num_hidden_layers": 2}}, "num_hidden_layers: 2"),
        ("extra_key", {"add": {"layers.1.self_attn.q_proj.weight": torch.zeros(4)}}, "key 'layers.1.self_attn.q_proj.weight'"),
        ("fc_bias", {"add": {"fc.bias": torch.zeros(64)}}, "key 'fc.bias' is not part of an EAGLE-3 draft"),
        ("bad_t2d", {"add": {"t2d": torch.ones(64, dtype=torch.bool)}}, "'t2d' disagrees with 'd2t'"),
        ("wide_target", {"cfg_update": {"target_hidden_size": 128}}, "target_hidden_size 128 differs"),
        ("bad_ids", {"cfg_update": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 99]}}},
         r"eagle_aux_hidden_state_layer_ids \[1, 2, 99\] do not fit"),
        ("gelu", {"cfg_update": {"hidden_act": "gelu"}}, "hidden_act 'gelu' is not supported"),
    ]:
        with pytest.raises(EngineError, match=msg):
            load_draft(variant(name, **kw), t)


def test_the_default_dtype_is_the_devices_fastest_and_is_said():
    """`auto` (the default of serve, generate and bench) is bfloat16 on CUDA; on CPU the tiny pair, whose steps
    are bound by overhead, runs in float32 (bench/dtype_bench.py); `generate` and `serve` say which one they run
    in, and serve says why."""
    import subprocess
    import sys

    from provision.engine.loading import auto_dtype, dtype_of

    want = {"cuda": "bfloat16", "cpu": "float32"}[DEVICE.split(":")[0]]
    why = {"cuda": "auto: bfloat16 on CUDA", "cpu": "auto: a step reads 6 MiB of float32 weights, under 64 MiB, "
           "where float32 is faster" if cpu_bf16() else "auto: this CPU has no bfloat16 instructions"}
    why = why[DEVICE.split(":")[0]]
    assert auto_dtype("cuda:1") == ("bfloat16", "auto: bfloat16 on CUDA")
    eng = load_engine(device=DEVICE, dtype="auto", max_seq_len=64)
    assert dtype_of(eng) == want and eng.dtype_note.startswith(why)
    assert load_engine(device=DEVICE, dtype="float32", max_seq_len=64).dtype_note == ""
    p = subprocess.run([sys.executable, "-m", "provision.cli", "engine", "generate", "the cat", "--max-tokens", "4",
                        "--device", DEVICE, "--json"], capture_output=True, text=True)
    assert p.returncode == 0 and json.loads(p.stdout)["dtype"] == want, p.stderr
    p = subprocess.run([sys.executable, "-m", "provision.cli", "engine", "serve", "--help"], capture_output=True,
                       text=True)
    words = " ".join(p.stdout.split())
    assert ("auto: where the engine is fastest (bfloat16 on CUDA; on CPU bfloat16 for a large target where the CPU "
            "has bfloat16 instructions, else float32)") in words and "[default: auto]" in words
    for argv in (["-m", "provision.engine.serve"], ["-m", "provision.cli", "engine", "serve"]):
        srv = subprocess.Popen([sys.executable, *argv, "--port", "0", "--device", DEVICE], stdout=subprocess.PIPE,
                               text=True)
        try:
            line = srv.stdout.readline()
        finally:
            srv.terminate()
            srv.wait()
        assert line.startswith("serving provision-tiny on http://127.0.0.1:") and (
            f" ({want} on {DEVICE}; {why}" in line) and line.endswith(")\n"), line


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's rule")
def test_auto_picks_bfloat16_for_a_large_target_on_a_cpu_with_bfloat16_instructions(tmp_path):
    """A target that reads 64 MiB or more of float32 weights a step (SmolLM2-135M: 513 MiB) runs in bfloat16 where
    the CPU has bfloat16 instructions (2.4x float32 with speculation, docs/engine-dtype.md), else in float32."""
    from provision.engine.loading import auto_dtype, dtype_of, step_weights

    torch.manual_seed(0)
    a = ModelArgs(vocab_size=4096, dim=512, n_layer=6, n_head=8, n_local_heads=8, intermediate_size=1536,
                  max_position_embeddings=256)
    assert step_weights(a) * 4 >= 64 << 20
    save_target(Transformer(a), tmp_path, dtype=torch.bfloat16)
    eng = load_engine(tmp_path, dtype="auto", max_seq_len=64)
    isa = cpu_bf16()
    if isa:
        assert dtype_of(eng) == "bfloat16" and eng.dtype_note.startswith(f"auto: {isa} and a step reads 86 MiB")
    else:
        assert dtype_of(eng) == "float32" and "no bfloat16 instructions" in eng.dtype_note
    smollm2 = ModelArgs(vocab_size=49152, dim=576, n_layer=30, n_head=9, n_local_heads=3, intermediate_size=1536,
                        tie_word_embeddings=True)
    assert step_weights(smollm2) == 134515008            # its parameter count: every one is read each step
    assert auto_dtype("cpu", smollm2)[0] == ("bfloat16" if isa else "float32")
