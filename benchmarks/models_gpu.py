"""GPU check of the model shims: per family of the table (decoders and vision-language
``*ForConditionalGeneration``), at a realistic small language-model size, a bf16 training step
patched vs native with the same weights.

    python -m benchmarks.models_gpu [--families llama,qwen2,...] [--batch 2] [--seq 2048]
                                    [--hidden 1024] [--layers 2] [--vocab 128256] [--out DIR] [--name models_gpu]
    python -m benchmarks.models_gpu --device cpu --seq 64 --hidden 128 --vocab 512 --iters 1   # smoke run
    python -m benchmarks.models_gpu --small --fresh 3 [--steps 30]   # timing only, fresh processes

``--fresh N`` times instead of checking: native (``LIGER_COMPAT_DISABLE=1``) and patched each in
their own fresh process, alternating, N processes of each; every process builds each family's
bf16 model with the same weights, warms up, and times ``--steps`` forward + backward steps (CUDA
events, median). The report gives per family the median over the processes and the ratio
patched / native (below 1: faster than native), and the spread of the processes. ``--small``
is the host-bound shape: 2 layers, hidden 1024, vocabulary 128256, 2 x 1024 tokens.

For each family it reports

* loss and gradient error of the native bf16 step and of the patched bf16 step, both against an
  fp32 native step of the same weights (the patched error should be no worse than about the
  native one; the columns make that visible per family),
* extra peak memory of forward + backward (peak allocated minus what was allocated before the
  step; gradients set to None first, so both sides pay for the same gradients),
* median time of forward + backward over a few iterations (CUDA events),
* token accuracy returned by the fused forward vs argmax of the native logits.

Writes ``<name>.json`` and ``<name>.md`` (``--name``, default ``models_gpu``) under ``--out`` (default
benchmarks/results), each naming the command that regenerates it.
Families the installed transformers lacks (or without a tiny config) are listed as skipped, and
families the table leaves native as such, with the reason. Vision-language models keep their tiny
vision tower (one image of four placeholder tokens per sample, ``liger_compat.compat.tiny_vlms``);
the language model gets the sizes below. Needs CUDA; runs the Triton kernels through
``liger_compat.kernels``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

import liger_compat
from benchmarks._stats import median_interval
from liger_compat.compat import tiny_vlms
from liger_compat.compat.families import BY_NAME, FAMILIES
from liger_compat.compat.tiny_models import EXTRA, FamilyUnavailable, build


def log(*a):
    print(*a, flush=True)


@contextlib.contextmanager
def native():
    errors = liger_compat.revert()
    if errors:
        raise RuntimeError(f"revert failed: {errors}")
    try:
        yield
    finally:
        liger_compat.apply()


def make_model(family: str, args, dtype):
    heads = max(args.hidden // 64, 1)
    overrides = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate or int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(heads // 4, 1),
        head_dim=64,
        max_position_embeddings=max(args.seq, 4096),
        sliding_window=args.seq,
    )
    if family == "phi3":
        overrides["original_max_position_embeddings"] = max(args.seq, 4096)
    if family in ("gemma2", "gemma3"):
        # sdpa has no attention soft-cap: keep the final-logit soft-cap (the fused loss's quirk) only
        overrides.update(final_logit_softcapping=30.0, attn_logit_softcapping=None, query_pre_attn_scalar=64)
    extra = EXTRA.get(family, {})
    # the tiny test configs' MoE / hybrid widths scaled with the hidden size
    for key in ("moe_intermediate_size", "shared_expert_intermediate_size", "intermediate_size_mlp"):
        if key in extra:
            overrides[key] = args.hidden // 2
    if "vocab_size_per_layer_input" in extra or family in ("gemma4", "gemma3n_text"):
        overrides.update(vocab_size_per_layer_input=args.vocab, hidden_size_per_layer_input=64)
    if "sliding_window" in extra or family in ("cohere2", "gpt_oss", "gemma4", "gemma4_text", "muse_glimmer"):
        overrides["sliding_window"] = args.seq
    if "qk_rope_head_dim" in extra:  # MLA: head dims follow head_dim
        overrides.update(qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, kv_lora_rank=args.hidden // 4,
                         num_key_value_heads=heads)
    if "linear_key_head_dim" in extra or family in ("qwen3_5", "qwen3_5_moe"):
        overrides.update(linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=max(heads // 2, 1),
                         linear_num_value_heads=heads)
    if "mamba_d_ssm" in extra:
        overrides.update(mamba_d_ssm=args.hidden, mamba_n_heads=heads, mamba_d_head=64, mamba_d_state=64,
                         mamba_chunk_size=256)
    if family == "paligemma":
        # a sliding window on its Gemma 1 text config makes PaliGemma (5.23) build a per-layer-type
        # mask mapping that the Gemma 1 decoder does not take
        del overrides["sliding_window"]
    if family == "deepseek_v4":
        overrides.update(o_lora_rank=args.hidden // 4, q_lora_rank=args.hidden // 4, index_head_dim=64,
                         index_topk=min(args.seq, 512), head_dim=64, sliding_window=args.seq)
    model = build(family, seed=0, init_std=0.02, device=args.device, dtype=dtype, **overrides)
    for cfg in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        cfg._attn_implementation = "sdpa"
    return model.train()


def batch(model, args, family: str):
    """``(inputs, labels)``: random ids (10% of the labels ignored); a vision-language model gets one
    tiny image per sample through :func:`tiny_vlms.inputs`."""
    if BY_NAME[family].vision:
        return tiny_vlms.inputs(model, b=args.batch, t=args.seq, seed=1, ignore_frac=0.1)
    g = torch.Generator().manual_seed(1)
    v = model.config.vocab_size
    ids = torch.randint(3, v, (args.batch, args.seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=g) < 0.1] = -100
    return dict(input_ids=ids.to(args.device)), labels.to(args.device)


def step(model, kw, labels):
    """One forward + backward; returns (loss, grads, extra peak bytes (0 off CUDA), output)."""
    cuda = labels.is_cuda
    model.zero_grad(set_to_none=True)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    out = model(**kw, labels=labels, use_cache=False)
    out.loss.backward()
    peak = 0
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach().float(), grads, peak, out


def timed(model, kw, labels, iters: int, warmup: int = 1):
    """Median ms of ``iters`` training steps (forward with labels, backward; the gradients zeroed
    before each, outside the timing) after ``warmup`` more: CUDA events on the GPU, wall time on
    the CPU."""
    times = []
    for _ in range(iters + warmup):
        model.zero_grad(set_to_none=True)
        if not labels.is_cuda:
            t0 = time.perf_counter()
            model(**kw, labels=labels, use_cache=False).loss.backward()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model(**kw, labels=labels, use_cache=False).loss.backward()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[warmup:])


def rel(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in b)
    den = sum(float(b[k].pow(2).sum()) for k in b)
    return (num / max(den, 1e-30)) ** 0.5


def run_family(family: str, args) -> dict:
    fam = BY_NAME.get(family)
    row: dict = {"family": family, "vision": bool(fam and fam.vision)}  # also on skipped / error rows
    if fam is None:
        return {**row, "skipped": "not in the family table"}
    if fam.why_native():
        return {**row, "skipped": f"native forward: {fam.why_native()}"}
    try:
        model = make_model(family, args, torch.float32)
    except FamilyUnavailable as exc:
        return {**row, "skipped": str(exc)}
    kw, labels = batch(model, args, family)
    with native():
        truth_loss, truth_grads, _, _ = step(model, kw, labels)
        model.to(torch.bfloat16)
        kw = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in kw.items()}
        n_loss, n_grads, n_peak, n_out = step(model, kw, labels)
        with torch.no_grad():
            shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
            valid = shift != -100
            n_acc = float(((n_out.logits.argmax(-1) == shift) & valid).sum() / valid.sum())
        del n_out
        n_ms = timed(model, kw, labels, args.iters)
    p_loss, p_grads, p_peak, p_out = step(model, kw, labels)
    p_acc = float(p_out.token_accuracy)
    assert p_out.logits is None, "fused forward returned logits with labels"
    del p_out
    p_ms = timed(model, kw, labels, args.iters)
    row.update(
        params_m=sum(p.numel() for p in model.parameters()) / 1e6,
        loss_fp32=float(truth_loss),
        loss_err_native=abs(float(n_loss) - float(truth_loss)),
        loss_err_patched=abs(float(p_loss) - float(truth_loss)),
        grad_err_native=rel(n_grads, truth_grads),
        grad_err_patched=rel(p_grads, truth_grads),
        grad_err_patched_vs_native=rel(p_grads, n_grads),
        peak_gib_native=n_peak / 2**30,
        peak_gib_patched=p_peak / 2**30,
        ms_native=n_ms,
        ms_patched=p_ms,
        token_acc_native_logits=n_acc,
        token_acc_fused=p_acc,
    )
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"transformers {meta['transformers']}, torch {meta['torch']}, {meta['gpu']}; batch {meta['batch']} x "
           f"{meta['seq']}, hidden {meta['hidden']}, {meta['layers']} layers, vocab {meta['vocab']}, bf16", "",
           "| family | loss err native / ours | grad err native / ours | peak GiB native / ours | ms native / ours | acc logits / fused |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        name = r["family"] + (" (VL)" if r.get("vision") else "")
        if "skipped" in r or "error" in r:
            out.append(f"| {name} | {r.get('skipped') or r.get('error')} | | | | |")
            continue
        out.append(
            f"| {name} | {r['loss_err_native']:.2e} / {r['loss_err_patched']:.2e} "
            f"| {r['grad_err_native']:.2e} / {r['grad_err_patched']:.2e} "
            f"| {r['peak_gib_native']:.2f} / {r['peak_gib_patched']:.2f} "
            f"| {r['ms_native']:.1f} / {r['ms_patched']:.1f} "
            f"| {r['token_acc_native_logits']:.4f} / {r['token_acc_fused']:.4f} |"
        )
    return "\n".join(out)


def _timing_model(family: str, args):
    """``(model, inputs, labels)`` in bf16 for a timing run, or the row of a family that is skipped."""
    fam = BY_NAME.get(family)
    if fam is None:
        return {"family": family, "skipped": "not in the family table"}
    if fam.why_native():
        return {"family": family, "skipped": f"native forward: {fam.why_native()}"}
    try:
        model = make_model(family, args, torch.bfloat16)
    except FamilyUnavailable as exc:
        return {"family": family, "skipped": str(exc)}
    kw, labels = batch(model, args, family)
    return model, {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in kw.items()}, labels


def _warm_up(model, kw, labels) -> None:
    for _ in range(3):  # kernels compile, probes run, caches fill, the allocator settles
        model.zero_grad(set_to_none=True)
        model(**kw, labels=labels, use_cache=False).loss.backward()


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def time_family(family: str, args) -> dict:
    """This process's median step time of ``family`` (whatever liger_compat's state: the parent
    starts native processes with ``LIGER_COMPAT_DISABLE=1``)."""
    got = _timing_model(family, args)
    if isinstance(got, dict):
        return got
    model, kw, labels = got
    _warm_up(model, kw, labels)
    ms = timed(model, kw, labels, args.steps)
    del model, got
    _release()
    return {"family": family, "ms": ms}


def time_family_paired(family: str, args) -> dict:
    """Native and patched median step times of ``family`` in this process, interleaved: one model,
    ``liger_compat.revert()`` / ``apply()`` between batches of ``--steps`` steps, ``--rounds``
    rounds with the order reversed every other one (the two sides meet the same machine state).
    ``--alternate`` (``--steps 1``): the row also has each round's patched / native ratio."""
    got = _timing_model(family, args)
    if isinstance(got, dict):
        return got
    model, kw, labels = got
    sides = {"native": liger_compat.revert, "patched": liger_compat.apply}
    if getattr(args, "baseline", "native") == "nographs":  # both sides patched: the fused loss's graphs off / on
        settings = liger_compat._config.settings

        def graphs(on):
            def switch():
                liger_compat.apply()
                settings.flce_graphs = on
            return switch

        sides = {"native": graphs(False), "patched": graphs(True)}
    for switch in sides.values():
        switch()
        _warm_up(model, kw, labels)
    times: dict[str, list[float]] = {"native": [], "patched": []}
    for r in range(args.rounds):
        for side in ("native", "patched") if r % 2 == 0 else ("patched", "native"):
            sides[side]()
            times[side].append(timed(model, kw, labels, args.steps))
    liger_compat.apply()
    del model, got
    _release()
    row = {"family": family, "ms_native": statistics.median(times["native"]),
           "ms_patched": statistics.median(times["patched"])}
    if getattr(args, "alternate", False):  # every round is one step a side: the ratios round by round
        row["ratio_rounds"] = [p / n for n, p in zip(times["native"], times["patched"])]
    return row


