"""A tiny tokenizer, tiny random causal LMs and toy datasets, built in code (no hub access).

Used by the trainer scenarios of ``check --deep`` and by the trainer tests, so both run the real
trl trainers on the same small setup on whatever transformers / trl is installed: a word-level
``tokenizers`` tokenizer wrapped in ``PreTrainedTokenizerFast`` (pad / bos / eos / unk and a chat
template set), two-layer Llama and Qwen2 models with hidden size 32, and datasets in the formats
the trainers take (``text``; ``prompt`` / ``chosen`` / ``rejected``; ``prompt`` / ``completion`` /
``label``; ``prompt``).
"""

from __future__ import annotations

import random
from typing import Any

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
N_WORDS = 120

CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|> {{ message['content'] }} {{ eos_token }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def words() -> list[str]:
    return [f"w{i}" for i in range(N_WORDS)]


def build_tokenizer(model_max_length: int = 64):
    """A ``PreTrainedTokenizerFast`` over ``w0 .. w119`` plus special tokens (vocab 127)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + words())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        model_max_length=model_max_length,
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids: generate() refuses them
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "right"
    return fast


FAMILIES = ("llama", "qwen2")


def build_model(family: str, tokenizer: Any, seed: int = 0, init_std: float = 0.1, echo: bool = True):
    """A fresh two-layer ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` with seeded random weights
    (``tiny_models.build``'s configuration, sized to ``tokenizer``), in train mode.

    ``echo=True`` makes the head lean towards predicting the current token again (head = 3 x embedding,
    the layers' output projections scaled down), so on :func:`sft_rows`, which repeat words, the token
    accuracy is neither 0 nor 1 and a wrong accuracy shows.
    """
    import torch

    from .tiny_models import build

    if family not in FAMILIES:
        raise ValueError(f"family {family!r}: pick one of {FAMILIES}")
    model = build(family, seed=seed, init_std=init_std, perturb_norms=False, vocab_size=len(tokenizer),
                  intermediate_size=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, use_cache=False).train()
    with torch.no_grad():
        if echo:
            emb = model.get_input_embeddings().weight
            emb.mul_(10.0)
            model.get_output_embeddings().weight.copy_(emb * 0.3)
            for name, p in model.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    p.mul_(0.3)
    return model


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    w = words()
    return " ".join(rng.choice(w) for _ in range(rng.randint(lo, hi)))


def _repeating(rng: random.Random, n_words: int) -> str:
    out: list[str] = []
    w = words()
    while len(out) < n_words:
        out += [rng.choice(w)] * rng.randint(1, 3)
    return " ".join(out[:n_words])


def sft_rows(n: int = 16, seed: int = 0) -> list[dict[str, str]]:
    """Texts of 8 .. 14 words in which words often repeat (see ``build_model(echo=True)``)."""
    rng = random.Random(seed)
    return [{"text": _repeating(rng, rng.randint(8, 14))} for _ in range(n)]


def preference_rows(n: int = 16, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"prompt": _sentence(rng, 3, 6), "chosen": _sentence(rng, 3, 6), "rejected": _sentence(rng, 3, 6)}
            for _ in range(n)]


def unpaired_rows(n: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"prompt": _sentence(rng, 3, 6), "completion": _sentence(rng, 3, 6), "label": i % 2 == 0}
            for i in range(n)]


def prompt_rows(n: int = 16, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return [{"prompt": _sentence(rng, 3, 6)} for _ in range(n)]


def dataset(rows: list[dict[str, Any]]):
    from datasets import Dataset

    return Dataset.from_list(rows)
