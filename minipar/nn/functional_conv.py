"""Convolution, pooling and batch normalisation on NCHW images, each with a fused backward.

All three window ops rest on one pair of helpers (the im2col trick, Chellapilla et al. 2006):

    windows(x)        (N, C, H, W) -> (N, C, kh, kw, OH, OW): entry [.., i, j, y, x] is the pixel
                      at offset (i, j) of the window whose output is (y, x); kh·kw strided slices
    add_windows(g)    the adjoint (col2im): every window's gradient added back onto its pixels

so a convolution is one tensor contraction of the windows with the weight, and its backward is
two contractions plus one ``add_windows``.
"""
from .. import backend, ops
from ..amp.autocast_mode import to_lower_precision
from ..autograd import as_tensor, make_result
from ..checkpoint import is_recomputing as _is_recomputing  # a replay leaves running stats alone


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def _out_size(n, k, stride, padding):
    out = (n + 2 * padding - k) // stride + 1
    if out <= 0:
        raise ValueError(f"window {k} with stride {stride} and padding {padding} does not fit an "
                         f"input of size {n}")
    return out


def _pad(x, ph, pw, value=0.0):
    if not ph and not pw:
        return x
    xp = backend.get_array_module(x)
    return xp.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def windows(xpad, kh, kw, stride, oh, ow):
    """im2col: (N, C, Hp, Wp) -> (N, C, kh, kw, oh, ow), a copy made of kh·kw strided slices."""
    xp = backend.get_array_module(xpad)
    sh, sw = stride
    cols = xp.empty(xpad.shape[:2] + (kh, kw, oh, ow), dtype=xpad.dtype)
    for i in range(kh):
        for j in range(kw):
            cols[:, :, i, j] = xpad[:, :, i:i + sh * oh:sh, j:j + sw * ow:sw]
    return cols


def add_windows(cols, padded_shape, stride):
    """col2im, the adjoint of ``windows``: sum each window entry back onto its pixel."""
    xp = backend.get_array_module(cols)
    _, _, kh, kw, oh, ow = cols.shape
    sh, sw = stride
    out = xp.zeros(padded_shape, dtype=cols.dtype)
    for i in range(kh):
        for j in range(kw):
            out[:, :, i:i + sh * oh:sh, j:j + sw * ow:sw] += cols[:, :, i, j]
    return out


def _unpad(g, ph, pw):
    return g[:, :, ph:g.shape[2] - ph, pw:g.shape[3] - pw]


def _check_nchw(name, x):
    if x.ndim != 4:
        raise ValueError(f"{name}: expected an (N, C, H, W) input, got shape {x.shape}")


