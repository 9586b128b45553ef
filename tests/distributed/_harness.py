"""Shared by the gloo (CPU) and NCCL (2-GPU) tests: make a spec, run the ranks and the
independent reference, compare. Not a test module."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_worker.py")

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def make_spec(path: Path, *, seed: int | None = None, world: int = 2, steps: int = 3, batch: int = 4, seq: int = 24,
              lr: float = 0.5, min_gap: float = 0.05) -> int:
    """Fresh random weights and batches (a fresh seed unless one is given), built so that they tell a
    right normalisation of the loss across ranks from a wrong one, whatever the seed: the ranks get
    different numbers of label tokens, and rank 0's labels are random while every other rank's are
    the initial model's own greedy next tokens, so the per-rank losses of the first step differ by
    construction and the mean of per-rank means lies far from the loss over all tokens (checked:
    at least ``min_gap`` apart; 50x the tightest loss tolerance of the tests that use it)."""
    seed = random.randrange(2**31) if seed is None else seed
    gap = _write_spec(path, seed, world, steps, batch, seq, lr)
    assert gap >= min_gap, f"spec of seed {seed}: naive and right step-0 losses only {gap} apart"
    return seed


def _write_spec(path: Path, seed: int, world: int, steps: int, batch: int, seq: int, lr: float) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    state = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False)).state_dict()
    state_tied = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).state_dict()
    # larger init than the default 0.02 so the loss moves visibly in three steps
    state = {k: (v * 5 if v.dim() == 2 else v) for k, v in state.items()}
    state_tied = {k: (v * 5 if v.dim() == 2 else v) for k, v in state_tied.items()}
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=False))
    model.load_state_dict(state)
    batches = []
    rows = batch // world
    for _ in range(steps):
        ids = torch.randint(0, TINY["vocab_size"], (batch, seq), generator=g)
        labels = ids.clone()
        with torch.no_grad():
            greedy = model(input_ids=ids).logits.argmax(-1)
        # ranks after the first are scored on the model's own greedy next tokens (a low loss; the
        # model shifts labels by one position), rank 0 on random tokens (a high one)
        labels[rows:, 1:] = greedy[rows:, :-1]
        # rank r keeps a different share of its label tokens (the rest -100)
        for r in range(world):
            keep = 0.9 - 0.6 * r / max(1, world - 1)
            mask = torch.rand(rows, seq, generator=g) > keep
            labels[r * rows:(r + 1) * rows][mask] = -100
        batches.append((ids, labels))
    torch.save({"config": TINY, "state": state, "state_tied": state_tied, "batches": batches, "lr": lr,
                "world_size": world, "seed": seed}, path)
    # the naive (mean of per-rank means) against the right loss of step 0, in fp32 as the workers compute
    ids, labels = batches[0]
    with torch.no_grad():
        per_rank = [float(model(input_ids=ids[r * rows:(r + 1) * rows], labels=labels[r * rows:(r + 1) * rows]).loss)
                    for r in range(world)]
        whole = float(model(input_ids=ids, labels=labels).loss)
    return abs(sum(per_rank) / world - whole)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.pop("LIGER_COMPAT_DISABLE", None)
    env.update(extra or {})
    return env


def _native_abort(log: str, worker: Path = WORKER) -> bool:
    """A rank killed by a C++ abort before any Python error of the worker: on this 2-core CI machine,
    with the other pytest worker busy, gloo's ranks occasionally die with only 'terminate called
    without an active exception' (about one full suite in three, twice in a row once; never
    reproduced alone, nor with two gloo tests side by side). ``faulthandler``'s stacks, which the
    log may carry after it (:func:`_fault_stacks`), are not a Python error of the worker."""
    log = log.split("\n[faulthandler, ")[0]
    if f'File "{worker}"' in log:
        return False
    # a run killed past its limit with no Python error (seen once: a native DDP run whose ranks
    # stopped after their first step, with the machine running two suites at once) counts as well
    return "terminate called" in log or TIMED_OUT in log


def _start(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def torchrun_many(runs: list[tuple[Path, list[str], dict[str, str] | None]], *, nproc: int = 2,
                  timeout: float = 300) -> list[str]:
    """Start ``torchrun --nproc_per_node nproc SCRIPT ARGS`` for every ``(script, args, env)`` side by
    side; return their logs. A run whose ranks died by a native abort before any Python error is
    started again (:func:`_native_abort`, at most :data:`ATTEMPTS` runs in all); any other failure
    fails the test."""
    with tempfile.TemporaryDirectory(prefix="dist-faults-") as faults:
        def start(script: Path, args: list[str], env: dict[str, str] | None) -> tuple[subprocess.Popen, Path]:
            return _start_torchrun(script, args, nproc=nproc, faults_parent=Path(faults), env=env)

        started = [start(script, args, env) for script, args, env in runs]
        logs = []
        for (script, args, env), first in zip(runs, started):
            p, log = _with_retries(first, lambda: start(script, args, env), timeout, script)
            if p.returncode != 0:
                raise AssertionError(f"{script.name} {' '.join(args)} (env {env}) failed (exit {p.returncode}):\n"
                                     f"{log[-8000:]}")
            logs.append(log)
    return logs


def _start_torchrun(script: Path, args: list[str], *, nproc: int, faults_parent: Path,
                    env: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """``torchrun --nproc_per_node nproc SCRIPT ARGS`` on a free port, its ranks writing their
    ``faulthandler`` stacks into a fresh folder under ``faults_parent``; the process and that folder."""
    faults = Path(tempfile.mkdtemp(prefix="faults-", dir=faults_parent))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), *args]
    return _start(cmd, dict(env or {}, **{FAULT_DIR_ENV: str(faults)})), faults


#: runs of one distributed command in all when its ranks die by a native abort (:func:`_native_abort`)
ATTEMPTS = 3
#: where the workers write ``faulthandler``'s stacks of every thread when a rank aborts (one file a rank)
FAULT_DIR_ENV = "LIGER_COMPAT_TEST_FAULT_DIR"


def _with_retries(first: tuple[subprocess.Popen, Path], restart, timeout: float,
                  script: Path = WORKER) -> tuple[subprocess.Popen, str]:
    """Wait for a started run; while its ranks died by a native abort, start it again (at most
    :data:`ATTEMPTS` runs). The log returned keeps every earlier attempt's tail and the Python stacks
    the aborting ranks wrote (``faulthandler``), so a failure says where the abort happened."""
    p, faults = first
    log = _wait(p, timeout) + _fault_stacks(faults)
    earlier = []
    while p.returncode != 0 and _native_abort(log, script) and len(earlier) + 1 < ATTEMPTS:
        earlier.append(log)
        time.sleep(2)
        p, faults = restart()
        log = _wait(p, timeout) + _fault_stacks(faults)
    if earlier:
        log = "".join(f"[attempt {i + 1}]\n{e[-3000:]}\n" for i, e in enumerate(earlier)) + \
            f"[attempt {len(earlier) + 1}]\n{log}"
    return p, log


def _fault_stacks(faults: Path) -> str:
    """The non-empty ``faulthandler`` files of a run's ranks, as one block of text ('' if none)."""
    out = []
    for f in sorted(faults.glob("*.txt")):
        text = f.read_text(errors="replace").strip()
        if text:
            out.append(f"\n[faulthandler, {f.stem}]\n{text}\n")
    return "".join(out)


