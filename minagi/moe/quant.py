"""Quantized expert weights: int8 and int4, for inference through expert_mlp.

    qw = quantize(w_SIO, bits=8)                   # int8, one scale per output channel
    qw = quantize(w_SIO, bits=4, group_size=32)    # int4, one scale per 32 inputs (llama.cpp's Q4_0 granularity)
    y = expert_mlp(x, slot_idx, gates, quantize(w_in, bits=4, group_size=32), quantize(w_out, bits=8))

A QuantizedWeight stands for a logical [S, in, out] weight (expert_mlp's w_in [S, d, h or 2h] or
w_out [S, h, d]); quantize takes a contiguous [S, in, out] tensor or the .mT view of an
nn.Linear-style [S, out, in] one alike. Its storage is fixed for the kernels, output-major with the
inputs contiguous (llama.cpp's layout: one output channel's weights are one run of bytes):

  bits 8:  q [S, out, in'] int8
  bits 4:  q [S, out, in' / 2] uint8: each block of 32 inputs in 16 bytes, byte j holding input j
           in its low nibble and input j + 16 in its high nibble (llama.cpp's Q4_0 order), each
           nibble the value + 8 (values -8..7)
  scale    [S, out] with group_size None (one per output channel), else [S, out, ceil(in /
           group_size)]: float16, bfloat16 (the default) or float32

in' is in, or with groups in rounded up to whole groups: where group_size does not divide in, the
last group is short (its scale from its own inputs) and its padding holds zeros; in_features keeps
the logical in.

Symmetric: weight = value * scale, no zero point. In each group the weight of the largest
magnitude is mapped to -2^(bits - 1) (-128, -8; llama.cpp's Q4_0 rule), so all 2^bits levels are
used; the scale is rounded to its dtype first (never to a smaller magnitude) and the values are
computed from the rounded scale, so dequantize() gives exactly value * stored scale.

Inference only: expert_mlp gives gradients to x and the gates, never to a quantized weight (its
values are integers). requires_grad_(True) is refused, and so is a scale tensor that requires grad.

torch.save(qw) and torch.load(..., weights_only=True) work once this module is imported (it adds
the class to torch's safe globals).

Legend: S slots (experts), I inputs (in), O outputs (out), G groups per output channel.
"""
from __future__ import annotations

import torch

from . import reference

BITS = (8, 4)
SCALE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 32  # int4's packing block (16 bytes), and the unit of every group size


class QuantizedWeight:
    """An expert weight [S, in, out] in int8 or int4 (see the module's docstring for the storage).

    q, scale: the stored tensors; bits (8 or 4); group_size (None: per output channel, else a
    multiple of 32); dtype: the float dtype it dequantizes to and computes in (x's dtype in
    expert_mlp); in_features: the logical inputs (None: all q stores, which with groups may hold
    padding past them, up to the end of the last group)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bits: int, group_size: int | None, dtype: torch.dtype,
                 in_features: int | None = None):
        in_features = _check_storage(q, scale, bits, group_size, dtype, in_features)
        self.q, self.scale, self.bits, self.group_size, self.dtype = q, scale, bits, group_size, dtype
        self.in_features = in_features

    @property
    def shape(self) -> torch.Size:
        S, O, _ = self.q.shape
        return torch.Size((S, self.in_features, O))

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dim(self) -> int:
        return 3

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    @property
    def requires_grad(self) -> bool:
        return self.scale.requires_grad

    def requires_grad_(self, requires_grad: bool = True) -> QuantizedWeight:
        if requires_grad:
            raise ValueError(_NO_GRAD)
        self.scale.requires_grad_(False)
        return self

    @property
    def group(self) -> int:
        """The op's group_size argument: 0 for one scale per output channel."""
        return self.group_size or 0

    @property
    def nbytes(self) -> int:
        """Bytes stored: q and the scales."""
        return self.q.nbytes + self.scale.nbytes

    def dequantize(self) -> torch.Tensor:
        """The float weight it stands for, [S, in, out] in self.dtype (the .mT view of a contiguous
        [S, out, in] tensor: the storage's own order)."""
        return reference.dequantize(self.q, self.scale, self.bits, self.group, self.dtype, self.in_features).mT

    def to(self, *args, **kwargs) -> QuantizedWeight:
        """A copy on another device and/or with another float dtype to dequantize to, as
        Tensor.to takes them (.to(device), .to(dtype), .to(device, dtype), device=, dtype=); the
        integers and scales stay as they are stored."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"QuantizedWeight.to: dtype must be a floating dtype to dequantize to, got {dtype}")
        q, scale = self.q, self.scale
        if device is not None:
            q, scale = q.to(device, non_blocking=non_blocking), scale.to(device, non_blocking=non_blocking)
        return QuantizedWeight(q, scale, self.bits, self.group_size, dtype or self.dtype, self.in_features)

    def index_select(self, dim: int, index: torch.Tensor) -> QuantizedWeight:
        """The experts at `index` (dim 0 only: a card of a pool's experts), as Tensor.index_select."""
        if dim != 0:
            raise ValueError(f"QuantizedWeight.index_select: only dim 0 (the experts) can be selected, got {dim}")
        return QuantizedWeight(self.q.index_select(0, index), self.scale.index_select(0, index), self.bits,
                               self.group_size, self.dtype, self.in_features)

    def cpu(self) -> QuantizedWeight:
        return self.to("cpu")

    def cuda(self, device=None) -> QuantizedWeight:
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device)

    def __repr__(self) -> str:
        group = "per output channel" if self.group_size is None else f"group_size={self.group_size}"
        return (f"QuantizedWeight(shape={tuple(self.shape)}, int{self.bits}, {group}, scale {self.scale.dtype}, "
                f"dequantizes to {self.dtype}, {self.nbytes} bytes, device={self.device})")

    # Pickled as its fields (torch.save); torch.load(weights_only=True) rebuilds it through
    # __setstate__, which checks them as __init__ does.
    def __getstate__(self) -> dict:
        return {"q": self.q, "scale": self.scale, "bits": self.bits, "group_size": self.group_size,
                "dtype": self.dtype, "in_features": self.in_features}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["q"], state["scale"], state["bits"], state["group_size"], state["dtype"],
                      state.get("in_features"))


