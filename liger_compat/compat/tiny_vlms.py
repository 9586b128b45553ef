"""Tiny randomly initialised vision-language ``*ForConditionalGeneration`` models and inputs.

Used by the model tests and the GPU table (``benchmarks/models_gpu.py``) to run the fused forward
through a vision-language model's own forward: each entry builds the composite config in code
(no hub access; a tower of one or two layers, hidden size 32) and a batch of token ids with the
image placeholder tokens where the model expects them, random pixel inputs and the extra
tensors the model takes (``image_grid_thw`` of the Qwen-VL and GLM-4V families, ``image_sizes``
of Mistral 3, ``token_type_ids`` of Gemma 3 / PaliGemma). A family the installed transformers
lacks raises :class:`~liger_compat.compat.tiny_models.FamilyUnavailable`.
"""

from __future__ import annotations

from typing import Any, Callable

#: special token ids inside the tiny vocabulary; text tokens are drawn from [3, TEXT_MAX)
IMAGE, START, END, VIDEO = 95, 94, 93, 92
TEXT_MAX = 88


def _text(base: dict[str, Any], **kw: Any) -> dict[str, Any]:
    out = {k: v for k, v in base.items() if k != "tie_word_embeddings"}
    out.update(kw)
    return out


def _mrope(t: dict[str, Any], partial: float = 1.0, **extra: Any) -> dict[str, Any]:
    """M-RoPE parameters whose sections (temporal, height, width) cover the rotary half of the head."""
    head_dim = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    half = int(head_dim * partial) // 2
    hw = half * 3 // 8
    section = [half - 2 * hw, hw, hw]
    if partial != 1.0:
        extra["partial_rotary_factor"] = partial
    return dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=section, **extra))


def _out(t: dict[str, Any], vision: dict[str, Any], key: str = "out_hidden_size") -> dict[str, Any]:
    """The vision tower's output width set to the language model's hidden size."""
    return dict(vision, **{key: t["hidden_size"]})


# -- vision towers ----------------------------------------------------------------------------

_QWEN2_VISION = dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=2,
                     spatial_merge_size=2, temporal_patch_size=2)
_QWEN25_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32, patch_size=2,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=8, fullatt_block_indexes=[0])
_QWEN3_VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32, patch_size=2,
                     spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                     deepstack_visual_indexes=[0])
_GLM4V_VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32, patch_size=2,
                     spatial_merge_size=2, temporal_patch_size=2, image_size=8)
_SIGLIP = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
               num_attention_heads=4, image_size=16, patch_size=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, output_router_logits=True,
            router_aux_loss_coef=0.02)
_LINEAR_ATTN = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)


class Spec:
    """How to build one family's tiny model: its config keyword arguments (from the text base) and
    the image part of a sample (``tokens``: the placeholder run in the ids; ``pixels``: the tensors)."""

    def __init__(self, config: Callable[[dict[str, Any]], dict[str, Any]], layout: str, tokens: int,
                 config_class: str | None = None):
        self.config = config
        self.layout = layout  # grid (Qwen / GLM patches + image_grid_thw), image, tiles (Idefics3 / SmolVLM)
        self.tokens = tokens  # image placeholder tokens per image
        self.config_class = config_class


