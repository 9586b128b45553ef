"""Tensor parallelism on two CPU processes (torchrun, gloo): transformers' ``tp_plan="auto"``
shards ``lm_head`` over the vocabulary (``Shard(0)``), and the fused loss runs vocabulary-parallel
(``liger_compat/kernels/vocab_parallel.py``): each rank scores its rows of the head, the ranks
combine a few floats a row, no rank forms the ``[N, V]`` logits.

* the loss function itself, on random shards of uneven size, for every option, against a float64
  reference of the whole head computed in each process (pure torch);
* FSDP2 x TP on four processes (transformers' ``DistributedConfig(tp_size=2, fsdp_size=2)``);
* a tiny Llama loaded with ``tp_plan="auto"``, three SGD steps, patched on the kernel path
  (``LIGER_COMPAT_CPU_NATIVE=0``, what every GPU runs) against the same run in processes that
  never import liger_compat: losses, the head's gradient norms, final weights, what
  ``check()``'s distributed section says in the patched processes, given the model and not, that
  the decoder's kernels ran, and the tensors each op produced: native's ``[N, V]`` logits on every
  rank, none spanning the vocabulary for every token with liger_compat.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import _harness as h  # noqa: E402
from liger_compat.shims import _sharded_head as sd  # noqa: E402

if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)

WORKER = Path(__file__).with_name("_tp_worker.py")


def test_vocabulary_parallel_loss_equals_the_whole_heads_on_uneven_shards(tmp_path):
    seed = h.random.randrange(2**31)
    (log,) = h.torchrun_many([(WORKER, ["kernel", str(seed), str(tmp_path)], None)], timeout=240)
    for rank in (0, 1):
        for e in json.loads((tmp_path / f"kernel{rank}.json").read_text()):
            msg = f"seed {seed} rank {rank}: {e}"
            assert e["loss"] <= 1e-5 * max(1.0, e["loss_scale"]), msg
            assert e["grad_hidden"] <= 1e-5 * max(1.0, e["grad_hidden_scale"]), msg
            assert e["grad_weight"] <= 1e-5 * max(1.0, e["grad_weight_scale"]), msg
            assert e.get("grad_bias", 0.0) <= 1e-5, msg
            assert e.get("accuracy", 0.0) == 0.0, msg


def _tiny(tmp_path: Path) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    seed = h.make_spec(tmp_path / "spec.pt", world=2)
    spec = torch.load(tmp_path / "spec.pt", weights_only=False)
    model = LlamaForCausalLM(LlamaConfig(**spec["config"], tie_word_embeddings=False))
    model.load_state_dict(spec["state"])
    model.save_pretrained(tmp_path / "tiny")
    return seed


def test_tp_plan_auto_trains_as_natively_with_the_vocabulary_parallel_loss(tmp_path):
    seed = _tiny(tmp_path)
    args = ["model", str(seed), str(tmp_path)]
    h.torchrun_many([(WORKER, args, {"LIGER_COMPAT_TP_PATCHED": "0"}),
                     (WORKER, args, {"LIGER_COMPAT_TP_PATCHED": "1", "LIGER_COMPAT_CPU_NATIVE": "0"})], timeout=300)
    spec = torch.load(tmp_path / "spec.pt", weights_only=False)
    steps = len(spec["batches"])
    for rank in (0, 1):
        nat = json.loads((tmp_path / f"model_0_{rank}.json").read_text())
        ours = json.loads((tmp_path / f"model_1_{rank}.json").read_text())
        if "unsupported" in nat:
            assert ours == nat
            pytest.skip(f"this transformers has no tensor parallelism: {nat['unsupported']}")
        msg = f"seed {seed} rank {rank}: native {nat}, patched {ours}"
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(nat["losses"]), rtol=1e-5, atol=1e-5,
                                   msg=msg)
        torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(nat["norms"]), rtol=1e-4, atol=1e-6,
                                   msg=msg)
        vocab_sharded = nat["placements"] == ["S(0)"]
        # transformers 5.x shards the head over the vocabulary; earlier releases' plans leave it whole
        assert ours["tensor_parallel_calls"] == (steps if vocab_sharded else 0), msg
        if not vocab_sharded:
            continue
        assert nat["local_rows"] == h.TINY["vocab_size"] // 2, msg
        # native gathers the [N, V] logits on every rank (the premise); the vocabulary-parallel loss never
        # forms a tensor that spans the vocabulary for every token, forward or backward
        assert nat["full_vocab_tensors"], msg
        assert ours["full_vocab_tensors"] == [], msg
        # the decoder's own kernels keep running under the plan (RMSNorm on replicated activations,
        # RoPE on each rank's heads, the gated MLP on the column-sharded projections' local outputs)
        assert {"rms_norm", "rope", "swiglu"} <= set(ours["kernels_run"]), msg
        for key in ("given", "found"):  # check() with the model, and without it (found among live objects)
            d = ours[key]
            assert d["engine"] == "tensor parallel (tp=2)", msg
            assert d["head"] == "DTensor (S(0)) over tp=2: vocabulary-parallel fused loss", msg
            assert d["head_gather"] == "wired" and d["warnings"] == [], msg
    nat_w, ours_w = torch.load(tmp_path / "final_0.pt"), torch.load(tmp_path / "final_1.pt")
    start = spec["state"]
    moved = max(float((nat_w[k] - start[k]).abs().max()) for k in start)
    assert moved > 1e-2, f"seed {seed}: the weights hardly moved ({moved}); the comparison would show nothing"
    for k in nat_w:
        torch.testing.assert_close(ours_w[k], nat_w[k], rtol=1e-4, atol=2e-5, msg=lambda m: f"seed {seed} {k}: {m}")


def test_fsdp2_by_tensor_parallel_on_four_ranks_trains_as_natively(tmp_path):
    """transformers' ``DistributedConfig(tp_size=2, fsdp_size=2)``: the head is its own FSDP2 unit
    over a 2-D mesh; inside its call the gathered weight is split over the vocabulary on the
    tensor-parallel dimension, and the fused loss runs vocabulary-parallel there."""
    seed = _tiny(tmp_path)
    args = ["fsdp_tp", str(seed), str(tmp_path)]
    h.torchrun_many([(WORKER, args, {"LIGER_COMPAT_TP_PATCHED": "0"}),
                     (WORKER, args, {"LIGER_COMPAT_TP_PATCHED": "1", "LIGER_COMPAT_CPU_NATIVE": "0"})], nproc=4,
                    timeout=400)
    spec = torch.load(tmp_path / "spec.pt", weights_only=False)
    by_rank = []
    for rank in range(4):
        nat = json.loads((tmp_path / f"fsdp_tp_0_{rank}.json").read_text())
        ours = json.loads((tmp_path / f"fsdp_tp_1_{rank}.json").read_text())
        if "unsupported" in nat:
            pytest.skip(f"this transformers has no DistributedConfig (FSDP2 x TP at load): {nat['unsupported']}")
        msg = f"seed {seed} rank {rank}: native {nat}, patched {ours}"
        assert nat["mesh"] == ["fsdp", "tp"] and nat["placements"][-1] == "S(0)", msg
        assert ours["tensor_parallel_calls"] == ours["engine_calls"] == len(spec["batches"]), msg
        torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(nat["losses"]), rtol=1e-5, atol=1e-5,
                                   msg=msg)
        by_rank.append(nat["losses"])
    assert by_rank[0] != by_rank[2], "the two data-parallel halves saw the same batches"
    nat_w, ours_w = torch.load(tmp_path / "fsdp_tp_final_0.pt"), torch.load(tmp_path / "fsdp_tp_final_1.pt")
    assert max(float((nat_w[k] - spec["state"][k]).abs().max()) for k in spec["state"]) > 1e-2
    for k in nat_w:
        torch.testing.assert_close(ours_w[k], nat_w[k], rtol=1e-4, atol=2e-5, msg=lambda m: f"seed {seed} {k}: {m}")


class _Mesh:
    def __init__(self, *names: str):
        self.mesh_dim_names = names
        self.ndim = len(names)

    def size(self, i: int) -> int:
        return 2


class _Weight:
    def __init__(self, placements, mesh):
        self.placements, self.device_mesh = placements, mesh


def test_a_head_placement_the_loss_cannot_take_names_it_and_the_setting():
    from torch.distributed.tensor import Replicate, Shard

    assert sd.dtensor_route(_Weight((Shard(0),), _Mesh("tp"))) == "vocab"
    assert sd.dtensor_route(_Weight((Replicate(),), _Mesh("tp"))) == "replicated"
    for placements, mesh in (((Shard(1),), _Mesh("tp")), ((Shard(0), Shard(0)), _Mesh("dp", "tp"))):
        with pytest.raises(sd.ShardedHeadError, match="LIGER_COMPAT_KERNELS") as err:
            sd.dtensor_route(_Weight(placements, mesh))
        assert str(placements) in str(err.value) and isinstance(err.value, RuntimeError)
        text = sd.describe_dtensor_head(_Weight(placements, mesh))
        assert "NOT supported" in text and "over " in text
