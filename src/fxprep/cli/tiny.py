"""Tiny transformers configs: the ``transformers:TYPE`` spec's model, built offline in a blink.

A model type's default config is its real size: building Llava's would allocate 7 billion
parameters (28 GB in float32), Mistral-Large's a trillion, and the process is killed before fxprep
starts. Shrinking the top-level config is not enough for composite models: a VLM's language model,
vision tower and projector each have their own config (``text_config``, ``vision_config``, an
omni model's thinker inside which sit three more), and mixture-of-experts layers have their own
widths and expert counts. :func:`tiny_config` shrinks every level, the way ``from_pretrained``
would read them from a ``config.json``: the top level as keyword arguments, each sub-config as the
dictionary of its defaults with the tiny values in.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# width 32, 2 layers, 2 heads of 16: every size key of the families we know, at every level of a config
TINY_CONFIG: dict[str, int] = dict(
    vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
    max_position_embeddings=64, num_key_value_heads=1, image_size=32, patch_size=8, d_model=32, d_ff=37,
    num_layers=2, num_heads=2, d_kv=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
    decoder_attention_heads=2, encoder_ffn_dim=37, decoder_ffn_dim=37, n_embd=32, n_layer=2, n_head=2,
    n_positions=64, head_dim=16, n_layers=2,
    # mixture of experts: a few small experts (DeepSeek's grouped routing needs the groups to divide them)
    num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, n_group=1, topk_group=1,
    # vision towers that name their sizes otherwise (Qwen2-VL: depth blocks of width embed_dim, merged to out_hidden_size)
    depth=2, embed_dim=32, out_hidden_size=32,
    # Gemma 3n / 4's per-layer embeddings: a vocabulary of their own
    vocab_size_per_layer_input=99, hidden_size_per_layer_input=8,
    # detection queries: RT-DETR's pick their top-k of the anchors, of which a 32x32 image has 21
    num_queries=10,
    # the rotary part of a head (GPT-J, CodeGen: 64 of the real 256) within the tiny head of 16
    rotary_dim=8,
    # Mamba-2 mixers of hybrid models (Bamba, GraniteMoeHybrid): heads x head size is the expanded width (2 x 32)
    mamba_n_heads=4, mamba_d_head=16,
)
# special token ids of the real vocabularies do not fit a 99-token one
TOKEN_IDS: dict[str, int] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 2,
                             "sep_token_id": 2, "cls_token_id": 1, "unk_token_id": 3, "mask_token_id": 4,
                             "blank_token_id": 0}
# keys added with the sub-configs: at the top level too, set only over a whole-number default
_WHOLE_ONLY = frozenset(("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok",
                         "moe_intermediate_size", "shared_expert_intermediate_size", "n_group", "topk_group",
                         "depth", "embed_dim", "out_hidden_size", "n_layers", "vocab_size_per_layer_input",
                         "hidden_size_per_layer_input", "num_queries", "rotary_dim", "mamba_n_heads", "mamba_d_head"))
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# multi-head latent attention (DeepSeek-V2/V3, Kimi, Mistral 4, ...): head sizes scaled together, ranks made small
_MLA_HEAD_KEYS = ("head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "qk_head_dim")
_MLA_RANK_KEYS = ("kv_lora_rank", "q_lora_rank")
_MLA_ROPE = 8
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "depth")


def tiny_config(model_type: str) -> Any:
    """A tiny config of ``model_type`` (2 layers, width 32, at every level): builds in milliseconds,
    runs in a blink. The first of :func:`tiny_configs` that transformers accepts. Raises
    ``ValueError`` / ``KeyError`` (from transformers) for a type it does not know."""
    return next(tiny_configs(model_type))[0]


def tiny_configs(model_type: str) -> Iterator[tuple[Any, bool]]:
    """Tiny configs of ``model_type``, smallest first, each one transformers accepts, with whether
    its every level is tiny: every level shrunk; then the sub-configs' layer counts kept (a
    projector that reads the vision tower's 24th layer, per-layer settings of a fixed count); then
    the top level only; last the top level's widths and layers only (what this did before
    sub-configs and experts were shrunk). These two leave a composite model's sub-configs at their
    real sizes (``False``). A caller whose model does not build from one takes the next:
    transformers checks some sizes only when it builds the model. A candidate equal to one before
    it is skipped (a model with no sub-configs has two, not four)."""
    import transformers

    defaults = transformers.AutoConfig.for_model(model_type)
    shallow = _overrides(defaults, top=True)
    first_pass = {k: v for k, v in shallow.items() if k not in _WHOLE_ONLY and k not in TOKEN_IDS}

    def deep(keep_layers: bool) -> dict[str, Any]:
        subs = {name: _shrunk(sub, keep_layers) for name, sub in _sub_configs(defaults)}
        return {**shallow, **_per_layer(defaults, shallow), **_rope(defaults, shallow), **subs}

    tried: list[dict[str, Any]] = []
    whole = not _sub_configs(defaults)
    refused: Exception | None = None  # why transformers refused the last candidate
    yielded = False
    for kwargs, tiny in ((deep(False), True), (deep(True), True), (shallow, whole), (first_pass, whole)):
        if kwargs in tried:
            continue
        tried.append(kwargs)
        try:
            config = transformers.AutoConfig.for_model(model_type, **kwargs)
        except Exception as err:  # noqa: BLE001 - a check between sizes we do not know (ZAYA's expert count): the next
            refused = err
            continue
        yielded = True
        yield config, tiny
    if not yielded and refused is not None:
        raise refused  # every candidate refused (before, a first-pass candidate equal to an earlier one hid why)


def _overrides(config: Any, *, top: bool = False) -> dict[str, Any]:
    """The tiny values of the size keys ``config`` has: those whose default is a whole number, and
    at the top level every first-pass key it knows (an unset ``head_dim`` is set). A key whose
    default is a list (sizes per stage) keeps it, and a backbone keeps its layer count (the stages
    its ``out_features`` name must exist). Inside, any other whole-number ``..._hidden_size`` is
    the width too (a projector's ``text_hidden_size``), and so is a key whose default equals the
    config's width (Mimi's ``upsample_groups``). Special token ids past the tiny vocabulary are
    moved into it."""
    values = config.to_dict()
    aliases = getattr(config, "attribute_map", {}) or {}
    known = set(values) | set(aliases)
    keep = _LAYER_KEYS if (values.get("out_features") or values.get("out_indices")) and not top else frozenset()
    width = TINY_CONFIG["hidden_size"]
    out: dict[str, Any] = {}
    for key, tiny in TINY_CONFIG.items():
        if key not in known or key in keep:
            continue
        current = values.get(aliases.get(key, key))
        if isinstance(current, (list, tuple, dict)):
            continue  # per stage (Swin's heads, SegFormer's): that family's sizes are its own
        if _whole(current) or (top and key not in _WHOLE_ONLY):
            out[key] = tiny
    if "embed_dim" in out and not _whole(values.get("num_heads")):
        del out["embed_dim"]  # a width shrunk only with its heads (Qwen2-VL's vision tower)
    if "intermediate_size" in out and any(_whole(values.get(k)) for k in _EXPERT_KEYS):
        out["intermediate_size"] = 40  # experts run grouped matmuls, which need rows of 16 bytes (Mixtral's)
    if any(_whole(values.get(k)) for k in _EXPERT_KEYS) and "num_experts_per_tok" in values and \
            values["num_experts_per_tok"] is None:
        out["num_experts_per_tok"] = TINY_CONFIG["num_experts_per_tok"]  # unset by default beside experts (DeepSeek-V2's)
    if not top and "num_key_value_heads" in out and values.get("num_key_value_heads") == values.get(
            aliases.get("num_attention_heads", "num_attention_heads")):
        out["num_key_value_heads"] = TINY_CONFIG["num_attention_heads"]  # multi-head attention stays so (GLM-5's checks it)
    if not top:
        old = values.get(aliases.get("hidden_size", "hidden_size"))
        for key, value in values.items():
            if key not in out and _whole(value) and (key.endswith("hidden_size") or (
                    _whole(old) and value == old and any(w in key for w in ("hidden", "groups", "dim", "size")))):
                out[key] = width
    out.update(_latent_attention(values))
    out.update({k: v for k, v in TOKEN_IDS.items() if _whole(values.get(k)) and values[k] >= TINY_CONFIG["vocab_size"]})
    return out


def _latent_attention(values: dict[str, Any]) -> dict[str, Any]:
    """Multi-head latent attention's sizes, tiny. Its head is made of a rotary part
    (``qk_rope_head_dim``) and a plain part, and families tie ``head_dim`` to either the rotary
    part (DeepSeek-V3) or the whole (Mistral 4, whose rotary part is half of it): scaling every head
    size by the same factor keeps whichever tie the family has, where setting ``head_dim`` alone
    made the rotary tables and the queries disagree. The low ranks are independent widths; a family
    whose keys have as many heads as its queries keeps them so."""
    if not _whole(values.get("kv_lora_rank")):
        return {}  # no latent attention
    out = {k: 2 * _MLA_ROPE for k in _MLA_RANK_KEYS if _whole(values.get(k)) and values[k] > 2 * _MLA_ROPE}
    if values.get("num_key_value_heads") == values.get("num_attention_heads"):
        out["num_key_value_heads"] = TINY_CONFIG["num_attention_heads"]  # keys have every head (Kimi's repeat them)
    rope: Any = values.get("qk_rope_head_dim")
    if _whole(rope) and rope > _MLA_ROPE:  # GLM-5 Next's has no rotary part (0)
        out.update({k: values[k] * _MLA_ROPE // rope for k in _MLA_HEAD_KEYS
                    if _whole(values.get(k)) and values[k] * _MLA_ROPE % rope == 0})
    return out


def _rope(config: Any, tiny: dict[str, Any]) -> dict[str, Any]:
    """Multimodal rotary sections (``mrope_section``: halves of the rotary part of a head, given to
    time, height and width) for the tiny head, in the same proportions. The rotary part is
    ``qk_rope_head_dim`` where the config has one, else the head (16 once tiny) times its
    ``partial_rotary_factor``. A config that reads sections its defaults leave out (Qwen2-VL's and
    GLM-4V's sit in their modelling code, sized for the real head) gets them explicitly, in
    Qwen2-VL's proportions; the one case left as it was is a rotary part too small to give each of
    the three a share (Qwen3.5's interleaved sections, which tolerate any size)."""
    values = config.to_dict()
    rope = values.get("rope_parameters")
    if not isinstance(rope, dict):
        return {}
    section = rope.get("mrope_section")
    if section is None and "rope_type" in rope and "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ()):
        section = [16, 24, 24]  # one set of parameters (not one per layer kind, nor none: Cohere Compass's {})
    if not (isinstance(section, list) and section and all(_whole(s) and s > 0 for s in section)):
        return {}
    rotary: Any = tiny.get("qk_rope_head_dim", values.get("qk_rope_head_dim"))
    if not _whole(rotary):
        factor = rope.get("partial_rotary_factor", values.get("partial_rotary_factor")) or 1.0
        rotary = int(tiny.get("head_dim", TINY_CONFIG["head_dim"]) * factor)
    half = rotary // 2
    scaled = [max(1, s * half // sum(section)) for s in section]
    scaled[0] += half - sum(scaled)
    return {"rope_parameters": {**rope, "mrope_section": scaled}} if scaled[0] > 0 else {}


def _shrunk(config: Any, keep_layers: bool) -> dict[str, Any]:
    """``config`` (a sub-config) as the dictionary a ``config.json`` would hold, tiny at every level
    (its layer count kept with ``keep_layers``)."""
    values = config.to_dict()
    tiny = {k: v for k, v in _overrides(config).items() if not (keep_layers and k in _LAYER_KEYS)}
    out = {**values, **tiny, **_per_layer(config, tiny), **_rope(config, tiny)}
    for name, sub in _sub_configs(config):
        out[name] = _shrunk(sub, keep_layers)
    return out


def _per_layer(config: Any, tiny: dict[str, Any]) -> dict[str, Any]:
    """Settings with one entry per layer, for the layers ``tiny`` leaves. A list as long as the
    layer count was (``layer_types``) keeps one layer of each kind in the order they come
    (Qwen3.5's ``linear_attention`` x3, ``full_attention``: one of each; a cut to the first two
    would leave no full-attention layer, which its cache cannot do without); settings keyed by
    layer index keep the layers there are. A count known by another name (ConvNeXt's
    ``num_stages``, which its ``attribute_map`` calls ``num_hidden_layers``) is read under that
    name: its per-stage lists (``depths``, ``hidden_sizes``) were left whole while the stages were
    cut, and the model's last norm took the fourth stage's width after the second stage."""
    values = config.to_dict()
    aliases = getattr(config, "attribute_map", {}) or {}
    before = {k: values.get(aliases.get(k, k)) for k in _LAYER_KEYS}
    if all(tiny.get(k, before[k]) == before[k] for k in _LAYER_KEYS):
        return {}
    layers = {v for v in before.values() if _whole(v)}
    count = TINY_CONFIG["num_hidden_layers"]
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, list) and value and len(value) in layers:
            kinds = [v for i, v in enumerate(value) if v not in value[:i]]
            out[key] = (kinds + [kinds[-1]] * count)[:count]
        elif isinstance(value, dict) and value and all(_whole(i) or (isinstance(i, str) and i.isdigit()) for i in value):
            out[key] = {i: v for i, v in value.items() if int(i) < count}
    return out


def _sub_configs(config: Any) -> list[tuple[str, Any]]:
    """The sub-configs ``config`` holds (its ``text_config``, ``vision_config``, ...), by object."""
    from transformers import PretrainedConfig

    names = list(getattr(config, "sub_configs", {}) or {})
    names += [k for k in config.to_dict() if k.endswith("config") and k not in names]  # some are not declared
    found = [(n, getattr(config, n, None)) for n in names]
    return [(n, c) for n, c in found if isinstance(c, PretrainedConfig)]


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
