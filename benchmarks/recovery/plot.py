"""Plot training progress around the kill, elastic vs checkpoint-restart, from recovery/sigkill.py's recovery.json.

    python -m benchmarks.recovery.plot benchmarks/results/recovery.json docs/recovery.png
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(src: str, dst: str) -> None:
    results = json.load(open(src))
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (size, r) in zip(axes[0], results.items()):
        for label, run, color in (
            ("monarch-run (cold replacement)", r["elastic"], "tab:blue"),
            ("monarch-run --spares 1 (hot spare)", r["warm"], "tab:green"),
        ):
            steps, t = zip(*run["series"]["survivor"])
            ax.plot(t, steps, color=color, label=label, drawstyle="steps-post")
            if run["series"]["replacement"]:
                joined_step, joined_t = run["series"]["replacement"][0]
                ax.plot([joined_t], [joined_step], "o", color=color)
        steps, t = zip(*r["restart"]["series"]["rank0"])
        ax.plot(t, steps, color="tab:red", label="torchrun --max-restarts 1 (checkpoint every few steps)",
                drawstyle="steps-post")
        ax.axvline(0, color="red", lw=0.8)
        ax.text(0, ax.get_ylim()[1] * 0.95, " SIGKILL", color="red", va="top")
        ax.set_title(f"{size} params, 4 replicas")
        ax.set_xlabel("seconds since the kill")
        ax.set_ylabel("global step committed (dot: replacement's first step)")
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(dst, dpi=110)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="recovery.json")
    p.add_argument("dst", help="the picture to write (.png)")
    args = p.parse_args()
    main(args.src, args.dst)
