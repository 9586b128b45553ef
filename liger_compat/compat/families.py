"""The model families the model shims know, their quirks, and where transformers keeps them.

Upstream: transformers ``models/<family>/modeling_<family>.py`` (4.45 .. 5.x). Every family is a
``<Prefix>ForCausalLM`` (or, for vision-language models, a ``<Prefix>ForConditionalGeneration``)
with a decoder at ``self.model`` and a head at ``self.lm_head``; what differs between them is small
and listed here, not re-implemented per family. Without the table a family trains on the native
loss path, materialising ``[B, T, V]`` logits, and nothing says so:

* RMSNorm: Gemma 1/2/3 store ``w - 1`` and multiply by ``1 + w`` (offset 1) and compute in fp32
  throughout; the others normalise in fp32, cast back, then multiply (Llama casting). OLMo2
  changed its casting between releases, so the casting is confirmed numerically per class
  (:mod:`liger_compat.shims.rms_norm`), the table only gives the expected offset.
* final logits: Gemma 2/3/4, PaliGemma and Muse Glimmer soft-cap them (``final_logit_softcapping``),
  Granite divides them by ``logits_scaling``, Cohere (``logit_scale``), Falcon-H1
  (``lm_head_multiplier``) and Muse Glimmer (``output_multiplier``) multiply them; the attributes
  are read from the language model's config (``config.get_text_config()``).
* MLP: SiLU-gated everywhere except the Gemmas (tanh GELU); Phi3 and GLM-4 fuse gate and up into one
  ``gate_up_proj``; Mixtral's experts (before transformers 5) name them ``w1``/``w3``/``w2``.
  Which MLP / RMSNorm / rotary function our kernels reproduce is decided by the structural probes
  of :mod:`liger_compat.shims.gated_mlp`, :mod:`~liger_compat.shims.rms_norm` and
  :mod:`~liger_compat.shims.rope`, not by this table.
* MoE families with a router load-balancing loss (Mixtral, Qwen3-MoE, Qwen3-Next, gpt-oss,
  DeepSeek-V4, Qwen3-VL-MoE, GLM-4V-MoE, Qwen3.5-MoE) add it when ``output_router_logits``.
* vision-language models (``vision``): the decoder takes the pixel inputs and merges the image
  features itself, so the head and the loss are the generic ones.
* ``native_reason``: a family the generic forward cannot serve (Llama 4's vision-language model
  takes the loss from its language model's full logits) stays native and the report says why.
* ``fused_from``: the first transformers release on which the fused forward was checked against
  the native model; on older releases the family stays native (:meth:`Family.why_native`), so a
  release whose forward the generic path does not reproduce is never silently wrong.

Embedding scaling (Gemma's ``sqrt(hidden_size)``, Granite's ``embedding_multiplier``) happens
inside the decoder, which the fused forward calls unchanged, so it needs no entry.

Families outside this table keep their native forward;
:func:`liger_compat.shims._family_states.family_states` (what ``check()`` shows per family) says so
for any ``*ForCausalLM`` class of an imported transformers modeling module.

This module is data that both sides read: it imports no shim (the shims import it); what a
family's patch state is, the shims say themselves.

transformers imports its modeling modules lazily: the model shims name
:func:`family_modules` (or :func:`all_modeling_modules`) as their ``modules``, and the shim
registry patches each one when it is imported.
"""

from __future__ import annotations

import importlib.util
import os
from typing import NamedTuple


#: vision-language families were checked against the native model from transformers 5.0 (on 4.51,
#: LLaVA, Mistral3 and Gemma 3's fused loss differed): before it they stay native
VISION_FUSED_FROM = "5.0"


