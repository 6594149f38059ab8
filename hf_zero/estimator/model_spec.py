"""What the estimator needs to know about a model, read without downloading or allocating weights.

A model is given as a local directory holding ``config.json``, a path to a ``config.json``, a
``transformers`` config object or dict, or a bare parameter count (``7e9``, ``"6.7B"``, ``"500M"``).

From a config the parameters are counted **exactly** by building the model on the meta device
(``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``): no memory is allocated, and
tied tensors (input and output embeddings) are counted once because ``Module.parameters()`` yields
each tensor once. When that fails (custom code without ``trust_remote_code``, an architecture the
installed transformers does not know) a closed form for a Llama-style decoder is used instead and a
note says so.

torch and transformers are imported lazily, only to read a config.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hf_zero.estimator.errors import EstimatorError
from hf_zero.estimator.units import parse_param_count

__all__ = [
    "ALL_LINEAR",
    "DEFAULT_HEAD_DIM",
    "LinearLayer",
    "ModelSpec",
    "closed_form_spec",
    "load_model_spec",
    "lora_param_count",
    "lora_target_layers",
]

ALL_LINEAR = "all-linear"
"""peft's shorthand: every ``nn.Linear``/``Conv1D`` except the output layer (the LM head)."""

DEFAULT_HEAD_DIM = 128
"""Head size assumed when only ``hidden_size`` is known (Llama, Qwen, Mistral all use 128)."""

NORMS_PER_BLOCK = 2
"""A pre-norm decoder block has two norms (before attention, before the MLP); closed form only."""

