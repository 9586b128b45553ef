"""The distributed context for ``check()``: launcher, world size, rank, backend, sharding engine,
and the combinations known to break the fused kernels.

Sources, in order of trust: a model passed to :func:`detect` (its parameters and wrappers say
exactly which engine shards it), ``torch.distributed``'s state when it is already imported and
initialised, transformers' ZeRO-3 flag when its DeepSpeed integration is already imported,
``TrainingArguments`` when given, and the environment variables that ``torchrun``,
``accelerate launch``, the ``deepspeed`` launcher, MPI and SLURM set. Nothing here imports
``torch.distributed`` (or torch): it is only read from ``sys.modules`` when something else
imported it, so ``import liger_compat`` and a plain ``check()`` stay cheap.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from .. import _config
from . import versions



@dataclass
class DistWarning:
    code: str
    level: str  # "error": training gives wrong results or fails; "warning": fragile or differs from 1 GPU
    message: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass
class DistributedInfo:
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    local_world_size: int | None = None
    launcher: str | None = None  # torchrun, accelerate, deepspeed, mpi, slurm
    initialized: bool = False  # torch.distributed process group exists
    backend: str | None = None
    engine: str = "none"  # none, DDP, FSDP (FSDP1), FSDP2, DeepSpeed ZeRO-<n>, Megatron-LM
    engine_source: str = ""  # what the engine was read from
    zero_stage: int | None = None
    fsdp_version: int | None = None
    fsdp_use_orig_params: bool | None = None
    head: str | None = None  # how the LM head is sharded, when a model was given
    head_gather: str = "n/a"  # wired / NOT wired / n/a (...)
    warnings: list[DistWarning] = field(default_factory=list)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.initialized or self.engine not in ("none", "")

    @property
    def errors(self) -> list[DistWarning]:
        return [w for w in self.warnings if w.level == "error"]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["distributed"] = self.distributed
        return d

    def summary(self) -> str:
        if not self.distributed:
            return "single process (no launcher or process group seen)"
        parts = [f"world size {self.world_size}, rank {self.rank} (local {self.local_rank})"]
        parts.append(f"backend {self.backend or 'not initialised'}")
        parts.append(f"engine {self.engine}" + (f" [{self.engine_source}]" if self.engine_source else ""))
        if self.launcher:
            parts.append(f"launched by {self.launcher}")
        return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# environment
# --------------------------------------------------------------------------------------------


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for n in names:
        v = env.get(n)
        if v is not None and v.strip().lstrip("-").isdigit():
            return int(v)
    return None


def _flag(env: Mapping[str, str], name: str) -> bool | None:
    v = env.get(name)
    return None if v is None else v.strip().lower() in _config.TRUE_VALUES


def _launcher(env: Mapping[str, str]) -> str | None:
    if "ACCELERATE_MIXED_PRECISION" in env and "ACCELERATE_DYNAMO_BACKEND" in env:  # accelerate launch writes both
        return "accelerate"
    if "TORCHELASTIC_RUN_ID" in env or "TORCHELASTIC_RESTART_COUNT" in env:
        return "torchrun"
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpi"
    if "LOCAL_RANK" in env and "WORLD_SIZE" in env:
        return "deepspeed" if "CROSS_RANK" in env or "DS_ACCELERATOR" in env else "torch.distributed env"
    if "SLURM_PROCID" in env and (_int(env, "SLURM_NTASKS") or 1) > 1:
        return "slurm"
    return None


def _from_env(info: DistributedInfo, env: Mapping[str, str]) -> None:
    info.launcher = _launcher(env)
    ws = _int(env, "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if ws is None and info.launcher == "slurm":
        ws = _int(env, "SLURM_NTASKS")
    info.world_size = ws or 1
    rank = _int(env, "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    if rank is None and info.launcher == "slurm":
        rank = _int(env, "SLURM_PROCID")
    info.rank = rank or 0
    local = _int(env, "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
    if local is None and info.launcher == "slurm":
        local = _int(env, "SLURM_LOCALID")
    info.local_rank = local or 0
    info.local_world_size = _int(env, "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")

    if _flag(env, "ACCELERATE_USE_DEEPSPEED"):
        info.zero_stage = _int(env, "ACCELERATE_DEEPSPEED_ZERO_STAGE")
        info.engine = f"DeepSpeed ZeRO-{info.zero_stage}" if info.zero_stage is not None else "DeepSpeed"
        info.engine_source = "ACCELERATE_USE_DEEPSPEED"
    elif _flag(env, "ACCELERATE_USE_FSDP"):
        # accelerate launch writes FSDP_VERSION; without it accelerate's plugin defaults to 1
        info.fsdp_version = _int(env, "FSDP_VERSION") or 1
        info.engine = "FSDP2" if info.fsdp_version == 2 else "FSDP"
        info.fsdp_use_orig_params = _flag(env, "FSDP_USE_ORIG_PARAMS")
        info.engine_source = "ACCELERATE_USE_FSDP"
    elif _flag(env, "ACCELERATE_USE_MEGATRON_LM"):
        info.engine, info.engine_source = "Megatron-LM", "ACCELERATE_USE_MEGATRON_LM"
    elif info.world_size > 1:
        # torchrun / accelerate without a sharding plugin: Trainer and accelerate use DDP
        info.engine, info.engine_source = "DDP", "WORLD_SIZE > 1, no FSDP/DeepSpeed plugin (assumed)"


# --------------------------------------------------------------------------------------------
# live state: torch.distributed, transformers' DeepSpeed flag, TrainingArguments, a model
# --------------------------------------------------------------------------------------------


def _unreadable(info: DistributedInfo, what: str, exc: BaseException) -> None:
    """A source that raised while being read: detection goes on without it, and says so in
    ``check()`` (a sharding engine it would have shown may be missing from the report)."""
    info.warnings.append(DistWarning(
        "D0", "warning",
        f"{what} could not be read ({type(exc).__name__}: {exc}); the engine shown may be incomplete."))


def _from_torch_distributed(info: DistributedInfo) -> None:
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return
        info.initialized = True
        info.world_size = dist.get_world_size()
        info.rank = dist.get_rank()
        info.backend = str(dist.get_backend())
    except Exception as exc:  # a half-torn-down group must not break check(): reported instead
        _unreadable(info, "the torch.distributed process group", exc)


def _from_transformers(info: DistributedInfo) -> None:
    ds = sys.modules.get("transformers.integrations.deepspeed")
    if ds is None:
        return
    try:
        zero3 = ds.is_deepspeed_zero3_enabled()
    except Exception as exc:  # a broken DeepSpeed config must not break check(): reported instead
        _unreadable(info, "transformers' DeepSpeed ZeRO-3 flag (is_deepspeed_zero3_enabled)", exc)
        return
    if zero3:
        info.engine, info.zero_stage = "DeepSpeed ZeRO-3", 3
        info.engine_source = "transformers HfDeepSpeedConfig"


def _zero_stage_of(config: Any) -> int | None:
    if isinstance(config, str):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return None
    if isinstance(config, Mapping):
        stage = (config.get("zero_optimization") or {}).get("stage")
        return int(stage) if isinstance(stage, (int, str)) and str(stage).isdigit() else None
    return None


def _from_training_args(info: DistributedInfo, args: Any) -> None:
    if getattr(args, "deepspeed", None):
        info.zero_stage = _zero_stage_of(args.deepspeed)
        info.engine = f"DeepSpeed ZeRO-{info.zero_stage}" if info.zero_stage is not None else "DeepSpeed"
        info.engine_source = "TrainingArguments.deepspeed"
    elif getattr(args, "fsdp", None):
        cfg = getattr(args, "fsdp_config", None) or {}
        default = 2 if versions.matches(versions.installed("transformers").raw or "0", ">=5") else 1
        info.fsdp_version = int(cfg.get("version", cfg.get("fsdp_version", default)))
        info.engine = "FSDP2" if info.fsdp_version == 2 else "FSDP"
        uop = cfg.get("use_orig_params", cfg.get("fsdp_use_orig_params", "true"))
        info.fsdp_use_orig_params = str(uop).lower() in _config.TRUE_VALUES
        info.engine_source = "TrainingArguments.fsdp"


def _output_head(model: Any) -> Any:
    m = model
    for _ in range(4):  # DDP / DeepSpeedEngine / FSDP1 wrappers keep the model in .module
        if hasattr(m, "lm_head") or hasattr(m, "get_output_embeddings"):
            break
        m = getattr(m, "module", None) or getattr(m, "_fsdp_wrapped_module", None)
        if m is None:
            return None
    head = getattr(m, "lm_head", None)
    if head is None and hasattr(m, "get_output_embeddings"):
        try:
            head = m.get_output_embeddings()
        except NotImplementedError:  # transformers' base classes: a model without an output embedding
            head = None
    return head


def _tensor_parallel_model() -> Any:
    """A live model of this process whose LM head is a DTensor (loaded with ``tp_plan``, or
    parallelised by hand), so that ``check()`` without a model still names tensor parallelism
    rather than assuming DDP from the process group. None when there is none (or no DTensor yet)."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    import gc

    import torch

    from ..shims import _sharded_head as sd

    for obj in gc.get_objects():
        # modules only, by their type (isinstance reads __class__, which a weakref proxy forwards, and
        # a dead one raises): an attribute read on any other live object can run its own __getattr__
        # (deprecation warnings, lazy proxies)
        if not issubclass(type(obj), torch.nn.Module):
            continue
        try:
            head = obj._modules.get("lm_head")
            if head is not None and sd.is_dtensor(getattr(sd.head_module(head), "weight", None)):
                return obj
        except Exception:  # noqa: BLE001 - a module whose attributes raise is not the model
            continue
    return None