def _child_times(which: str, args, families: list[str], on_row=None) -> dict[str, dict]:
    """One child process's rows, by family; ``on_row(row)`` as each arrives (its stdout read line by
    line), so that a run cut short keeps the families done so far."""
    import os
    import subprocess
    import tempfile

    env = dict(os.environ)
    if which == "native":
        env["LIGER_COMPAT_DISABLE"] = "1"
    else:
        env.pop("LIGER_COMPAT_DISABLE", None)
    cmd = [sys.executable, "-m", "benchmarks.models_gpu", "--time-only", "--families", ",".join(families),
           *model_argv(args), "--steps", str(args.steps), "--device", args.device, "--rounds", str(args.rounds)]
    if which == "paired":
        cmd += ["--paired", "--baseline", args.baseline, *(["--alternate"] if args.alternate else [])]
    rows = {}
    with tempfile.TemporaryFile("w+") as errf:  # a file, not a pipe: a full pipe would stall the child
        with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=errf, text=True) as proc:
            for line in proc.stdout:
                if line.startswith("{"):
                    r = json.loads(line)
                    rows[r["family"]] = r
                    if on_row is not None:
                        on_row(r)
        if proc.returncode:
            errf.seek(0)
            log(errf.read()[-3000:])
    return rows


def fresh_timing(args, families: list[str], on_process=None) -> list[dict]:
    """Rows of ``--fresh`` timing; ``on_process(rows)`` after every child process, so that a run cut
    short keeps what it measured (the rows then cover the processes done so far)."""
    runs: dict[str, dict[str, list]] = {"native": {}, "patched": {}}
    skipped: dict[str, str] = {}
    if args.paired:  # each fresh process times both sides, interleaved
        def add(row):
            fam = row["family"]
            if "ms_native" in row:
                runs["native"].setdefault(fam, []).append(row["ms_native"])
                runs["patched"].setdefault(fam, []).append(row["ms_patched"])
                if "ratio_rounds" in row:
                    runs.setdefault("ratio_rounds", {}).setdefault(fam, []).extend(row["ratio_rounds"])
            else:
                skipped[fam] = row.get("skipped") or row.get("error", "?")
            if on_process is not None:  # after every family: a run cut short keeps the families done
                on_process(_fresh_rows(runs, skipped, families, paired=True))

        for r in range(args.fresh):
            t0 = time.perf_counter()
            _child_times("paired", args, families, on_row=add)
            log(f"process {r + 1}/{args.fresh} (both sides): {time.perf_counter() - t0:.0f} s")
        return _fresh_rows(runs, skipped, families, paired=True)
    for r in range(args.fresh):
        for which in ("native", "patched") if r % 2 == 0 else ("patched", "native"):
            t0 = time.perf_counter()
            for fam, row in _child_times(which, args, families).items():
                if "ms" in row:
                    runs[which].setdefault(fam, []).append(row["ms"])
                else:
                    skipped[fam] = row.get("skipped") or row.get("error", "?")
            log(f"round {r + 1}/{args.fresh} {which}: {time.perf_counter() - t0:.0f} s")
            if on_process is not None:
                on_process(_fresh_rows(runs, skipped, families))
    return _fresh_rows(runs, skipped, families)


