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

    def applies(self, installed: dict[str, versions.PackageVersion] | None = None) -> bool:
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
)


def by_id(issue_id: str) -> KnownIssue:
    for issue in KNOWN_ISSUES:
        if issue.id == issue_id:
            return issue
    raise KeyError(f"no known issue {issue_id!r}; known: {', '.join(i.id for i in KNOWN_ISSUES)}")