SPECS: dict[str, Spec] = {
    "llava": Spec(lambda t: dict(
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, image_size=16, patch_size=8, projection_dim=32),
        text_config=_text(t, model_type="llama"), image_token_index=IMAGE, vision_feature_layer=-1,
        image_seq_length=4), "image", 4),
    "mistral3": Spec(lambda t: dict(
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, head_dim=8, image_size=16, patch_size=4),
        text_config=_text(t, model_type="mistral"), image_token_index=IMAGE, spatial_merge_size=2,
        vision_feature_layer=-1), "image_sizes", 4),
    "qwen2_vl": Spec(lambda t: dict(
        vision_config=_out(t, _QWEN2_VISION, "hidden_size"), text_config=_text(t, **_mrope(t)),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=VIDEO), "grid", 4),
    "qwen2_5_vl": Spec(lambda t: dict(
        vision_config=_out(t, _QWEN25_VISION), text_config=_text(t, **_mrope(t)),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=VIDEO), "grid", 4),
    "qwen3_vl": Spec(lambda t: dict(
        vision_config=_out(t, _QWEN3_VISION), text_config=_text(t, **_mrope(t, mrope_interleaved=True)),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=VIDEO), "grid", 4),
    "qwen3_vl_moe": Spec(lambda t: dict(
        vision_config=_out(t, _QWEN3_VISION),
        text_config=_text(t, **_MOE, **_mrope(t, mrope_interleaved=True)),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=VIDEO), "grid", 4),
    "qwen3_5": Spec(lambda t: dict(
        vision_config=_out(t, _QWEN3_VISION),
        text_config=_text(t, **_LINEAR_ATTN, **_mrope(t, mrope_interleaved=True)),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=VIDEO), "grid", 4),
    "qwen3_5_moe": Spec(lambda t: dict(
        vision_config=_out(t, _QWEN3_VISION),
        text_config=_text(t, **_LINEAR_ATTN, **_MOE, shared_expert_intermediate_size=24,
                          **_mrope(t, mrope_interleaved=True)),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END, video_token_id=VIDEO), "grid", 4),
    "glm4v": Spec(lambda t: dict(
        vision_config=_out(t, _GLM4V_VISION),
        text_config=_text(t, **_mrope(t, 0.5)),
        image_token_id=IMAGE, image_start_token_id=START, image_end_token_id=END, video_token_id=VIDEO), "grid", 4),
    "glm4v_moe": Spec(lambda t: dict(
        vision_config=_out(t, _GLM4V_VISION),
        text_config=_text(t, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, first_k_dense_replace=1,
                          n_group=1, topk_group=1, n_shared_experts=1, output_router_logits=True,
                          router_aux_loss_coef=0.02, **_mrope(t, 0.5)),
        image_token_id=IMAGE, image_start_token_id=START, image_end_token_id=END, video_token_id=VIDEO), "grid", 4),
    "gemma3_vlm": Spec(lambda t: dict(
        vision_config=_SIGLIP,
        text_config=_text(t, model_type="gemma3_text", query_pre_attn_scalar=8, sliding_window=8,
                          hidden_activation="gelu_pytorch_tanh"),
        mm_tokens_per_image=4, image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END), "token_types", 4),
    "paligemma": Spec(lambda t: dict(
        vision_config=dict(_SIGLIP, projection_dim=t["hidden_size"]),
        text_config=_text(t, model_type="gemma", hidden_activation="gelu_pytorch_tanh"),
        image_token_index=IMAGE, projection_dim=t["hidden_size"], hidden_size=t["hidden_size"]), "prefix", 16),
    "internvl": Spec(lambda t: dict(
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48,
                           image_size=[16, 16], patch_size=[4, 4]),
        text_config=_text(t, model_type="qwen2"), image_token_id=IMAGE, image_seq_length=4, downsample_ratio=0.5,
        tie_word_embeddings=False), "image", 4),
    "smolvlm": Spec(lambda t: dict(
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                           image_size=16, patch_size=4),
        text_config=_text(t, model_type="llama"), image_token_id=IMAGE, scale_factor=2), "tiles", 4),
    "idefics3": Spec(lambda t: dict(
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                           image_size=16, patch_size=4),
        text_config=_text(t, model_type="llama"), image_token_id=IMAGE, scale_factor=2), "tiles", 4),
    "gemma4": Spec(lambda t: dict(
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=4, head_dim=8, patch_size=4, pooling_kernel_size=2,
                           position_embedding_size=16),
        text_config=_text(t, model_type="gemma4_text", sliding_window=8, hidden_size_per_layer_input=8,
                          vocab_size_per_layer_input=t["vocab_size"]),
        audio_config=None, image_token_id=IMAGE, boi_token_id=START, eoi_token_id=END, video_token_id=VIDEO,
        audio_token_id=91, boa_token_id=90, eoa_token_index=89), "patches", 4),
    "muse_glimmer": Spec(lambda t: dict(
        vision_config=dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, num_attention_heads=4, num_hidden_layers=1,
                           hidden_size=32, intermediate_size=48, max_position_embeddings=16),
        text_config=_text(t, sliding_window=8, final_logit_softcapping=3.0, output_multiplier=0.5),
        out_hidden_size=128, projector_hidden_size=32, image_token_id=IMAGE, video_token_id=VIDEO),
        "grid", 4),
    "mllama": Spec(lambda t: dict(
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_global_layers=1, attention_heads=4,
                           intermediate_size=48, vision_output_dim=64, intermediate_layers_indices=[0],
                           image_size=16, patch_size=8, max_num_tiles=1, supported_aspect_ratios=[[1, 1]]),
        text_config=_text(t, cross_attention_layers=[1]), image_token_index=IMAGE), "cross_attention", 1),
}


#: families of the table without a tiny config here, and why
_NO_SPEC = {"gemma3n": "its vision tower is a timm MobileNet (timm is not a dependency of the tests)"}


def config_for(fam: Any, text_base: dict[str, Any], **text_overrides: Any):
    from .tiny_models import FamilyUnavailable, construct_config, modeling_module

    spec = SPECS.get(fam.name)
    if spec is None:
        why = _NO_SPEC.get(fam.name, "")
        raise FamilyUnavailable(f"no tiny vision-language config for {fam.name}{': ' + why if why else ''}")
    mod = modeling_module(fam)
    head = getattr(mod, fam.causal_lm, None)
    cls = getattr(head, "config_class", None)
    if cls is None:
        raise FamilyUnavailable(f"{mod.__name__} has no {fam.causal_lm}")
    kw = spec.config(dict(text_base, **text_overrides))
    cfg = construct_config(cls, kw)
    for c in {id(cfg): cfg, id(cfg.get_text_config()): cfg.get_text_config()}.values():
        c._attn_implementation = "eager"
    vc = getattr(cfg, "vision_config", None)
    if vc is not None:
        vc._attn_implementation = "eager"
    return cfg