def _fresh_rows(runs: dict[str, dict[str, list]], skipped: dict[str, str], families: list[str],
                paired: bool = False) -> list[dict]:
    """Per family: median times over the processes and the ratio patched / native (paired: the
    median of each process's own ratio; with ``runs["ratio_rounds"]``, the rounds' own ratios of
    ``--alternate`` over every process, their median and its 95 % interval)."""
    rows = []
    for fam in families:
        n, p = runs["native"].get(fam, []), runs["patched"].get(fam, [])
        if not n or not p:
            rows.append({"family": fam, "skipped": skipped.get(fam, "no timing (yet, or see the log)")})
            continue
        rounds = runs.get("ratio_rounds", {}).get(fam)
        if rounds:  # step by step: the median of the rounds' ratios, with its 95 % interval
            ratio = statistics.median(rounds)
        else:
            ratio = (statistics.median(b / a for a, b in zip(n, p)) if paired
                     else statistics.median(p) / statistics.median(n))
        row = {"family": fam, "ms_native": statistics.median(n), "ms_patched": statistics.median(p),
               "ratio": ratio, "ms_native_runs": n, "ms_patched_runs": p,
               "native_spread": (max(n) - min(n)) / statistics.median(n)}
        if rounds:
            row["ratio_interval"] = list(median_interval(rounds))
            row["ratio_rounds"] = rounds
        rows.append(row)
    return rows