def _from_model(info: DistributedInfo, model: Any) -> None:
    from ..shims import _sharded_head as sd

    top = {c.__name__ for c in type(model).__mro__}
    engine = None
    if "DeepSpeedEngine" in top:
        try:
            info.zero_stage = int(model.zero_optimization_stage())
        except Exception as exc:  # reported: the ZeRO stage (ZeRO-3 or not) stays unknown
            _unreadable(info, f"{type(model).__name__}.zero_optimization_stage()", exc)
        engine = f"DeepSpeed ZeRO-{info.zero_stage}" if info.zero_stage is not None else "DeepSpeed"
    for mod in model.modules():
        names = {c.__name__ for c in type(mod).__mro__}
        if "FSDPModule" in names:
            engine, info.fsdp_version = "FSDP2", 2
            break
        if "FullyShardedDataParallel" in names:
            engine, info.fsdp_version = "FSDP", 1
            uop = getattr(mod, "_use_orig_params", None)
            info.fsdp_use_orig_params = None if uop is None else bool(uop)
            break
    if engine is None:
        if any(sd.is_zero3_param(p) for p in model.parameters()):
            engine, info.zero_stage = "DeepSpeed ZeRO-3", 3
        elif "DistributedDataParallel" in top:
            engine = "DDP"
        else:
            dt = next((p for p in model.parameters() if sd.is_dtensor(p)), None)
            if dt is not None:
                mesh = dt.device_mesh
                dims = getattr(mesh, "mesh_dim_names", None) or ()
                engine = "tensor parallel" + (f" ({', '.join(f'{d}={mesh.size(i)}' for i, d in enumerate(dims))})"
                                              if dims else "")
    if engine is not None:
        info.engine, info.engine_source = engine, "model"
    head = _output_head(model)
    if head is not None:
        kind = sd.head_sharding(head)
        if kind == "dtensor" and engine == "FSDP2":
            kind = "parent"  # sharded here, gathered by the enclosing unit's forward
        if kind == "dtensor":
            info.head = sd.describe_dtensor_head(sd.head_module(head).weight)
        else:
            info.head = {
                "parent": "in its parent's FSDP2 unit (gathered in the parent's forward)",
                "none": "ordinary module (gathered with its parent unit, if any)",
                "fsdp2": "own FSDP2 unit (sharded DTensor outside its forward)",
                "fsdp1": "own FSDP1 unit",
                "zero3": "ZeRO-3 partitioned",
            }[kind]