def inputs(model: Any, b: int = 2, t: int = 24, seed: int = 0, ignore_frac: float = 0.25) -> tuple[dict[str, Any], Any]:
    """``(model inputs, labels)``: ``b`` samples of ``t`` tokens, one image each (its placeholder run
    after two text tokens), random pixels; labels are the ids with the image run and a random
    ``ignore_frac`` of the text set to -100, as a collator masks them."""
    import torch

    from .families import family_of

    fam = family_of(type(model))
    spec = SPECS[fam.name]
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    lo, hi = (IMAGE + 1, vocab) if vocab > 4 * IMAGE else (3, TEXT_MAX)  # text ids clear of the special ones
    ids = torch.randint(lo, hi, (b, t), generator=g)
    n = spec.tokens
    image = torch.zeros(b, t, dtype=torch.bool)
    if spec.layout == "grid":
        ids[:, 2] = START
        ids[:, 3 + n] = END
    image[:, 3:3 + n] = True
    ids[image] = IMAGE
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    cfg = model.config
    kw: dict[str, Any] = {}
    if spec.layout == "grid":
        vc = cfg.vision_config
        merge = getattr(vc, "spatial_merge_size", None) or getattr(vc, "merge_size", 2)
        temporal = getattr(vc, "temporal_patch_size", None) or getattr(vc, "patch_temporal", 2)
        side = 2 * merge  # a 4 x 4 patch grid, merged 2 x 2: four tokens
        per = getattr(vc, "in_channels", 3) * temporal * vc.patch_size ** 2
        kw["pixel_values"] = torch.randn(b * side * side, per, generator=g)
        kw["image_grid_thw"] = torch.tensor([[1, side, side]] * b)
        if "mm_token_type_ids" in _decoder_params(model):  # transformers 5.2x: M-RoPE reads them
            kw["mm_token_type_ids"] = image.long()
    elif spec.layout == "cross_attention":  # Mllama: one tile per image, attended from every later token
        size = cfg.vision_config.image_size
        kw["pixel_values"] = torch.randn(b, 1, 1, 3, size, size, generator=g)
        kw["aspect_ratio_ids"] = torch.ones(b, 1, dtype=torch.long)
        kw["aspect_ratio_mask"] = torch.ones(b, 1, 1, dtype=torch.long)
        kw["cross_attention_mask"] = (torch.arange(t) >= 3).long().view(1, t, 1, 1).expand(b, t, 1, 1).clone()
    elif spec.layout == "patches":  # Gemma 4: flattened patches of a 4 x 4 grid with their (x, y), pooled 2 x 2
        p = cfg.vision_config.patch_size
        kw["pixel_values"] = torch.randn(b, 16, 3 * p * p, generator=g)
        xy = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1).reshape(16, 2)
        kw["image_position_ids"] = xy.expand(b, 16, 2).clone()
        if "mm_token_type_ids" in _decoder_params(model):
            kw["mm_token_type_ids"] = image.long()
    elif spec.layout == "tiles":
        size = cfg.vision_config.image_size
        kw["pixel_values"] = torch.randn(b, 1, 3, size, size, generator=g)
    else:
        vc = cfg.vision_config
        size = vc.image_size if isinstance(vc.image_size, int) else vc.image_size[0]
        kw["pixel_values"] = torch.randn(b, 3, size, size, generator=g)
        if spec.layout == "image_sizes":
            kw["image_sizes"] = torch.tensor([[size, size]] * b)
        if spec.layout == "token_types":  # Gemma 3: 1 marks the image tokens
            kw["token_type_ids"] = image.long()
        if spec.layout == "prefix":  # PaliGemma: 0 marks the prefix (image and prompt), 1 the suffix
            kw["token_type_ids"] = (torch.arange(t) >= 3 + n + 2).long().expand(b, t).clone()
    kw = {k: (v.to(device=device, dtype=dtype) if v.is_floating_point() else v.to(device)) for k, v in kw.items()}
    labels = ids.clone()
    labels[image] = -100
    labels[(torch.rand(b, t, generator=g) < ignore_frac) & ~image] = -100
    for tok in (START, END):
        labels[labels == tok] = -100
    return dict(input_ids=ids.to(device), **kw), labels.to(device)


def _decoder_params(model: Any) -> tuple[str, ...]:
    from ..shims._patching import signature

    try:
        return tuple(signature(type(model.model).forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return ()
