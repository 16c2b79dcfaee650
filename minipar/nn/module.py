"""Parameters and Modules: a model is a tree of Modules whose leaves are Parameters.

A ``Module`` finds its parameters, buffers and children by walking its own attributes in
assignment order (needle's ``_unpack_params``), so

    class Net(Module):
        def __init__(self):
            super().__init__()
            self.fc1 = Linear(4, 8)      # a child: its parameters are "fc1.weight", "fc1.bias"
            self.fc2 = Linear(8, 2)

gives ``named_parameters()`` = fc1.weight, fc1.bias, fc2.weight, fc2.bias, in that order on every
rank. Only attributes are searched: keep layers in a ``ModuleList`` or ``Sequential``, not a plain
list. ``state_dict()`` and ``load_state_dict`` map dotted names to arrays, as PyTorch's do.
"""
from .. import backend
from ..autograd import Tensor


class Parameter(Tensor):
    """A trainable tensor: a leaf with ``requires_grad=True``; ``isinstance(x, Parameter)``
    tells a weight from an activation."""

    __slots__ = ()

    def __init__(self, data, requires_grad=True, dtype=None, name=None):
        super().__init__(data, requires_grad=requires_grad, dtype=dtype, name=name)

    def __repr__(self):
        return "Parameter containing:\n" + super().__repr__()


class Module:
    """Base class: subclasses set parameters and child modules as attributes, define forward."""

    def __init__(self):
        self.training = True
        self._buffers = []  # names of attributes that hold buffers, in registration order

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} must define forward()")

    def __call__(self, *args, **kwargs):
        hooks = self.__dict__.get("_forward_hooks")
        if hooks is None:
            return self.forward(*args, **kwargs)
        for hook in hooks[0]:
            args = hook(self, args) or args
        out = self.forward(*args, **kwargs)
        for hook in hooks[1]:
            new = hook(self, args, out)
            out = out if new is None else new
        return out

    # Forward hooks (torch's) run around every call of the module; fully sharded data
    # parallelism gathers a layer's parameters in them.
    def register_forward_pre_hook(self, hook):
        """``hook(module, args) -> None or new args`` runs before each forward (torch's)."""
        self.__dict__.setdefault("_forward_hooks", ([], []))[0].append(hook)
        return hook

    def register_forward_hook(self, hook):
        """``hook(module, args, output) -> None or new output`` runs after each forward."""
        self.__dict__.setdefault("_forward_hooks", ([], []))[1].append(hook)
        return hook

    # --- the tree ---------------------------------------------------------------------------
    def _members(self):
        """(name, value) of this module's own attributes, in assignment order."""
        if "_buffers" not in self.__dict__:
            raise RuntimeError(f"{type(self).__name__}.__init__ must call super().__init__()")
        return self.__dict__.items()

    def named_children(self):
        for name, value in self._members():
            if isinstance(value, Module):
                yield name, value

    def children(self):
        return (module for _, module in self.named_children())

    def named_modules(self, prefix=""):
        """(dotted name, module) for this module ("") and every descendant, each once."""
        seen = set()
        stack = [(prefix, self)]
        while stack:
            name, module = stack.pop()
            if id(module) in seen:
                continue
            seen.add(id(module))
            yield name, module
            kids = [(f"{name}.{n}" if name else n, m) for n, m in module.named_children()]
            stack.extend(reversed(kids))

    def modules(self):
        return (module for _, module in self.named_modules())

    def named_parameters(self, prefix=""):
        """(dotted name, Parameter), depth first in assignment order; a parameter shared by two
        modules (tied weights) once, under its first name."""
        seen = set()
        for mod_name, module in self.named_modules(prefix):
            for name, value in module._members():
                if isinstance(value, Parameter) and id(value) not in seen:
                    seen.add(id(value))
                    yield (f"{mod_name}.{name}" if mod_name else name), value

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def register_buffer(self, name, array):
        """Saved, not trained (BatchNorm's running statistics): ``self.<name>`` is a backend
        array that forward updates in place."""
        if name not in self._buffers:
            self._buffers.append(name)
        setattr(self, name, array)

    def named_buffers(self, prefix=""):
        for mod_name, module in self.named_modules(prefix):
            for name in module._buffers:
                yield (f"{mod_name}.{name}" if mod_name else name), getattr(module, name)

    def num_parameters(self):
        return sum(p.size for p in self.parameters())

    def apply(self, fn):
        """Call ``fn(module)`` on every module, children first (as torch's ``Module.apply``)."""
        for module in reversed(list(self.modules())):
            fn(module)
        return self

    # --- modes and gradients -----------------------------------------------------------------
    def train(self, mode=True):
        for module in self.modules():
            module.training = bool(mode)
        return self

    def eval(self):
        return self.train(False)

    def zero_grad(self):
        """Drop every parameter's gradient (PyTorch's default ``set_to_none=True``)."""
        for p in self.parameters():
            p.grad = None

    def astype(self, dtype):
        """Convert parameters and floating-point buffers, e.g. ``model.astype("float64")``."""
        dtype = backend.check_dtype(dtype)
        for p in self.parameters():
            p.data = backend.cast(p.data, dtype)
            p.grad = None
        for module in self.modules():
            for name in module._buffers:
                value = getattr(module, name)
                if backend.is_floating(value.dtype):
                    setattr(module, name, backend.cast(value, dtype))
        return self

    def double(self):
        return self.astype("float64")

    def float(self):
        return self.astype("float32")

    def half(self):
        return self.astype("float16")

    def bfloat16(self):
        return self.astype("bfloat16")

    def to(self, dtype):
        """torch's ``module.to(dtype)``: parameters and floating buffers in ``dtype``."""
        return self.astype(dtype)

    # --- saving and loading ------------------------------------------------------------------
    def state_dict(self):
        """{dotted name: live backend array} for parameters, then buffers: no copy, like
        PyTorch's detached tensors (copy them, or ``to_numpy`` them, for a snapshot)."""
        state = {name: p.data for name, p in self.named_parameters()}
        state.update(self.named_buffers())
        return state

    def load_state_dict(self, state, strict=True):
        """Copy ``state``'s arrays (NumPy or CuPy) into this module's parameters and buffers, in
        place.

        Mis-shaped keys are always an error; with ``strict``, so are missing and unexpected keys,
        every one named before anything changes.
        Returns ``(missing, unexpected)`` name lists, as PyTorch does.
        """
        own = self.state_dict()
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        misshaped = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                     for k in own if k in state and tuple(state[k].shape) != own[k].shape]
        refuse_load(self, missing, unexpected, misshaped, strict)
        for key, current in own.items():
            if key in state:
                value = state[key].data if isinstance(state[key], Tensor) else state[key]
                xp = backend.get_array_module(current)
                if backend.is_gpu_array(value) and not backend.is_gpu_array(current):
                    value = backend.to_numpy(value)
                current[...] = xp.asarray(value, dtype=current.dtype)
        return missing, unexpected

    # --- printing ----------------------------------------------------------------------------
    def extra_repr(self):
        return ""

    def __repr__(self):
        kids = list(self.named_children())
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not kids:
            return head + ")"
        lines = [f"  ({name}): " + repr(m).replace("\n", "\n  ") for name, m in kids]
        return head + "\n" + "\n".join(lines) + "\n)"