def enable_fault_stacks() -> None:
    """In a worker: where the harness asks for it (:data:`FAULT_DIR_ENV`), dump every thread's Python
    stack to a file of this rank's own on a fatal signal (the C++ abort of :func:`_native_abort`)."""
    import faulthandler

    where = os.environ.get(FAULT_DIR_ENV)
    if where:
        name = f"rank{os.environ['RANK']}" if "RANK" in os.environ else "process"
        global _fault_file
        # kept open for the process's lifetime: faulthandler writes to its file descriptor
        _fault_file = open(Path(where) / f"{name}.txt", "w")
        faulthandler.enable(_fault_file, all_threads=True)


_fault_file: Any = None


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children first-found, then theirs), read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


TIMED_OUT = "[timed out after"


def _wait(p: subprocess.Popen, timeout: float) -> str:
    """The run's output; past ``timeout`` the run is killed with every process below it (torchrun's
    ranks: killing torchrun alone leaves a rank holding the output pipe, and reading it then waits
    for that rank forever)."""
    try:
        return p.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        for pid in [*_descendants(p.pid), p.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            out = p.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:  # a grandchild that left the tree still holds the pipe
            p.stdout.close()
            p.wait()
            out = ""
        return (out or "") + f"\n{TIMED_OUT} {timeout:.0f} s: the run and its ranks were killed]"


def run(tmp: Path, *, device: str = "cpu", configs: str, forward: str = "helper", nproc: int = 2,
        timeout: float = 300, allow_errors: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start the ranks (torchrun) and the reference process side by side; return both results.
    A distributed run whose ranks died by a native abort before any Python error is started again
    (:func:`_native_abort`, at most :data:`ATTEMPTS` runs); any other failure fails the test."""
    import torch

    spec, out_dist, out_ref = tmp / "spec.pt", tmp / "dist.pt", tmp / "ref.pt"
    dist_args = ["dist", "--spec", str(spec), "--out", str(out_dist), "--device", device, "--configs", configs,
                 "--forward", forward] + (["--allow-errors"] if allow_errors else [])

    def start_dist() -> tuple[subprocess.Popen, Path]:
        return _start_torchrun(WORKER, dist_args, nproc=nproc, faults_parent=tmp)

    ref_cmd = [sys.executable, str(WORKER), "reference", "--spec", str(spec), "--out", str(out_ref), "--device", device]
    first, ref_p = start_dist(), _start(ref_cmd)
    dist_p, dist_log = _with_retries(first, start_dist, timeout)
    ref_log = _wait(ref_p, timeout)
    for p, log, what in ((dist_p, dist_log, "distributed run"), (ref_p, ref_log, "reference run")):
        if p.returncode != 0:
            # every rank's output: the rank that raised first is not always rank 0
            raise AssertionError(f"{what} failed (exit {p.returncode}):\n{log[-8000:]}")
    return torch.load(out_dist, weights_only=False), torch.load(out_ref, weights_only=False)


def _max_abs(a: dict, b: dict) -> tuple[float, float]:
    """max |a - b| over common keys, and max |b| (scale)."""
    keys = sorted(set(a) & set(b))
    assert keys, "no common parameter names"
    diff = max(float((a[k] - b[k]).abs().max()) for k in keys)
    scale = max(float(b[k].abs().max()) for k in keys)
    return diff, scale


def compare(dist: dict[str, Any], ref: dict[str, Any], configs: list[str]) -> list[dict[str, Any]]:
    rows = []
    for name in configs:
        res = dist[name]
        assert "error" not in res, (name, res["error"])
        r = ref["tied" if name.split("@")[0].endswith("_tied") else "untied"]
        row = {"config": name, "losses": res["losses"], "ref_losses": r["losses"],
               "loss_max_abs_diff": max(abs(x - y) for x, y in zip(res["losses"], r["losses"]))}
        if res.get("grads") is not None:
            d, s = _max_abs(res["grads"], r["grads"])
            row["grad_max_abs_diff"], row["grad_max_abs"] = d, s
            assert set(res["grads"]) == set(r["grads"]), (name, set(res["grads"]) ^ set(r["grads"]))
        d, s = _max_abs(res["state"], r["state"])
        row["weight_max_abs_diff"], row["weight_max_abs"] = d, s
        row["weight_names_match"] = set(res["state"]) == set(r["state"])
        row["checks"] = res.get("checks", {})
        rows.append(row)
    return rows


def assert_close(rows: list[dict[str, Any]], ref: dict[str, Any], *, loss_tol: float, grad_rel: float,
                 weight_tol: float) -> None:
    naive_gap = abs(ref["naive_step0_loss"] - ref["untied"]["losses"][0])
    assert naive_gap > 50 * loss_tol, f"data does not discriminate the normalisation (gap {naive_gap})"
    for row in rows:
        name = row["config"]
        assert row["weight_names_match"], name
        assert row["loss_max_abs_diff"] < loss_tol, (name, row["losses"], row["ref_losses"])
        if "grad_max_abs_diff" in row:
            assert row["grad_max_abs_diff"] < grad_rel * row["grad_max_abs"], (name, row["grad_max_abs_diff"])
        assert row["weight_max_abs_diff"] < weight_tol, (name, row["weight_max_abs_diff"])
    # the reference's weights moved far more than the tolerance: a run that never stepped would fail
    for kind in ("untied", "tied"):
        assert ref[kind]["moved"] > 100 * weight_tol, (kind, ref[kind]["moved"])


def vs_single(dist: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Add the distance of each untied config to the one-process liger_compat run ("single")."""
    single = dist.get("single")
    for row in rows:
        res = dist[row["config"]]
        if single is None or row["config"].split("@")[0].endswith("_tied") or "state" not in res:
            continue
        row["vs_single_loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(res["losses"], single["losses"]))
        row["vs_single_weight_max_abs_diff"] = _max_abs(res["state"], single["state"])[0]


def to_json(rows: list[dict[str, Any]], **meta: Any) -> str:
    import json

    return json.dumps({**meta, "rows": rows}, indent=1, default=str)


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    out = [f"### {title}", "",
           "| config | engine seen by check | head | step losses (liger_compat, 2 ranks) | single-process native | "
           "max abs loss diff | max abs grad diff (step 1) / max abs grad | max abs weight diff (final) | "
           "vs 1-process liger_compat: loss / weight diff |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["checks"]
        g = (f"{r['grad_max_abs_diff']:.2e} / {r['grad_max_abs']:.2e}" if "grad_max_abs_diff" in r else "n/a")
        out.append(
            f"| {r['config']} | {c.get('engine', '-')} | {str(c.get('head', '-')).split(' (')[0]} | "
            f"{', '.join(f'{x:.6f}' for x in r['losses'])} | {', '.join(f'{x:.6f}' for x in r['ref_losses'])} | "
            f"{r['loss_max_abs_diff']:.2e} | {g} | {r['weight_max_abs_diff']:.2e} | "
            + (f"{r['vs_single_loss_max_abs_diff']:.1e} / {r['vs_single_weight_max_abs_diff']:.1e} |"
               if "vs_single_weight_max_abs_diff" in r else "- |"))
    return "\n".join(out) + "\n"


def has_fused_forward_shim() -> bool:
    """Whether this build has a fused CausalLM forward shim (the model shims) to test."""
    from liger_compat.shims import REGISTRY, load_all

    load_all()
    return any("fused_linear_cross_entropy" in s.kernels for s in REGISTRY.shims())
