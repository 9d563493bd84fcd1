"""A readable loop oracle: expert_mlp by plain Python over characters, in float64."""
import math

import torch
import torch.nn.functional as F


def expert_mlp_loop(x, slot_idx, gates, w_in, w_out, capacity_factor=0.0):
    N, K = slot_idx.shape
    S = w_in.shape[0]
    cap = math.ceil(capacity_factor * N * K / S) if capacity_factor > 0 else None
    taken = [0] * S
    y = torch.zeros(N, x.shape[1], dtype=torch.float64)
    for n in range(N):
        for j in range(K):
            s = int(slot_idx[n, j])
            taken[s] += 1
            if cap is not None and taken[s] > cap:
                continue  # past this slot's capacity: dropped
            h = F.gelu(x[n].double() @ w_in[s].double())
            y[n] += float(gates[n, j]) * (h @ w_out[s].double())
    return y


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
