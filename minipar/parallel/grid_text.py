"""How a ``RankGrid`` shows itself: ``describe`` (text, shortened above ``SHOW_ALL`` ranks to the
first and last few ranks and groups), ``title`` and ``as_dict`` (the JSON of ``minipar groups``).
``GridText`` reads the grid's table of group kinds from its class: ``KINDS``, ``KEYS``, ``DENSE``
and ``EXPERT`` (see ``groups.py``)."""

SHOW_ALL = 64  # describe() prints every rank and group up to this many ranks


class GridText:
    """The text and JSON of a ``RankGrid``."""

    def as_dict(self):
        """{'tensor': [[...]], 'pipeline': [[...]], 'data': [[...]]} plus sizes and each rank's
        coordinates; with cp > 1 also cp and the context groups, with ep > 1 ep, edp, 'expert'
        and 'expert_data' groups, and each rank's ep and edp coordinates."""
        dense = [kind for kind in self.shown(self.KINDS) if kind not in self.EXPERT]
        out = {"world": self.world, **{k: self.sizes[k] for k in self.shown(self.DENSE)},
               "order": self.order_name}
        out.update((self.KEYS[kind], self.groups(kind)) for kind in dense)
        out.update({kind: self.sizes[kind] for kind in self.shown(self.EXPERT)})
        out.update((self.KEYS[kind], self.groups(kind)) for kind in self.shown(self.EXPERT))
        out["coords"] = [self.all_coords(r) for r in range(self.world)]
        return out

    def all_coords(self, rank):
        """The coordinates ``minipar groups`` shows: ``coords(rank)`` with cp only when cp > 1,
        and the ep and edp coordinates when ep > 1."""
        c = {**self.coords(rank), **self.expert_coords(rank)}
        return {k: c[k] for k in self.shown([*c])}

    def title(self):
        """"world 16 = tp 2 × dp 4 × pp 2, dp 4 = ep 2 × edp 2  (order ..., fastest first)"."""
        dense = " × ".join(f"{k} {self.sizes[k]}" for k in self.shown(self.DENSE))
        block = "dp" if self.cp == 1 else "dp·cp"
        split = f", {block} {self.sizes['dp-cp']} = ep {self.ep} × edp {self.edp}" \
            if self.ep > 1 else ""
        return f"world {self.world} = {dense}{split}  (order {self.order_name}, fastest first)"

    def describe(self, full=False):
        """The grid as text: each rank's coordinates, then every group (context groups when
        cp > 1, expert and expert-data groups when ep > 1). Above ``SHOW_ALL`` ranks (unless
        ``full``) it shows the first and last few ranks and groups, the number left out in
        between, and the rank list of a long group as its first ranks and its last."""
        columns = self.shown(self.DENSE + self.EXPERT)
        lines = [self.title(), "", " rank" + "".join(f"{k:>5}" for k in columns)]
        short = not full and self.world > SHOW_ALL
        for r in _ends(range(self.world), 8 if short else self.world, "ranks"):
            c = self.all_coords(r) if isinstance(r, int) else {}  # or r is "... (N more ranks) ..."
            lines.append(f"{r:5d}" + "".join(f"{c[k]:5d}" for k in columns) if c else f"  {r}")
        for kind in self.shown(self.KINDS):
            groups = self.groups(kind)
            shown = _ends(groups, 4 if short else len(groups), "groups")
            text = " ".join(g if isinstance(g, str) else _ranks(g, short) for g in shown)
            lines.append(f"\n{self.KINDS[kind]} groups ({len(groups)} of {self.sizes[kind]}): "
                         f"{text}")
        return "\n".join(lines)


def _ends(items, keep, what):
    """The first ``keep`` and last ``keep`` items, with "... (N more what) ..." between them."""
    if len(items) <= 2 * keep + 1:
        return list(items)
    return [*items[:keep], f"... ({len(items) - 2 * keep} more {what}) ...", *items[-keep:]]


def _ranks(group, short):
    """[0,1,2] -- or, when ``short`` and the group is long, [0,2,4,...,16382]."""
    if short and len(group) > 8:
        return f"[{group[0]},{group[1]},{group[2]},...,{group[-1]}]"
    return str(group).replace(" ", "")
