"""Named model configurations built from ``transformers`` configs with random weights.

Nothing is downloaded: every model is built from its config, so lessons run offline and the sizes
are exact. Each entry knows its transformer block class (what auto-wrap wraps) and its parameter
count (from its shapes for the named models; on the meta device for a config file, so asking
costs no memory).

torch and transformers are imported when a model is built, not with this module: the launcher
checks ``--model`` names without loading them.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from utilities.errors import UsageError, bad_value

if TYPE_CHECKING:
    import torch
    from torch import nn

VOCAB = 384  # byte tokenizer (259 ids) padded to a multiple of 128 for fast matmuls


@dataclass(frozen=True)
class ModelSpec:
    """What a lesson needs to know about a model before building it."""

    name: str
    family: str  # "t5", "llama", or the transformers ``model_type`` of a config file
    make_config: Callable[[], object]
    block_class_name: str
    default_seq_len: int
    task: str = ""  # "seq2seq", "causal" or "masked"; "" means: from the family (t5: seq2seq)
    # config -> model, built on the current default device; None: transformers' class for the task
    make_model: Callable[[object], nn.Module] | None = None
    block_type: type | None = None  # the block class itself, for a model built by make_model
    # the parameter count from the architecture's shapes (the named models: listing them builds
    # nothing); None: counted on the meta device when asked
    known_parameters: int | None = None
    # what a plan of it must say (a config file's size fields that transformers defaulted)
    warnings: tuple[str, ...] = ()

    @property
    def is_seq2seq(self) -> bool:
        return (self.task or ("seq2seq" if self.family == "t5" else "causal")) == "seq2seq"

    def config(self):
        return self.make_config()

    def block_class(self) -> type[nn.Module]:
        """The transformer block class (what auto-wrap wraps), found beside the model's class."""
        import sys

        if self.block_type is not None:
            return self.block_type
        module = sys.modules[self.model_class().__module__]
        return getattr(module, self.block_class_name)

    def model_class(self) -> type[nn.Module]:
        """The transformers class that builds this model from its config."""
        if self.make_model is not None:
            raise TypeError(f"{self.name} is built by its own factory, not a transformers class")
        if self.family in ("t5", "llama"):
            return _model_class(self.family)
        return _task_model_class(self.config(), self.task)

    @property
    def num_parameters(self) -> int:
        return self.known_parameters if self.known_parameters is not None else count_parameters(self)

    def build(self, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> nn.Module:
        """Build with random weights on ``device`` (``"meta"`` for a model too large for one host),
        in fp32 unless ``dtype`` says otherwise.

        Every rank must call this after the same ``torch.manual_seed`` so unsharded copies agree.
        """
        import torch

        cfg = self.config()
        with torch.device(device):
            model = (self.make_model or self.model_class())(cfg)
        return model.to(dtype) if dtype not in (None, torch.float32) else model

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N + 12 * layers * heads * head_dim * seq (nanoGPT / torchtitan)."""
        layers, heads, head_dim = attention_shape(self.config())
        return 6.0 * self.num_parameters + 12.0 * layers * heads * head_dim * seq_len


def attention_shape(cfg) -> tuple[int, int, int]:
    """(layers, heads, head_dim) of a transformers config, under the names families use."""
    def first(*names, default=0):
        for n in names:
            value = getattr(cfg, n, None)
            if isinstance(value, int) and value > 0:
                return value
        return default

    if getattr(cfg, "is_encoder_decoder", False):
        layers = first("num_layers", "encoder_layers") + first("num_decoder_layers", "decoder_layers",
                                                                "num_layers")
    else:
        layers = first("num_hidden_layers", "n_layer", "num_layers")
    heads = first("num_attention_heads", "num_heads", "n_head", "encoder_attention_heads", default=1)
    hidden = first("hidden_size", "d_model", "n_embd")
    head_dim = first("head_dim", "d_kv", default=hidden // heads)
    return layers, heads, head_dim


def t5_shapes(d_model: int, d_ff: int, layers: int, heads: int, d_kv: int, vocab: int = VOCAB) -> dict:
    """A T5 (v1.0: ReLU feed-forward, embeddings tied to the LM head, 32 relative-position buckets)
    of these shapes: its config factory and its parameter count, from the shapes."""
    inner, buckets = heads * d_kv, 32
    attention = 4 * d_model * inner + d_model  # q, k, v, o and its layer norm
    feed_forward = 2 * d_model * d_ff + d_model  # wi, wo and its layer norm
    encoder = layers * (attention + feed_forward) + buckets * heads + d_model  # + bias, final norm
    decoder = layers * (2 * attention + feed_forward) + buckets * heads + d_model  # + cross-attention
    parameters = vocab * d_model + encoder + decoder

    def make():
        from transformers import T5Config

        from utilities.data import ByteTokenizer

        tok = ByteTokenizer()
        return T5Config(
            vocab_size=vocab, d_model=d_model, d_ff=d_ff, num_layers=layers, num_decoder_layers=layers,
            num_heads=heads, d_kv=d_kv, dropout_rate=0.0, pad_token_id=tok.pad_id,
            eos_token_id=tok.eos_id, decoder_start_token_id=tok.pad_id, use_cache=False,
        )

    return dict(make_config=make, known_parameters=parameters)


def llama_shapes(hidden: int, inter: int, layers: int, heads: int, kv_heads: int, vocab: int = VOCAB,
           tie: bool = False, max_pos: int = 8192) -> dict:
    """A Llama (no biases, SwiGLU, RMSNorm) of these shapes: its config factory and its parameter
    count, from the shapes."""
    head_dim = hidden // heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim  # q, o; k, v
    block = attention + 3 * hidden * inter + 2 * hidden  # + gate, up, down and two norms
    parameters = vocab * hidden * (1 if tie else 2) + layers * block + hidden  # + the final norm

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

    return dict(make_config=make, known_parameters=parameters)


# The "real size" entries keep the published architecture shapes; the vocabulary is the course's
# byte tokenizer except for the Llama 3 sizes, which keep their 128,256-token embedding so the
# parameter counts (1.24B, 8.03B) match the published models.
MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec("t5-tiny", "t5", block_class_name="T5Block", default_seq_len=64,
                  **t5_shapes(128, 512, 4, 4, 32)),
        ModelSpec("t5-small", "t5", block_class_name="T5Block", default_seq_len=512,
                  **t5_shapes(512, 2048, 6, 8, 64, vocab=32128)),
        ModelSpec("t5-base", "t5", block_class_name="T5Block", default_seq_len=512,
                  **t5_shapes(768, 3072, 12, 12, 64, vocab=32128)),
        ModelSpec("t5-large", "t5", block_class_name="T5Block", default_seq_len=512,
                  **t5_shapes(1024, 4096, 24, 16, 64, vocab=32128)),
        ModelSpec("t5-3b", "t5", block_class_name="T5Block", default_seq_len=512,
                  **t5_shapes(1024, 16384, 24, 32, 128, vocab=32128)),
        ModelSpec("llama-tiny", "llama", block_class_name="LlamaDecoderLayer", default_seq_len=64,
                  **llama_shapes(128, 352, 4, 4, 2)),
        ModelSpec("llama-1b", "llama", block_class_name="LlamaDecoderLayer", default_seq_len=2048,
                  **llama_shapes(2048, 8192, 16, 32, 8, vocab=128256, tie=True)),
        ModelSpec("llama-8b", "llama", block_class_name="LlamaDecoderLayer", default_seq_len=2048,
                  **llama_shapes(4096, 14336, 32, 32, 8, vocab=128256)),
    )
}

# Models whose weights would not comfortably fit one host unsharded in fp32 are built on "meta".
META_INIT_THRESHOLD = 1_500_000_000


CONFIG_FILE_ALLOWED = ("a course model name (" + ", ".join(MODELS) + "), a Hugging Face config.json "
                       "or a folder holding one")


def get_model_spec(name: str | ModelSpec) -> ModelSpec:
    """A model by name, or from a Hugging Face ``config.json`` (or a folder holding one); an unknown
    name or a config that cannot be built is a one-line error."""
    if isinstance(name, ModelSpec):
        return name
    if name in MODELS:
        return MODELS[name]
    if looks_like_path(name):
        path = os.path.abspath(os.path.expanduser(name))
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise bad_value("model", name, CONFIG_FILE_ALLOWED + " (no such file: " + path + ")")
        return spec_from_config_file(path, os.stat(path).st_mtime_ns)
    raise bad_value("model", name, CONFIG_FILE_ALLOWED)


def looks_like_path(name: str) -> bool:
    """A ``--model`` value that names a file or folder rather than a course model."""
    return (os.sep in name or name.endswith(".json") or name.startswith((".", "~"))
            or os.path.exists(name))


TASKS = ("seq2seq", "causal", "masked")


@functools.cache
def spec_from_config_file(path: str, mtime_ns: int = 0) -> ModelSpec:
    """A ``ModelSpec`` from a Hugging Face ``config.json``: nothing is downloaded and no code from
    the file runs (``auto_map`` / remote code is ignored; only transformers' own classes build).

    The task follows the config: encoder-decoder -> seq2seq LM; otherwise the class its
    ``architectures`` names when transformers has it, else a causal LM when the family has one,
    else a masked LM (BERT-style). The block class is the most frequent class among the model's
    ``_no_split_modules`` (the units FSDP should wrap), else the element class of its largest
    ``nn.ModuleList``. ``mtime_ns`` keys the cache, so an edited file is read again.
    """
    def refuse(why: str) -> UsageError:
        return UsageError(f"model config {path!r} cannot be built: {why}")

    from utilities.json_input import read_json

    try:
        raw = read_json(path)
    except UsageError as e:
        raise refuse(f"not a readable JSON file ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise refuse("it has no \"model_type\" (a transformers config.json names its family there)")
    try:
        defaulted = check_config_sizes(raw)
    except UsageError as e:
        raise refuse(str(e)) from None
    try:
        config = _config_from_dict(raw["model_type"], raw)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; each becomes one line
        raise refuse(f"{type(e).__name__}: {_one_line(e)}") from None
    odd = _odd_rotary_dim(config)
    if odd:
        raise refuse(odd)
    task = _task_of(config)
    try:
        model_class = _task_model_class(config, task)
        import torch

        with torch.device("meta"):
            model = model_class(config)
    except Exception as e:  # noqa: BLE001
        raise refuse(f"{type(e).__name__}: {_one_line(e)}") from None
    block = _pick_block_class(model)
    if block is None:
        raise refuse("no repeated transformer block found to shard (no _no_split_modules, no ModuleList)")
    if not hasattr(config, "vocab_size"):
        raise refuse("the config has no vocab_size (the planner feeds token ids)")
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = min(int(max_pos), 2048) if isinstance(max_pos, int) and max_pos > 0 else 512
    frozen = config.to_dict()
    warnings = ()
    if defaulted:
        values = ", ".join(f"{name}={getattr(config, name, None)}" for name in defaulted)
        warnings = (f"{os.path.basename(path)} does not give {', '.join(defaulted)}: planned with "
                    f"transformers' {raw['model_type']} defaults ({values})",)
    return ModelSpec(name=path, family=raw["model_type"],
                     make_config=functools.partial(_config_from_dict, raw["model_type"], frozen),
                     block_class_name=block.__name__, default_seq_len=seq, task=task,
                     warnings=warnings)


def _one_line(e: Exception, limit: int = 300) -> str:
    """An exception's whole message on one line (transformers puts the reason on the second)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _odd_rotary_dim(config) -> str:
    """Why rotary position embeddings cannot run on ``config`` (an odd head dimension: RoPE
    rotates pairs of features), or "" (transformers 5 refuses it itself; older ones fail inside
    the step)."""
    if getattr(config, "rope_theta", None) is None and not getattr(config, "rope_parameters", None):
        return ""
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    head_dim = getattr(config, "head_dim", None) or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 else None)
    if not isinstance(head_dim, int) or head_dim % 2 == 0:
        return ""
    return (f"head_dim {head_dim} (hidden_size {hidden} / {heads} heads) is odd; allowed: an even "
            "head dimension (rotary position embeddings rotate pairs of features)")


# The sizes a plan depends on, by transformers' standard name, and the names families give them
# in a config.json (a family's ``attribute_map`` adds its own).
SIZE_FIELDS = {
    "hidden_size": ("hidden_size", "d_model", "n_embd", "dim"),
    "num_hidden_layers": ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers"),
    "num_attention_heads": ("num_attention_heads", "num_heads", "n_head", "n_heads",
                            "encoder_attention_heads"),
    "vocab_size": ("vocab_size",),
    "intermediate_size": ("intermediate_size", "d_ff", "n_inner", "ffn_dim", "encoder_ffn_dim",
                          "hidden_dim"),
}
# Layer counts are bounded: the planner builds and traces every block (about 0.1-0.2 s each on a
# laptop core), and the deepest published model (Llama 3.1 405B) has 126.
MAX_LAYERS = 256
LAYER_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers",
                "decoder_layers", "num_decoder_layers")
