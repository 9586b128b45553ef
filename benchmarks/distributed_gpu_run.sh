#!/usr/bin/env bash
# The multi-GPU results on a 2- or 4-GPU machine (the device tool's nvidia-h100-x2 / -x4): the 2-GPU correctness
# tests, the 1/2-GPU scaling benchmark, the tensor-parallel head and model steps (4-GPU FSDP2 x TP where 4 GPUs are
# there), results into $OUT (then copied to benchmarks/results/). SKIP_SCALING=1 leaves out the DDP / FSDP2 scaling.
# Leaves the NCCL / NVLink-multicast environment as the machine sets it.
set -u
OUT=${OUT:-/tmp/distributed_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the scripts import liger_compat from this checkout
LOG="$OUT/distributed_gpu_run.log"
{
  nvidia-smi -L
  python3 -m pip list 2>/dev/null | grep -i -E "^(torch|transformers|accelerate|deepspeed|triton) "
  env | grep -E "^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)="
} >>"$LOG" 2>&1

step() { echo "=== $1 ($(date +%T))" >>"$LOG"; }

step "2-GPU training vs 1-GPU reference: DDP, FSDP2, FSDP1"
LIGER_COMPAT_DIST_RESULTS="$OUT" timeout 110 python3 -m pytest -q -p no:cacheprovider \
  tests/distributed/test_multi_gpu.py -k ddp_fsdp2 >>"$LOG" 2>&1

ngpu=$(nvidia-smi -L | wc -l)
if [ "${SKIP_SCALING:-0}" != 1 ]; then
step "scaling, 1 GPU"
timeout 80 python3 -m torch.distributed.run --nproc_per_node 1 -m benchmarks.distributed_scaling \
  --out "$OUT/distributed_scaling_1gpu.json" --warmup 2 --steps 6 >>"$LOG" 2>&1
step "scaling, 2 GPUs"
timeout 100 python3 -m torch.distributed.run --nproc_per_node 2 -m benchmarks.distributed_scaling \
  --out "$OUT/distributed_scaling_2gpu.json" --warmup 2 --steps 6 >>"$LOG" 2>&1
python3 -m benchmarks.distributed_scaling --table "$OUT"/distributed_scaling_1gpu.json \
  "$OUT"/distributed_scaling_2gpu.json >"$OUT/distributed_scaling.md" 2>>"$LOG"
fi

step "tensor parallelism: the LM head's loss, native vs vocabulary-parallel"
timeout 150 python3 -m torch.distributed.run --nproc_per_node 2 -m benchmarks.tp_head --out "$OUT" >>"$LOG" 2>&1

# A Llama-3-8B head (hidden 4096, vocab 128256) on 4 decoder layers, loaded with tp_plan="auto"
TP_MODEL="--hidden 4096 --layers 4 --intermediate 14336 --model-dir /tmp/tp_model --warmup 2 --steps 6"
step "tensor parallelism: model steps, 2 GPUs (plain loop and transformers.Trainer)"
timeout 240 python3 -m torch.distributed.run --nproc_per_node 2 -m benchmarks.distributed_scaling $TP_MODEL \
  --engines tp,tp_trainer --out "$OUT/distributed_tp_2gpu.json" >>"$LOG" 2>&1
tp_files=("$OUT/distributed_tp_2gpu.json")
if [ "$ngpu" -ge 4 ]; then
  step "tensor parallelism: model steps, 4 GPUs (tp 4; FSDP2 x TP, dp 2 x tp 2)"
  timeout 200 python3 -m torch.distributed.run --nproc_per_node 4 -m benchmarks.distributed_scaling $TP_MODEL \
    --engines tp,fsdp2_tp --out "$OUT/distributed_tp_4gpu.json" >>"$LOG" 2>&1
  tp_files+=("$OUT/distributed_tp_4gpu.json")
fi
python3 -m benchmarks.distributed_scaling --table "${tp_files[@]}" >"$OUT/distributed_tp.md" 2>>"$LOG"

if [ "${WITH_ZERO3:-0}" = 1 ] && ls .whl_ds/deepspeed-*.whl >/dev/null 2>&1; then
  step "ZeRO-3 (deepspeed carried as wheels)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl_ds/*.whl >>"$LOG" 2>&1 &&
    PYTHONPATH="/tmp/site:$PYTHONPATH" LIGER_COMPAT_DIST_RESULTS="$OUT" timeout 85 python3 -m pytest -q -p no:cacheprovider \
      tests/distributed/test_multi_gpu.py -k zero3 >>"$LOG" 2>&1
fi
step "done"
tail -c 6000 "$LOG"