_NO_GRAD = ("a QuantizedWeight takes no gradient: its values are integers, and expert_mlp gives gradients to x and "
            "the gates only (inference). To train the weights, keep the float tensor (QuantizedWeight.dequantize() "
            "gives it back, with the rounding) and quantize after training")


def stored_inputs(n_in: int, group_size: int | None) -> int:
    """The inputs a channel stores: n_in, or with groups n_in rounded up to whole groups
    (csrc/cpu/quant.cpp padded_inputs), so the kernels run over whole groups only."""
    return n_in if group_size is None else -(-n_in // group_size) * group_size


def _check_storage(q, scale, bits, group_size, dtype, in_features) -> int:
    """Checks the fields, and returns the logical inputs."""
    def fail(msg):
        raise ValueError(f"QuantizedWeight: {msg}")

    if bits not in BITS:
        fail(f"bits must be 8 or 4, got {bits!r}")
    if not isinstance(q, torch.Tensor) or not isinstance(scale, torch.Tensor):
        raise TypeError("QuantizedWeight: q and scale must be tensors")
    want = torch.int8 if bits == 8 else torch.uint8
    if q.dtype != want or q.dim() != 3 or not q.is_contiguous():
        fail(f"int{bits} stores q as a contiguous [S, out, {'in' if bits == 8 else 'in / 2'}] {want} tensor, got "
             f"{q.dtype} {tuple(q.shape)}{'' if q.is_contiguous() else ' (not contiguous)'}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        fail(f"dtype (what it dequantizes to) must be a floating dtype, got {dtype!r}")
    if scale.dtype not in SCALE_DTYPES:
        fail(f"scale must be float16, bfloat16 or float32, got {scale.dtype}")
    if scale.device != q.device:
        fail(f"scale is on {scale.device} but q is on {q.device}")
    S, O, X = q.shape
    n_stored = X * (8 // bits)
    n_in = n_stored if in_features is None else in_features
    _check_group(bits, group_size)
    if isinstance(n_in, bool) or not isinstance(n_in, int) or stored_inputs(n_in, group_size) != n_stored:
        fail(f"q {tuple(q.shape)} stores {n_stored} inputs a channel, which does not hold in_features={n_in!r} "
             f"(int{bits}, group_size={group_size}: {n_in!r} inputs are stored as "
             f"{stored_inputs(n_in, group_size) if isinstance(n_in, int) else '?'})")
    shape = (S, O) if group_size is None else (S, O, -(-n_in // group_size))
    if tuple(scale.shape) != shape or not scale.is_contiguous():
        fail(f"scale must be a contiguous {shape} tensor for q {tuple(q.shape)} (int{bits}, group_size={group_size}), "
             f"got {tuple(scale.shape)}")
    return n_in


def _check_group(bits: int, group_size) -> None:
    if group_size is None:
        if bits == 4:
            raise ValueError("quantize: int4 needs a group_size (32, as llama.cpp's Q4_0, or 128, as GPTQ/AWQ's): "
                             "one scale per output channel is too coarse for 16 levels")
        return
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or group_size % BLOCK:
        raise ValueError(f"quantize: group_size must be None (int8 only: one scale per output channel) or a positive "
                         f"multiple of {BLOCK} (32, 128, ...), got {group_size!r}")


def quantize(w_SIO: torch.Tensor, bits: int = 8, group_size: int | None = None,
             scale_dtype: torch.dtype = torch.bfloat16) -> QuantizedWeight:
    """w [S, in, out] (contiguous, or the .mT view of an [S, out, in] weight) as a QuantizedWeight
    of `bits` (8 or 4) with one scale per output channel (group_size None; int8 only) or per
    `group_size` inputs (a multiple of 32: 32 or 128; where it does not divide in, the last group
    is short), scales in scale_dtype. It dequantizes to w's dtype. Symmetric: in each group the
    weight of the largest magnitude maps to -2^(bits - 1), every value is round(w / scale) clamped
    to [-2^(bits - 1), 2^(bits - 1) - 1]."""
    if not isinstance(w_SIO, torch.Tensor):
        raise TypeError(f"quantize: the weight must be a torch.Tensor, got {type(w_SIO).__name__}")
    if bits not in BITS:
        raise ValueError(f"quantize: bits must be 8 or 4, got {bits!r}")
    if not w_SIO.is_floating_point():
        raise ValueError(f"quantize: the weight must be a floating-point tensor (float32, bfloat16, ...), got "
                         f"{w_SIO.dtype}")
    if w_SIO.dim() != 3:
        raise ValueError(f"quantize: the weight must be [S, in, out] (experts, inputs, outputs), got shape "
                         f"{tuple(w_SIO.shape)}")
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"quantize: scale_dtype must be torch.bfloat16, torch.float16 or torch.float32, got "
                         f"{scale_dtype}")
    S, n_in, n_out = w_SIO.shape
    _check_group(bits, group_size)
    with torch.no_grad():
        work = torch.float64 if w_SIO.dtype == torch.float64 else torch.float32
        w_SOI = w_SIO.detach().mT.to(work)  # output-major: each channel's inputs contiguous
        g = n_in if group_size is None else group_size
        n_pad = -(-n_in // g) * g  # whole groups: zeros past the inputs, which never set a scale
        w_SOI = torch.nn.functional.pad(w_SOI, (0, n_pad - n_in))
        w_SOGg = w_SOI.reshape(S, n_out, n_pad // g, g)
        # The signed value of largest magnitude in each group goes to -2^(bits-1).
        peak = w_SOGg.gather(-1, w_SOGg.abs().argmax(-1, keepdim=True))
        exact = peak / -(1 << (bits - 1))
        scale = exact.to(scale_dtype)
        # Where rounding shrank the scale, the next one up in magnitude (its bits + 1: sign and
        # magnitude), so no weight lies past the end of the range and clips by more than a step.
        shrunk = scale.to(work).abs() < exact.abs()
        ints = torch.int32 if scale_dtype == torch.float32 else torch.int16
        scale = torch.where(shrunk, (scale.view(ints) + 1).view(scale_dtype), scale)
        s = scale.to(work)
        ratio = torch.where(s == 0, 0.0, w_SOGg / torch.where(s == 0, 1.0, s))
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        v = ratio.round().clamp(lo, hi).reshape(S, n_out, n_pad)  # n_pad: stored_inputs(n_in, group_size)
        scale = scale.reshape(S, n_out) if group_size is None else scale.reshape(S, n_out, n_pad // g)
        if bits == 8:
            q = v.to(torch.int8).contiguous()
        else:
            u = (v + 8).to(torch.uint8).reshape(S, n_out, n_pad // BLOCK, 2, BLOCK // 2)
            q = (u[..., 0, :] | (u[..., 1, :] << 4)).reshape(S, n_out, n_pad // 2).contiguous()
    return QuantizedWeight(q, scale.contiguous(), bits, group_size, w_SIO.dtype, n_in)


torch.serialization.add_safe_globals([QuantizedWeight])
