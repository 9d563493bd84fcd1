"""Data-parallel cases run by tests/test_distributed.py under torchrun (2 ranks, 4 for ep-grads;
gloo, one thread): `torchrun --standalone --nproc-per-node 2 tests/dist_worker.py CASE OUT`. Each
rank checks the DDP model against a one-process oracle it computes itself, and writes
OUT/rank{R}.json.

Cases:
  empty  - rank 1 routes every character to slots 0 and 1 (a routing bias of 1e4 on them: the
           choice only, the gates stay the router's), so the other experts get no character
           there; the whole pool on the card. DDP's gradients equal those of the mean of both
           ranks' losses in one process.
  card   - a card smaller than the pool (choose_card over both ranks) and the load balance term
           summed across ranks; DDP's gradients equal one process's on both batches as one.
  drift  - rank 1's model is changed by one bit: check_replicas must name the tensor.
  ep-uniform, ep-sink, ep-empty - expert parallelism's dispatch (minagi.moe.expert_parallel): 6
           experts, 3 on each rank; each rank's characters routed uniformly, with every one taking
           expert 0 (a sink), or all of both ranks' to rank 0's experts (rank 1 receives nothing).
           Outputs, the gradients of x and the gates, and each rank's expert weight gradients
           equal one process's expert_mlp with the whole pool over both ranks' characters.
  ep-grads - 4 ranks, E = 2: two expert-parallel groups; DDP's and the expert shards' gradients
           (reduce_grads over each data-parallel pair) equal one process's on all four batches.
  ep-rows - the model with its pool sharded and halting on: rank 0's characters stop after one row,
           rank 1's go on; both ranks still meet in every row, and the logits equal one process's.
"""
import copy
import json
import sys
from pathlib import Path

import torch

from minagi.lm import distributed
from minagi.lm.config import ModelConfig
from minagi.lm.model import ByteModel

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
    errors = []
    # Replicated (also as a shard of a one-rank group); a shard of a 2-rank group; and an
    # identical tensor next to a shard, which is still compared.
    for sharded, ep in (((), 1), (("attn.proj.weight",), 1), (("attn.proj.weight",), 2), (("head.weight",), 2)):
        try:
            distributed.check_replicas(model, d, 5, sharded, ep)
            errors.append(None)
        except distributed.DistributedError as exc:
            errors.append(str(exc))
    return {"errors": errors}


def ep_inputs(r: int, routing: str):
    """Rank r's characters (the same on every rank, so each can compute the oracle)."""
    g = torch.Generator().manual_seed(10 + r)
    N, K, D = (5, 7)[r], 2, 8
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    idx = torch.rand(N, 6, generator=g).topk(K, dim=1).indices
    if routing == "sink":
        idx[:, 0] = torch.where(idx[:, 1] == 0, idx[:, 0], torch.zeros_like(idx[:, 0]))
    elif routing == "empty":
        idx = torch.rand(N, 3, generator=g).topk(K, dim=1).indices  # experts 0..2: rank 0's
    gates = torch.softmax(torch.randn(N, K, generator=g, dtype=torch.float64), 1)
    probe = torch.randn(N, D, generator=g, dtype=torch.float64)
    return x, idx, gates, probe


def case_ep(d, routing):
    from minagi.moe.dispatch import expert_mlp
    from minagi.moe.expert_parallel import ep_expert_mlp

    g = torch.Generator().manual_seed(0)
    P, D, H, L = 6, 8, 12, 3
    w_in, w_out = torch.randn(P, D, H, generator=g, dtype=torch.float64), torch.randn(P, H, D, generator=g, dtype=torch.float64)
    mine = slice(d.rank * L, (d.rank + 1) * L)
    w_in_l, w_out_l = w_in[mine].clone().requires_grad_(), w_out[mine].clone().requires_grad_()
    x, idx, gates, probe = (t.requires_grad_() if t.is_floating_point() and i in (0, 2) else t
                            for i, t in enumerate(ep_inputs(d.rank, routing)))
    y = ep_expert_mlp(x, idx, gates, w_in_l, w_out_l, group=torch.distributed.group.WORLD, n_experts=P)
    (y * probe).sum().backward()
    w_in_f, w_out_f = w_in.clone().requires_grad_(), w_out.clone().requires_grad_()
    total, want_y, want = 0, None, None
    for r in (0, 1):
        xr, ir, gr, pr = (t.requires_grad_() if i in (0, 2) else t for i, t in enumerate(ep_inputs(r, routing)))
        yr = expert_mlp(xr, ir, gr, w_in_f, w_out_f)
        total = total + (yr * pr).sum()
        if r == d.rank:
            want_y, want = yr, (xr, gr)
    total.backward()
    zero = lambda t, like: torch.zeros_like(like) if t is None else t  # noqa: E731
    pairs = [(y, want_y), (x.grad, want[0].grad), (gates.grad, want[1].grad),
             (zero(w_in_l.grad, w_in_l), w_in_f.grad[mine]), (zero(w_out_l.grad, w_out_l), w_out_f.grad[mine])]
    err = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in pairs)
    assert err < 1e-9, err
    return {"max_err": err}


