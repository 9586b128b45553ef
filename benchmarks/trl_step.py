"""trl training step: SFTTrainer and DPOTrainer as shipped, with liger-kernel, and under ``import liger_compat``.

    python -m benchmarks.trl_step [--trainers sft] [--models llama-8l] [--shapes 4x2048] [--dpo-shapes 2x2048]
                                  [--impls trl,trl_liger_kernel,trl_liger_compat] [--steps 8] [--warmup 3]
                                  [--profile [--profile-steps 3]] [--sync-stacks]
                                  [--out DIR] [--name trl_step]

The model is one of :data:`benchmarks.e2e.MODELS` (random weights, bf16, SDPA, on CUDA); the dataset
is random pre-tokenised rows of exactly the sequence length, so every step sees ``batch x seq``
tokens with no padding. ``SFTTrainer`` trains ``warmup + steps`` optimizer steps (fused AdamW, bf16,
no checkpointing, logging every step); a callback times each step between ``on_step_begin`` and
``on_step_end`` with the GPU synchronised, and the table reports the median of the steps after the
warm-up, the peak allocated memory over them, and the first logged loss. Implementations:

* ``trl``: trl as installed (trl 1.15+ computes the loss in its own fused LM head);
* ``trl_liger_kernel``: ``SFTConfig(use_liger_kernel=True)`` (liger-kernel's layer kernels; on
  trl 1.15+ its fused loss is not used);
* ``trl_liger_compat``: ``import liger_compat`` first, default settings;
* ``trl_liger_compat_recompute`` (only when named): the same, with the log-prob head's backward
  recomputing the logits where the default keeps their gradient (``kernels.logprob.KEEP_GRAD_MAX_BYTES``
  set to 0): the per-token weighted heads of DPO, GRPO and KTO;
* ``trl_liger_compat_all_rows`` (only when named): the same, with trl's head scoring every row
  (``trl.trainer.utils._use_triton`` answering False, as trl does off Triton devices) instead of
  gathering the labelled rows with a boolean mask, whose size the host reads (two host syncs in the
  forward, two in the backward): what those syncs cost a step.

Each runs in a fresh interpreter.

``--trainers sft,dpo`` adds a ``DPOTrainer`` step (the default is ``sft`` alone). Its shapes
(``--dpo-shapes``, ``PAIRSxSEQ``) count preference pairs of ``seq`` tokens: the prompt is the first
half, the chosen and the rejected completions (random words, trl appends EOS) fill the second, so a
step runs the policy and the reference model (a copy of the policy's initial weights, trl's own
forward in ``no_grad``) over ``2 x PAIRS`` sequences of ``seq`` tokens. The dataset is text
(``prompt`` / ``chosen`` / ``rejected``) that trl tokenizes itself with a word-level tokenizer of one
word per token id. The row also gets the first logged ``logps/chosen`` (the summed log-probability
of the chosen completions under the policy): with the reference equal to the policy, the first loss
is ``log 2`` whatever the log-probabilities are, so that number is what compares the heads.

``--profile`` adds, per implementation, a ``torch.profiler`` record of ``--profile-steps`` steps
after the warm-up (not timed with the others) and writes ``<name>_<impl>_profile.txt``: the time
of each phase of the step (data, forward + loss, backward, optimizer, logging: ranges this
script marks on the trainer's own methods), the host syncs (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, ``cudaEventSynchronize``, synchronous copies, and the aten ops that read
a value on the host: ``item`` / ``_local_scalar_dense``, ``nonzero``, ``equal``, ``masked_select``),
the GPU kernel time against the wall time, the top operators by self CPU and by GPU time, and on CUDA
where the GPU idles (:mod:`benchmarks.gpu_gaps`: the idle stretches by the phase and host code whose
launch ended them). The result row gets the phase times, sync counts and idle summary.

``--sync-stacks`` (CUDA) runs one more step under ``torch.cuda.set_sync_debug_mode("warn")`` and
records each host sync it makes with the innermost frames of its stack (the row's ``sync_sites``,
and the profile file's last section with ``--profile``): which library's line waits for the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from . import _results, gpu_gaps
from .e2e import MODELS

IMPLS = ("trl", "trl_liger_kernel", "trl_liger_compat", "trl_liger_compat_recompute", "trl_liger_compat_all_rows")
#: the default implementations (``trl_liger_compat_recompute``, an A/B of the log-prob head's kept
#: gradient, and ``trl_liger_compat_all_rows``, of trl's row gathering, run when named)
DEFAULT_IMPLS = IMPLS[:3]
TRAINERS = ("sft", "dpo")
TRAINER_CLASSES = {"sft": "SFTTrainer", "dpo": "DPOTrainer"}
#: the e2e models, plus a tiny one for a CPU smoke run of this script (tests)
MODEL_SPECS = {**MODELS, "tiny": dict(family="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      tie_word_embeddings=False, rms_norm_eps=1e-5)}


def _tokenizer():
    """A word-level tokenizer with the special tokens SFTTrainer needs; the rows are token ids
    already, so its vocabulary is never used to encode. Built here, not taken from liger_compat:
    importing any part of the package patches the libraries, and the ``trl`` and
    ``trl_liger_kernel`` runs must be unpatched."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<bos>", "<eos>"]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(specials)}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def _word_tokenizer(vocab_size: int):
    """The tokenizer of :func:`_tokenizer` with one word per token id (``w<id>``, split on
    whitespace), for the DPO dataset, which trl tokenizes from text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<bos>", "<eos>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


def _preference_rows(n_pairs: int, seq: int, vocab_size: int, seed: int = 1) -> dict:
    """``n_pairs`` text pairs whose prompt + completion + EOS is ``seq`` tokens: prompt ``seq // 2``
    random words, chosen and rejected ``seq - seq // 2 - 1`` random words each."""
    import torch

    if seq < 4:
        raise ValueError(f"--dpo-shapes: seq must be at least 4 (a prompt, a completion and EOS), got {seq}")
    g = torch.Generator().manual_seed(seed)
    n_prompt, n_completion = seq // 2, seq - seq // 2 - 1
    words = lambda n: [" ".join(f"w{i}" for i in row) for row in  # noqa: E731
                       torch.randint(4, vocab_size, (n_pairs, n), generator=g).tolist()]
    prompts, chosen, rejected = words(n_prompt), words(n_completion), words(n_completion)
    return {"prompt": prompts, "chosen": [" " + c for c in chosen], "rejected": [" " + r for r in rejected]}