# --------------------------------------------------------------------------------------------
# known bad combinations
# --------------------------------------------------------------------------------------------


def _fused_head_active() -> bool:
    if _config.settings.disabled or not _config.kernel_enabled("fused_linear_cross_entropy"):
        return False
    from ..shims import REGISTRY

    return any(
        "fused_linear_cross_entropy" in s.kernels and s.state.value in ("applied", "waiting")
        for s in REGISTRY.shims()
    )


def _warnings(info: DistributedInfo, *, model: Any, training_args: Any, device_count: int | None) -> None:
    from ..shims import _sharded_head as sd

    add = lambda code, level, msg: info.warnings.append(DistWarning(code, level, msg))  # noqa: E731
    active = _fused_head_active()
    wired = sd.wired()
    if not active:
        info.head_gather = "n/a (no fused forward active)"
    else:
        info.head_gather = "wired" if wired else "NOT wired"
    sharded_engine = info.engine.startswith("DeepSpeed ZeRO-3") or info.engine in ("FSDP", "FSDP2")

    if active and not wired and info.engine == "DeepSpeed ZeRO-3":
        add("D1", "warning",
            "DeepSpeed ZeRO-3 with a fused LM-head loss that reads lm_head.weight directly (not through "
            "liger_compat.shims._sharded_head): inside the model's forward recent DeepSpeed gathers it as an "
            "'external parameter'; anywhere else (a loss computed after the decoder, older DeepSpeed) the kernel "
            "gets ZeRO-3's empty partition.")
    if active and not wired and info.head and info.head.startswith(("own FSDP", "ZeRO-3")):
        add("D2", "error",
            f"lm_head is an {info.head}, and the fused forward reads lm_head.weight outside lm_head.forward: it "
            "gets the local shard. Route the loss through liger_compat.shims._sharded_head.fused_head_loss.")
    elif active and not wired and info.engine == "FSDP2" and info.head is None:
        add("D3", "warning",
            "FSDP2 with a fused forward that reads lm_head.weight directly: right only while lm_head is in its "
            "parent's fully_shard unit, not when lm_head is sharded as its own unit.")
    if info.engine == "FSDP" and info.fsdp_use_orig_params is False:
        add("D4", "warning",
            "FSDP1 with use_orig_params=False: parameters are flattened into FlatParameters, so lm_head.weight "
            "outside its unit's forward is an empty view, instance patches see wrapper names, and units with "
            "mixed requires_grad (LoRA) fail. Prefer FSDP2 (fsdp_version: 2) or use_orig_params=True.")
    if info.engine.startswith("DeepSpeed") and not versions.installed("deepspeed").installed:
        add("D5", "error", "a DeepSpeed engine is configured but the deepspeed package is not installed.")
    if active and info.head and info.head.startswith("DTensor") and "NOT supported" in info.head:
        add("D6", "error",
            f"lm_head.weight is a {info.head.split(':')[0]}: the fused loss takes a head split over the vocabulary "
            "(Shard(0)) along one mesh dimension, or a replicated one, and raises ShardedHeadError on this one; "
            "leave fused_linear_cross_entropy out of LIGER_COMPAT_KERNELS for this run.")
    if (info.local_world_size and device_count is not None and device_count > 0
            and info.local_world_size > device_count and info.backend in (None, "nccl")):
        add("D7", "error",
            f"{info.local_world_size} processes on this node but {device_count} visible GPU(s): ranks would share "
            "a GPU, which NCCL refuses ('Duplicate GPU detected').")
    if training_args is not None and info.world_size > 1:
        if getattr(training_args, "average_tokens_across_devices", True) is False:
            add("D8", "warning",
                "average_tokens_across_devices=False: each rank divides its loss by its own token count, so loss "
                "and gradients differ from a single-GPU run over the same global batch when ranks hold different "
                "numbers of label tokens.")
    if info.initialized and info.backend == "gloo" and device_count and sharded_engine:
        add("D9", "warning", "a sharding engine on the gloo backend with GPUs visible: use nccl for GPU tensors.")