class Family(NamedTuple):
    name: str
    prefix: str  # class-name prefix: "Qwen2" -> Qwen2ForCausalLM, Qwen2RMSNorm, Qwen2MLP
    module_name: str  # the directory under transformers/models
    since: str  # first transformers release with the family
    rms_offset: float = 0.0
    rms_casting: str = "llama"  # kernel casting mode tried first; "gemma": fp32 throughout
    mlp_act: str = "silu"  # "silu" -> swiglu kernel, "gelu_tanh" -> geglu kernel
    mlp_layout: str = "gate_up_down"  # or "fused_gate_up" (Phi3), "w1_w3_w2" (Mixtral experts)
    softcap_attr: str | None = None  # config attribute: final logits = c * tanh(logits / c)
    logit_divisor_attr: str | None = None  # config attribute: final logits = logits / d
    moe: bool = False  # router aux loss, MoeCausalLMOutputWithPast
    logit_multiplier_attr: str | None = None  # config attribute: final logits = logits * m
    head_class: str | None = None  # the class patched, when not <prefix>ForCausalLM
    vision: bool = False  # a vision-language *ForConditionalGeneration: pixel inputs reach the decoder
    native_reason: str | None = None  # the generic forward cannot honour the family: left native, says why
    fused_from: str | None = None  # transformers release from which the fused forward matches native

    def why_native(self, transformers_version: str | None = None) -> str | None:
        """Why this family keeps its native forward on ``transformers_version`` (default: the
        installed one), or None when the fused forward serves it."""
        if self.native_reason:
            return self.native_reason
        floor = self.fused_from or (VISION_FUSED_FROM if self.vision else None)
        if floor:
            from ..compat.versions import matches

            tf = transformers_version or _installed_transformers()
            if tf and not matches(tf, f">={floor}"):
                return f"the fused forward matches the native one from transformers {floor}; not on {tf}"
        return None

    @property
    def module(self) -> str:
        return f"transformers.models.{self.module_name}.modeling_{self.module_name}"

    @property
    def causal_lm(self) -> str:
        return self.head_class or f"{self.prefix}ForCausalLM"


