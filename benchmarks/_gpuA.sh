set -u
SITE=/tmp/gpu_site/site-packages
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl >"$OUT/pip.log" 2>&1
export PYTHONPATH="$PWD:$SITE" PYTHONUNBUFFERED=1
nvidia-smi -L > "$OUT/machine.log"
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gpu.py tests/kernels/test_lowmem_sparsity_gpu.py tests/kernels/test_logprob_gpu.py -k "fp32_grad_weight or peaked" > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >> "$OUT/machine.log"
tail -3 "$OUT/pytest.log"
IMPLS="liger_compat,liger_compat fp32 grad_weight,liger_compat lowmem,torch eager,torch.compile,liger-kernel,cce"
python3 -m benchmarks.kernels_regimes --out "$OUT" --name regB --heads llama3-8b,gemma2-9b-softcap,qwen2-7b,llama3.2-1b,llama3-8b-32k --regimes peaked --impls "$IMPLS" --budget-s 330 > "$OUT/regB.log" 2>&1
python3 -m benchmarks.kernels_regimes --out "$OUT" --name regC --heads llama3-8b-32k --regimes trained --impls "$IMPLS" --budget-s 120 > "$OUT/regC.log" 2>&1
echo "regimes rc=$?" >> "$OUT/machine.log"
cat "$OUT/machine.log"