def timing_markdown(rows: list[dict], meta: dict) -> str:
    """The ``--fresh`` table; with ``--alternate`` its last column is each ratio's 95 % interval, and
    the summary also names the families whose interval lies wholly above 1 (slower, resolved)."""
    procs = f"{meta['fresh']} fresh process{'es' if meta['fresh'] != 1 else ''}"
    alternate = meta.get("alternate")
    base, ours = ("graphs off", "graphs on") if meta.get("baseline") == "nographs" else ("native", "patched")
    if alternate:
        how = (f"{procs}, the sides alternating step by step ({meta['rounds']} rounds, each one untimed and one timed "
               f"step a side, the order reversed every other round); the ratio the median over rounds of the "
               f"round's {ours} / {base}, with a distribution-free 95 % interval")
    elif meta.get("paired"):
        how = (f"{procs}, each timing native and patched interleaved ({meta['rounds']} "
               f"rounds of {meta['steps']} steps a side, median), the ratio the median of the processes' ratios")
    else:
        how = f"{meta['fresh']} fresh processes each, alternating, {meta['steps']} steps each (median)"
    if meta.get("baseline") == "nographs":
        how = how.replace("native and patched", "both sides") + (
            "; both sides patched, the fused loss's CUDA graphs off (`LIGER_COMPAT_FLCE_GRAPHS=0`) and on")
    last = "95 % interval" if alternate else f"{base} spread over processes"
    out = [f"transformers {meta['transformers']}, torch {meta['torch']}, {meta['gpu']}; batch {meta['batch']} x "
           f"{meta['seq']}, hidden {meta['hidden']}, {meta['layers']} layers, vocab {meta['vocab']}, bf16; {how}", "",
           f"| family | ms {base} | ms {ours} | {ours} / {base} | {last} |", "|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['family']} | {r['skipped']} | | | |")
            continue
        cell = ("{:.3f}-{:.3f}".format(*r["ratio_interval"]) if alternate
                else f"{100 * r['native_spread']:.0f} %")
        out.append(f"| {r['family']} | {r['ms_native']:.2f} | {r['ms_patched']:.2f} | {r['ratio']:.3f} | {cell} |")
    timed_rows = [r for r in rows if "ratio" in r]
    if timed_rows:
        above = [r["family"] for r in timed_rows if r["ratio"] > 1.0]
        listed = f"{len(above)} of {len(timed_rows)} families" + (f": {', '.join(above)}" if above else "")
        if alternate:
            resolved = [r["family"] for r in timed_rows if r["ratio_interval"][0] > 1.0]
            out += ["", f"{ours} / {base} above 1 on {listed}; its interval wholly above 1 on {len(resolved)}"
                    + (f": {', '.join(resolved)}" if resolved else "")]
        else:
            out += ["", f"{ours} slower than {base} on {listed}"]
    return "\n".join(out)


