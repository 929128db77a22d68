"""The language model: a Llama-style decoder in one readable file, or any Hugging Face causal LM.

Our `Transformer` is the paper's architecture family (pre-norm RMSNorm, rotary position
embeddings, SwiGLU MLP, no biases, tied input/output embedding), sized by named presets.
`build_model` is the single entry point: it builds ours, or, when `ModelConfig.hf_config_path`
points at a local `config.json`, whatever `AutoModelForCausalLM.from_config` makes of it
(randomly initialised: this is pre-training, no weights are loaded and nothing is downloaded).

Either way the model maps token ids `[B, T]` to float32 logits `[B, T, V]`, and
`lowrank_parameter_names` says which 2-D weights get low-rank optimizer states
(the attention and MLP matrices of every block; embeddings, norms and biases stay full-rank).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from lordo_fed.config import setting

log = logging.getLogger(__name__)

# Leaf module names of the block matrices that get low-rank optimizer states, followed by
# `.weight` at the end of the parameter name (so biases never match):
#   ours:                    attn.{wq,wk,wv,wo}, mlp.{w1,w2,w3}
#   HF Llama/Mistral/Qwen:   self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj
#   HF GPT-2 (Conv1D, 2-D):  attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj
# Embeddings (tok_emb, embed_tokens, wte, wpe), norms and lm_head have other names.
DEFAULT_LOWRANK_PATTERN = (
    r"(?:^|\.)(?:wq|wk|wv|wo|w1|w2|w3"
    r"|q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj"
    r"|c_attn|c_proj|c_fc)\.weight$"
)

# Architecture presets, named as in the paper. The names are nominal: the real parameter
# count depends on the vocabulary, because the (tied) embedding is vocab_size * dim
# (e.g. 720m with the GPT-2 vocabulary of 50257 is ~0.71 B; with a 256-symbol byte vocabulary
# it is ~0.61 B). `tiny` is for unit tests, `small` for CPU benchmarks.
PRESETS: dict[str, dict] = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, max_seq_len=128),
    "small": dict(dim=128, n_layers=4, n_heads=4, max_seq_len=128),
    "16m": dict(dim=256, n_layers=4, n_heads=4, max_seq_len=256),
    "125m": dict(dim=768, n_layers=12, n_heads=12, max_seq_len=256),
    "360m": dict(dim=1024, n_layers=24, n_heads=16, max_seq_len=256),
    "720m": dict(dim=2048, n_layers=12, n_heads=16, max_seq_len=256),
}

CUSTOM_PRESET = "custom"
_DEFAULT_MAX_SEQ_LEN = 256  # for preset="custom" when max_seq_len is not given


@dataclass
class ModelConfig:
    """Model architecture. Fields left at None are filled by `resolve_model_config`."""

    preset: str = setting("model-preset", "tiny")
    """Name of a preset in PRESETS, or "custom" (then dim, n_layers, n_heads are required)."""
    dim: int | None = None
    """Model width (residual stream size). None = the preset's."""
    n_layers: int | None = None
    """Number of transformer blocks. None = the preset's."""
    n_heads: int | None = None
    """Number of query heads; must divide dim. None = the preset's."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); must divide n_heads. None = n_heads."""
    ffn_hidden: int | None = None
    """SwiGLU hidden width. None = Llama rule: multiple_of * ceil(int(8 * dim / 3) / multiple_of)."""
    multiple_of: int = 64
    """Rounding for the default ffn_hidden (keeps matmuls hardware-friendly)."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorms."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    max_seq_len: int | None = None
    """Longest sequence the RoPE tables cover. None = the preset's (256; 128 for tiny/small)."""
    init_std: float = 0.02
    """Std of the normal init of linears and the embedding (output projections also / sqrt(2L))."""
    hf_config_path: str | None = None
    """Local directory holding a config.json (or the file itself): build that HF model instead."""
    lowrank_pattern: str = DEFAULT_LOWRANK_PATTERN
    """Regex (re.search) on parameter names selecting the 2-D weights with low-rank states."""


def default_ffn_hidden(dim: int, multiple_of: int) -> int:
    """Llama's SwiGLU width: 2/3 of 4*dim (same FLOPs as a 4*dim GELU MLP), rounded up."""
    return multiple_of * math.ceil(int(8 * dim / 3) / multiple_of)


def _check_positive(name: str, value, kind: type = int) -> None:
    ok_type = (
        isinstance(value, int) and not isinstance(value, bool)
        if kind is int
        else isinstance(value, (int, float)) and not isinstance(value, bool)
    )
    if not ok_type or not value > 0:
        what = "a positive integer" if kind is int else "a positive number"
        raise ValueError(f"ModelConfig.{name}={value!r}: expected {what}")


def _compile_pattern(pattern: str | re.Pattern) -> re.Pattern:
    if isinstance(pattern, re.Pattern):
        return pattern
    try:
        return re.compile(pattern)
    except (re.error, TypeError) as e:
        raise ValueError(f"lowrank_pattern={pattern!r} is not a valid regular expression: {e}") from e


