"""A training step of a tiny Llama that never imports liger_compat: the program the launcher tests run.

``python train_step.py SEED OUT_DIR`` (or under ``torchrun``: gloo, one file per rank). Writes
``OUT_DIR/rank<R>-<pid>.json`` with the loss, whether the training-mode forward with labels left
``logits`` out (the fused path), the gradients of the LM head and the final norm, and whether and
how liger_compat is loaded in this process and in a Python child it starts. Not a test module.
"""

import json
import os
import subprocess
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

seed, out_dir = int(sys.argv[1]), sys.argv[2]
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    import torch.distributed as dist

    dist.init_process_group("gloo")

torch.manual_seed(seed)
config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
model = LlamaForCausalLM(config)
with torch.no_grad():  # larger than the default init so the loss is far from log(V)
    for p in model.parameters():
        p.add_(torch.randn_like(p) * 0.2)
g = torch.Generator().manual_seed(seed * 7 + 1 + rank)
ids = torch.randint(0, config.vocab_size, (2, 12), generator=g)
labels = ids.clone()
labels[torch.rand(ids.shape, generator=g) < 0.2] = -100

model.train()
out = model(input_ids=ids, labels=labels)
out.loss.backward()
loss_sum = out.loss.detach().clone()
if world > 1:
    dist.all_reduce(loss_sum)
    dist.destroy_process_group()

child = subprocess.run([sys.executable, "-c", "import sys; print('liger_compat' in sys.modules)"],
                       capture_output=True, text=True, check=True).stdout.strip() == "True"
activation = sys.modules.get("liger_compat._activation")
record = {
    "rank": rank,
    "world": world,
    "pid": os.getpid(),
    "loss": out.loss.item(),
    "loss_sum": loss_sum.item(),
    "logits_none": out.logits is None,
    "grad_lm_head": model.lm_head.weight.grad.flatten().tolist(),
    "grad_norm": model.model.norm.weight.grad.flatten().tolist(),
    "liger_compat_loaded": "liger_compat" in sys.modules,
    "activated_by": activation.how if activation is not None else None,
    "child_liger_compat_loaded": child,
}
with open(os.path.join(out_dir, f"rank{rank}-{os.getpid()}.json"), "w") as f:
    json.dump(record, f)