def add_model_args(ap: argparse.ArgumentParser, families: str) -> None:
    """The families and the model and batch sizes that :func:`make_model` and :func:`batch` read."""
    ap.add_argument("--families", default=families)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128256)


def model_argv(args) -> list[str]:
    """The sizes of :func:`add_model_args` as command-line arguments, for a child process."""
    return ["--batch", str(args.batch), "--seq", str(args.seq), "--hidden", str(args.hidden),
            "--intermediate", str(args.intermediate), "--layers", str(args.layers), "--vocab", str(args.vocab)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(ap, ",".join(f.name for f in FAMILIES))
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="models_gpu", help="result files <name>.json and <name>.md")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself (tiny sizes advised)")
    ap.add_argument("--small", action="store_true",
                    help="the host-bound shape: 2 layers, hidden 1024, vocabulary 128256, 2 x 1024 tokens")
    ap.add_argument("--fresh", type=int, default=0,
                    help="timing only: N fresh processes each of native and patched, alternating")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per family and process (--fresh)")
    ap.add_argument("--paired", action="store_true",
                    help="with --fresh: every process times both sides, interleaved (--rounds batches a side)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved batches a side and process (--paired)")
    ap.add_argument("--alternate", action="store_true",
                    help="with --fresh --paired: the sides alternate step by step (one untimed and one timed step "
                         "a side a round, --steps is 1), the ratio the median of the rounds' ratios with a 95 %% interval")
    ap.add_argument("--baseline", choices=("native", "nographs"), default="native",
                    help="with --paired: the side patched is timed against: native, or patched with the fused "
                         "loss's CUDA graphs off (LIGER_COMPAT_FLCE_GRAPHS=0)")
    ap.add_argument("--time-only", action="store_true", help=argparse.SUPPRESS)  # one --fresh child
    args = ap.parse_args(argv)
    if args.alternate:
        if not ((args.fresh or args.time_only) and args.paired):
            ap.error("--alternate needs --fresh N --paired")
        args.steps = 1
    if args.small:
        args.layers, args.hidden, args.vocab, args.batch, args.seq = 2, 1024, 128256, 2, 1024
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if args.time_only:
        for family in families:
            try:
                row = time_family_paired(family, args) if args.paired else time_family(family, args)
            except Exception as exc:  # one family failing must not hide the others
                row = {"family": family, "error": f"{type(exc).__name__}: {exc}"}
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            print(json.dumps(row), flush=True)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        log("needs a CUDA GPU (or --device cpu for a smoke run)")
        return 2
    import transformers

    liger_compat.apply()
    meta = dict(transformers=transformers.__version__, torch=torch.__version__, gpu=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                batch=args.batch, seq=args.seq, hidden=args.hidden, layers=args.layers, vocab=args.vocab)
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks import _results

    cmd = _results.command("benchmarks.models_gpu", sys.argv[1:] if argv is None else argv)
    if args.fresh:
        meta.update(fresh=args.fresh, steps=args.steps, paired=args.paired, rounds=args.rounds)
        if args.alternate:
            meta["alternate"] = True
        if args.paired and args.baseline != "native":
            meta["baseline"] = args.baseline

        def write_timing(rows: list[dict]) -> str:  # after every child process
            (out / f"{args.name}.json").write_text(json.dumps({"regenerate": cmd, "meta": meta, "rows": rows}, indent=2))
            md = _results.md_line(cmd) + timing_markdown(rows, meta)
            (out / f"{args.name}.md").write_text(md + "\n")
            return md

        log(write_timing(fresh_timing(args, families, on_process=write_timing)))
        return 0

    def write() -> str:  # after every family, so a run cut short keeps what it measured
        (out / f"{args.name}.json").write_text(json.dumps({"regenerate": cmd, "meta": meta, "rows": rows}, indent=2))
        md = _results.md_line(cmd) + markdown(rows, meta)
        (out / f"{args.name}.md").write_text(md + "\n")
        return md

    md = ""
    for family in families:
        t0 = time.perf_counter()
        try:
            row = run_family(family, args)
        except Exception as exc:  # one family failing must not hide the others
            traceback.print_exc()
            row = {"family": family, "vision": bool(family in BY_NAME and BY_NAME[family].vision),
                   "error": f"{type(exc).__name__}: {exc}"}
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        log(json.dumps(row))
        md = write()
    log(md or "no family")
    bad = [r["family"] for r in rows if "error" in r or
           ("grad_err_patched" in r and r["grad_err_patched"] > 2 * r["grad_err_native"] + 1e-2)]
    if bad:
        log(f"PROBLEMS: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
