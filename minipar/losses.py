"""The losses of torch.nn.functional, with torch's arguments and values: ``cross_entropy``
(``weight``, ``ignore_index``, ``label_smoothing``), ``nll_loss``, ``mse_loss``, ``l1_loss`` and
``binary_cross_entropy_with_logits`` (``weight``, ``pos_weight``), each with ``reduction``
"mean", "sum" or "none". ``minipar.functional`` (F) holds them; ``minipar.nn.loss`` wraps them as
modules (``nn.CrossEntropyLoss()``).

    loss = F.cross_entropy(logits, targets, label_smoothing=0.1)   # logits (N, C) or (N, C, d..)

cross_entropy and nll_loss share one fused kernel (``_class_loss``), whose backward is one
formula; mse and l1 are built from ops; the logistic loss is fused (softplus never overflows).
"""
import functools
import numbers
import warnings

from . import backend
from .amp.autocast_mode import to_float32
from .autograd import Tensor, as_tensor, make_result
from .ops import unbroadcast

REDUCTIONS = ("mean", "sum", "none")


def _xp(a):
    return backend.get_array_module(a)


def check_reduction(name, reduction):
    if reduction not in REDUCTIONS:
        raise ValueError(f"{name}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _torch_cross_entropy(fn):
    """Also take torch's ``cross_entropy(input, target, weight, size_average, ignore_index,
    reduce, reduction, label_smoothing)`` and its (N, C, d1, ...) logits (classes on axis 1)
    where minipar's (..., C) does not fit the target."""
    @functools.wraps(fn)
    def cross_entropy(logits, target, weight=None, size_average=None, ignore_index=-100,
                      reduce=None, reduction="mean", label_smoothing=0.0):
        if isinstance(weight, numbers.Integral):  # minipar's cross_entropy(z, t, ignore_index, ..)
            weight, ignore_index = None, weight
            if isinstance(size_average, str):
                size_average, reduction = None, size_average
        reduction = legacy_reduction(size_average, reduce, reduction)
        logits = as_tensor(logits)
        t_shape = tuple(target.shape if hasattr(target, "shape")
                        else _xp(logits.data).asarray(target).shape)
        if (logits.ndim > 2 and logits.shape[:-1] != t_shape
                and logits.shape[:1] + logits.shape[2:] == t_shape):
            logits = logits.permute(0, *range(2, logits.ndim), 1)
        return fn(logits, target, ignore_index, reduction, weight, label_smoothing)
    del cross_entropy.__wrapped__
    return cross_entropy


def legacy_reduction(size_average, reduce, reduction):
    """The reduction torch's deprecated pair ``size_average``, ``reduce`` names, if given."""
    if size_average is None and reduce is None:
        return reduction
    return "none" if reduce is False else "sum" if size_average is False else "mean"


def kept_targets(t, classes, ignore_index, name, given=None):
    """Flat class-index targets and the mask of those not equal to ``ignore_index``; an
    IndexError (torch's) naming the first bad one unless every kept one is a class in
    [0, classes). Reading device targets waits for the GPU: the check reads ``given`` (the
    targets as the caller passed them) when that is a host array, else runs on device targets
    only under MINIPAR_DEBUG=1 (``backend.check_values``)."""
    t = t.reshape(-1)
    keep = t != ignore_index
    seen = given.reshape(-1) if hasattr(given, "reshape") and backend.check_values(given) else t
    if backend.check_values(seen):
        bad = (seen < 0) | (seen >= classes)
        if bool(bad.any()):  # seldom: only then are the ignored ones set apart
            bad &= seen != ignore_index
            if bool(bad.any()):
                i = int(bad.argmax())
                raise IndexError(f"{name}: target values must lie in [0, {classes}) (or equal "
                                 f"ignore_index={ignore_index}), got {int(seen[i])} at "
                                 f"position {i}")
    return t, keep


@_torch_cross_entropy
def cross_entropy(logits, target, ignore_index=-100, reduction="mean", weight=None,
                  label_smoothing=0.0):
    """Mean over targets of −log softmax(logits)[target], logits (..., C), integer target (...);
    with class weights w, the w[target]-weighted mean; with smoothing ε, (1 − ε) of that plus
    ε/C of −Σ_c w_c log softmax(logits)_c.

    d/dlogits = (softmax(logits) − onehot(target)) / n, with ignored targets contributing 0.
    """
    logits = as_tensor(logits)
    given, t = _integer_targets("cross_entropy", target, _xp(logits.data))
    if logits.shape[:-1] != t.shape:
        raise ValueError(f"cross_entropy: logits of shape {logits.shape} need a target of shape "
                         f"{logits.shape[:-1]}, got {t.shape}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must lie in [0, 1], got "
                         f"{label_smoothing}")
    return _class_loss("cross_entropy", logits, given, t, ignore_index, reduction, True, weight,
                       label_smoothing)


def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
             reduction="mean"):
    """torch's: the mean over targets of −input[n, target[n]], ``input`` log-probabilities with
    the classes on axis 1, (N, C) or (N, C, d...), or (C,) for one target; ignored targets count
    neither in the sum nor in n (with ``weight``: the w[target]-weighted mean).
    d/dinput = −onehot(target)/n."""
    x = as_tensor(input)
    given, t = _integer_targets("nll_loss", target, _xp(x.data))
    # the classes on the last axis, where _class_loss reads them
    z = x.reshape(1, -1) if x.ndim == 1 else x.permute(0, *range(2, x.ndim), 1)
    if z.shape[:-1] != (t.shape or (1,)):
        want = z.shape[:-1] if x.ndim > 1 else ()
        raise ValueError(f"nll_loss: input of shape {x.shape} needs a target of shape {want}, "
                         f"got {t.shape}")
    reduction = legacy_reduction(size_average, reduce, reduction)
    return _class_loss("nll_loss", z, given, t, ignore_index, reduction, False, weight)


