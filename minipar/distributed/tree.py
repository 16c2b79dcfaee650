"""A state dict as a flat list of ``(path, leaf)`` items, and back.

A path is a tuple of steps ``(container kind, key)``, kind "d" (dict), "l" (list) or "t"
(tuple), so integer dict keys, lists and tuples survive the trip through a manifest; an empty
container is a leaf of its own, ``("empty", kind)``. A Stateful object (anything with
``state_dict()`` and ``load_state_dict()``: a module, an optimizer, a trainer) stands for its
``state_dict()``.

    items({"model": {"w": w}, "rng": (0, 3)})
        -> [((("d", "model"), ("d", "w")), w), ((("d", "rng"), ("t", 0)), 0),
            ((("d", "rng"), ("t", 1)), 3)]
    unflatten(items(tree)) == tree
"""
import numpy


def is_stateful(obj):
    return (not isinstance(obj, (dict, list, tuple)) and hasattr(obj, "state_dict")
            and hasattr(obj, "load_state_dict"))


def is_array(x):
    """A NumPy or CuPy array; a NumPy scalar is a value, like a Python number."""
    return hasattr(x, "shape") and hasattr(x, "dtype") and not isinstance(x, numpy.generic)


def items(obj, path=()):
    """(path, leaf) for every leaf of the tree ``obj``, depth first in insertion order."""
    if is_stateful(obj):
        obj = obj.state_dict()
    if not isinstance(obj, (dict, list, tuple)):
        yield path, obj
        return
    pairs = obj.items() if isinstance(obj, dict) else enumerate(obj)
    kind = "d" if isinstance(obj, dict) else "t" if isinstance(obj, tuple) else "l"
    empty = True
    for key, value in pairs:
        empty = False
        yield from items(value, path + ((kind, key),))
    if empty and path:
        yield path, ("empty", kind)


def unflatten(pairs):
    """The tree (a dict at the top) of ``(path, leaf)`` pairs: ``items``' inverse."""
    root = {"__kind__": "d"}
    for path, leaf in pairs:
        node = root
        for step, (kind, _) in zip(path[:-1], path[1:]):  # a child's kind: its first step's
            if not isinstance(node.get(step), dict):  # (an empty marker gives way)
                node[step] = {"__kind__": kind}
            node = node[step]
        if not (_empty(leaf) and isinstance(node.get(path[-1]), dict)):
            node[path[-1]] = leaf  # a container empty on one rank and not on another: the union
    return _build(root)


def _empty(leaf):
    return isinstance(leaf, tuple) and leaf[:1] == ("empty",)


def _build(node):
    """Containers back from {"__kind__": kind, (kind, key): child, ...} nodes."""
    if _empty(node):
        return {"d": {}, "l": [], "t": ()}[node[1]]
    if not isinstance(node, dict):
        return node
    children = [(step[1], _build(child)) for step, child in node.items() if step != "__kind__"]
    if node["__kind__"] == "d":
        return dict(children)
    values = [v for _, v in sorted(children, key=lambda kv: kv[0])]
    return values if node["__kind__"] == "l" else tuple(values)