def conv2d(x, weight, bias=None, stride=1, padding=0):
    """y[n, o] = Σ_c,i,j W[o, c, i, j] · xpad[n, c, s·y + i, s·x + j] + b[o]; W is (O, C, kh, kw).

    With cols = windows(xpad):  dW = Σ_n,y,x g ⊗ cols;  dcols = Wᵀ g;  dx = add_windows(dcols);
    db = Σ_n,y,x g. 16-bit operands: each of these sums in float32, rounded once
    (``ops.low_precision``), the bias added before the rounding.
    """
    x, weight, bias = to_lower_precision(as_tensor(x), weight, bias)
    _check_nchw("conv2d", x)
    O, C, kh, kw = weight.shape
    if x.shape[1] != C:
        raise ValueError(f"conv2d: input has {x.shape[1]} channels (shape {x.shape}) but the "
                         f"weight of shape {weight.shape} expects {C}")
    stride, (ph, pw) = _pair(stride), _pair(padding)
    oh = _out_size(x.shape[2], kh, stride[0], ph)
    ow = _out_size(x.shape[3], kw, stride[1], pw)
    xp = backend.get_array_module(x.data)
    xpad = _pad(x.data, ph, pw)
    cols = windows(xpad, kh, kw, stride, oh, ow)
    w = weight.data

    def convolve(cols, w, b):
        y = xp.tensordot(cols, w, axes=([1, 2, 3], [1, 2, 3])).transpose(0, 3, 1, 2)  # N O oh ow
        return y if b is None else y + b.reshape(1, O, 1, 1)

    y = xp.ascontiguousarray(ops.low_precision(convolve, cols, w,
                                               None if bias is None else bias.data))
    parents = (x, weight) if bias is None else (x, weight, bias)
    needs = tuple(p.requires_grad for p in parents)

    def input_grad(g, w):  # dcols = Wᵀ g, added back onto the pixels: dx, padded
        gcols = xp.tensordot(g, w, axes=([1], [0])).transpose(0, 3, 4, 5, 1, 2)
        return add_windows(gcols, xpad.shape, stride)

    def backward(g, only=needs):  # a split backward (graph.py): gx in B, gw and gb in W
        gx = gw = gb = None
        if only[0]:
            gx = _unpad(ops.low_precision(input_grad, g, w), ph, pw)
        if only[1]:
            gw = ops.low_precision(lambda g, c: xp.tensordot(g, c, axes=([0, 2, 3], [0, 4, 5])),
                                   g, cols)
        if bias is not None and only[2]:
            gb = ops.low_precision(lambda g: g.sum(axis=(0, 2, 3)), g)
        return (gx, gw) if bias is None else (gx, gw, gb)

    return make_result(y, parents, backward, "conv2d", split="only")


def _pool_windows(name, x, kernel_size, stride, padding, pad_value):
    """The pools' set-up: x, its windows (N, C, kh, kw, oh, ow), padded shape, stride, padding."""
    x = as_tensor(x)
    _check_nchw(name, x)
    (kh, kw), (ph, pw) = _pair(kernel_size), _pair(padding)
    stride = _pair(stride if stride is not None else kernel_size)
    oh, ow = _out_size(x.shape[2], kh, stride[0], ph), _out_size(x.shape[3], kw, stride[1], pw)
    xpad = _pad(x.data, ph, pw, value=pad_value)
    return x, windows(xpad, kh, kw, stride, oh, ow), xpad.shape, stride, (ph, pw)


def max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False,
               return_indices=False):
    """Largest value of each window (padding counts as −∞); the gradient goes to that element
    (the first one, on ties). torch's arguments: ``return_indices`` also gives where each
    maximum is, as torch numbers it (h·W + w in its input plane); a dilation other than 1 and
    ``ceil_mode`` are not implemented."""
    if _pair(dilation) != (1, 1) or ceil_mode:
        raise NotImplementedError(f"max_pool2d: dilation={dilation!r} and ceil_mode="
                                  f"{ceil_mode!r} are not implemented (only 1 and False)")
    x, cols, padded, stride, (ph, pw) = _pool_windows("max_pool2d", x, kernel_size, stride,
                                                      padding, -float("inf"))
    xp = backend.get_array_module(cols)
    N, C, kh, kw, oh, ow = cols.shape
    cols = cols.reshape(N, C, kh * kw, oh, ow)
    arg = cols.argmax(axis=2)[:, :, None]
    y = xp.take_along_axis(cols, arg, axis=2)[:, :, 0]

    def backward(g):
        hit = xp.arange(kh * kw).reshape(1, 1, -1, 1, 1) == arg
        gcols = (hit * g[:, :, None]).reshape(N, C, kh, kw, oh, ow)
        return (_unpad(add_windows(gcols, padded, stride), ph, pw),)

    out = make_result(y, (x,), backward, "max_pool2d")
    if not return_indices:
        return out
    # window offset (i, j) of output (r, c) is input pixel (r·sh + i − ph, c·sw + j − pw)
    rows = xp.arange(oh).reshape(-1, 1) * stride[0] + arg[:, :, 0] // kw - ph
    columns = xp.arange(ow).reshape(1, -1) * stride[1] + arg[:, :, 0] % kw - pw
    return out, as_tensor(rows * x.shape[3] + columns)


