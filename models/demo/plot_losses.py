"""Loss curves of the demo pair from the training logs saved beside the models. Usage: python models/demo/plot_losses.py"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def main() -> None:
    target = json.loads((HERE / "target" / "training_log.json").read_text())
    drafter = json.loads((HERE / "drafter" / "training_log.json").read_text())["log"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    a.plot([e["step"] for e in target["loss"]], [e["loss"] for e in target["loss"]], label="train")
    a.plot([e["step"] for e in target["eval"]], [e["heldout_loss"] for e in target["eval"]], "o-", label="held-out")
    a.set(title="target LM loss", xlabel="step", ylabel="cross-entropy")
    a.legend()
    b.plot([e["step"] for e in drafter], [e["loss"] for e in drafter], lw=0.6)
    b.set(title="drafter weighted block loss", xlabel="step")
    c.plot([e["step"] for e in drafter], [e["tau_est"] for e in drafter], lw=0.6, label="τ estimate (chain)")
    for k in (0, 3, 7):
        c.plot([e["step"] for e in drafter], [e["acc"][k] for e in drafter], lw=0.6, label=f"acc @ depth {k + 1}")
    c.set(title="drafter on its training data", xlabel="step")
    c.legend()
    fig.tight_layout()
    fig.savefig(HERE / "loss_curves.png", dpi=100)


if __name__ == "__main__":
    main()