def _integer_targets(name, target, xp):
    """The targets as given (for kept_targets' host check) and as a device array of integers."""
    given = target.data if isinstance(target, Tensor) else target
    t = xp.asarray(given)
    if t.dtype.kind not in "iu":
        raise TypeError(f"{name}: target must hold integer class indices, got {t.dtype}")
    return given, t


def _class_weights(name, weight, classes, like):
    """``weight`` as a device array of C values in ``like``'s dtype (None stays None)."""
    if weight is None:
        return None
    w = _xp(like).asarray(weight.data if isinstance(weight, Tensor) else weight, like.dtype)
    if w.shape != (classes,):
        raise ValueError(f"{name}: weight must hold one value per class, shape ({classes},), "
                         f"got {w.shape}")
    return w


def _class_loss(name, z, given, t, ignore_index, reduction, normalise, weight=None, eps=0.0):
    """The loss −z[target] (``normalise``: of log softmax(z), i.e. logsumexp(z) − z[target])
    of each row of z (..., C) with its target t (...), weighted by ``weight[target]`` and
    reduced, plus (``eps``) the label-smoothing term; rows whose target is ``ignore_index``
    count neither in the sum nor in n."""
    check_reduction(name, reduction)
    z = to_float32(z)
    xp = _xp(z.data)
    classes, shape = z.shape[-1], t.shape
    zf = z.data.reshape(-1, classes)
    t, keep = kept_targets(t, classes, ignore_index, name, given)
    safe_t = xp.where(keep, t, 0)
    rows = xp.arange(zf.shape[0])
    w = _class_weights(name, weight, classes, zf)
    def row_weights(dtype=zf.dtype):  # each row's weight; made again in backward, not kept
        return keep.astype(dtype) if w is None else w[safe_t] * keep
    wt = row_weights()
    lse, p, smooth = 0, None, 0
    if normalise:  # logsumexp(z), and softmax(z) for backward from the same exponentials
        m = zf.max(axis=-1, keepdims=True)
        p = xp.exp(zf - m)
        total = p.sum(axis=-1, keepdims=True)
        lse = (m + xp.log(total))[:, 0]
        p /= total
    losses = (lse - zf[rows, safe_t]) * wt
    n = wt.sum()
    n = xp.where(n > 0, n, 1)  # on the device: no host read
    # torch's smoothing term: −Σ_c w_c log p_c per kept row, its mean over the rows' weights
    if eps:
        logp = zf - lse[:, None]
        smooth = -(logp * w if w is not None else logp).sum(axis=-1) * keep
    if reduction == "mean":
        out = (1 - eps) * losses.sum() / n + (eps / classes) * (smooth.sum() / n if eps else 0)
    elif reduction == "sum":
        out = (1 - eps) * losses.sum() + (eps / classes) * (smooth.sum() if eps else 0)
    else:
        out = ((1 - eps) * losses + (eps / classes) * smooth).reshape(shape)

    flat_shape, z_shape, dtype = zf.shape, z.shape, zf.dtype  # backward keeps p, not z

    def backward(g):  # d/dz of a·(lse − z_t) + b·Σ_c w_c (lse − z_c), row by row
        g = g.reshape(-1) if reduction == "none" else g
        a = (1 - eps) * row_weights() * (g / n if reduction == "mean" else g)
        dz = p * a[:, None] if normalise else xp.zeros(flat_shape, dtype)
        dz[rows, safe_t] -= a
        if eps:
            b = (eps / classes) * keep * (g / n if reduction == "mean" else g)
            wc = xp.ones(classes, dtype) if w is None else w
            dz += b[:, None] * (p * wc.sum() - wc)
        return (dz.reshape(z_shape),)

    return make_result(xp.asarray(out, dtype=z.dtype), (z,), backward, name)


