"""Context-parallel pictures: the ring attention's steps, rank by rank (``RingLog.steps()``).

    ring_chart(steps, chunks)   a row per rank, a column per step; in each cell the four blocks
                                (q chunk × k chunk) coloured full, diagonal (masked) or skipped
"""
from minipar.figures.style import IDLE, KIND_COLOURS, drawing, new_figure

# the forward's blue for a whole block, amber for a masked one, the idle grey for a skipped one
BLOCK_COLOURS = {"full": KIND_COLOURS["F"], "diagonal": KIND_COLOURS["W"], "skipped": IDLE}
BLOCK_TEXT = {"full": "white", "diagonal": "black", "skipped": "#9e9e9e"}
BLOCK_NAMES = {"full": "whole: k chunk before q's",
               "diagonal": "diagonal: causal mask",
               "skipped": "skipped: k chunk after q's"}
CELL = 0.84  # of a step's column and a rank's row


@drawing
def ring_chart(steps, chunks, title=None):
    """The ring's timeline: ``steps[r][s]`` is rank r's blocks at step s, ``(q chunk, k chunk,
    kind)`` in RingLog's order (its first q chunk against the two k chunks in hand, then its
    second); ``chunks[r]`` the q chunks rank r holds. Each block is a Rectangle in
    ``ax.patches`` labelled ``q3·k0``, coloured by kind; rank 0 on top."""
    from matplotlib.patches import Patch, Rectangle
    n, m = len(steps), max(len(rows) for rows in steps)
    fig, ax = new_figure(height=min(2.0 + 1.5 * n, 24))
    half = CELL / 2
    for r, rows in enumerate(steps):
        for s, blocks in enumerate(rows):
            for b, (i, j, kind) in enumerate(blocks):
                x, y = s - half + (b % 2) * half, r - half + (b // 2) * half
                ax.add_patch(Rectangle((x, y), half, half, facecolor=BLOCK_COLOURS[kind],
                                       edgecolor="white", linewidth=1.5, zorder=2))
                ax.text(x + half / 2, y + half / 2, f"q{i}·k{j}", ha="center", va="center",
                        fontsize=10, color=BLOCK_TEXT[kind], zorder=3)
    kinds = [k for k in BLOCK_COLOURS if any(b[2] == k for rows in steps for blocks in rows
                                             for b in blocks)]
    handles = [Patch(facecolor=BLOCK_COLOURS[k], edgecolor="#bbbbbb", label=BLOCK_NAMES[k])
               for k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              title="block (q chunk × k chunk)")
    ax.set_xlim(-0.5, m - 0.5)
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_xticks(range(m), [f"step {s}" for s in range(m)])
    ax.set_yticks(range(n), [f"rank {r}\nq chunks {', '.join(map(str, chunks[r]))}"
                             for r in range(n)])
    ax.tick_params(axis="x", top=True, labeltop=True, bottom=False, labelbottom=False)
    ax.grid(False)
    ax.set_title(title or "ring attention: each rank's blocks at each step", wrap=True)
    return fig