FAMILIES: tuple[Family, ...] = (
    Family("llama", "Llama", "llama", "4.0"),
    Family("mistral", "Mistral", "mistral", "4.34"),
    Family("mixtral", "Mixtral", "mixtral", "4.36", mlp_layout="w1_w3_w2", moe=True),
    Family("qwen2", "Qwen2", "qwen2", "4.37"),
    Family("qwen3", "Qwen3", "qwen3", "4.51"),
    Family("gemma", "Gemma", "gemma", "4.38", rms_offset=1.0, rms_casting="gemma", mlp_act="gelu_tanh"),
    Family("gemma2", "Gemma2", "gemma2", "4.42", rms_offset=1.0, rms_casting="gemma", mlp_act="gelu_tanh",
           softcap_attr="final_logit_softcapping"),
    Family("gemma3", "Gemma3", "gemma3", "4.50", rms_offset=1.0, rms_casting="gemma", mlp_act="gelu_tanh",
           softcap_attr="final_logit_softcapping"),
    Family("phi3", "Phi3", "phi3", "4.40", mlp_layout="fused_gate_up"),
    Family("olmo2", "Olmo2", "olmo2", "4.47"),
    Family("granite", "Granite", "granite", "4.45", logit_divisor_attr="logits_scaling"),
    # text families added after the first eleven: quirks, where any, in the same fields
    Family("ministral", "Ministral", "ministral", "4.57"),
    Family("ministral3", "Ministral3", "ministral3", "5.0"),
    Family("nemotron", "Nemotron", "nemotron", "4.44"),  # LayerNorm1P and a relu^2 MLP: native modules
    Family("smollm3", "SmolLM3", "smollm3", "4.54"),
    Family("olmo3", "Olmo3", "olmo3", "4.57"),
    Family("glm4", "Glm4", "glm4", "4.51", mlp_layout="fused_gate_up"),
    Family("glm4_moe", "Glm4Moe", "glm4_moe", "4.54"),
    Family("exaone4", "Exaone4", "exaone4", "4.54"),
    Family("hunyuan_v1_dense", "HunYuanDenseV1", "hunyuan_v1_dense", "4.57"),
    Family("hunyuan_v1_moe", "HunYuanMoEV1", "hunyuan_v1_moe", "4.57"),
    Family("qwen3_moe", "Qwen3Moe", "qwen3_moe", "4.51", moe=True),
    Family("qwen3_next", "Qwen3Next", "qwen3_next", "4.57", rms_offset=1.0, rms_casting="gemma", moe=True),
    Family("gpt_oss", "GptOss", "gpt_oss", "4.55", moe=True),
    Family("llama4_text", "Llama4", "llama4", "4.51"),
    Family("deepseek_v2", "DeepseekV2", "deepseek_v2", "4.56"),
    Family("deepseek_v3", "DeepseekV3", "deepseek_v3", "4.54"),
    Family("deepseek_v4", "DeepseekV4", "deepseek_v4", "5.0", moe=True),
    Family("falcon_h1", "FalconH1", "falcon_h1", "4.53", logit_multiplier_attr="lm_head_multiplier"),
    Family("cohere", "Cohere", "cohere", "4.40", logit_multiplier_attr="logit_scale"),
    Family("cohere2", "Cohere2", "cohere2", "4.48", logit_multiplier_attr="logit_scale"),
    Family("gemma3n_text", "Gemma3n", "gemma3n", "4.53", rms_offset=0.0, rms_casting="gemma", mlp_act="gelu_tanh",
           softcap_attr="final_logit_softcapping"),
    Family("gemma4_text", "Gemma4", "gemma4", "5.0", rms_casting="gemma", mlp_act="gelu_tanh",
           softcap_attr="final_logit_softcapping"),
    Family("mllama_text", "Mllama", "mllama", "4.45"),
    Family("qwen3_5_text", "Qwen3_5", "qwen3_5", "5.0", rms_offset=1.0, rms_casting="gemma"),
    Family("qwen3_5_moe_text", "Qwen3_5Moe", "qwen3_5_moe", "5.0", rms_offset=1.0, rms_casting="gemma", moe=True),
    # vision-language: <Prefix>ForConditionalGeneration with the same model / lm_head layout; the
    # decoder (``self.model``) takes the pixel inputs, merges the image features and returns the
    # hidden states, the head and the loss are the generic ones
    Family("llava", "Llava", "llava", "4.36", head_class="LlavaForConditionalGeneration", vision=True),
    Family("mistral3", "Mistral3", "mistral3", "4.52", head_class="Mistral3ForConditionalGeneration", vision=True),
    Family("qwen2_vl", "Qwen2VL", "qwen2_vl", "4.45", head_class="Qwen2VLForConditionalGeneration", vision=True),
    Family("qwen2_5_vl", "Qwen2_5_VL", "qwen2_5_vl", "4.49", head_class="Qwen2_5_VLForConditionalGeneration",
           vision=True),
    Family("qwen3_vl", "Qwen3VL", "qwen3_vl", "4.57", head_class="Qwen3VLForConditionalGeneration", vision=True),
    # 5.0: loss 4-8 % off native on the tiny model; checked equal from 5.21
    Family("qwen3_vl_moe", "Qwen3VLMoe", "qwen3_vl_moe", "4.57", head_class="Qwen3VLMoeForConditionalGeneration",
           vision=True, moe=True, fused_from="5.21"),
    Family("qwen3_5", "Qwen3_5", "qwen3_5", "5.0", rms_offset=1.0, rms_casting="gemma", head_class="Qwen3_5ForConditionalGeneration",
           vision=True),
    # 5.4: loss 0.8 % off native on the tiny model (both vision-language MoE families); checked equal from
    # 5.18, the next release in the grid
    Family("qwen3_5_moe", "Qwen3_5Moe", "qwen3_5_moe", "5.0", rms_offset=1.0, rms_casting="gemma", moe=True,
           head_class="Qwen3_5MoeForConditionalGeneration", vision=True, fused_from="5.18"),
    Family("gemma3_vlm", "Gemma3", "gemma3", "4.50", rms_offset=1.0, rms_casting="gemma", mlp_act="gelu_tanh",
           head_class="Gemma3ForConditionalGeneration", vision=True),
    Family("gemma3n", "Gemma3n", "gemma3n", "4.53", rms_casting="gemma", mlp_act="gelu_tanh",
           softcap_attr="final_logit_softcapping", head_class="Gemma3nForConditionalGeneration", vision=True),
    Family("gemma4", "Gemma4", "gemma4", "5.0", rms_casting="gemma", mlp_act="gelu_tanh",
           softcap_attr="final_logit_softcapping", head_class="Gemma4ForConditionalGeneration", vision=True),
    # 5.21 / 5.22: labels-free logits and loss differ from native by 4-8 % on the tiny model
    Family("paligemma", "PaliGemma", "paligemma", "4.41", softcap_attr="final_logit_softcapping",
           head_class="PaliGemmaForConditionalGeneration", vision=True, fused_from="5.23"),
    Family("mllama", "Mllama", "mllama", "4.45", head_class="MllamaForConditionalGeneration", vision=True),
    Family("internvl", "InternVL", "internvl", "4.52", head_class="InternVLForConditionalGeneration", vision=True),
    Family("smolvlm", "SmolVLM", "smolvlm", "4.50", head_class="SmolVLMForConditionalGeneration", vision=True),
    Family("idefics3", "Idefics3", "idefics3", "4.46", head_class="Idefics3ForConditionalGeneration", vision=True),
    Family("glm4v", "Glm4v", "glm4v", "4.56", head_class="Glm4vForConditionalGeneration", vision=True),
    Family("glm4v_moe", "Glm4vMoe", "glm4v_moe", "4.56", head_class="Glm4vMoeForConditionalGeneration", vision=True,
           moe=True, fused_from="5.18"),
    Family("muse_glimmer", "MuseGlimmer", "muse_glimmer", "5.0", head_class="MuseGlimmerForConditionalGeneration",
           vision=True, softcap_attr="final_logit_softcapping", logit_multiplier_attr="output_multiplier"),
    Family("llama4", "Llama4", "llama4", "4.51", head_class="Llama4ForConditionalGeneration", vision=True,
           native_reason="its language model computes the full logits and the loss is taken from them outside "
                         "(no model / lm_head pair under the wrapper); Llama4ForCausalLM is fused"),
)

BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}
#: modeling module -> its first family (the module-wide quirks: RMSNorm offset and casting, MLP activation)
BY_MODULE: dict[str, Family] = {}
#: modeling module -> every family whose head class lives there (Gemma3ForCausalLM, Gemma3ForConditionalGeneration)
ALL_BY_MODULE: dict[str, tuple[Family, ...]] = {}
for _f in FAMILIES:
    BY_MODULE.setdefault(_f.module, _f)
    ALL_BY_MODULE[_f.module] = ALL_BY_MODULE.get(_f.module, ()) + (_f,)
del _f


_family_cache: dict[type, Family | None] = {}


def family_of(cls: type) -> Family | None:
    """The family whose ``*ForCausalLM`` class is ``cls`` or one of its bases (cached per class)."""
    try:
        return _family_cache[cls]
    except (KeyError, TypeError):
        pass
    found = None
    for klass in getattr(cls, "__mro__", ()):
        for fam in ALL_BY_MODULE.get(getattr(klass, "__module__", ""), ()):
            if klass.__name__ == fam.causal_lm:
                found = fam
                break
        if found is not None:
            break
    try:
        _family_cache[cls] = found
    except TypeError:  # pragma: no cover - unhashable
        pass
    return found


# --------------------------------------------------------------------------------------------
# modeling modules and post-import hooks
# --------------------------------------------------------------------------------------------

_all_modeling: list[str] | None = None


def all_modeling_modules() -> list[str]:
    """Names of every PyTorch modeling module of the installed transformers (file listing only)."""
    global _all_modeling
    if _all_modeling is None:
        names: list[str] = []
        try:
            spec = importlib.util.find_spec("transformers")
            roots = list(spec.submodule_search_locations or []) if spec else []
        except (ImportError, ValueError):
            roots = []
        for root in roots:
            models = os.path.join(root, "models")
            try:
                subdirs = sorted(os.listdir(models))
            except OSError:
                continue
            for sub in subdirs:
                try:
                    files = os.listdir(os.path.join(models, sub))
                except OSError:
                    continue
                for f in sorted(files):
                    if (f.startswith("modeling_") and f.endswith(".py")
                            and not f.startswith(("modeling_tf_", "modeling_flax_"))):
                        names.append(f"transformers.models.{sub}.{f[:-3]}")
        _all_modeling = names
    return list(_all_modeling)


def family_modules() -> list[str]:
    return list(ALL_BY_MODULE)


def _installed_transformers() -> str | None:
    from ..compat import versions

    return versions.installed("transformers").raw