NON_GATED_ACTIVATIONS = frozenset({"gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "relu", "quick_gelu"})
"""``hidden_act`` values of two-matrix MLPs; anything else (``silu``, ChatGLM's swiglu) is a gated
three-matrix MLP in the closed form."""

QKV_BIAS_MODEL_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"})
"""Model types whose q/k/v projections have a bias although their config has no ``attention_bias``."""

# Config keys differ across architectures; the first one present wins (Llama, GPT-2, T5, ChatGLM names).
_KEYS: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_layers": ("num_hidden_layers", "num_layers", "n_layer"),
    "num_heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab_size": ("vocab_size", "padded_vocab_size"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size", "n_inner"),
    "head_dim": ("head_dim", "kv_channels"),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearLayer:
    """One linear layer, the unit LoRA attaches to."""

    name: str
    """Module path, e.g. ``model.layers.0.self_attn.q_proj`` (what peft matches target names against)."""
    in_features: int
    out_features: int
    block: int | None = None
    """Index of the transformer block holding it; ``None`` outside the blocks (e.g. ``lm_head``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Parameter counts and shapes of one model; everything else in the estimator is arithmetic on it.

    Example:
        >>> spec = load_model_spec("7e9")
        >>> spec.total_params, spec.hidden_size is None
        (7000000000, True)
    """

    total_params: int
    """Unique parameters (tied tensors once)."""
    name: str = ""
    """What the user passed, for the report."""
    source: str = ""
    """How ``total_params`` was obtained: ``meta-device count``, ``closed form`` or ``given``."""
    hidden_size: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    block_params: int | None = None
    """Parameters of the largest transformer block (one FSDP unit); ``None`` if unknown."""
    root_params: int | None = None
    """Parameters outside the blocks (embeddings, final norm, untied head): the root FSDP unit."""
    largest_tensor: int | None = None
    """Elements of the largest single parameter (sizes an NVMe parameter swap buffer)."""
    linear_layers: tuple[LinearLayer, ...] = ()
    """Every linear layer, for LoRA; empty if unknown."""
    output_layer: str | None = None
    """Name of the output embedding (LM head), which peft's ``all-linear`` leaves out."""
    notes: tuple[str, ...] = field(default=())
    """Assumptions made while reading the model, shown in the report."""
    fsdp_units: tuple[Any, ...] = ()
    """The engine's FSDP2 units with their parameter shapes (``comm_plan.UnitShapes``, root last),
    when the model was built on the meta device: what the communication plan counts exactly."""

    @property
    def has_blocks(self) -> bool:
        """Whether per-unit sizes (for gathered-parameter buffers) are known."""
        return self.block_params is not None and self.root_params is not None


def load_model_spec(
    model: str | os.PathLike[str] | int | Mapping[str, Any] | Any,
    *,
    hidden_size: int | None = None,
    num_layers: int | None = None,
    num_heads: int | None = None,
    vocab_size: int | None = None,
    intermediate_size: int | None = None,
    num_kv_heads: int | None = None,
    trust_remote_code: bool = False,
) -> ModelSpec:
    """Read a :class:`ModelSpec` from a config (no weights) or a bare parameter count.

    Args:
        model: a directory with ``config.json``; a path to a config file; a ``PretrainedConfig`` or a
            config dict; a :class:`ModelSpec` (returned as is); or a parameter count (``int`` or text
            such as ``"7e9"``, ``"6.7B"``, ``"500M"``, ``"1,234,567"``). An existing path always wins
            over reading the text as a count.
        hidden_size, num_layers, num_heads, vocab_size, intermediate_size, num_kv_heads: the shape
            of a model given as a bare count, for the activation estimate and for LoRA. Ignored (with
            a note) when a config gives the shape.
        trust_remote_code: let transformers run the model's own code (``auto_map`` configs such as
            ChatGLM3) to build it on the meta device. Without it such models use the closed form.

    Returns:
        The spec; ``spec.notes`` lists every assumption made.

    Raises:
        EstimatorError: the path does not exist or holds no readable ``config.json``, or the text is
            neither a path nor a count. The message quotes the value.

    Examples:
        >>> load_model_spec("6.7B").total_params
        6700000000
        >>> load_model_spec("./no/such/dir")
        Traceback (most recent call last):
        ...
        hf_zero.estimator.errors.EstimatorError: model './no/such/dir' is neither a directory with a config.json, a config.json file, nor a parameter count such as '7e9', '6.7B' or '500M'
    """
    shape = dict(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        vocab_size=vocab_size,
        intermediate_size=intermediate_size,
        num_kv_heads=num_kv_heads,
    )
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, bool):
        raise EstimatorError(f"model {model!r} is not a config path or a parameter count")
    if isinstance(model, int):
        return _spec_from_count(model, str(model), shape)
    if isinstance(model, (str, os.PathLike)):
        text = os.fspath(model)
        path = Path(text).expanduser()
        if path.exists():
            spec = _spec_from_path(path, text, trust_remote_code)
            return _note_ignored_shape(spec, shape)
        try:
            count = parse_param_count(text)
        except EstimatorError:
            hub = " (for a Hub model, download its config.json first)" if "/" in text and not text.startswith((".", "/")) else ""
            raise EstimatorError(
                f"model {text!r} is neither a directory with a config.json, a config.json file, nor a "
                f"parameter count such as '7e9', '6.7B' or '500M'{hub}"
            ) from None
        return _spec_from_count(count, text, shape)
    if isinstance(model, Mapping):
        return _note_ignored_shape(_spec_from_config_dict(dict(model), "config dict", trust_remote_code), shape)
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):  # a transformers PretrainedConfig
        spec = _spec_from_config(model, dict(model.to_dict()), type(model).__name__, trust_remote_code)
        return _note_ignored_shape(spec, shape)
    raise EstimatorError(f"model {model!r} is not a config path, a config, or a parameter count")


# --- bare counts ---------------------------------------------------------------------------------


def _spec_from_count(count: int, name: str, shape: dict[str, int | None]) -> ModelSpec:
    """A spec for a bare count; the shape flags, when given, let activations and LoRA be estimated."""
    if count <= 0:
        raise EstimatorError(f"parameter count {name!r} must be positive")
    h, layers, vocab = shape["hidden_size"], shape["num_layers"], shape["vocab_size"]
    heads = shape["num_heads"] or (h // DEFAULT_HEAD_DIM if h else None)
    notes: list[str] = []
    if h is not None and shape["num_heads"] is None:
        notes.append(f"num_heads not given: assumed hidden_size / {DEFAULT_HEAD_DIM} = {heads}")
    block_params = root_params = None
    if h and layers and vocab:
        # Untied input and output embeddings: the larger (safer) root unit of the two cases.
        root_params = min(count, 2 * vocab * h)
        block_params = (count - root_params) // layers
        notes.append("block sizes from a bare count assume untied embeddings and equal blocks")
    linear_layers: tuple[LinearLayer, ...] = ()
    if h and layers and shape["intermediate_size"]:
        linear_layers = _llama_linear_layers(
            hidden=h,
            layers=layers,
            heads=heads or 1,
            kv_heads=shape["num_kv_heads"] or heads or 1,
            head_dim=h // (heads or 1),
            intermediate=shape["intermediate_size"],
            gated=True,
            vocab=vocab,
            tied=False,
        )
    return ModelSpec(
        total_params=count,
        name=name,
        source="given",
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        vocab_size=vocab,
        block_params=block_params,
        root_params=root_params,
        linear_layers=linear_layers,
        output_layer="lm_head" if linear_layers and vocab else None,
        notes=tuple(notes),
    )


def _note_ignored_shape(spec: ModelSpec, shape: dict[str, int | None]) -> ModelSpec:
    given = sorted(key for key, value in shape.items() if value is not None)
    if not given:
        return spec
    return replace(spec, notes=spec.notes + (f"ignored {', '.join(given)}: the config gives the model's shape",))


# --- configs -------------------------------------------------------------------------------------


def _spec_from_path(path: Path, name: str, trust_remote_code: bool) -> ModelSpec:
    config_file = path / "config.json" if path.is_dir() else path
    if not config_file.is_file():
        raise EstimatorError(f"model {name!r} is a directory without a config.json")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EstimatorError(f"cannot read model config {str(config_file)!r}: {exc}") from None
    if not isinstance(raw, dict):
        raise EstimatorError(f"model config {str(config_file)!r} is not a JSON object")
    try:
        from transformers import AutoConfig

        # A directory keeps any custom modelling code next to config.json; a bare file has none.
        source = str(path) if path.is_dir() else str(config_file)
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001 -- any failure means "use the closed form", reported below
        reason = f"transformers could not load the config: {_short(exc)}"
        if raw.get("auto_map") and not trust_remote_code:
            reason += "; --trust_remote_code would count it exactly with the model's own code"
        return closed_form_spec(raw, name=name, reason=reason)
    return _spec_from_config(config, raw, name, trust_remote_code)


def _spec_from_config_dict(raw: dict[str, Any], name: str, trust_remote_code: bool) -> ModelSpec:
    try:
        from transformers import AutoConfig

        config = AutoConfig.for_model(**raw)
    except Exception as exc:  # noqa: BLE001
        return closed_form_spec(raw, name=name, reason=f"transformers could not read the dict ({_short(exc)})")
    return _spec_from_config(config, raw, name, trust_remote_code)


def _spec_from_config(config: Any, raw: dict[str, Any], name: str, trust_remote_code: bool) -> ModelSpec:
    try:
        model = _build_on_meta(config, trust_remote_code)
    except Exception as exc:  # noqa: BLE001
        return closed_form_spec(raw, name=name, reason=f"could not build the model on the meta device ({_short(exc)})")
    return _spec_from_meta_model(model, config, name)


def _build_on_meta(config: Any, trust_remote_code: bool) -> Any:
    """The model with every tensor on the meta device: shapes only, no memory, no weights read."""
    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    errors = []
    for auto_class in (AutoModelForCausalLM, AutoModel):
        try:
            with torch.device("meta"):
                return auto_class.from_config(config, trust_remote_code=trust_remote_code)
        except Exception as exc:  # noqa: BLE001 -- try the next class, then give up with all reasons
            errors.append(f"{auto_class.__name__}: {_short(exc)}")
    raise RuntimeError("; ".join(errors))


def _spec_from_meta_model(model: Any, config: Any, name: str) -> ModelSpec:
    import torch

    from hf_zero.estimator.comm_plan import fsdp_units_of

    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - present in every supported transformers
        Conv1D = ()  # noqa: N806

    # parameters() yields each tensor once: tied embeddings count once, as they take memory once.
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    blocks = _find_blocks(model)
    owner: dict[int, int] = {}  # id(param) -> block index, first owner wins (shared params count once)
    block_sizes = []
    for index, (_, block) in enumerate(blocks):
        size = 0
        for p in block.parameters():
            if id(p) not in owner:
                owner[id(p)] = index
                size += p.numel()
        block_sizes.append(size)
    prefixes = [(prefix + ".", index) for index, (prefix, _) in enumerate(blocks)]

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    output_name = None
    linear_layers = []
    for module_name, module in model.named_modules():
        if module is output and output is not None:
            output_name = module_name
        if isinstance(module, torch.nn.Linear):
            in_features, out_features = module.in_features, module.out_features
        elif Conv1D and isinstance(module, Conv1D):  # GPT-2 style: weight is (in, out)
            in_features, out_features = module.weight.shape
        else:
            continue
        block = next((index for prefix, index in prefixes if module_name.startswith(prefix)), None)
        linear_layers.append(LinearLayer(name=module_name, in_features=int(in_features), out_features=int(out_features), block=block))

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = _first(text, "hidden_size")
    heads = _first(text, "num_heads")
    return ModelSpec(
        total_params=total,
        name=name,
        source="meta-device count",
        hidden_size=hidden,
        # The text config's layer count, not len(blocks): multimodal models also have vision blocks.
        num_layers=_first(text, "num_layers") or len(blocks) or None,
        num_heads=heads,
        vocab_size=_first(text, "vocab_size"),
        block_params=max(block_sizes) if block_sizes else None,
        root_params=total - sum(block_sizes) if block_sizes else None,
        largest_tensor=max((p.numel() for p in params), default=0),
        linear_layers=tuple(linear_layers),
        output_layer=output_name,
        fsdp_units=tuple(fsdp_units_of(model)),
        notes=() if blocks else ("no transformer blocks found: stage-2/3 gathered-parameter buffers not estimated",),
    )


def _find_blocks(model: Any) -> list[tuple[str, Any]]:
    """The transformer blocks (FSDP wrap units): modules whose class is in ``_no_split_modules``.

    Falls back to the longest ``nn.ModuleList`` of same-class modules (``model.layers``, ``h``).
    """
    import torch

    no_split = set(getattr(model, "_no_split_modules", None) or ())
    if no_split:
        found = [(n, m) for n, m in model.named_modules() if type(m).__name__ in no_split]
        # Keep outermost matches only: a block class nested inside another block is not a unit.
        outer = [(n, m) for n, m in found if not any(n.startswith(o + ".") for o, _ in found)]
        if outer:
            return outer
    best: list[tuple[str, Any]] = []
    for list_name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > len(best):
            children = list(module)
            if len({type(c) for c in children}) == 1:
                best = [(f"{list_name}.{i}", c) for i, c in enumerate(children)]
    return best


def _first(config: Any, key: str) -> int | None:
    for name in _KEYS[key]:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]


# --- closed form ---------------------------------------------------------------------------------


def closed_form_spec(raw: Mapping[str, Any], *, name: str = "config", reason: str = "") -> ModelSpec:
    """Parameters of a Llama-style decoder from its config values alone.

    Counted per block: q/k/v/o projections (grouped-query aware, optional q/k/v bias), an MLP of three
    matrices (gate/up/down; two for GELU/ReLU configs), two RMSNorm weights; plus the token
    embedding, the final norm and the LM head unless ``tie_word_embeddings`` is true (a missing key
    counts the head separately: the larger estimate). Exact for Llama, Qwen2 and Mistral; close for
    other decoders (fused q/k/v, LayerNorm biases).

    Raises:
        EstimatorError: ``hidden_size``, the layer count, the head count or the vocabulary is missing.

    Example:
        >>> spec = closed_form_spec({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        ...     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000})
        >>> spec.total_params
        202048
    """
    h, layers, heads, vocab = (_first(raw, k) for k in ("hidden_size", "num_layers", "num_heads", "vocab_size"))
    missing = [k for k, v in (("hidden_size", h), ("num_hidden_layers", layers), ("num_attention_heads", heads), ("vocab_size", vocab)) if not v]
    if missing:
        why = f" ({reason})" if reason else ""
        raise EstimatorError(f"cannot count the parameters of {name!r}{why}: the config lacks {', '.join(missing)}")
    assert h and layers and heads and vocab  # for type checkers; checked just above
    model_type = str(raw.get("model_type", ""))
    if raw.get("multi_query_attention"):  # ChatGLM spelling of grouped-query attention
        kv_heads = int(raw.get("multi_query_group_num") or 1)
    else:
        kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = _first(raw, "head_dim") or h // heads
    intermediate = _first(raw, "intermediate_size")
    activation = str(raw.get("hidden_act") or raw.get("activation_function") or "silu")
    gated = intermediate is not None and activation not in NON_GATED_ACTIVATIONS
    intermediate = intermediate or 4 * h
    qkv_bias = bool(raw.get("attention_bias") or raw.get("add_qkv_bias") or model_type in QKV_BIAS_MODEL_TYPES)
    mlp_bias = bool(raw.get("mlp_bias"))
    tied = bool(raw.get("tie_word_embeddings", False))

    linear = _llama_linear_layers(
        hidden=h, layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=intermediate, gated=gated, vocab=vocab, tied=tied,
    )
    block_weights = sum(l.in_features * l.out_features for l in linear if l.block == 0)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    mlp_bias_params = (2 * intermediate if gated else intermediate) + h  # gate/up biases, then down's
    block_biases = (q_size + 2 * kv_size if qkv_bias else 0) + (mlp_bias_params if mlp_bias else 0)
    block = block_weights + block_biases + NORMS_PER_BLOCK * h
    embeddings = vocab * h * (1 if tied else 2)
    root = embeddings + h  # + the final norm
    notes = [f"closed-form parameter count for a Llama-style decoder{f' ({reason})' if reason else ''}"]
    if "tie_word_embeddings" not in raw:
        notes.append("tie_word_embeddings missing: counted the LM head separately")
    return ModelSpec(
        total_params=root + layers * block,
        name=name,
        source="closed form",
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        vocab_size=vocab,
        block_params=block,
        root_params=root,
        largest_tensor=max(vocab * h, max(l.in_features * l.out_features for l in linear)),
        linear_layers=linear,
        output_layer=None if tied else "lm_head",
        notes=tuple(notes),
    )


def _llama_linear_layers(
    *, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
    gated: bool, vocab: int | None, tied: bool,
) -> tuple[LinearLayer, ...]:
    """Linear layers named as in transformers' Llama, so LoRA target names match."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    shapes = [
        ("self_attn.q_proj", hidden, q_size),
        ("self_attn.k_proj", hidden, kv_size),
        ("self_attn.v_proj", hidden, kv_size),
        ("self_attn.o_proj", q_size, hidden),
    ]
    if gated:
        shapes.append(("mlp.gate_proj", hidden, intermediate))
    shapes += [("mlp.up_proj", hidden, intermediate), ("mlp.down_proj", intermediate, hidden)]
    out = [
        LinearLayer(name=f"model.layers.{i}.{suffix}", in_features=fan_in, out_features=fan_out, block=i)
        for i in range(layers)
        for suffix, fan_in, fan_out in shapes
    ]
    if vocab and not tied:
        out.append(LinearLayer(name="lm_head", in_features=hidden, out_features=vocab, block=None))
    return tuple(out)


# --- LoRA ----------------------------------------------------------------------------------------


def lora_target_layers(spec: ModelSpec, target_modules: str | Sequence[str] = ALL_LINEAR) -> tuple[LinearLayer, ...]:
    """The linear layers LoRA adapts, chosen as peft chooses them.

    Args:
        spec: the model.
        target_modules: ``"all-linear"`` (every linear layer except the output layer); another
            string is a regular expression matched against the whole module name
            (``re.fullmatch``); a list of names matches a module whose name equals one or ends
            with ``"." + name`` (``["q_proj", "v_proj"]``).

    Raises:
        EstimatorError: the model's linear layers are unknown (a bare count without shape flags),
            or no layer matches.
    """
    if not spec.linear_layers:
        raise EstimatorError(
            f"LoRA needs the model's linear layers, unknown for {spec.name!r}: give a config, or "
            "--hidden_size, --num_layers and --intermediate_size with a bare count"
        )
    if isinstance(target_modules, str) and target_modules.lower() == ALL_LINEAR:
        chosen = [l for l in spec.linear_layers if l.name != spec.output_layer]
    elif isinstance(target_modules, str):
        pattern = re.compile(target_modules)
        chosen = [l for l in spec.linear_layers if pattern.fullmatch(l.name)]
    else:
        targets = tuple(target_modules)
        chosen = [l for l in spec.linear_layers if any(l.name == t or l.name.endswith("." + t) for t in targets)]
    if not chosen:
        names = sorted({l.name.rsplit(".", 1)[-1] for l in spec.linear_layers})
        raise EstimatorError(f"lora_target_modules {target_modules!r} matches no linear layer; the model has {names}")
    return tuple(chosen)


def lora_param_count(layers: Sequence[LinearLayer], rank: int) -> int:
    """LoRA parameters added to ``layers``: ``rank * (in + out)`` each (A is r x in, B is out x r, no bias).

    Example:
        >>> lora_param_count([LinearLayer(name="q_proj", in_features=64, out_features=64)], rank=8)
        1024
    """
    if rank <= 0:
        raise EstimatorError(f"lora rank {rank!r} must be a positive integer")
    return sum(rank * (l.in_features + l.out_features) for l in layers)