# Experts of a mixture-of-experts layer are modules too (DeepSeek-V3: 256 per layer).
MAX_EXPERTS = 1024
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
# A bound on a width, head count or vocabulary (the largest vocabularies hold about 256K tokens): a
# config far past any model's is inspected on meta tensors all the same (a vocabulary of 2**31 is),
# and refused only past 2**40, where one dimension alone outgrows every machine.
MAX_SIZE = 2**40
# how many close matches an unknown model_type is answered with
CLOSE_MATCHES = 3


def check_config_sizes(raw: dict) -> tuple[str, ...]:
    """Check a config.json's ``model_type`` and size fields before transformers sees them: an
    unknown family is named with its closest known ones; a size that is not a positive integer
    (a layer or expert count beyond ``MAX_LAYERS`` / ``MAX_EXPERTS``) is refused naming the field
    and what is allowed; a file that gives none of the sizes its family has is refused (it would
    be planned with transformers' defaults, a model nobody wrote). Returns the family's size
    fields the file leaves out (planned with the defaults, which a plan says)."""
    import difflib

    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

    model_type = raw["model_type"]
    if model_type not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(model_type[:100], list(CONFIG_MAPPING_NAMES), n=CLOSE_MATCHES)
        shown = model_type if len(model_type) <= 60 else model_type[:60] + "..."
        raise UsageError(f"model_type {shown!r} is not one transformers {transformers.__version__} "
                         "knows" + (f"; the closest: {', '.join(close)}" if close else ""))
    config_class = CONFIG_MAPPING[model_type]
    default = config_class()
    aliases = getattr(config_class, "attribute_map", {}) or {}
    scopes = [(raw, vars(default))]
    sub = getattr(default, "text_config", None)
    if sub is not None and hasattr(sub, "__dict__"):  # a multimodal config: the sizes are its LM's
        text = raw.get("text_config")
        scopes.append((text if isinstance(text, dict) else {}, vars(sub)))
    for given, defaults in scopes:
        for name, value in given.items():
            _check_size_value(name, value, defaults)
    names = raw.get("architectures")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        shown = repr(names) if len(repr(names)) <= 40 else repr(names)[:37] + "..."
        raise UsageError(f"architectures {shown} is not allowed; allowed: a list of class names")
    missing, present = [], []
    for standard, names in SIZE_FIELDS.items():
        names = (*names, aliases[standard]) if standard in aliases else names
        for given, defaults in scopes:
            own = [n for n in names if n in defaults]
            if not own:
                continue
            (present if any(n in given for n in names) else missing).append(own[0])
            break
    if missing and not present:
        raise UsageError(f"it gives none of the sizes a {model_type} model needs ({', '.join(missing)}); "
                         "transformers' defaults would be planned, not your model")
    return tuple(missing)