def resolve_model_config(cfg: ModelConfig) -> ModelConfig:
    """Return a copy of `cfg` with preset values filled in and every field validated.

    Explicitly set fields override the preset. The result has no None left among the
    architecture fields (n_kv_heads and ffn_hidden get their derived values), so resolving
    twice is a no-op. With `hf_config_path` set the architecture fields are unused (the HF
    config decides), so only what is given is checked; max_seq_len still gets a value, since
    the data pipeline reads it.
    """
    if cfg.preset != CUSTOM_PRESET and cfg.preset not in PRESETS:
        known = ", ".join([*PRESETS, CUSTOM_PRESET])
        raise ValueError(f"ModelConfig.preset={cfg.preset!r}: unknown preset; expected one of {known}")
    preset = PRESETS.get(cfg.preset, {})
    values = dataclasses.asdict(cfg)
    for key, value in preset.items():
        if values[key] is None:
            values[key] = value
    if values["max_seq_len"] is None:
        values["max_seq_len"] = _DEFAULT_MAX_SEQ_LEN
    out = ModelConfig(**values)

    _compile_pattern(out.lowrank_pattern)
    _check_positive("max_seq_len", out.max_seq_len)
    if out.hf_config_path is not None:
        return out

    for name in ("dim", "n_layers", "n_heads"):
        if getattr(out, name) is None:
            raise ValueError(
                f"ModelConfig.{name}=None: preset={out.preset!r} provides no value, "
                f"so {name} must be set explicitly (a positive integer)"
            )
        _check_positive(name, getattr(out, name))
    _check_positive("multiple_of", out.multiple_of)
    for name in ("norm_eps", "rope_theta", "init_std"):
        _check_positive(name, getattr(out, name), float)

    if out.dim % out.n_heads != 0:
        raise ValueError(
            f"ModelConfig.n_heads={out.n_heads}: must divide dim={out.dim} "
            f"(head size = dim / n_heads)"
        )
    if (out.dim // out.n_heads) % 2 != 0:
        raise ValueError(
            f"ModelConfig.n_heads={out.n_heads}: head size dim/n_heads={out.dim // out.n_heads} "
            f"must be even for rotary embeddings"
        )
    if out.n_kv_heads is None:
        out.n_kv_heads = out.n_heads
    _check_positive("n_kv_heads", out.n_kv_heads)
    if out.n_heads % out.n_kv_heads != 0:
        raise ValueError(
            f"ModelConfig.n_kv_heads={out.n_kv_heads}: must divide n_heads={out.n_heads} "
            f"(each key/value head serves n_heads / n_kv_heads query heads)"
        )
    if out.ffn_hidden is None:
        out.ffn_hidden = default_ffn_hidden(out.dim, out.multiple_of)
    _check_positive("ffn_hidden", out.ffn_hidden)
    return out


# --------------------------------------------------------------------------------------------
# Our Transformer
# --------------------------------------------------------------------------------------------


def rope_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_seq_len, head_dim] for the "rotate half" RoPE layout (as in HF Llama).

    Computed in float32: bf16 angles lose whole radians at long positions.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(t, inv_freq)  # [T, head_dim / 2]
    angles = torch.cat([angles, angles], dim=-1)  # [T, head_dim]: each frequency for both halves
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, head_dim] by position; cast back so bf16 autocast stays bf16."""
    return (x * cos + _rotate_half(x) * sin).type_as(x)


def _rms_norm(dim: int, eps: float) -> nn.Module:
    if hasattr(nn, "RMSNorm"):  # torch >= 2.4: fused, and what torch.compile knows best
        return nn.RMSNorm(dim, eps=eps)
    return _RMSNorm(dim, eps)


class _RMSNorm(nn.Module):
    """Fallback for old torch: x / rms(x) * weight, computed in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


