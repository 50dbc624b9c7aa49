"""One saved tensor of a block as the activation formulas count it (plan/activations.py, and
transformers' blocks in plan/activations_hf.py), the names of the saved inputs that only a
weight's gradient reads, and those of the recomputed regions' inputs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

When = Literal["always", "not_selective", "selective_only"]


@dataclass(frozen=True)
class Term:
    name: str
    nbytes: float  # bytes for the whole (unsplit) micro-batch
    tp: bool  # split by tensor parallelism (heads / MLP width / vocabulary)
    sp: bool  # split by sequence parallelism (with tp) when not already split by tp
    when: When = "always"  # selective recompute drops "not_selective" terms

    def per_rank(self, t: int, sp: bool, selective: bool) -> float:
        if (selective and self.when == "not_selective") or (
            not selective and self.when == "selective_only"
        ):
            return 0.0
        return self.nbytes / t if (self.tp or (sp and self.sp)) else self.nbytes


# the saved inputs that only a linear's weight gradient reads, and which linears read them
CHUNKED_WEIGHT_GRAD = "head weight gradient (chunked loss)"  # none when the head is frozen
NORMALISED = ("normalised (fp32)", "normalised")  # an RMSNorm's: only its weight's gradient
WEIGHT_INPUTS = {
    "attn_norm output": ("wq", "wk", "wv", "wqkv"),
    "mlp_norm output": ("w1", "w3"),
    "w2 input": ("w2",),
    "final norm output": ("head",),
}
# the inputs of the regions selective recomputation checkpoints (parallel/recompute.PLANS: the
# attention core, the MLP's activation): torch.utils.checkpoint saves a region's tensor inputs
# as saved tensors whether or not they have a gradient, so a LoRA run's blocks before the
# first adapted linear save them too
RECOMPUTED_INPUTS = ("core inputs q, k, v", "w1, w3 outputs", "GELU input")
