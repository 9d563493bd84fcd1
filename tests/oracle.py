"""A readable loop oracle: expert_mlp by plain Python over the (character, k) pairs, in float64,
and each expert form's activation written out from its definition."""
import math

import torch


def expert_mlp_loop(x, slot_idx, gates, w_in, w_out, activation="gelu", b_in=None, b_out=None, post=None,
                    capacity_factor=0.0, skip=False, alpha=1.702, limit=7.0):
    """y[n] = sum_j g[n, j] * post(act(x[n] @ w_in[s] + b_in[s]) @ w_out[s] + b_out[s]), s = slot_idx[n, j],
    one pair at a time, differentiable (twice) in every tensor. activation: a form's name (act_math)
    or a callable; post: None or a callable. A slot keeps its first ceil(capacity_factor N K / S)
    pairs in character order (capacity_factor > 0); with skip, a pair whose slot is outside [0, S)
    adds nothing."""
    x, gates, w_in, w_out = (t.double() for t in (x, gates, w_in, w_out))
    b_in, b_out = (None if b is None else b.double() for b in (b_in, b_out))
    act = activation if callable(activation) else (lambda h: act_math(h, activation, alpha, limit))
    N, K = slot_idx.shape
    S = w_in.shape[0]
    cap = math.ceil(capacity_factor * N * K / S) if capacity_factor > 0 else None
    taken = [0] * S
    rows = []
    for n in range(N):
        y = x.new_zeros(x.shape[1])
        for j in range(K):
            s = int(slot_idx[n, j])
            if skip and not 0 <= s < S:
                continue  # an expert held elsewhere
            taken[s] += 1
            if cap is not None and taken[s] > cap:
                continue  # past this slot's capacity: dropped
            h = x[n] @ w_in[s] + (b_in[s] if b_in is not None else 0)
            out = act(h) @ w_out[s] + (b_out[s] if b_out is not None else 0)
            y = y + gates[n, j] * (out if post is None else post(out))
        rows.append(y)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


def act_math(h, form: str, alpha: float = 1.702, limit: float = 7.0):
    """Each expert form's activation written out from its definition, independently of minagi's
    own (reference.activate, the kernels): gated forms take [.., 2H] and give [.., H]."""
    silu = lambda v: v / (1 + torch.exp(-v))  # noqa: E731
    if form == "gelu":  # x * Phi(x)
        return h * 0.5 * (1 + torch.erf(h / math.sqrt(2)))
    if form == "gelu_tanh":
        return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    if form == "silu":
        return silu(h)
    if form == "relu2":
        return torch.where(h > 0, h * h, torch.zeros_like(h))
    half = h.shape[-1] // 2
    if form == "swiglu":  # [gate | up]
        return silu(h[..., :half]) * h[..., half:]
    if form == "swiglu_interleaved":  # gate, up, gate, up, ...
        return silu(h[..., 0::2]) * h[..., 1::2]
    if form == "swiglu_oai":  # GPT-OSS: gate clamped above, up clamped both ways, (up + 1) * gate * sigmoid(alpha gate)
        gate = torch.minimum(h[..., 0::2], torch.tensor(limit, dtype=h.dtype))
        up = torch.maximum(torch.minimum(h[..., 1::2], torch.tensor(limit, dtype=h.dtype)),
                           torch.tensor(-limit, dtype=h.dtype))
        return (up + 1) * gate / (1 + torch.exp(-alpha * gate))
    raise ValueError(form)