def _check_size_value(name: str, value: object, defaults: dict) -> None:
    """Refuse one size field whose value no model has (the family's own default of None passes)."""
    sizes = {n for names in SIZE_FIELDS.values() for n in names}
    if name not in sizes | set(LAYER_FIELDS) | set(EXPERT_FIELDS):
        return
    if value is None and defaults.get(name, 0) is None:
        return
    low = 0 if name in EXPERT_FIELDS else 1
    high = MAX_LAYERS if name in LAYER_FIELDS else MAX_EXPERTS if name in EXPERT_FIELDS else None
    allowed = (f"integers in [{low}, {high}]" if high else
               f"integers >= {low} (at most {MAX_SIZE:,})")
    if (isinstance(value, bool) or not isinstance(value, int) or value < low
            or value > (high or MAX_SIZE)):
        shown = value if not isinstance(value, str) or len(value) <= 40 else value[:40] + "..."
        raise bad_value(name, shown, allowed + (" (the planner builds and traces every layer; the "
                                                 "deepest published model has 126)"
                                                 if name in LAYER_FIELDS else ""))


def _config_from_dict(model_type: str, values: dict):
    """The config for training: no KV cache (recomputed blocks under checkpointing would append
    to it), no ``auto_map`` (remote code never runs)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in values.items() if k not in ("model_type", "auto_map")}
    return AutoConfig.for_model(model_type, **dict(fields, use_cache=False))


def _task_of(config) -> str:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    for arch in getattr(config, "architectures", None) or []:
        if arch.endswith("ForMaskedLM"):
            return "masked"
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return "causal"
    return "causal" if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else "masked"


def _task_model_class(config, task: str):
    """transformers' class for ``task``: the one ``architectures`` names when it is transformers'
    own and fits the task, else the Auto class's choice."""
    import transformers

    suffixes = {"seq2seq": ("ForConditionalGeneration", "Seq2SeqLM"),
                "causal": ("ForCausalLM", "LMHeadModel"), "masked": ("ForMaskedLM",)}[task]
    for arch in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, arch, None) if isinstance(arch, str) and arch.isidentifier() else None
        if isinstance(cls, type) and arch.endswith(suffixes):
            return cls
    from transformers.models.auto import modeling_auto

    names = {"seq2seq": modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES,
             "causal": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
             "masked": modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES}[task]
    cls = getattr(transformers, names.get(config.model_type, ""), None)
    if not isinstance(cls, type):
        raise ValueError(f"transformers has no {task} language-model class for {config.model_type!r}")
    return cls