#: profiler event names that read a device value on the host (aten); the CUDA runtime calls that wait
#: for the GPU are ``gpu_gaps.is_wait``'s
HOST_READS = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::equal", "aten::masked_select",
              "aten::is_nonzero")
#: trainer methods whose calls are marked as phases of the step in the profile
PHASES = {"training_step": "step", "get_batch_samples": "data", "compute_loss": "forward+loss",
          "_maybe_log_save_evaluate": "logging"}


def _mark_phases(trainer) -> None:
    """Wrap the trainer's phase methods (and the accelerator's backward, the optimizer's step once it
    exists) in ``record_function`` ranges named ``phase:<name>``."""
    import functools

    from torch.profiler import record_function

    def marked(fn, label):
        @functools.wraps(fn)
        def inner(*a, **k):
            with record_function(f"phase:{label}"):
                return fn(*a, **k)
        return inner

    for meth, label in PHASES.items():
        if hasattr(trainer, meth):
            setattr(trainer, meth, marked(getattr(trainer, meth), label))
    trainer.accelerator.backward = marked(trainer.accelerator.backward, "backward")


def _profile_summary(prof, n_steps: int, wall_ms: float, trace: list | None = None) -> tuple[str, dict]:
    ev = prof.key_averages()
    per = lambda x: x / n_steps / 1e3  # noqa: E731  (us in total -> ms per step)
    # from the raw host events: the averaged entries read 0 ms for every phase in the H100 run (on
    # CUDA a range also gets a GPU annotation of the same name, which shares the averaged key)
    phases: dict = {}
    for e in prof.events():
        if e.name.startswith("phase:") and e.device_type.name == "CPU":
            key = e.name[len("phase:"):]
            phases[key] = phases.get(key, 0.0) + per(e.cpu_time_total)
    opt = [e for e in ev if e.key.startswith("Optimizer.step#")]
    if opt:
        phases["optimizer"] = per(sum(e.cpu_time_total for e in opt))
    syncs = {}
    for e in ev:
        if e.key in HOST_READS or gpu_gaps.is_wait(e.key):
            syncs[e.key] = syncs.get(e.key, 0) + e.count / n_steps
    gpu_attr = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
    kernels_ms = per(sum(getattr(e, gpu_attr, 0) for e in ev if e.device_type.name == "CPU"))
    lines = [f"profile of {n_steps} steps; per step: wall {wall_ms:.2f} ms, GPU self time of all ops {kernels_ms:.2f} ms",
             "", "phases (host time per step, ms; nested ranges overlap):"]
    lines += [f"  {k:14s} {v:8.2f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1])]
    lines += ["", "host syncs per step:"] + [f"  {k:28s} {v:6.1f}" for k, v in sorted(syncs.items())]
    lines += ["", "top operators by self CPU time:", ev.table(sort_by="self_cpu_time_total", row_limit=25)]
    sort_gpu = "self_cuda_time_total" if gpu_attr == "self_cuda_time_total" else "self_device_time_total"
    try:
        lines += ["", "top operators by GPU time:", ev.table(sort_by=sort_gpu, row_limit=25)]
    except Exception:  # no GPU events (CPU smoke run)
        pass
    summary = {"phases_ms": phases, "syncs_per_step": syncs, "gpu_self_ms": kernels_ms, "profiled_wall_ms": wall_ms}
    if trace:
        text, idle = gpu_gaps.summarize(trace, n_steps)
        lines += ["", text]
        summary["idle"] = idle
    return "\n".join(lines), summary


def _one(model_name: str, shape: str, impl: str, steps: int, warmup: int, profile_steps: int = 0,
         out_dir: str | None = None, name: str = "trl_step", trainer_kind: str = "sft",
         sync_stacks: bool = False) -> dict:
    if trainer_kind not in TRAINERS:
        raise ValueError(f"trainer_kind: unknown trainer {trainer_kind!r}; choose from {', '.join(TRAINERS)}")
    if impl.startswith("trl_liger_compat"):
        import liger_compat  # noqa: F401  (first import, as a user would)

        if impl == "trl_liger_compat_recompute":  # the weighted heads' backward recomputes the logits
            from liger_compat.kernels import logprob

            logprob.KEEP_GRAD_MAX_BYTES = 0
        if impl == "trl_liger_compat_all_rows":  # trl's head scores every row: no boolean-mask gather
            import trl.trainer.utils as trl_utils

            trl_utils._use_triton = lambda device: False
    import copy
    import tempfile

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    spec = dict(MODEL_SPECS[model_name])
    family = spec.pop("family")
    cfg_cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen2Config
    cfg = cfg_cls(max_position_embeddings=8192, **spec)
    cfg._attn_implementation = "sdpa"
    bsz, seq = (int(x) for x in shape.split("x"))
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16 if cuda else torch.float32)
    n_rows = bsz * (steps + warmup + profile_steps + bool(sync_stacks and cuda))
    if trainer_kind == "sft":
        g = torch.Generator().manual_seed(1)
        rows = torch.randint(3, cfg.vocab_size, (n_rows, seq), generator=g)
        ds = Dataset.from_dict({"input_ids": rows.tolist()})
        tok = _tokenizer()
    else:
        ds = Dataset.from_dict(_preference_rows(n_rows, seq, cfg.vocab_size))
        tok = _word_tokenizer(cfg.vocab_size)

    times: list[float] = []
    prof_state: dict = {}
    last_timed = warmup + steps  # the profiled steps come after the timed ones
    # --sync-stacks: one more step after those, its host syncs recorded with their stacks
    stack_step = last_timed + profile_steps if sync_stacks and cuda else None
    sites = _results.SyncSites(frames=10) if stack_step is not None else None

    class Timer(TrainerCallback):
        t0 = 0.0

        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == warmup and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            sync()
            if profile_steps and state.global_step == last_timed:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                prof_state["prof"] = profile(activities=acts)
                prof_state["prof"].__enter__()
                prof_state["t0"] = time.perf_counter()
            if state.global_step == stack_step:
                sites.__enter__()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            sync()
            if warmup < state.global_step <= last_timed:
                times.append(time.perf_counter() - self.t0)
            if "prof" in prof_state and state.global_step == last_timed + profile_steps:
                prof_state["wall_ms"] = (time.perf_counter() - prof_state["t0"]) * 1e3 / profile_steps
                prof_state["prof"].__exit__(None, None, None)
                if cuda:  # where the GPU idles, from the trace (benchmarks.gpu_gaps)
                    prof_state["trace"] = gpu_gaps.from_profiler(prof_state["prof"])
            if stack_step is not None and state.global_step == stack_step + 1:
                sites.__exit__(None, None, None)

    # a DPO step runs the policy (and the reference) over the chosen and the rejected sequence of each pair
    tokens = bsz * seq * (2 if trainer_kind == "dpo" else 1)
    res = {"trainer": trainer_kind, "model": model_name, "shape": shape, "impl": impl, "tokens": tokens,
           "torch": torch.__version__,
           "transformers": transformers.__version__, "trl": trl.__version__, "gpu": torch.cuda.get_device_name(0) if cuda else "cpu"}
    with tempfile.TemporaryDirectory() as out:
        common = dict(output_dir=out, per_device_train_batch_size=bsz, max_length=seq, bf16=cuda, use_cpu=not cuda,
                      max_steps=steps + warmup + profile_steps + (stack_step is not None), learning_rate=1e-5,
                      logging_steps=1, report_to="none",
                      save_strategy="no", optim="adamw_torch_fused" if cuda else "adamw_torch",
                      dataloader_num_workers=0, use_liger_kernel=impl == "trl_liger_kernel",
                      gradient_checkpointing=False)
        if trainer_kind == "sft":
            trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**common), train_dataset=ds,
                                     processing_class=tok, callbacks=[Timer()])
        else:
            ref_model = copy.deepcopy(model).eval()
            ref_model.requires_grad_(False)
            trainer = trl.DPOTrainer(model=model, ref_model=ref_model, args=trl.DPOConfig(**common), train_dataset=ds,
                                     processing_class=tok, callbacks=[Timer()])
        if profile_steps:
            _mark_phases(trainer)
        try:
            trainer.train()
        except torch.OutOfMemoryError:
            return dict(res, status="OOM")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer_kind == "dpo":
        logps = [h["logps/chosen"] for h in trainer.state.log_history if "logps/chosen" in h]
        res["first_logps_chosen"] = logps[0] if logps else None
    res["liger_compat_loaded"] = "liger_compat" in sys.modules
    step = statistics.median(times)
    res.update(status="ok", step_ms=step * 1e3, tokens_per_s=tokens / step, steps_ms=[t * 1e3 for t in times],
               peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"), first_loss=losses[0] if losses else None)
    if sites is not None:
        res["sync_sites"] = sites.found
    if "wall_ms" in prof_state:
        text, summary = _profile_summary(prof_state["prof"], profile_steps, prof_state["wall_ms"], prof_state.get("trace"))
        res["profile"] = summary
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            tag = "" if trainer_kind == "sft" else f"{trainer_kind}_"
            path = os.path.join(out_dir, f"{name}_{tag}{model_name}_{shape}_{impl}_profile.txt")
            with open(path, "w") as f:
                f.write(f"{TRAINER_CLASSES[trainer_kind]}, {impl}, {model_name}, {shape}\n{text}\n")
                if sites is not None:
                    f.write("\nhost syncs of one step (torch.cuda.set_sync_debug_mode), innermost frame first:\n")
                    f.write("".join(f"  {site}\n" for site in sites.found))
            res["profile_file"] = path
    if impl.startswith("trl_liger_compat"):
        import liger_compat

        rep = liger_compat.check(quiet=True)
        res["shims_applied"] = sorted(s["id"] for s in rep.shims if s["state"] == "applied")
        res["heads"] = [s.get("reason", "") for s in rep.shims if s["id"] == "trl.fused_lm_head"]
    return res


def _table(rows: list[dict], trainer_kind: str) -> list[str]:
    dpo = trainer_kind == "dpo"
    shape_col = "pairs x seq" if dpo else "batch x seq"
    extra = " first logps/chosen |" if dpo else ""
    ncols = 11 if dpo else 10
    lines = [f"| model | {shape_col} | impl | step ms | tokens/s | x trl tokens/s | x trl + liger-kernel tokens/s | "
             f"peak GiB | x trl peak | first loss |{extra}", "|---" * ncols + "|"]
    for failed, r, d in _results.table_rows(rows, IMPLS, ncols):
        if failed:
            lines.append(failed)
            continue
        m, s, impl = r["model"], r["shape"], r["impl"]
        base, lk = d.get("trl", {}), d.get("trl_liger_kernel", {})
        ratio = lambda other, key: (f"{r[key] / other[key]:.2f}" if other.get("status") == "ok" else "-")  # noqa: E731
        num = lambda key: f"{r[key]:.4f}" if r.get(key) is not None else "-"  # noqa: E731
        lines.append(f"| {m} | {s} | {impl} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{ratio(base, 'tokens_per_s')} | {ratio(lk, 'tokens_per_s')} | {r['peak_gib']:.2f} | "
                     f"{ratio(base, 'peak_gib')} | {num('first_loss')} |" + (f" {num('first_logps_chosen')} |" if dpo else ""))
    return lines


def _markdown(rows: list[dict]) -> str:
    """One table per trainer (rows written before DPO was measured have no ``trainer``: SFT)."""
    by = {k: [r for r in rows if r.get("trainer", "sft") == k] for k in TRAINERS}
    kinds = [k for k in TRAINERS if by[k]]
    title = " and ".join(TRAINER_CLASSES[k] for k in kinds) + (" steps" if len(kinds) > 1 else " step")
    lines = [f"# trl {title} (forward, backward, AdamW), bf16, random weights and tokens", ""]
    ok = [r for r in rows if r.get("status") == "ok"]
    if ok:
        r0 = ok[0]
        lines += [f"GPU: {r0['gpu']}; torch {r0['torch']}; transformers {r0['transformers']}; trl {r0['trl']}", ""]
    lines += ["Median step after the warm-up steps, each implementation in a fresh process.", ""]
    for k in kinds:
        if len(kinds) > 1:
            lines += [f"## {TRAINER_CLASSES[k]}", ""]
        if k == "dpo":
            lines += ["Each pair: a prompt of half the sequence, chosen and rejected completions of the other half "
                      "(EOS included); the reference model is a copy of the policy, so the first loss is log 2 and "
                      "`first logps/chosen` compares the log-probabilities. Tokens per step: 2 x pairs x seq.", ""]
        lines += _table(by[k], k) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", default="sft", help=f"any of {', '.join(TRAINERS)}")
    ap.add_argument("--models", default="llama-8l", help=f"any of {', '.join(MODEL_SPECS)}")
    ap.add_argument("--shapes", default="4x2048", help="SFT shapes, BATCHxSEQ")
    ap.add_argument("--dpo-shapes", default="2x2048", help="DPO shapes, PAIRSxSEQ (each pair: prompt + chosen, "
                    "prompt + rejected, SEQ tokens each)")
    ap.add_argument("--impls", default=",".join(DEFAULT_IMPLS), help=f"any of {', '.join(IMPLS)}")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    ap.add_argument("--name", default="trl_step")
    ap.add_argument("--profile", action="store_true",
                    help="also profile --profile-steps steps after the timed ones: "
                    "<name>_[dpo_]<model>_<shape>_<impl>_profile.txt")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--sync-stacks", action="store_true",
                    help="on CUDA, run one more step with torch.cuda.set_sync_debug_mode and record each host "
                    "sync's stack (the row's sync_sites; the profile file with --profile)")
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "SHAPE", "IMPL"), help=argparse.SUPPRESS)
    ap.add_argument("--trainer", default="sft", choices=TRAINERS, help=argparse.SUPPRESS)  # of --one
    a = ap.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(_one(*a.one, steps=a.steps, warmup=a.warmup,
                                          profile_steps=a.profile_steps if a.profile else 0, out_dir=a.out,
                                          name=a.name, trainer_kind=a.trainer, sync_stacks=a.sync_stacks)),
              flush=True)
        return 0
    trainers = a.trainers.split(",")
    for t in trainers:
        if t not in TRAINERS:
            ap.error(f"--trainers: unknown trainer {t!r}; choose from {', '.join(TRAINERS)}")
    for m in a.models.split(","):
        if m not in MODEL_SPECS:
            ap.error(f"--models: unknown model {m!r}; choose from {', '.join(MODEL_SPECS)}")
    for i in a.impls.split(","):
        if i not in IMPLS:
            ap.error(f"--impls: unknown implementation {i!r}; choose from {', '.join(IMPLS)}")
    for flag, value, form in (("--shapes", a.shapes, "BATCHxSEQ"), ("--dpo-shapes", a.dpo_shapes, "PAIRSxSEQ")):
        for shape in value.split(","):
            parts = shape.split("x")
            if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
                ap.error(f"{flag}: {shape!r} is not {form}")
    if "dpo" in trainers and any(int(s.split("x")[1]) < 4 for s in a.dpo_shapes.split(",")):
        ap.error("--dpo-shapes: SEQ must be at least 4 (a prompt, a completion and EOS)")
    if a.steps < 1 or a.warmup < 1:
        ap.error("--steps and --warmup must be at least 1")
    rows = []
    runs = [(t, m, s) for t in trainers for m in a.models.split(",")
            for s in (a.shapes if t == "sft" else a.dpo_shapes).split(",")]
    for t, m, s in runs:
        for impl in a.impls.split(","):
            cmd = [sys.executable, "-m", "benchmarks.trl_step", "--one", m, s, impl, "--trainer", t,
                   "--steps", str(a.steps), "--warmup", str(a.warmup), "--out", a.out, "--name", a.name]
            if a.profile:
                cmd += ["--profile", "--profile-steps", str(a.profile_steps)]
            if a.sync_stacks:
                cmd.append("--sync-stacks")
            p = subprocess.run(cmd, capture_output=True, text=True)
            got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if got:
                rows.append(json.loads(got[-1][len("RESULT "):]))
            else:
                rows.append({"trainer": t, "model": m, "shape": s, "impl": impl,
                             "status": f"failed (rc {p.returncode})",
                             "stderr_tail": p.stderr[-3000:]})
                print(p.stderr[-3000:], file=sys.stderr)
            print(json.dumps(rows[-1])[:300], flush=True)
    _results.write(a.out, a.name, rows, _markdown(rows), _results.command("benchmarks.trl_step", argv or sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
