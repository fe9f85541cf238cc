"""The benchmarks' figures: panels of lines drawn with matplotlib into one PNG (`--plot FILE.png`).

    _plot.draw("docs/map.png", "soma bench map (full), ...", [
        Panel("items/s against work per input", xlabel="µs of work per input", x=["0", "10", "100", "1,000"],
              series={"soma": [...], "procpool_chunked": [...]}, logy=True),
        Panel("soma / the chunked pool", x=[...], series={...}, targets={"target 1.0x": 1.0}),
    ])

A panel's `x` is either numbers (`logx_base` draws them on a log scale) or labels (equally spaced, in order);
a series may hold None where nothing was measured (a gap, never a made-up point). matplotlib is the `plot`
extra (`pip install 'soma[plot]'`): imported here only when a figure is drawn, and its absence named.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

STYLES = {"soma": ("C0", "o"), "local": ("C0", "o"), "inprocess": ("C1", "s"), "process_pool": ("C2", "^"),
          "procpool": ("C2", "^"), "procpool_chunked": ("C1", "s"), "mp_imap_chunked": ("C3", "D"),
          "ray_serve": ("C3", "D"), "per_item": ("C2", "^"), "hand_batched": ("C1", "s"), "batched": ("C0", "o")}


@dataclass
class Panel:
    title: str
    x: list
    series: dict  # name → one y per x (None: not measured)
    xlabel: str = ""
    ylabel: str = ""
    logy: bool = False
    logx_base: int | None = None
    targets: dict = field(default_factory=dict)  # label → y of a dashed horizontal line
    labels: dict = field(default_factory=dict)  # series name → its legend text (default: the name)


def draw(path: str, title: str, panels: list[Panel], columns: int | None = None) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(f"--plot {path}: matplotlib is not installed (pip install 'soma[plot]')") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = columns or len(panels)
    rows = -(-len(panels) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.8 * rows), squeeze=False)
    for ax, panel in zip([a for row in axes for a in row], panels):
        numeric = all(isinstance(v, (int, float)) for v in panel.x)
        where = list(panel.x) if numeric else list(range(len(panel.x)))
        for i, (name, ys) in enumerate(panel.series.items()):
            color, marker = STYLES.get(name, (f"C{4 + i % 6}", "x"))
            points = [(x, y) for x, y in zip(where, ys) if y is not None]
            if points:
                ax.plot(*zip(*points), marker=marker, color=color, label=panel.labels.get(name, name))
        for (label, y), dashes in zip(panel.targets.items(), ("--", ":", "-.")):
            ax.axhline(y, color="grey", linestyle=dashes, linewidth=1, label=label)
        if numeric and panel.logx_base:
            ax.set_xscale("log", base=panel.logx_base)
        ax.set_xticks(where, [f"{v:,}" if numeric else str(v) for v in panel.x])
        if panel.logy:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in [a for row in axes for a in row][len(panels):]:
        ax.set_visible(False)
    fig.suptitle("\n".join(textwrap.wrap(title, 60 * columns)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"\nwrote the plot to {path}")
