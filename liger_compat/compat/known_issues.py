"""Known breakages between fused kernels and transformers / trl, as data.

Each entry says which installed versions it affects (every library named in ``affects``
must be installed inside its range), which shims mitigate it, and where it comes from.
``check()`` evaluates them against package metadata only (no imports), then reads the
shim registry to say whether the installed liger_compat mitigates them.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import versions


class KnownIssue(NamedTuple):
    id: str
    title: str
    failure: str
    affects: dict[str, str]
    mitigated_by: tuple[str, ...]
    upstream: str
    scenario: str | None = None
    notes: str = ""
    #: package -> first release in which the issue no longer applies (an upstream fix); empty when
    #: no release of the affected packages fixes it (liger_compat's shims are then the mitigation)
    fixed_in: dict[str, str] = {}
    #: the failure needs training on CPU tensors: where a CUDA device is visible it does not apply
    cpu_only: bool = False

    def applies(self, installed: dict[str, versions.PackageVersion] | None = None,
                cuda: bool | None = None) -> bool:
        """Whether the installed releases are in every ``affects`` range (and, for a ``cpu_only``
        issue, ``cuda`` is not True; None: unknown, the versions alone decide)."""
        if self.cpu_only and cuda:
            return False
        inst = installed or versions.all_installed()
        for lib, spec in self.affects.items():
            pv = inst.get(lib) or versions.installed(lib)
            if not pv.installed or not versions.matches(pv.raw, spec):
                return False
        return True

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "title": self.title,
            "failure": self.failure,
            "affects": dict(self.affects),
            "mitigated_by": list(self.mitigated_by),
            "upstream": self.upstream,
            "scenario": self.scenario,
            "fixed_in": dict(self.fixed_in),
            "cpu_only": self.cpu_only,
        }


KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        id="F1",
        title="SFTTrainer reads outputs.logits for token accuracy",
        failure="fused forward returns logits=None -> TypeError: 'NoneType' object is not subscriptable",
        affects={"trl": ">=0.15,<1.15"},
        mitigated_by=("trl.sft_token_accuracy",),
        upstream="trl 0.15 SFTTrainer.compute_loss logs mean_token_accuracy from outputs.logits[..., :-1, :]",
        scenario="F1",
        fixed_in={"trl": "1.15.0"},  # trl 1.15 SFT trains through its own fused LM head (add_fused_lm_head)
    ),
    KnownIssue(
        id="F2",
        title="DPOTrainer calls the model without labels",
        failure="a fused forward that assumes labels slices None",
        affects={"trl": ">=0.11"},
        mitigated_by=("transformers.fused_causal_lm_forward",),
        upstream="trl DPOTrainer.concatenated_forward calls model(input_ids, attention_mask) and computes log-probs itself",
        scenario="F2",
    ),
    KnownIssue(
        id="F3",
        title="logits_to_keep swallowed by **kwargs on transformers < 4.49",
        failure="full [B, T, V] logits come back silently (huge memory)",
        affects={"transformers": ">=4.45,<4.49", "trl": ">=0.14"},
        mitigated_by=("transformers.logits_to_keep",),
        upstream="transformers 4.49 renamed num_logits_to_keep -> logits_to_keep (PR #35757); trl GRPO passes logits_to_keep",
        scenario="F3",
        fixed_in={"transformers": "4.49.0"},
    ),
    KnownIssue(
        id="F4",
        title="FlashAttention kwargs reach the loss function",
        failure="TypeError: unexpected keyword argument 'cu_seq_lens_q'",
        affects={"transformers": ">=4.47"},
        mitigated_by=("transformers.fused_causal_lm_forward",),
        upstream="transformers 4.47+ passes FlashAttentionKwargs through **kwargs for padding-free batches",
        scenario="F4",
    ),
    KnownIssue(
        id="F5",
        title="label counting and renamed trainer kwargs",
        failure="KeyError: 'labels' for ORPO/CPO batches; TypeError on tokenizer= / processing_class=",
        affects={"transformers": ">=4.46"},
        mitigated_by=("transformers.num_items_in_batch_labels", "transformers.renamed_kwargs", "trl.renamed_kwargs"),
        upstream="transformers 4.46 Trainer.get_batch_samples counts batch['labels']; trainers renamed tokenizer -> processing_class",
        scenario="F5",
    ),
    KnownIssue(
        id="trl-head-on-cpu",
        title="trl 1.15.0's fused LM head launches Triton kernels on CPU tensors",
        failure="RuntimeError: 0 active drivers ([]). There should only be one. (every SFT / DPO / GRPO / KTO / "
                "RLOO training step on CPU)",
        affects={"trl": "==1.15.0"},
        mitigated_by=("trl.fused_lm_head",),
        upstream="trl 1.15.0 trainer/utils.py add_fused_lm_head scores through trl.kernels.chunked_logprob's "
                 "Triton kernels on whatever device the model is on; trl 1.16.0 falls back to torch off CUDA / XPU",
        notes="liger_compat's head shim scores trl's head with its own fused log-prob kernel, which runs the "
              "torch implementation on CPU tensors",
        fixed_in={"trl": "1.16.0"},
        cpu_only=True,
    ),
)


class KnownConflict(NamedTuple):
    """A release range of a library that patches or wraps the same models (liger-kernel, unsloth,
    cut-cross-entropy) which breaks next to some transformers / trl releases, and what coexists."""

    id: str
    package: str  #: distribution name
    versions: str  #: the conflicting releases of ``package`` (specifier; "" = every release)
    when: dict[str, str]  #: distribution -> specifier: the other side of the conflict
    failure: str
    coexists: tuple[str, ...]  #: requirements any one of which avoids the conflict
    evidence: str

    def applies(self, installed: dict[str, str | None]) -> bool:
        """Whether the installed releases (distribution name -> version or None) conflict."""
        have = installed.get(self.package)
        if have is None or not versions.matches(have, self.versions):
            return False
        return all(installed.get(d) is not None and versions.matches(installed[d], spec) for d, spec in self.when.items())

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "package": self.package, "versions": self.versions, "when": dict(self.when),
                "failure": self.failure, "coexists": list(self.coexists), "evidence": self.evidence}


#: read from the released wheels (see ``evidence``)
KNOWN_CONFLICTS: tuple[KnownConflict, ...] = (
    KnownConflict(
        id="liger-kernel-llama-docstrings",
        package="liger-kernel",
        versions="<0.5.10",
        when={"transformers": ">=4.52"},
        failure="ImportError: cannot import name '_CONFIG_FOR_DOC' from transformers.models.llama.modeling_llama "
                "(liger_kernel.transformers.model.llama)",
        coexists=("liger-kernel>=0.5.10", "transformers<4.52"),
        evidence="liger-kernel 0.5.9 liger_kernel/transformers/model/llama.py imports _CONFIG_FOR_DOC and "
                 "LLAMA_INPUTS_DOCSTRING from modeling_llama; transformers 4.51.3 defines them, 4.52.4 does not; "
                 "liger-kernel 0.5.10 imports neither",
    ),
    KnownConflict(
        id="liger-fused-ce-under-trl-fused-head",
        package="liger-kernel",
        versions="",
        when={"trl": ">=1.15.0"},
        failure="SFTTrainer(use_liger_kernel=True) applies only liger's layer kernels; "
                "liger_kernel_config={'fused_linear_cross_entropy': True} raises ValueError",
        coexists=("trl<1.15.0",),
        evidence="trl 1.15.0 sft_trainer.py raises when liger_kernel_config enables fused_linear_cross_entropy "
                 "and forces it off otherwise (its own fused LM head, add_fused_lm_head); trl 1.14.2 has neither",
    ),
)


def by_id(issue_id: str) -> KnownIssue:
    for issue in KNOWN_ISSUES:
        if issue.id == issue_id:
            return issue
    raise KeyError(f"no known issue {issue_id!r}; known: {', '.join(i.id for i in KNOWN_ISSUES)}")
