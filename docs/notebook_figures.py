"""Make the pictures of docs/notebook.md from fresh runs, with the code that page shows.

    python docs/notebook_figures.py [--out docs/img]

Needs pandas and matplotlib (``pip install "layerwatch[pandas]" matplotlib``). Writes
``notebook-heatmap.png`` (the demo's gradient norms with a NaN injected at step 300, every layer
x every sampled step) and ``notebook-update-ratios.png`` (two learning rates side by side), and
prints the demo's alerts table as Markdown.
"""

from __future__ import annotations

import argparse
import tempfile
import warnings
from pathlib import Path

import numpy as np


def train_mlp(log_dir: Path, lr: float, steps: int = 400) -> None:
    import torch
    from torch import nn

    from layerwatch import Inspector

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x, y = torch.randn(256, 32), torch.randn(256, 1)
    with Inspector(model, log_dir=log_dir, every_n_steps=10, optimizer=opt) as inspector:
        for _ in range(steps):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            inspector.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "img"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import layerwatch
    from layerwatch.cli import main as cli

    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        demo = Path(tmp) / "demo"
        cli(["demo", "--steps", "600", "--every", "20", "--logdir", str(demo), "--inject-nan", "300"])
        for lr in (0.01, 0.1):
            train_mlp(Path(tmp) / "sweep" / f"lr-{lr}", lr)

        # --- the page's first example: one run's gradient norms, every layer x every step
        df = layerwatch.load(demo)
        grads = df[df.series == "grads_norm"].pivot_table("value", index="layer", columns="step", dropna=False)
        fig, ax = plt.subplots(figsize=(9, 3.2))
        image = ax.imshow(np.log10(grads.values), aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(grads.index)), grads.index, fontsize=8)
        ticks = range(0, len(grads.columns), 5)
        ax.set_xticks(ticks, [grads.columns[i] for i in ticks], fontsize=8)
        ax.set_xlabel("step")
        ax.set_title("log10 gradient norm per parameter (white: NaN, from the injected step on)", fontsize=10)
        fig.colorbar(image, ax=ax)
        fig.tight_layout()
        fig.savefig(out / "notebook-heatmap.png", dpi=110)

        # --- the second: two runs' update ratios, side by side
        sweep = layerwatch.load(Path(tmp) / "sweep", runs="lr-*")
        ratios = sweep[sweep.series == "update_ratio"]
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
        for ax, (run, one) in zip(axes, ratios.groupby("run")):
            for layer, series in one.groupby("layer"):
                ax.plot(series.step, series.value, label=layer)
            ax.set_yscale("log")
            ax.set_title(run, fontsize=10)
            ax.set_xlabel("step")
        axes[0].set_ylabel("update ratio ‖Δw‖ / ‖w‖")
        axes[1].legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        fig.savefig(out / "notebook-update-ratios.png", dpi=110)

        # --- the third: the alerts table
        alerts = layerwatch.load_alerts(demo)
        print(alerts[["step", "kind", "layer", "message"]].to_markdown(index=False) if _has_tabulate()
              else alerts[["step", "kind", "layer", "message"]].to_string(index=False))


def _has_tabulate() -> bool:
    try:
        import tabulate  # noqa: F401
    except ImportError:
        return False
    return True


if __name__ == "__main__":
    main()