class Attention(nn.Module):
    """Causal multi-head attention with RoPE and grouped-query key/value heads."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:
            # Share each k/v head among its group of query heads. An explicit repeat rather than
            # SDPA's enable_gqa, which not every fused backend supports.
            rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, head_dim]
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): w1 is the gate, w3 the up projection, w2 the down projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = _rms_norm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = _rms_norm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Llama-style decoder-only LM: token ids [B, T] -> float32 logits [B, T, vocab_size]."""

    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        cfg = resolve_model_config(cfg)
        if cfg.hf_config_path is not None:
            raise ValueError("ModelConfig.hf_config_path is set: use build_model() for HF models")
        if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
            raise ValueError(f"vocab_size={vocab_size!r}: expected a positive integer")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.max_seq_len = cfg.max_seq_len

        self.tok_emb = nn.Embedding(vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _rms_norm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, vocab_size, bias=False)
        # Tie input and output embeddings: one matrix, saves vocab*dim parameters, and it is
        # registered under tok_emb first, so named_parameters() lists it once, as tok_emb.weight.
        self.lm_head.weight = self.tok_emb.weight

        # RoPE tables are derived state: non-persistent, so they stay out of checkpoints and out
        # of the aggregated model state.
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re-)initialise all weights and the RoPE tables.

        Also the way out of meta-device construction: `model.to_empty(device=d)` then
        `model.init_weights()`.
        """
        std = self.cfg.init_std
        # Each block adds two outputs (attn wo, mlp w2) to the residual stream; shrinking their
        # init by 1/sqrt(2 * n_layers) keeps the stream's variance O(1) at depth (GPT-2).
        out_std = std / math.sqrt(2 * self.cfg.n_layers)
        nn.init.normal_(self.tok_emb.weight, mean=0.0, std=std)  # also the tied head
        for layer in self.layers:
            for lin in (layer.attn.wq, layer.attn.wk, layer.attn.wv, layer.mlp.w1, layer.mlp.w3):
                nn.init.normal_(lin.weight, mean=0.0, std=std)
            for lin in (layer.attn.wo, layer.mlp.w2):
                nn.init.normal_(lin.weight, mean=0.0, std=out_std)
            layer.attn_norm.reset_parameters()
            layer.mlp_norm.reset_parameters()
        self.norm.reset_parameters()
        cos, sin = rope_tables(
            self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len, self.cfg.rope_theta,
            device=self.rope_cos.device,
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        if T > self.max_seq_len:
            raise ValueError(
                f"sequence length {T} exceeds max_seq_len={self.max_seq_len} "
                f"(raise ModelConfig.max_seq_len)"
            )
        x = self.tok_emb(idx)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x)).float()


# --------------------------------------------------------------------------------------------
# Hugging Face models
# --------------------------------------------------------------------------------------------


class HFCausalLM(nn.Module):
    """Wraps a transformers causal LM so that forward(idx) returns float32 logits [B, T, V]."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        config = hf_model.config
        self.vocab_size = int(config.vocab_size)
        # Llama-likes say max_position_embeddings, GPT-2 says n_positions.
        self.max_seq_len = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)

    @property
    def config(self):
        return self.hf.config

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # No KV cache: we only train, and the cache object costs memory and time.
        return self.hf(input_ids=idx, use_cache=False).logits.float()


def _hf_config_dir(path: str | Path) -> Path:
    """The directory holding config.json, from a path to it or to the file itself."""
    p = Path(path).expanduser()
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"hf_config_path={str(path)!r}: no such file; expected a local directory containing "
            f"config.json (or the path of that file). Nothing is downloaded."
        )
    return p


def build_hf_model(hf_config_path: str | Path, vocab_size: int | None = None) -> HFCausalLM:
    """A randomly initialised HF causal LM from a local config.json (no download, no weights).

    The model keeps the vocabulary of its config. `vocab_size` (the tokenizer's) may be smaller
    (extra rows are never indexed; we log a warning) but not larger.
    """
    config_file = _hf_config_dir(hf_config_path)
    try:
        import transformers
    except ImportError as e:
        raise ImportError(
            "hf_config_path needs the optional dependency transformers: pip install lordo-fed[hf]"
        ) from e
    if config_file.name == "config.json":
        config = transformers.AutoConfig.from_pretrained(str(config_file.parent), local_files_only=True)
    else:  # a config saved under another name: read it ourselves
        with open(config_file) as f:
            config_dict = json.load(f)
        if "model_type" not in config_dict:
            raise ValueError(f"hf_config_path={str(hf_config_path)!r}: config has no 'model_type'")
        config = transformers.AutoConfig.for_model(**config_dict)

    model_vocab = int(config.vocab_size)
    if vocab_size is not None:
        if vocab_size > model_vocab:
            raise ValueError(
                f"tokenizer vocab_size={vocab_size} is larger than the HF config's "
                f"vocab_size={model_vocab} ({config_file}): token ids would be out of range"
            )
        if vocab_size != model_vocab:
            log.warning(
                "HF config %s has vocab_size=%d but the tokenizer has %d; using the config's",
                config_file, model_vocab, vocab_size,
            )
    model = transformers.AutoModelForCausalLM.from_config(config)
    return HFCausalLM(model)


def build_model(cfg: ModelConfig, vocab_size: int) -> nn.Module:
    """The model `cfg` describes: the HF model of cfg.hf_config_path if set, else our Transformer."""
    cfg = resolve_model_config(cfg)
    if cfg.hf_config_path is not None:
        return build_hf_model(cfg.hf_config_path, vocab_size)
    return Transformer(cfg, vocab_size)


# --------------------------------------------------------------------------------------------
# Helpers shared by the optimizer and the trainer
# --------------------------------------------------------------------------------------------


def lowrank_parameter_names(model: nn.Module, pattern: str | re.Pattern = DEFAULT_LOWRANK_PATTERN) -> list[str]:
    """Names (as in named_parameters, tied weights once) of 2-D parameters matching `pattern`."""
    regex = _compile_pattern(pattern)
    return [name for name, p in model.named_parameters() if p.ndim == 2 and regex.search(name)]


def count_parameters(model: nn.Module) -> int:
    """Number of unique parameter elements (a tied weight counts once)."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of model(x) [B, T, V] against targets y [B, T], in float32."""
    logits = model(x).float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