def _reduce(name, losses, reduction):
    check_reduction(name, reduction)
    return losses.mean() if reduction == "mean" else losses.sum() if reduction == "sum" \
        else losses


def _pair(name, input, target):
    """Input and target as tensors; torch's warning where the target broadcasts to the input."""
    x, y = as_tensor(input), as_tensor(target)
    if x.shape != y.shape:
        warnings.warn(f"{name}: a target of shape {y.shape} broadcasts against the input of "
                      f"shape {x.shape}: this is likely a bug (torch warns too)", stacklevel=3)
    return x, y


def mse_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    """(input − target)², reduced; from ops, so input and target both get gradients."""
    x, y = _pair("mse_loss", input, target)
    d = x - y
    return _reduce("mse_loss", d * d, legacy_reduction(size_average, reduce, reduction))


def l1_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    """|input − target|, reduced (the gradient sign(input − target), 0 where equal)."""
    x, y = _pair("l1_loss", input, target)
    return _reduce("l1_loss", (x - y).abs(), legacy_reduction(size_average, reduce, reduction))


def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None,
                                     reduction="mean", pos_weight=None):
    """w·[(1 − y)·x + (1 + (pw − 1)·y)·softplus(−x)], torch's stable form of
    −w·[pw·y·log σ(x) + (1 − y)·log(1 − σ(x))], reduced.
    d/dx = w·[(1 − y) − (1 + (pw − 1)·y)·σ(−x)];  d/dy = w·[(pw − 1)·softplus(−x) − x]."""
    x, y = as_tensor(input), as_tensor(target)
    if x.shape != y.shape:
        raise ValueError(f"binary_cross_entropy_with_logits: target size {y.shape} must be the "
                         f"same as input size {x.shape}")
    xp, xd, yd = _xp(x.data), x.data, y.data
    arrays = [1 if v is None else xp.asarray(v.data if isinstance(v, Tensor) else v, xd.dtype)
              for v in (weight, pos_weight)]
    w, pw = arrays
    softplus = xp.logaddexp(0, -xd)  # log(1 + e^−x), never overflowing
    scale = 1 + (pw - 1) * yd
    out = w * ((1 - yd) * xd + scale * softplus)
    if out.shape != x.shape:
        raise ValueError(f"binary_cross_entropy_with_logits: weight or pos_weight would change "
                         f"the shape {x.shape} to {out.shape}")

    def backward(g):
        sig_neg = 0.5 * (xp.tanh(-0.5 * xd) + 1)  # σ(−x) without overflow
        return (unbroadcast(g * w * ((1 - yd) - scale * sig_neg), x.shape),
                unbroadcast(g * w * ((pw - 1) * softplus - xd), y.shape))

    losses = make_result(out, (x, y), backward, "binary_cross_entropy_with_logits")
    return _reduce("binary_cross_entropy_with_logits", losses,
                   legacy_reduction(size_average, reduce, reduction))