def _pick_block_class(model: nn.Module) -> type | None:
    """The class to shard per instance: the most frequent of ``_no_split_modules``, else the
    element class of the model's largest ModuleList."""
    from torch import nn

    names = set(getattr(model, "_no_split_modules", None) or [])
    counts = Counter(type(m) for m in model.modules() if type(m).__name__ in names)
    if counts:
        return counts.most_common(1)[0][0]
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return None
    return type(max(lists, key=len)[0])


def custom_model_spec(name: str, factory: Callable[[], nn.Module], block_class: type[nn.Module],
                      vocab_size: int, seq_len: int = 512, task: str = "causal") -> ModelSpec:
    """A ``ModelSpec`` for your own ``nn.Module`` (for ``plan()``): ``factory()`` builds it on the
    current default device (the planner builds it on ``meta``), ``block_class`` is the unit to
    shard, and its ``forward(input_ids=, attention_mask=, labels=)`` returns an object with
    ``.loss`` (as transformers' models do)."""
    from types import SimpleNamespace

    if task not in TASKS:
        raise bad_value("task", task, TASKS)
    return ModelSpec(name=name, family="custom",
                     make_config=lambda: SimpleNamespace(vocab_size=vocab_size),
                     block_class_name=block_class.__name__, default_seq_len=seq_len, task=task,
                     make_model=lambda _config: factory(), block_type=block_class)


def _model_class(family: str):
    if family == "t5":
        from transformers import T5ForConditionalGeneration

        return T5ForConditionalGeneration
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM


@functools.cache
def count_parameters(spec: ModelSpec) -> int:
    model = spec.build(device="meta")
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
