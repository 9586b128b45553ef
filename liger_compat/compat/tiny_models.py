"""Tiny randomly initialised ``*ForCausalLM`` models built from a config in code (no hub access).

Used by the ``check --deep`` scenarios of the model shims and by the tests, so both exercise the
same configurations on whatever transformers is installed. A family the installed release lacks
raises :class:`FamilyUnavailable` with the reason.
"""

from __future__ import annotations

import importlib
from typing import Any

from .families import BY_NAME, Family


class FamilyUnavailable(Exception):
    """The installed transformers has no such family (or no usable config for it)."""


#: small enough for a CPU test in milliseconds, big enough for GQA, two layers and a real vocab
BASE: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

#: quirks switched on so the tests see them: Gemma's soft-cap low enough to bend the logits,
#: Granite's multipliers away from 1, Mixtral's router loss on
EXTRA: dict[str, dict[str, Any]] = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02),
    "gemma2": dict(final_logit_softcapping=3.0, attn_logit_softcapping=50.0, sliding_window=8, query_pre_attn_scalar=8),
    "gemma3": dict(final_logit_softcapping=3.0, attn_logit_softcapping=50.0, sliding_window=8, query_pre_attn_scalar=8),
    "gemma": dict(hidden_activation="gelu_pytorch_tanh"),
    "granite": dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2),
    "phi3": dict(original_max_position_embeddings=128),
    # MoE families: few small experts, the router loss on where the family has one
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, output_router_logits=True,
                      router_aux_loss_coef=0.02),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "qwen3_next": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24,
                       output_router_logits=True, router_aux_loss_coef=0.02, partial_rotary_factor=0.5,
                       layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                         linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                         linear_conv_kernel_dim=4),
    "qwen3_5_moe_text": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                             shared_expert_intermediate_size=24, output_router_logits=True, router_aux_loss_coef=0.02,
                             layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                             linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                             linear_conv_kernel_dim=4),
    "deepseek_v4": dict(n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=16, q_lora_rank=16,
                        index_n_heads=2, index_head_dim=8, index_topk=4, hc_mult=2, head_dim=16,
                        partial_rotary_factor=0.5, sliding_window=8, mlp_layer_types=["hash_moe", "moe"],
                        layer_types=["sliding_attention", "sliding_attention"], output_router_logits=True,
                        router_aux_loss_coef=0.02),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, first_k_dense_replace=1,
                     n_group=1, topk_group=1, partial_rotary_factor=0.5),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, first_k_dense_replace=1,
                        n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8,
                        v_head_dim=8, head_dim=8, n_group=1, topk_group=1, num_key_value_heads=4),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, first_k_dense_replace=1,
                        n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                        v_head_dim=8, head_dim=8, n_group=1, topk_group=1, num_key_value_heads=4),
    "llama4_text": dict(num_local_experts=2, num_experts_per_tok=1, intermediate_size_mlp=48, interleave_moe_layer_step=2,
                        no_rope_layers=[1, 0], attention_chunk_size=8),
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8,
                      mamba_chunk_size=16, lm_head_multiplier=0.5, embedding_multiplier=2.0, mlp_multipliers=[0.5, 2.0]),
    "cohere": dict(logit_scale=0.5),
    "cohere2": dict(logit_scale=0.5, sliding_window=8),
    "gemma3n_text": dict(num_kv_shared_layers=0, layer_types=["sliding_attention", "full_attention"],
                         sliding_window=8, final_logit_softcapping=3.0, vocab_size_per_layer_input=96,
                         hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2,
                         activation_sparsity_pattern=[0.0, 0.0], intermediate_size=48),
    "gemma4_text": dict(final_logit_softcapping=3.0, sliding_window=8, vocab_size_per_layer_input=96,
                        hidden_size_per_layer_input=8),
    # vision-language models: these go to the text config
    "gemma4": dict(final_logit_softcapping=3.0),
    "paligemma": dict(final_logit_softcapping=3.0),
}

_CONFIG_CLASSES = {"gemma3": ("Gemma3TextConfig",)}


def modeling_module(family: str | Family):
    fam = BY_NAME[family] if isinstance(family, str) else family
    try:
        return importlib.import_module(fam.module)
    except ImportError as exc:
        import transformers

        raise FamilyUnavailable(
            f"{fam.name} is not in transformers {transformers.__version__} (added in {fam.since})"
        ) from exc


