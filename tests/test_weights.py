"""Tests for reasoning_from_scratch.weights: safetensors save/load, sharding, errors, hub path."""

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_tokenizer import build_tokenizer_json
from tolerance import assert_rounded_alike, forward_terms

from reasoning_from_scratch import files
from reasoning_from_scratch.qwen3 import Qwen3Model, tiny_config
from reasoning_from_scratch.tokenizer import Qwen3Tokenizer
from reasoning_from_scratch.weights import (
    BUNDLED_MODELS,
    load_hf_state_dict,
    load_pretrained,
    resolve_model_dir,
    save_pretrained,
)

VOCAB = 272  # tokenizer has 264 tokens; the model rounds up as Qwen3 does (151669 -> 151936)
IDS = torch.tensor([[5, 17, 200, 261, 3, 99]])


def make_model(tie=True, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, head_dim=8, tie_word_embeddings=tie
    )
    model = Qwen3Model(cfg).eval()
    if not tie:  # give lm_head its own values
        model.lm_head.weight.data.normal_(0, 0.02)
    return model


def make_tokenizer(tmp_path):
    src = tmp_path / "tok_src"
    src.mkdir()
    build_tokenizer_json(src / "tokenizer.json")
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [261, 259]}))
    return Qwen3Tokenizer.from_pretrained(src)


@pytest.fixture
def saved(tmp_path):
    """(model, tokenizer, dir) of a tied tiny model written by save_pretrained."""
    model, tok = make_model(), make_tokenizer(tmp_path)
    out = tmp_path / "ckpt"
    save_pretrained(model, tok, out)
    return model, tok, out


def logits(model):
    with torch.no_grad():
        return model(IDS)


def test_roundtrip_identical_logits_tied(saved):
    model, tok, out = saved
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]  # no temp files left behind
    loaded, tok2 = load_pretrained(out, device="cpu")
    assert not loaded.training
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(logits(loaded), logits(model))
    assert tok2.eos_token_ids == [261, 259] and tok2.encode("hello") == tok.encode("hello")
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
        assert f.metadata() == {"format": "pt"}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["torch_dtype"] == "float32"
    assert cfg["eos_token_id"] == 261
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [261, 259] and gen["pad_token_id"] == 256 + 3


def test_roundtrip_untied(tmp_path):
    model = make_model(tie=False)
    save_pretrained(model, make_tokenizer(tmp_path), tmp_path / "out")
    assert "lm_head.weight" in load_file(str(tmp_path / "out" / "model.safetensors"))
    loaded, _ = load_pretrained(tmp_path / "out", device="cpu")
    assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight
    assert torch.equal(logits(loaded), logits(model))


def test_dtype_load_and_save(saved, tmp_path):
    model, tok, out = saved
    bf16, _ = load_pretrained(str(out), device="cpu", dtype="bfloat16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert bf16.lm_head.weight is bf16.model.embed_tokens.weight
    save_pretrained(bf16, tok, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back, _ = load_pretrained(tmp_path / "bf16", device="cpu", dtype=torch.float32)
    expected = model.model.embed_tokens.weight.to(torch.bfloat16).float()
    assert torch.equal(back.model.embed_tokens.weight, expected)


def test_sharded_checkpoint(saved, tmp_path):
    model, _, out = saved
    sharded = tmp_path / "sharded"
    shutil.copytree(out, sharded)
    (sharded / "model.safetensors").unlink()
    sd = load_file(str(out / "model.safetensors"))
    names = sorted(sd)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half]}
    shards["model-00002-of-00002.safetensors"] = names[half:]
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(sharded / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    state = load_hf_state_dict(sharded)
    assert sorted(state) == names and all(torch.equal(state[k], sd[k]) for k in names)
    loaded, _ = load_pretrained(sharded, device="cpu")
    assert torch.equal(logits(loaded), logits(model))

    # A shard listed in the index that is missing, and a tensor missing from its shard.
    (sharded / "model-00002-of-00002.safetensors").rename(sharded / "elsewhere.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_pretrained(sharded, device="cpu")
    (sharded / "elsewhere.safetensors").rename(sharded / "model-00002-of-00002.safetensors")
    weight_map["ghost.weight"] = "model-00001-of-00002.safetensors"
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match="'ghost.weight'.*model-00001-of-00002.safetensors"):
        load_pretrained(sharded, device="cpu")


def test_save_over_sharded_removes_stale_index(saved, tmp_path):
    model, tok, out = saved
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "old-shard.safetensors"}})
    )
    (out / "old-shard.safetensors").write_bytes(b"stale")
    save_pretrained(model, tok, out)
    assert not (out / "model.safetensors.index.json").exists()
    assert not (out / "old-shard.safetensors").exists()


