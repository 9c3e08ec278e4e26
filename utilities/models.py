"""Named model configurations built from ``transformers`` configs with random weights.

Nothing is downloaded: every model is built from its config, so lessons run offline and the sizes
are exact. Each entry knows its transformer block class (what auto-wrap wraps) and its parameter
count (computed on the meta device, so asking costs no memory).

torch and transformers are imported when a model is built, not with this module: the launcher
checks ``--model`` names without loading them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from utilities.errors import bad_value

if TYPE_CHECKING:
    import torch
    from torch import nn

VOCAB = 384  # byte tokenizer (259 ids) padded to a multiple of 128 for fast matmuls


@dataclass(frozen=True)
class ModelSpec:
    """What a lesson needs to know about a model before building it."""

    name: str
    family: str  # "t5" (encoder-decoder, seq2seq task) or "llama" (decoder-only, causal LM task)
    make_config: Callable[[], object]
    block_class_name: str
    default_seq_len: int

    @property
    def is_seq2seq(self) -> bool:
        return self.family == "t5"

    def config(self):
        return self.make_config()

    def block_class(self) -> type[nn.Module]:
        if self.family == "t5":
            from transformers.models.t5.modeling_t5 import T5Block

            return T5Block
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        return LlamaDecoderLayer

    @property
    def num_parameters(self) -> int:
        return _count_parameters(self.name)

    def build(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
        """Build with random weights on ``device`` (``"meta"`` for a model too large for one host),
        in fp32 unless ``dtype`` says otherwise.

        Every rank must call this after the same ``torch.manual_seed`` so unsharded copies agree.
        """
        import torch

        cfg = self.config()
        with torch.device(device):
            model = _model_class(self.family)(cfg)
        return model.to(dtype) if dtype not in (None, torch.float32) else model

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N + 12 * layers * heads * head_dim * seq (nanoGPT / torchtitan)."""
        cfg = self.config()
        if self.family == "t5":
            layers = cfg.num_layers + cfg.num_decoder_layers
            heads, head_dim = cfg.num_heads, cfg.d_kv
        else:
            layers = cfg.num_hidden_layers
            heads, head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        return 6.0 * self.num_parameters + 12.0 * layers * heads * head_dim * seq_len


def _t5(d_model: int, d_ff: int, layers: int, heads: int, d_kv: int, vocab: int = VOCAB):
    def make():
        from transformers import T5Config

        from utilities.data import ByteTokenizer

        tok = ByteTokenizer()
        return T5Config(
            vocab_size=vocab, d_model=d_model, d_ff=d_ff, num_layers=layers, num_decoder_layers=layers,
            num_heads=heads, d_kv=d_kv, dropout_rate=0.0, pad_token_id=tok.pad_id,
            eos_token_id=tok.eos_id, decoder_start_token_id=tok.pad_id, use_cache=False,
        )

    return make


def _llama(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int = VOCAB,
           tie: bool = False, max_pos: int = 8192):
    def make():
        from transformers import LlamaConfig

        from utilities.data import ByteTokenizer

        tok = ByteTokenizer()
        return LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
            num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
            tie_word_embeddings=tie, pad_token_id=tok.pad_id, bos_token_id=tok.bos_id,
            eos_token_id=tok.eos_id, use_cache=False, attention_dropout=0.0,
        )

    return make


# The "real size" entries keep the published architecture shapes; the vocabulary is the course's
# byte tokenizer except for the Llama 3 sizes, which keep their 128,256-token embedding so the
# parameter counts (1.24B, 8.03B) match the published models.
MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec("t5-tiny", "t5", _t5(128, 512, 4, 4, 32), "T5Block", 64),
        ModelSpec("t5-small", "t5", _t5(512, 2048, 6, 8, 64, vocab=32128), "T5Block", 512),
        ModelSpec("t5-base", "t5", _t5(768, 3072, 12, 12, 64, vocab=32128), "T5Block", 512),
        ModelSpec("t5-large", "t5", _t5(1024, 4096, 24, 16, 64, vocab=32128), "T5Block", 512),
        ModelSpec("t5-3b", "t5", _t5(1024, 16384, 24, 32, 128, vocab=32128), "T5Block", 512),
        ModelSpec("llama-tiny", "llama", _llama(128, 352, 4, 4, 2), "LlamaDecoderLayer", 64),
        ModelSpec("llama-1b", "llama", _llama(2048, 8192, 16, 32, 8, vocab=128256, tie=True),
                  "LlamaDecoderLayer", 2048),
        ModelSpec("llama-8b", "llama", _llama(4096, 14336, 32, 32, 8, vocab=128256),
                  "LlamaDecoderLayer", 2048),
    )
}

# Models whose weights would not comfortably fit one host unsharded in fp32 are built on "meta".
META_INIT_THRESHOLD = 1_500_000_000


def get_model_spec(name: str) -> ModelSpec:
    """Look a model up by name; an unknown name is a one-line error listing the known ones."""
    if name not in MODELS:
        raise bad_value("model", name, MODELS)
    return MODELS[name]


def _model_class(family: str):
    if family == "t5":
        from transformers import T5ForConditionalGeneration

        return T5ForConditionalGeneration
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM


@functools.cache
def _count_parameters(name: str) -> int:
    model = MODELS[name].build(device="meta")
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # parameters() already skips tied duplicates
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def init_weights(model: nn.Module) -> None:
    """(Re)initialize a model's weights in place with its own HF init (after ``to_empty``)."""
    if hasattr(model, "_init_weights"):
        model.apply(model._init_weights)
    else:  # pragma: no cover - plain nn.Module
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