class Sequential(Module):
    """Modules applied one after another; indexable and sliceable, so it can be cut into segments
    (``checkpoint_sequential``) or pipeline stages. Children are named "0", "1", ..."""

    def __init__(self, *modules):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], (list, tuple)):
            modules = modules[0]
        for i, module in enumerate(modules):
            if not isinstance(module, Module):
                raise TypeError(f"{type(self).__name__}: item {i} is a {type(module).__name__}, "
                                f"not a Module")
            setattr(self, str(i), module)

    def _list(self):
        return [m for _, m in self.named_children()]

    def __len__(self):
        return len(self._list())

    def __iter__(self):
        return iter(self._list())

    def __getitem__(self, index):
        items = self._list()
        if isinstance(index, slice):
            return Sequential(*items[index])
        return items[index]

    def append(self, module):
        setattr(self, str(len(self)), module)
        return self

    def forward(self, x):
        for module in self:
            x = module(x)
        return x


class ModuleList(Sequential):
    """A list of modules whose parameters are registered; it has no forward of its own."""

    def __getitem__(self, index):
        items = self._list()
        return ModuleList(items[index]) if isinstance(index, slice) else items[index]

    def forward(self, *args, **kwargs):
        raise TypeError("ModuleList has no forward(): iterate over it and call its modules")


def refuse_load(module, missing, unexpected, misshaped, strict=True):
    """A KeyError naming every problem of a state dict before anything is copied: mis-shaped
    keys always; missing and unexpected keys with ``strict``."""
    problems = []
    if strict and missing:
        problems.append("missing keys: " + ", ".join(missing))
    if strict and unexpected:
        problems.append("unexpected keys: " + ", ".join(unexpected))
    if misshaped:
        problems.append("mis-shaped keys: " + "; ".join(misshaped))
    if problems:
        raise KeyError(f"load_state_dict for {type(module).__name__}: " + " | ".join(problems))
