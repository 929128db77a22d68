"""Tests for lordo_fed.model: our Llama-style Transformer, presets/validation, HF loading."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch

from lordo_fed.model import (
    DEFAULT_LOWRANK_PATTERN,
    PRESETS,
    HFCausalLM,
    ModelConfig,
    Transformer,
    build_model,
    count_parameters,
    lm_loss,
    lowrank_parameter_names,
    resolve_model_config,
)

VOCAB = 97
OUR_LOWRANK = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w1", "mlp.w2", "mlp.w3")


def tiny(**overrides) -> Transformer:
    torch.manual_seed(0)
    return build_model(ModelConfig(preset="tiny", **overrides), VOCAB)


# ---- forward -------------------------------------------------------------------------------


def test_logits_shape_and_dtype():
    model = tiny()
    idx = torch.randint(0, VOCAB, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, VOCAB)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_causal_later_token_does_not_change_earlier_logits():
    model = tiny().eval()
    idx = torch.randint(0, VOCAB, (2, 24))
    t = 11
    changed = idx.clone()
    changed[:, t] = (changed[:, t] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t:], b[:, t:])  # and the change is seen from t on


def test_gqa_forward_and_kv_projection_sizes():
    model = tiny(n_kv_heads=2)
    head_dim = 64 // 4
    assert model.layers[0].attn.wk.weight.shape == (2 * head_dim, 64)
    assert model.layers[0].attn.wv.weight.shape == (2 * head_dim, 64)
    assert model(torch.randint(0, VOCAB, (2, 9))).shape == (2, 9, VOCAB)


def test_sequence_longer_than_max_seq_len_raises():
    model = tiny(max_seq_len=16)
    model(torch.zeros(1, 16, dtype=torch.long))
    with pytest.raises(ValueError, match=r"17 exceeds max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_rope_buffers_are_not_in_state_dict():
    model = tiny()
    assert not any("rope" in k for k in model.state_dict())


# ---- tied embedding, init ------------------------------------------------------------------


def test_tied_embedding_is_one_parameter():
    model = tiny()
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names
    cfg = model.cfg
    per_layer = 4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_hidden + 2 * cfg.dim
    assert count_parameters(model) == VOCAB * cfg.dim + cfg.n_layers * per_layer + cfg.dim
    assert count_parameters(model) == sum(p.numel() for p in model.parameters())


def test_output_projections_init_scaled():
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="custom", dim=256, n_layers=8, n_heads=4), VOCAB)
    std_in = model.layers[0].attn.wq.weight.std().item()
    std_out = model.layers[0].attn.wo.weight.std().item()
    assert std_in == pytest.approx(0.02, rel=0.05)
    assert std_out == pytest.approx(0.02 / 4.0, rel=0.05)  # 1/sqrt(2*8)
    assert torch.equal(model.norm.weight, torch.ones(256))


# ---- presets and validation ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name,dim,n_layers,n_heads,max_seq_len",
    [
        ("tiny", 64, 2, 4, 128),
        ("small", 128, 4, 4, 128),
        ("16m", 256, 4, 4, 256),
        ("125m", 768, 12, 12, 256),
        ("360m", 1024, 24, 16, 256),
        ("720m", 2048, 12, 16, 256),
    ],
)
def test_presets_resolve_to_documented_sizes(name, dim, n_layers, n_heads, max_seq_len):
    cfg = resolve_model_config(ModelConfig(preset=name))
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.max_seq_len) == (dim, n_layers, n_heads, max_seq_len)
    assert cfg.n_kv_heads == n_heads
    assert cfg.ffn_hidden % 64 == 0 and cfg.ffn_hidden >= int(8 * dim / 3)
    assert resolve_model_config(cfg) == cfg  # idempotent


def test_ffn_hidden_llama_rule():
    assert resolve_model_config(ModelConfig(preset="16m")).ffn_hidden == 704  # int(682.67)=682 -> 704
    assert resolve_model_config(ModelConfig(preset="720m")).ffn_hidden == 5504
    assert resolve_model_config(ModelConfig(preset="16m", multiple_of=256)).ffn_hidden == 768


def test_explicit_fields_override_preset():
    cfg = resolve_model_config(
        ModelConfig(preset="125m", dim=480, n_layers=3, max_seq_len=64, ffn_hidden=1000, n_kv_heads=4)
    )
    assert (cfg.dim, cfg.n_layers, cfg.n_heads) == (480, 3, 12)  # n_heads still the preset's
    assert (cfg.max_seq_len, cfg.ffn_hidden, cfg.n_kv_heads) == (64, 1000, 4)
    cfg = resolve_model_config(ModelConfig(preset="tiny", max_seq_len=256))
    assert cfg.max_seq_len == 256 and cfg.dim == 64


def test_custom_preset():
    cfg = resolve_model_config(ModelConfig(preset="custom", dim=96, n_layers=1, n_heads=3))
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.max_seq_len) == (96, 1, 3, 256)
    with pytest.raises(ValueError, match=r"ModelConfig\.dim=None.*custom"):
        resolve_model_config(ModelConfig(preset="custom", n_layers=1, n_heads=3))


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(preset="gpt5"), r"preset='gpt5'.*tiny.*720m.*custom"),
        (dict(dim=66), r"n_heads=4.*dim=66"),
        (dict(n_kv_heads=3), r"n_kv_heads=3.*n_heads=4"),
        (dict(n_layers=0), r"n_layers=0.*positive integer"),
        (dict(dim=-64), r"dim=-64.*positive integer"),
        (dict(max_seq_len=0), r"max_seq_len=0.*positive"),
        (dict(ffn_hidden=-1), r"ffn_hidden=-1.*positive"),
        (dict(norm_eps=0.0), r"norm_eps=0.0.*positive"),
        (dict(dim=4, n_heads=4), r"n_heads=4.*even"),
        (dict(lowrank_pattern="(unclosed"), r"lowrank_pattern='\(unclosed'"),
    ],
)
def test_invalid_config_messages(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        resolve_model_config(ModelConfig(**kwargs))
    with pytest.raises(ValueError, match=pattern):
        build_model(ModelConfig(**kwargs), VOCAB)


def test_invalid_vocab_size():
    with pytest.raises(ValueError, match="vocab_size=0"):
        build_model(ModelConfig(), 0)


# ---- low-rank selection --------------------------------------------------------------------


def test_lowrank_selection_our_model():
    model = tiny(n_kv_heads=2)
    names = lowrank_parameter_names(model)
    expected = [f"layers.{i}.{m}.weight" for i in range(2) for m in OUR_LOWRANK]
    assert sorted(names) == sorted(expected)
    assert len(names) == 7 * 2
    assert all(n in dict(model.named_parameters()) for n in names)


def test_lowrank_custom_pattern_and_invalid_pattern():
    model = tiny()
    assert lowrank_parameter_names(model, r"\.mlp\.") == [
        f"layers.{i}.mlp.{w}.weight" for i in range(2) for w in ("w1", "w3", "w2")
    ]
    # 2-D only: a pattern matching everything still skips the 1-D norm weights
    assert all(dict(model.named_parameters())[n].ndim == 2 for n in lowrank_parameter_names(model, "."))
    with pytest.raises(ValueError, match=re.escape("lowrank_pattern='[bad'")):
        lowrank_parameter_names(model, "[bad")


@pytest.mark.parametrize(
    "name,matches",
    [
        ("model.layers.3.self_attn.q_proj.weight", True),
        ("model.layers.3.self_attn.o_proj.weight", True),
        ("model.layers.3.mlp.gate_proj.weight", True),
        ("model.layers.3.mlp.up_proj.weight", True),
        ("model.layers.3.mlp.down_proj.weight", True),
        ("transformer.h.0.attn.c_attn.weight", True),
        ("transformer.h.0.attn.c_proj.weight", True),
        ("transformer.h.0.mlp.c_fc.weight", True),
        ("transformer.h.0.mlp.c_proj.weight", True),
        ("transformer.h.0.attn.c_attn.bias", False),
        ("model.layers.3.self_attn.q_proj.bias", False),
        ("model.embed_tokens.weight", False),
        ("transformer.wte.weight", False),
        ("transformer.wpe.weight", False),
        ("lm_head.weight", False),
        ("model.layers.3.input_layernorm.weight", False),
        ("model.norm.weight", False),
        ("tok_emb.weight", False),
        ("layers.1.attn_norm.weight", False),
    ],
)
def test_default_pattern_on_hf_names(name, matches):
    assert bool(re.search(DEFAULT_LOWRANK_PATTERN, name)) is matches


# ---- Hugging Face --------------------------------------------------------------------------


def write_llama_config(directory, vocab_size=256):
    directory.mkdir(parents=True, exist_ok=True)
    cfg = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=128,
    )
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def test_hf_llama_from_local_config(tmp_path):
    pytest.importorskip("transformers")
    d = write_llama_config(tmp_path / "llama")
    torch.manual_seed(0)
    model = build_model(ModelConfig(hf_config_path=str(d)), vocab_size=256)
    assert isinstance(model, HFCausalLM)
    assert model.vocab_size == 256 and model.max_seq_len == 128
    logits = model(torch.randint(0, 256, (2, 10)))
    assert logits.shape == (2, 10, 256) and logits.dtype == torch.float32
    names = lowrank_parameter_names(model)
    assert len(names) == 7 * 2
    for i in range(2):
        for leaf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
            assert any(n.endswith(f"layers.{i}.{leaf}.weight") for n in names)
    loss = lm_loss(model, torch.randint(0, 256, (2, 10)), torch.randint(0, 256, (2, 10)))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_hf_config_file_path_and_vocab_checks(tmp_path, caplog):
    pytest.importorskip("transformers")
    d = write_llama_config(tmp_path / "llama")
    with caplog.at_level(logging.WARNING, logger="lordo_fed.model"):
        model = build_model(ModelConfig(hf_config_path=str(d / "config.json")), vocab_size=200)
    assert model.vocab_size == 256  # the config's vocabulary wins
    assert "vocab_size=256" in caplog.text and "200" in caplog.text
    with pytest.raises(ValueError, match=r"vocab_size=300.*larger"):
        build_model(ModelConfig(hf_config_path=str(d)), vocab_size=300)


def test_hf_missing_path_raises_file_not_found(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing)) + r".*config\.json"):
        build_model(ModelConfig(hf_config_path=str(missing)), vocab_size=256)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        build_model(ModelConfig(hf_config_path=str(empty)), vocab_size=256)


# ---- training and size ---------------------------------------------------------------------


def test_adamw_steps_lower_loss_on_repeated_batch():
    model = tiny()
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (4, 33), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch.no_grad():
        initial = lm_loss(model, x, y).item()
    assert initial == pytest.approx(torch.log(torch.tensor(float(VOCAB))).item(), rel=0.1)
    for _ in range(20):
        loss = lm_loss(model, x, y)
        assert loss.dtype == torch.float32
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        final = lm_loss(model, x, y).item()
    assert final < initial - 0.5


def test_720m_preset_parameter_count_on_meta():
    vocab = 50257
    with torch.device("meta"):
        model = build_model(ModelConfig(preset="720m"), vocab)
    assert next(model.parameters()).device.type == "meta"
    d, L = 2048, 12
    ffn = 64 * -(-int(8 * d / 3) // 64)  # Llama rule: 5504
    assert ffn == 5504
    per_layer = 4 * d * d + 3 * d * ffn + 2 * d  # q,k,v,o + w1,w2,w3 + two RMSNorms
    expected = vocab * d + L * per_layer + d  # tied embedding + blocks + final norm
    assert count_parameters(model) == expected
    assert 0.65e9 < expected < 0.75e9
    assert len(lowrank_parameter_names(model)) == 7 * L


def test_presets_dict_matches_docs():
    assert set(PRESETS) == {"tiny", "small", "16m", "125m", "360m", "720m"}


def test_hf_gpt2_lowrank_selection(tmp_path):
    pytest.importorskip("transformers")
    d = tmp_path / "gpt2"
    d.mkdir()
    cfg = dict(model_type="gpt2", n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=128,
               bos_token_id=0, eos_token_id=0)
    (d / "config.json").write_text(json.dumps(cfg))
    model = build_model(ModelConfig(hf_config_path=str(d)), vocab_size=128)
    assert model.max_seq_len == 64
    assert model(torch.randint(0, 128, (1, 8))).shape == (1, 8, 128)
    names = lowrank_parameter_names(model)
    leaves = sorted(n.split(".h.")[1] for n in names)
    assert leaves == sorted(
        f"{i}.{m}.weight" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    )