def rewrite_weights(out, edit):
    sd = load_file(str(out / "model.safetensors"))
    edit(sd)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def test_missing_files_name_the_path(saved):
    _, _, out = saved
    (out / "tokenizer.json").rename(out / "tok.bak")
    with pytest.raises(FileNotFoundError, match=str(out / "tokenizer.json")):
        load_pretrained(out, device="cpu")
    (out / "tok.bak").rename(out / "tokenizer.json")
    (out / "model.safetensors").rename(out / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"no weights in .*model\.safetensors.*pickled"):
        load_pretrained(out, device="cpu")
    (out / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=str(out / "config.json")):
        load_pretrained(out, device="cpu")


def test_other_architecture_is_rejected(saved):
    _, _, out = saved
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*LlamaForCausalLM"):
        load_pretrained(out, device="cpu")


def test_missing_tensor_names_tensor_and_file(saved):
    _, _, out = saved
    rewrite_weights(out, lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(KeyError, match=r"model\.safetensors: model\.layers\.1\.mlp\.up_proj"):
        load_pretrained(out, device="cpu")


def test_shape_mismatch_names_tensor_and_file(saved):
    _, _, out = saved

    def edit(sd):
        sd["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 32)

    rewrite_weights(out, edit)
    with pytest.raises(ValueError, match=r"k_proj\.weight' in .*model\.safetensors has shape"):
        load_pretrained(out, device="cpu")


def test_unexpected_tensor_is_an_error(saved):
    _, _, out = saved
    rewrite_weights(
        out, lambda sd: sd.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(32)})
    )
    with pytest.raises(KeyError, match=r"unexpected.*q_proj\.bias \(model\.safetensors\)"):
        load_pretrained(out, device="cpu")


def test_tied_checkpoint_may_store_lm_head(saved):
    model, _, out = saved
    rewrite_weights(
        out, lambda sd: sd.update({"lm_head.weight": sd["model.embed_tokens.weight"].clone()})
    )
    loaded, _ = load_pretrained(out, device="cpu")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(logits(loaded), logits(model))
    rewrite_weights(out, lambda sd: sd.update({"lm_head.weight": torch.zeros(3, 3)}))
    with pytest.raises(ValueError, match="lm_head.weight"):
        load_pretrained(out, device="cpu")


def test_vocab_larger_than_model_is_rejected(tmp_path):
    torch.manual_seed(0)
    small = Qwen3Model(
        tiny_config(vocab_size=260, hidden_size=32, intermediate_size=64, head_dim=8)
    )
    save_pretrained(small, make_tokenizer(tmp_path), tmp_path / "small")
    with pytest.raises(ValueError, match=r"tokenizer\.json has 264 tokens.*vocab_size=260"):
        load_pretrained(tmp_path / "small", device="cpu")


