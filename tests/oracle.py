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