def detect(
    model: Any = None,
    *,
    training_args: Any = None,
    env: Mapping[str, str] | None = None,
    device_count: int | None = None,
) -> DistributedInfo:
    """Describe the distributed context this process is in, and warn on bad combinations.

    ``model`` (optional) is inspected for DDP / FSDP1 / FSDP2 / ZeRO-3 wrappers and for how its LM
    head is sharded; ``training_args`` (optional ``transformers.TrainingArguments``) adds its
    ``fsdp`` / ``deepspeed`` / ``average_tokens_across_devices`` settings; ``env`` defaults to
    ``os.environ``; ``device_count`` is the number of visible GPUs, when known.
    """
    info = DistributedInfo()
    _from_env(info, os.environ if env is None else env)
    if training_args is not None:
        _from_training_args(info, training_args)
    _from_transformers(info)
    _from_torch_distributed(info)
    if model is None and info.initialized and (info.engine == "none" or "assumed" in info.engine_source):
        model = _tensor_parallel_model()
    if model is not None:
        _from_model(info, model)
    if info.engine == "none" and info.world_size > 1:
        info.engine, info.engine_source = "DDP", "process group of size > 1, no sharding seen (assumed)"
    _warnings(info, model=model, training_args=training_args, device_count=device_count)
    return info
