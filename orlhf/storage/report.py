"""`orlhf report <save_path>`: one figure of a run (report.png) and a page around it (report.html).

    <save_path>/metrics.jsonl (one row per step, storage/metrics.py) --> report.png (3 x 3 panels) + report.html

Panels: reward (mean and a smoothed line; held-out pass@1 where the run evaluated), KL to the reference, policy
and value losses, entropy, samples/s, where each step's time went (timing/<phase>, stacked), staleness (async: how
many weight versions behind the rollouts were), the engine/trainer log-prob gap (a weight-sync or numerics check:
near 0 when the engines sample from the trainer's weights), and response length. A metric the run did not record says
so in its panel. The run writes the report at its end (launch/run.py); this module imports only matplotlib.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Optional

from orlhf.storage.metrics import read_metrics
from orlhf.storage.run_folder import RunFolder

PANELS = (  # (title, [(metric key, label)], y label)
    ("reward", [("reward_mean", "mean"), ("eval/pass@1", "held-out pass@1 (--eval_dataset)")], "reward"),
    ("KL to the reference", [("kl", "kl (per token)")], "kl"),
    ("losses", [("policy_loss", "policy"), ("value_loss", "value")], "loss"),
    ("entropy", [("entropy", "policy entropy")], "nats / token"),
    ("throughput", [("samples_per_s", "samples/s")], "samples / s"),
    ("step time by phase", [], "s"),  # stacked timing/* (drawn by _timing)
    ("staleness", [("staleness", "trainer - generation version")], "versions"),
    ("engine vs trainer log-probs", [("engine_logprob_gap", "mean |engine - trainer|")], "nats"),
    ("response length", [("response_length", "tokens")], "tokens"),
)


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def _smooth(values: list[float], k: int) -> list[float]:
    return [sum(values[max(0, i - k + 1) : i + 1]) / len(values[max(0, i - k + 1) : i + 1]) for i in range(len(values))]


def _timing(ax, rows: list[dict]) -> bool:
    phases = sorted({k for r in rows for k in r if k.startswith("timing/")})
    if not phases:
        return False
    steps = [r["step"] for r in rows]
    stacks = [[float(r.get(p, 0.0)) for r in rows] for p in phases]
    ax.stackplot(steps, *stacks, labels=[p[len("timing/") :] for p in phases], alpha=0.85)
    top = max(sum(col) for col in zip(*stacks))
    ax.set_ylim(0, top * 1.4)  # headroom: the legend sits above the stack, not on it
    ax.legend(fontsize=7, loc="upper right", ncol=3, framealpha=0.8)
    return True


def draw(rows: list[dict], out: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(14, 10))
    for ax, (name, keys, ylabel) in zip(axes.flat, PANELS):
        drew = _timing(ax, rows) if name == "step time by phase" else False
        for key, label in keys:
            steps, values = _series(rows, key)
            if not values:
                continue
            drew = True
            ax.plot(steps, values, marker="." if len(values) < 60 else None, lw=1, label=label)
            k = max(1, len(values) // 10)
            if key == "reward_mean" and len(values) > k > 1:
                ax.plot(steps, _smooth(values, k), lw=2, label=f"mean of last {k}")
        if name == "staleness" and drew:  # whole versions; a flat 0 (synchronous run) sits on the floor
            ax.set_ylim(-0.2, max(1, max(_series(rows, "staleness")[1])) + 0.5)
            ax.yaxis.get_major_locator().set_params(integer=True)
        if not drew:
            ax.text(
                0.5, 0.5, "not recorded in this run", ha="center", va="center", transform=ax.transAxes, color="gray"
            )
        elif ax.get_legend() is None and any(_series(rows, key)[1] for key, _ in keys):
            ax.legend(fontsize=8)
        ax.set_title(name, fontsize=11)
        ax.set_xlabel("step", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=13)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _table(rows: list[dict]) -> str:
    """First and last step, side by side, for every number the run logged."""
    first, last = rows[0], rows[-1]
    keys = [k for k in last if k != "step" and isinstance(last.get(k), (int, float))]
    body = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{_fmt(first.get(k))}</td><td>{_fmt(last[k])}</td></tr>" for k in keys
    )
    return f"<table><tr><th>metric</th><th>step {first['step']}</th><th>step {last['step']}</th></tr>{body}</table>"


def _fmt(v) -> str:
    return "" if v is None else f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))


def write_report(save_path: str | Path) -> tuple[Path, Path]:
    """report.png and report.html in save_path, from its metrics.jsonl. Raises FileNotFoundError / ValueError
    when there is nothing to plot."""
    save = Path(save_path)
    folder = RunFolder(save)
    metrics = folder.metrics
    if not metrics.exists():
        raise FileNotFoundError(f"{metrics}: no metrics file (is {save} an orlhf --save_path?)")
    rows = [r for r in read_metrics(metrics) if "step" in r]
    if not rows:
        raise ValueError(f"{metrics}: no steps logged yet")
    steps = sum(1 for r in rows if r["step"] > 0)  # step 0: --eval_before_train's evaluation, no training
    png = draw(rows, folder.report_png, f"orlhf run {save.resolve().name}: {steps} steps")
    page = folder.report_html
    page.write_text(
        "<!doctype html><meta charset='utf-8'><title>orlhf report</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 12px;text-align:right}"
        "td:first-child{text-align:left}</style>"
        f"<h1>orlhf run: {html.escape(str(save.resolve()))}</h1>"
        f"<p>{steps} steps logged in <code>metrics.jsonl</code>; terminal-free output in "
        f"<code>logs/</code>.</p><img src='{png.name}' style='max-width:100%'>"
        f"<h2>first and last step</h2>{_table(rows)}"
        f"<h2>config</h2><pre>{html.escape(_config(save) or 'not recorded')}</pre>"
    )
    return png, page


def _config(save: Path) -> Optional[str]:
    """The run's resolved configuration (run_config.json), one setting a line: its value and where it came from."""
    path = RunFolder(save).config
    if not path.exists():
        return None
    settings = json.loads(path.read_text())
    width = max((len(flag) for flag in settings), default=0)
    return "\n".join(f"--{f:<{width}}  {json.dumps(e['value'])}  ({e['source']})" for f, e in settings.items())