def test_failed_write_keeps_old_file(saved, monkeypatch):
    model, tok, out = saved
    before = (out / "model.safetensors").read_bytes()

    def boom(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(files, "save_file", boom)  # the atomic writer's safetensors call
    with pytest.raises(OSError, match="disk full"):
        save_pretrained(make_model(seed=1), tok, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_resolve_local_bundled_and_bad_names(saved, tmp_path, monkeypatch):
    _, _, out = saved
    assert resolve_model_dir(out) == out
    assert resolve_model_dir(str(out)) == out
    assert "tiny-arith" in BUNDLED_MODELS
    monkeypatch.setitem(BUNDLED_MODELS, "tiny-arith", out)
    assert resolve_model_dir("tiny-arith") == out
    monkeypatch.setitem(BUNDLED_MODELS, "tiny-arith", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="bundled model 'tiny-arith' is missing"):
        resolve_model_dir("tiny-arith")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(tmp_path / "nope")
    with pytest.raises(NotADirectoryError):
        resolve_model_dir(out / "config.json")


def test_hub_download_success(saved, tmp_path, monkeypatch):
    model, _, out = saved
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, **kw):
        calls.append((repo_id, allow_patterns))
        cache = tmp_path / "hub-cache" / repo_id.replace("/", "--")
        shutil.copytree(out, cache, dirs_exist_ok=True)
        return str(cache)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    loaded, tok = load_pretrained("Qwen/Qwen3-0.6B", device="cpu")
    assert calls[0][0] == "Qwen/Qwen3-0.6B"
    assert {"config.json", "tokenizer.json", "*.safetensors"} <= set(calls[0][1])
    assert "model.safetensors.index.json" in calls[0][1]
    assert torch.equal(logits(loaded), logits(model))


def test_hub_offline_gives_clear_message(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kw):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ConnectionError) as info:
        load_pretrained("Qwen/Qwen3-0.6B-Base", device="cpu")
    msg = str(info.value)
    assert "could not download Qwen/Qwen3-0.6B-Base" in msg
    assert "https://huggingface.co/Qwen/Qwen3-0.6B-Base" in msg
    for name in ["config.json", "tokenizer.json", "model.safetensors.index.json", "*.safetensors"]:
        assert name in msg
    assert "pass its path" in msg


def test_transformers_loads_saved_dir(saved):
    transformers = pytest.importorskip("transformers")
    model, tok, out = saved
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    with torch.no_grad():
        hf_logits = hf(IDS).logits
    assert_rounded_alike(hf_logits, logits(model), forward_terms(model.cfg, IDS.shape[1]))
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "<|im_start|>héllo wörld 🙂<think>\n</think>"
    assert hf_tok.encode(text) == tok.encode(text)
    assert hf_tok.eos_token_id == tok.eos_token_id
    for think in (True, False):
        hf_text = hf_tok.apply_chat_template(
            [{"role": "user", "content": "2+3?"}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=think,
        )
        assert hf_text == tok.apply_chat_template("2+3?", enable_thinking=think)


def test_saved_files_get_normal_permissions(saved):
    """Atomic writes go through mkstemp (mode 0600); the final files must be readable by all."""
    _, _, out = saved
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f.name


def test_opt_in_qwen3_skips_without_the_directory_and_loads_it_when_set(tmp_path, monkeypatch,
                                                                          capsys):
    """The notebooks' opt-in cells: one line saying the cell was skipped when QWEN3_DIR is unset;
    the checkpoint it names loaded (float32, on the best device) when set."""
    from reasoning_from_scratch.weights import OPT_IN_ENV, opt_in_qwen3
    monkeypatch.delenv(OPT_IN_ENV, raising=False)
    assert opt_in_qwen3() is None
    shown = capsys.readouterr().out
    assert shown.startswith("skipped:") and OPT_IN_ENV in shown and shown.count("\n") == 1
    model, tokenizer = load_pretrained("tiny-arith", device="cpu", dtype=torch.bfloat16)
    save_pretrained(model, tokenizer, tmp_path / "qwen3")
    monkeypatch.setenv(OPT_IN_ENV, str(tmp_path / "qwen3"))
    monkeypatch.setattr("reasoning_from_scratch.weights.get_device", lambda: torch.device("cpu"))
    loaded = opt_in_qwen3()
    assert loaded.path == tmp_path / "qwen3" and loaded.device == torch.device("cpu")
    assert next(loaded.model.parameters()).dtype == torch.float32
    ids = torch.tensor([loaded.tokenizer.encode("Compute 2+3")])
    with torch.no_grad():
        assert torch.allclose(loaded.model(ids), model.float()(ids), atol=1e-5)

