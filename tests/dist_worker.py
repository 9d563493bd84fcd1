"""Data-parallel cases run by tests/test_distributed.py under torchrun (2 ranks, gloo, one thread):
`torchrun --standalone --nproc-per-node 2 tests/dist_worker.py CASE OUT`. Each rank checks the
DDP model against a one-process oracle it computes itself, and writes OUT/rank{R}.json.

Cases:
  empty  - rank 1 routes every character to slots 0 and 1 (a routing bias of 1e4 on them: the
           choice only, the gates stay the router's), so the other experts get no character
           there; the whole pool on the card. DDP's gradients equal those of the mean of both
           ranks' losses in one process.
  card   - a card smaller than the pool (choose_card over both ranks) and the load balance term
           summed across ranks; DDP's gradients equal one process's on both batches as one.
  drift  - rank 1's model is changed by one bit: check_replicas must name the tensor.
"""
import copy
import json
import sys
from pathlib import Path

import torch

from minagi import distributed
from minagi.config import ModelConfig
from minagi.model import ByteModel

T = 32


def send_to_first_slots(model) -> None:
    with torch.no_grad():
        model.pool.route_bias[:2] = 1e4


def batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    chunk = torch.randint(0, 256, (4, T + 1), generator=g)
    return chunk[:, :-1], chunk[:, 1:]


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def compare(got: dict, want: dict) -> float:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    worst = 0.0
    for n in want:
        err = (got[n] - want[n]).abs().max().item()
        bound = 1e-6 + 1e-4 * want[n].abs().max().item()
        assert err <= bound, f"{n}: gradient off by {err} (bound {bound})"
        worst = max(worst, err)
    return worst


def setup(d, cfg, seeds):
    """The DDP model, a one-process copy of it (the oracle), both ranks' batches and this rank's."""
    torch.manual_seed(0)
    model = ByteModel(cfg, T)
    oracle = copy.deepcopy(model)
    batches = [batch(s) for s in seeds]
    return distributed.wrap(model, d, torch.device("cpu")), model, oracle, batches, batches[d.rank]


def case_empty(d, cfg):
    engine, model, oracle, ((x0, y0), (x1, y1)), (x, y) = setup(d, cfg, (1, 2))
    if d.rank == 1:
        send_to_first_slots(model)
    out = engine(x, y)
    out.loss.backward()
    loads = [st.slot_load for st in out.dispatch]
    loss0 = oracle(x0, y0).loss
    send_to_first_slots(oracle)
    loss1 = oracle(x1, y1).loss
    ((loss0 + loss1) / 2).backward()
    return {"max_err": compare(grads(model), grads(oracle)), "loads": loads}


def case_card(d, cfg):
    engine, model, oracle, ((x0, y0), (x1, y1)), (x, y) = setup(d, cfg, (3, 4))
    card = model.choose_card([x])
    engine(x, y, card).loss.backward()
    oracle(torch.cat([x0, x1]), torch.cat([y0, y1])).loss.backward()
    assert torch.equal(card, oracle.pool.last_admitted), (card, oracle.pool.last_admitted)
    return {"max_err": compare(grads(model), grads(oracle)), "card": card.tolist()}


def case_drift(d, cfg):
    torch.manual_seed(0)
    model = ByteModel(cfg, T)
    distributed.check_replicas(model, d, 0)  # identical: passes
    if d.rank == 1:
        with torch.no_grad():
            w = model.attn.proj.weight.view(-1)
            w[7] = torch.nextafter(w[7], torch.tensor(1.0))
    try:
        distributed.check_replicas(model, d, 5)
    except distributed.DistributedError as exc:
        return {"error": str(exc)}
    return {"error": None}


if __name__ == "__main__":
    case, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    d = distributed.start("cpu", timeout_s=60)
    small = dict(d_model=32, n_heads=2, d_hidden=48, max_rows=3)
    cfg = {"empty": ModelConfig(**small, n_pool=6, n_slots=6, top_k=2, balance="bias"),
           "card": ModelConfig(**small, n_pool=6, n_slots=3, top_k=2, balance="load", balance_coef=0.1),
           "drift": ModelConfig(**small)}[case]
    result = {"empty": case_empty, "card": case_card, "drift": case_drift}[case](d, cfg)
    (out / f"rank{d.rank}.json").write_text(json.dumps(result))
    distributed.stop(d)