def avg_pool2d(x, kernel_size, stride=None, padding=0):
    """Mean of each window, padding counted as zeros (PyTorch's count_include_pad=True); each
    element of a window gets g / (kh·kw)."""
    x, cols, padded, stride, (ph, pw) = _pool_windows("avg_pool2d", x, kernel_size, stride,
                                                      padding, 0.0)
    xp = backend.get_array_module(cols)
    kh, kw = cols.shape[2:4]
    y = cols.mean(axis=(2, 3))

    def backward(g):
        share = g[:, :, None, None] / (kh * kw)
        gcols = xp.broadcast_to(share, g.shape[:2] + (kh, kw) + g.shape[2:])
        return (_unpad(add_windows(gcols, padded, stride), ph, pw),)

    return make_result(y, (x,), backward, "avg_pool2d")


def adaptive_avg_pool2d(x, output_size=1):
    """Global average pooling to 1×1 (the only output size implemented): mean over H and W."""
    if _pair(output_size) != (1, 1):
        raise NotImplementedError(f"adaptive_avg_pool2d: only output_size=1 is implemented, got "
                                  f"{output_size}")
    x = as_tensor(x)
    _check_nchw("adaptive_avg_pool2d", x)
    return x.mean(axis=(2, 3), keepdims=True)


def batch_norm(x, running_mean, running_var, weight=None, bias=None, training=True,
               momentum=0.1, eps=1e-5):
    """Batch normalisation (Ioffe & Szegedy 2015) over every axis but the channels (axis 1).

    Training: x̂ = (x − μ_B)/√(σ²_B + ε) with the batch's mean and biased variance, and the
    running stats move: r ← (1 − momentum)·r + momentum·stat (the variance unbiased, ·m/(m−1)),
    except while a checkpointed forward is being recomputed. Eval: the running stats are used.
    y = x̂·w + b.  Training backward, m values per channel, ĝ = g·w:
    dx = (ĝ − mean(ĝ) − x̂·mean(ĝ⊙x̂)) / √(σ²_B + ε);  dw = Σ g⊙x̂;  db = Σ g.
    """
    x = as_tensor(x)
    if x.ndim < 2:
        raise ValueError(f"batch_norm: expected (N, C, ...) input, got shape {x.shape}")
    xp = backend.get_array_module(x.data)
    axes = (0,) + tuple(range(2, x.ndim))
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)  # broadcasts a per-channel vector
    m = x.size // x.shape[1]
    if training:
        if m < 2:
            raise ValueError(f"batch_norm: need more than 1 value per channel when training, "
                             f"got input shape {x.shape}")
        mean = x.data.mean(axis=axes, keepdims=True)
        xc = x.data - mean
        var = (xc * xc).mean(axis=axes, keepdims=True)
        if running_mean is not None and not _is_recomputing():
            running_mean *= 1 - momentum
            running_mean += momentum * mean.reshape(-1)
            running_var *= 1 - momentum
            running_var += momentum * var.reshape(-1) * (m / (m - 1))
    else:
        mean, var = running_mean.reshape(shape), running_var.reshape(shape)
        xc = x.data - mean
    rstd = 1 / xp.sqrt(var + eps)
    xhat = xc * rstd
    y = xhat
    if weight is not None:
        y = y * weight.data.reshape(shape)
    if bias is not None:
        y = y + bias.data.reshape(shape)
    parents = [p for p in (x, weight, bias) if p is not None]

    def backward(g):
        gxhat = g * weight.data.reshape(shape) if weight is not None else g
        if training:
            gx = rstd * (gxhat - gxhat.mean(axis=axes, keepdims=True)
                         - xhat * (gxhat * xhat).mean(axis=axes, keepdims=True))
        else:
            gx = gxhat * rstd
        grads = [gx]
        if weight is not None:
            grads.append((g * xhat).sum(axis=axes) if weight.requires_grad else None)
        if bias is not None:
            grads.append(g.sum(axis=axes) if bias.requires_grad else None)
        return grads

    return make_result(y, parents, backward, "batch_norm")
