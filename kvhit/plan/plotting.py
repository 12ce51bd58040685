"""``kvhit plan --plot``: hit length and recomputed tokens against prompt length, drawn with matplotlib (the
``[tools]`` extra, imported only here and only when a plot is asked for)."""

from .evaluation import hit_of


def curve_points(settings, max_n, budget=1500):
    """Prompt lengths to draw: an even grid, plus both sides of every alignment step of the settings (the
    sawtooth's teeth) while there are few enough of them to see."""
    xs = set(range(1, max_n + 1, max(1, max_n // budget))) | {max_n}
    for s in settings:
        a = s.sizes.alignment
        for unit in {a, s.sizes.hash_block, s.sizes.eagle_unit or a}:
            if max_n // unit <= budget:
                for k in range(1, max_n // unit + 2):
                    xs |= {x for x in (k * unit - 1, k * unit, k * unit + 1) if 1 <= x <= max_n}
    return sorted(xs)


def plot(settings, workload, path, by):
    """A PNG of hit length versus prompt length (the first repeat of an N-token prompt, or the whole prompt
    cached with the dense cache) for ``settings`` under policy ``by``,
    and below it the tokens each setting recomputes (``N - hit``: the sawtooth that alignment and the eagle
    drop make), with the workload's prompt lengths marked and its requests' hits as dots."""
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit("kvhit plan --plot needs matplotlib: pip install 'kvhit[tools]'") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    max_n = max(n for n, _ in workload)
    xs = curve_points(settings, max_n)
    sample = workload[:: max(1, len(workload) // 400)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), dpi=110, sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    top.plot([0, max_n], [0, max_n - 1], color="0.75", lw=1, ls="--", label="N - 1 (whole prompt)")
    for s in settings:
        ys = [hit_of(s, n, n, by)[0] for n in xs]
        line, = top.step(xs, ys, where="post", lw=1.4, label=f"{s.label} (mean {s.mean[by]:.0f})")
        bottom.step(xs, [n - y for n, y in zip(xs, ys)], where="post", lw=1.2, color=line.get_color())
        top.scatter([n for n, _ in sample], [hit_of(s, n, p, by)[0] for n, p in sample], s=6,
                    color=line.get_color(), alpha=0.5)
    for ax in (top, bottom):
        lo, hi = ax.get_ylim()
        ax.plot([n for n, _ in sample], [lo] * len(sample), "|", color="k", alpha=0.3, ms=12)
        ax.grid(alpha=0.3)
    top.plot([], [], "|", color="k", alpha=0.5, ms=12, label="workload prompt lengths")
    top.set_ylabel(f"cached tokens (hit), policy {by}")
    bottom.set_ylabel("recomputed tokens N - hit")
    bottom.set_xlabel("prompt length N (tokens)")
    top.set_title(f"{settings[0].layout.name or 'layout'}: best {len(settings)} settings by {by} "
                  f"(lines: {'whole prompt cached' if settings[0].retention == 'dense' else 'first repeat of N tokens'}; "
                  f"dots: the workload's requests)", fontsize=10)
    top.legend(loc="upper left", fontsize=8)
    bottom.set_xlim(0, max_n * 1.02)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
