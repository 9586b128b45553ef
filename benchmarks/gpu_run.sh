#!/usr/bin/env bash
# One device-tool call on the H100: the peers from the carried wheels (.whl/: liger-kernel,
# cut-cross-entropy; the machine has no network), then the benchmark steps named on the command
# line, each into $OUT with its log. Steps: gpu_tests (COMMIT names the commit: the machine gets no
# .git), kernels:<sections> (KERNELS_ARGS), e2e (E2E_ARGS), e2e_memory (E2E_MEMORY_ARGS),
# compile_families (COMPILE_ARGS), generate (GENERATE_ARGS), kernels_regimes (REGIMES_ARGS; about 4-5 min:
# every fused-loss peer at five heads in three logit regimes, stops starting measurements at --budget-s),
# e2e_small (the host-bound llama-small 2x1024 step; E2E_SMALL_ARGS), trl_step (TRL_ARGS), models_gpu
# (MODELS_ARGS), host_profile (HOST_ARGS: where a small step's host time goes), step_phases
# (PHASES_ARGS: a small step's host time by phase, and its CUDA runtime calls), host_pieces (PIECES_ARGS: the host
# time of each piece of a small step, module forwards and our entry points, measured inside the step),
# compiled_profile (PROFILE_ARGS: a compiled step's GPU-busy and host time per implementation), op_host
# (OP_HOST_ARGS: one fused-loss call's host time, layer by layer), logprob_rows (LP_ROWS_ARGS: the
# log-prob head's row passes over one chunk by block width and warps), kernel_leave_out (LEAVE_OUT_ARGS: a
# family's small step with each of our kernels left out in turn, in one process), gh_gemm (GH_GEMM_ARGS: the loss's
# grad_hidden product to a bf16 against an fp32 result), compaction (COMPACTION_ARGS: the fused loss's
# ignored-row compaction against every row computed, behind work queued on the GPU),
# module_host (host time per module call, native and patched), rms_norm_host (one RMSNorm call's host
# time, Llama's and Gemma's norm, native, our kernel, torch's fused op and the patched module), skip_analysis (SKIP_ARGS: the
# sparse backward's rule in exact fp32 at GPU sizes), sparse_grads_profile (SPARSE_ARGS: one chunk of the
# block-sparse gradient matmuls over tile configurations), pytest:<args> (a pytest selection; the first writes pytest.log, the next pytest_2.log, ...).
#   bash benchmarks/gpu_run.sh gpu_tests "kernels:ceilings,elem_profile,flce_rows" e2e_memory
# The device tool brings back at most 8 files from $OUT: the steps write under $RES, which is packed
# into $OUT/results.tgz after every step and every 30 s (a run cut short keeps what was written).
# The wheels go to a directory named site-packages: datasets hashes its functions with dill, which
# pickles modules outside a site-packages directory by value (and fails on pyarrow's).
set -u
OUT=${OUT:-/tmp/gpu_out}
DEST=$OUT
OUT=${RES:-/tmp/gpu_res}
mkdir -p "$OUT" "$DEST"
export PYTHONUNBUFFERED=1
SITE=/tmp/gpu_site/site-packages
# one wheel at a time: a wheel built for another Python (carried for each, e.g. xxhash) fails alone
for whl in .whl/*.whl; do
  [ -e "$whl" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$whl" >>"$OUT/pip.log" 2>&1 \
    || echo "not installed: $whl" >>"$OUT/pip.log"
done
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L >"$OUT/machine.log" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" >>"$OUT/machine.log" 2>&1
pack() { tar czf "$DEST/results.tgz.tmp" -C "$OUT" . && mv "$DEST/results.tgz.tmp" "$DEST/results.tgz"; cp "$OUT/machine.log" "$DEST/"; }
# also every 30 s, so that a step the call's time limit cuts short keeps what it wrote so far
( while sleep 30; do pack 2>/dev/null; done ) &
PACKER=$!
trap 'kill $PACKER 2>/dev/null' EXIT
for step in "$@"; do
  t0=$(date +%s)
  case "$step" in
    gpu_tests) python3 -m benchmarks.gpu_tests --commit "${COMMIT:-unknown}" --out "$OUT" >"$OUT/gpu_tests.log" 2>&1 ;;
    compile_families) python3 -m benchmarks.compile_families --out "$OUT" ${COMPILE_ARGS:-} >"$OUT/compile_families.log" 2>&1 ;;
    kernels:*) mkdir -p "$OUT/kernels"; python3 -m benchmarks.kernels --out "$OUT/kernels" --sections "${step#kernels:}" ${KERNELS_ARGS:-} >"$OUT/kernels.log" 2>&1 ;;
    e2e) python3 -m benchmarks.e2e --out "$OUT" ${E2E_ARGS:-} >"$OUT/e2e.log" 2>&1 ;;
    e2e_memory) python3 -m benchmarks.e2e_memory --out "$OUT" ${E2E_MEMORY_ARGS:-} >"$OUT/e2e_memory.log" 2>&1 ;;
    kernels_regimes) python3 -m benchmarks.kernels_regimes --out "$OUT" ${REGIMES_ARGS:-} >"$OUT/kernels_regimes.log" 2>&1 ;;
    generate) python3 -m benchmarks.generate --out "$OUT" ${GENERATE_ARGS:-} >"$OUT/generate.log" 2>&1 ;;
    e2e_small) python3 -m benchmarks.e2e --out "$OUT" --name e2e_small_h100 --models llama-small --shapes 2x1024 ${E2E_SMALL_ARGS:-} >"$OUT/e2e_small.log" 2>&1 ;;
    trl_step) python3 -m benchmarks.trl_step --out "$OUT" ${TRL_ARGS:-} >"$OUT/trl_step.log" 2>&1 ;;
    models_gpu) python3 -m benchmarks.models_gpu --out "$OUT" ${MODELS_ARGS:-} >"$OUT/models_gpu.log" 2>&1 ;;
    compiled_profile) python3 -m benchmarks.compiled_profile --out "$OUT" ${PROFILE_ARGS:-} >"$OUT/compiled_profile.log" 2>&1 ;;
    kernel_leave_out) python3 -m benchmarks.kernel_leave_out --out "$OUT" ${LEAVE_OUT_ARGS:-} >>"$OUT/kernel_leave_out.log" 2>&1 ;;
    logprob_rows) python3 -m benchmarks.logprob_rows --out "$OUT" ${LP_ROWS_ARGS:-} >"$OUT/logprob_rows.log" 2>&1 ;;
    compaction) python3 -m benchmarks.compaction --out "$OUT" ${COMPACTION_ARGS:-} >>"$OUT/compaction.log" 2>&1 ;;
    gh_gemm) python3 -m benchmarks.gh_gemm --out "$OUT" ${GH_GEMM_ARGS:-} >"$OUT/gh_gemm.log" 2>&1 ;;
    op_host) python3 -m benchmarks.op_host --out "$OUT" ${OP_HOST_ARGS:-} >"$OUT/op_host.log" 2>&1 ;;
    rms_norm_host) for n in llama gemma; do python3 -m benchmarks.rms_norm_host --norm $n --out "$OUT" ${RMS_HOST_ARGS:-}; done >"$OUT/rms_norm_host.log" 2>&1 ;;
    module_host) python3 -m benchmarks.module_host --out "$OUT" ${MODULE_HOST_ARGS:-} >"$OUT/module_host.log" 2>&1 ;;
    step_phases) python3 -m benchmarks.step_phases --out "$OUT" ${PHASES_ARGS:-} >"$OUT/step_phases.log" 2>&1 ;;
    host_pieces) python3 -m benchmarks.host_pieces --out "$OUT" ${PIECES_ARGS:-} >"$OUT/host_pieces.log" 2>&1 ;;
    host_profile) python3 -m benchmarks.host_profile --out "$OUT" ${HOST_ARGS:-} >"$OUT/host_profile.log" 2>&1 ;;
    sparse_grads_profile) python3 -m benchmarks.sparse_grads_profile --out "$OUT" ${SPARSE_ARGS:-} >"$OUT/sparse_grads_profile.log" 2>&1 ;;
    skip_analysis) python3 -m benchmarks.skip_analysis --device cuda --out "$OUT" ${SKIP_ARGS:-} >"$OUT/skip_analysis.log" 2>&1 ;;
    pytest:*) np=$(( ${np:-0} + 1 )); log="$OUT/pytest.log"; [ "$np" -eq 1 ] || log="$OUT/pytest_$np.log"
      python3 -m pytest -q -p no:cacheprovider ${step#pytest:} >"$log" 2>&1 ;;
    *) echo "unknown step $step" >>"$OUT/machine.log" ;;
  esac
  echo "$step: rc=$? $(( $(date +%s) - t0 )) s" >>"$OUT/machine.log"
  pack
done
pack
cat "$OUT/machine.log"