def construct_config(cls: type, kw: dict[str, Any]):
    """``cls(**kw)``; where the config class's strict validation refuses a ``True`` / ``False`` for a
    field it annotates as ``int`` (transformers 5.4.0 with huggingface_hub 1.33: ``tie_word_embeddings``
    and ``use_cache`` of Olmo2 / Olmo3 / Cohere2 / FalconH1, even their own defaults), the same value
    is given as 1 / 0."""
    import re

    kw = dict(kw)
    for _ in range(len(kw) + 1):
        try:
            return cls(**kw)
        except Exception as exc:  # huggingface_hub's StrictDataclassFieldValidationError (an Exception)
            text = f"{exc} {getattr(exc, '__cause__', '')}"
            m = re.search(r"field '(\w+)'.*?expected int, got bool \(value: (True|False)\)", text, re.S)
            if m is None or not isinstance(kw.get(m.group(1), m.group(2) == "True"), bool):
                raise
            kw[m.group(1)] = int(m.group(2) == "True")  # (also a default of the class's own __init__)
    return cls(**kw)


def config_for(family: str | Family, **overrides: Any):
    fam = BY_NAME[family] if isinstance(family, str) else family
    modeling_module(fam)
    mod = modeling_module(fam)
    cfg_mod = importlib.import_module(f"transformers.models.{fam.module_name}.configuration_{fam.module_name}")
    cls = None
    for cls_name in _CONFIG_CLASSES.get(fam.name, (f"{fam.prefix}Config",)):
        cls = getattr(cfg_mod, cls_name, None)
        if cls is not None:
            break
    head_cfg = getattr(getattr(mod, fam.causal_lm, None), "config_class", None)
    if isinstance(head_cfg, type) and fam.name not in _CONFIG_CLASSES:
        cls = head_cfg  # Llama4ForCausalLM -> Llama4TextConfig, Gemma3nForCausalLM -> Gemma3nTextConfig ...
    if cls is None:
        raise FamilyUnavailable(f"no config class for {fam.name} in {cfg_mod.__name__}")
    kw = dict(BASE)
    kw.update(EXTRA.get(fam.name, {}))
    kw.update(overrides)
    cfg = construct_config(cls, kw)
    cfg._attn_implementation = "eager"
    return cfg


def randomize(model: Any, *, seed: int, init_std: float, perturb_norms: bool = True, device: Any = "cpu") -> None:
    """Matrices drawn with std ``init_std`` from a seeded generator on ``device`` (logits far from 0);
    norm weights, with ``perturb_norms``, moved a little off their neutral value."""
    import torch

    with torch.no_grad():
        g = torch.Generator(device=device).manual_seed(seed)
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device=device) * init_std)
            elif perturb_norms and "norm" in name:
                p.add_(torch.randn(p.shape, generator=g, device=device) * 0.1)


def build(family: str | Family, *, seed: int = 0, dtype: Any = None, device: Any = "cpu",
          init_std: float = 0.2, perturb_norms: bool = True, **overrides: Any):
    """A fresh ``<Family>ForCausalLM`` with random weights of std ``init_std`` (logits far from 0),
    in eval mode; ``overrides`` change the config (:data:`BASE`, :data:`EXTRA`)."""
    import torch

    fam = BY_NAME[family] if isinstance(family, str) else family
    mod = modeling_module(fam)
    cls = getattr(mod, fam.causal_lm, None)
    if cls is None:
        raise FamilyUnavailable(f"{mod.__name__} has no {fam.causal_lm}")
    if fam.vision:
        from . import tiny_vlms

        cfg = tiny_vlms.config_for(fam, {**BASE, **EXTRA.get(fam.name, {})}, **overrides)
    else:
        cfg = config_for(fam, **overrides)
    torch.manual_seed(seed)
    dev = torch.device(device)
    model = None
    if dev.type != "cpu":  # built and drawn on the device: big configs (benchmarks) build in a fraction of the time
        try:
            with dev:
                model = cls(cfg)
            randomize(model, seed=seed, init_std=init_std, perturb_norms=perturb_norms, device=dev)
        except Exception:  # a family whose init needs the CPU: built there as below
            model = None
    if model is None:
        model = cls(cfg)
        randomize(model, seed=seed, init_std=init_std, perturb_norms=perturb_norms)
    if fam.vision:
        with torch.no_grad():  # Mllama's cross-attention gates start at 0 (tanh(0): the image has no effect)
            for name, p in model.named_parameters():
                if name.endswith("_gate") and p.dim() <= 1 and not p.any():
                    p.fill_(0.5)
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    return model.eval()
