"""Whether a drafter service can draft for the verifier service's target, from their Infos: for deployments where
the two start separately, so no command line saw both model directories (runtime.models.check_fit does there)."""

from __future__ import annotations

from protos.types import DrafterInfo, VerifierInfo
from runtime.models import DrafterShape, TargetShape, misfit


def info_misfit(verifier: VerifierInfo, drafter: DrafterInfo) -> str | None:
    """Why the drafter cannot draft for the verifier (its target, or a verifier that has no drafter to ask), or
    None when it fits."""
    if not verifier.drafts:
        return "the verifier has no drafter to ask for trees (start it with --drafter, the drafter's address)"
    taps = tuple(drafter.target_layer_ids)
    # the drafter's features are its taps' hidden states side by side
    hidden = drafter.feature_dim // len(taps) if taps else drafter.feature_dim
    return misfit(TargetShape(verifier.hidden_size, verifier.vocab_size, verifier.num_layers),
                  DrafterShape(hidden, drafter.vocab_size, taps, None))
