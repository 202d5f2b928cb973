"""Plot training progress around the kill, elastic vs checkpoint-restart, from recovery.json.

    python benchmarks/plot.py benchmarks/results/recovery.json docs/recovery.png
"""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    results = json.load(open(src))
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (size, r) in zip(axes[0], results.items()):
        for label, series, style in (
            ("monarch elastic: survivor", r["elastic"]["series"]["survivor"], "-"),
            ("monarch elastic: replacement", r["elastic"]["series"]["replacement"], "--"),
            ("monarch + warm spare: replacement", r["warm"]["series"]["replacement"], ":"),
            ("torchrun checkpoint-restart", r["restart"]["series"]["rank0"], "-"),
        ):
            if series:
                steps, t = zip(*series)
                ax.plot(t, steps, style, label=label, drawstyle="steps-post")
        ax.axvline(0, color="red", lw=0.8)
        ax.text(0, ax.get_ylim()[1] * 0.95, " SIGKILL", color="red", va="top")
        ax.set_title(f"{size} params, 4 replicas")
        ax.set_xlabel("seconds since the kill")
        ax.set_ylabel("global step committed")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