def case_ep_grads(d):
    """4 ranks, E = 2 (two groups of two): DDP's gradients, and each expert shard's (averaged over
    its data-parallel pair by reduce_grads), equal one process's on the four batches as one."""
    from minagi.moe.expert_parallel import ExpertParallel

    cfg = ModelConfig(d_model=32, n_heads=2, d_hidden=48, max_rows=3, n_pool=6, n_slots=6, top_k=2, balance="none")
    torch.manual_seed(0)
    model = ByteModel(cfg, T)
    oracle = copy.deepcopy(model)
    ep = ExpertParallel(d.world, 2)
    ep.shard(model)
    engine = distributed.wrap(model, d, torch.device("cpu"), ignore=ep.expert_names)
    batches = [batch(s) for s in range(11, 11 + d.world)]
    engine(*batches[d.rank]).loss.backward()
    ep.reduce_grads(model)
    oracle(torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])).loss.backward()
    want = grads(oracle)
    n = model.pool.w_in.shape[0]
    for name in ep.expert_names:  # this rank's experts of the whole pool's gradient
        want[name] = want[name][ep.rank * n:(ep.rank + 1) * n]
    return {"max_err": compare(grads(model), want)}


def case_ep_rows(d):
    """Expert parallelism in the model with halting: ranks whose characters halt after different
    rows still meet in every row's all_to_all; logits equal one process's on both batches."""
    from minagi.moe.expert_parallel import ExpertParallel

    cfg = ModelConfig(d_model=32, n_heads=2, d_hidden=48, max_rows=4, n_pool=6, n_slots=6, top_k=2, balance="none")
    torch.manual_seed(0)
    oracle = ByteModel(cfg, T)
    with torch.no_grad():  # halting that depends on the character: rows differ between the ranks
        oracle.halt.weight.normal_(std=2.0)
        oracle.halt.bias.fill_(1.0)
    model = copy.deepcopy(oracle)
    ExpertParallel(d.world, 2).shard(model)
    # Rank 0: one chunk of one byte (every character alike, so all halt together); rank 1: four random chunks.
    x = [torch.full((1, T), 32, dtype=torch.long), batch(6)[0]]
    with torch.no_grad():
        out = model(x[d.rank])
        both = oracle(torch.cat(x))
        want, want_rows = both.logits, both.rows_used
    mine = want[:1] if d.rank == 0 else want[1:]
    return {"max_err": float((out.logits - mine).abs().max()), "rows": out.rows_used.max().item(),
            "oracle_rows": (want_rows[:1] if d.rank == 0 else want_rows[1:]).max().item()}


if __name__ == "__main__":
    case, out = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    d = distributed.start("cpu", timeout_s=60)
    if case.startswith("ep-"):
        own = {"ep-rows": case_ep_rows, "ep-grads": case_ep_grads}
        result = own[case](d) if case in own else case_ep(d, case[3:])
        (out / f"rank{d.rank}.json").write_text(json.dumps(result))
        distributed.stop(d)
        sys.exit(0)
    small = dict(d_model=32, n_heads=2, d_hidden=48, max_rows=3)
    cfg = {"empty": ModelConfig(**small, n_pool=6, n_slots=6, top_k=2, balance="bias"),
           "card": ModelConfig(**small, n_pool=6, n_slots=3, top_k=2, balance="load", balance_coef=0.1),
           "drift": ModelConfig(**small)}[case]
    result = {"empty": case_empty, "card": case_card, "drift": case_drift}[case](d, cfg)
    (out / f"rank{d.rank}.json").write_text(json.dumps(result))
    distributed.stop(d)
