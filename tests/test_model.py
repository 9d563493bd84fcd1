"""The byte model: dispatch paths agree, the degenerate dense case, admission and the optimizer."""
import pytest
import torch
import torch.nn.functional as F

from minagi.lm.config import ModelConfig
from minagi.lm.model import ByteModel
from minagi.lm.optim import PoolAdamW

from conftest import EXT, assert_close

PATHS = ["rectangle", "grouped"] + (["compiled"] if EXT else [])


def small(**kw):
    base = dict(d_model=16, n_heads=2, max_rows=3, d_hidden=24, n_pool=6, n_slots=6, top_k=2)
    base.update(kw)
    return ModelConfig(**base)


def _forward_backward(cfg, path, idx, tgt, seed=0):
    torch.manual_seed(seed)
    cfg.dispatch = path
    model = ByteModel(cfg, context=idx.shape[1]).double()
    out = model(idx, tgt)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("adaptive", [True, False])
def test_paths_agree_on_logits_and_gradients(adaptive):
    idx = torch.randint(0, 256, (3, 11))
    tgt = torch.randint(0, 256, (3, 11))
    ref_out, ref_grads = _forward_backward(small(adaptive_rows=adaptive), "rectangle", idx, tgt)
    for path in PATHS[1:]:
        out, grads = _forward_backward(small(adaptive_rows=adaptive), path, idx, tgt)
        assert_close(out.logits, ref_out.logits, msg=f"{path} logits")
        assert_close(out.loss, ref_out.loss, msg=f"{path} loss")
        for name, g in grads.items():
            assert_close(g, ref_grads[name], scale=4, msg=f"{path} grad of {name}")


def test_adaptive_rows_send_only_active_characters_to_the_mlp():
    torch.manual_seed(3)
    model = ByteModel(small(max_rows=4), context=16).double()
    with torch.no_grad():
        model.halt.bias.fill_(0.0)  # p = 0.5: characters halt after 2 rows (0.5 + 0.5 > 0.99)
        model.halt.weight.normal_(std=2.0)  # ...or at other rows, by their state
    out = model(torch.randint(0, 256, (2, 16)))
    routed = [st.routed_pairs for st in out.dispatch]
    active = [int((out.rows_used > r).sum()) * 2 for r in range(len(routed))]
    assert routed == active and routed[-1] < routed[0]


def test_one_expert_top1_fixed_rows_is_a_dense_weight_shared_transformer():
    cfg = small(n_pool=1, n_slots=1, top_k=1, adaptive_rows=False, balance="none")
    torch.manual_seed(0)
    model = ByteModel(cfg, context=9).double()
    idx = torch.randint(0, 256, (2, 9))
    got = model(idx).logits
    # The same weights as a plain transformer: one block applied max_rows times, dense GELU MLP.
    m = model
    w1, w2 = m.pool.w_in[0], m.pool.w_out[0]
    cos, sin = m.rotary_tables(9, idx.device, torch.float64)
    h = m.embed(idx)
    for r in range(cfg.max_rows):
        u = h + m.row_embed[r]
        a = u + m.attn(m.norm_attn(u), cos, sin)
        h = a + F.gelu(m.norm_mlp(a) @ w1) @ w2
    assert_close(got, m.head(m.norm_out(h)))


def test_admission_trains_only_the_experts_on_the_card():
    torch.manual_seed(0)
    cfg = small(n_pool=8, n_slots=3, top_k=2)
    model = ByteModel(cfg, context=10)
    opt = PoolAdamW(model.param_groups(0.1), model.pool, lr=1e-2)
    idx, tgt = torch.randint(0, 256, (4, 10)), torch.randint(0, 256, (4, 10))
    for _ in range(3):  # a few steps, so moments exist for every expert that was ever admitted
        model(idx, tgt).loss.backward()
        opt.step()
        opt.zero_grad()
    before = {n: p.detach().clone() for n, p in model.pool.named_parameters()}
    moments = {n: opt.state[p]["exp_avg"].clone() for n, p in model.pool.named_parameters()}
    out = model(torch.randint(0, 256, (4, 10)), tgt)
    out.loss.backward()
    admitted = model.pool.last_admitted
    off = torch.ones(8, dtype=torch.bool)
    off[admitted] = False
    assert admitted.numel() == 3 and off.sum() == 5
    # Expert weights get gradients only on the admitted pool rows; router keys also learn from
    # the admission affinity over the whole pool (the balance term), which the optimizer drops
    # for off-card experts below.
    for n in ("w_in", "w_out"):
        g = getattr(model.pool, n).grad
        assert g[off].abs().sum() == 0 and g[admitted].abs().sum() > 0, n
    assert model.pool.router.grad[admitted].abs().sum() > 0
    opt.step()
    for n, p in model.pool.named_parameters():
        assert torch.equal(p[off], before[n][off]), f"{n}: an off-card expert moved"
        assert torch.equal(opt.state[p]["exp_avg"][off], moments[n][off]), f"{n}: an off-card moment moved"
        assert not torch.equal(p[admitted], before[n][admitted]), f"{n}: on-card experts did not move"


def test_whole_pool_on_card_is_plain_adamw():
    torch.manual_seed(0)
    model = ByteModel(small(), context=8)
    ours = PoolAdamW(model.param_groups(0.1), model.pool, lr=1e-2, betas=(0.9, 0.99))
    clone = ByteModel(small(), context=8)
    clone.load_state_dict(model.state_dict())
    theirs = torch.optim.AdamW(clone.param_groups(0.1), lr=1e-2, betas=(0.9, 0.99), eps=1e-8)
    idx, tgt = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    for _ in range(3):
        for m, o in ((model, ours), (clone, theirs)):
            m(idx, tgt).loss.backward()
            o.step()
            o.zero_grad()
    for (n, a), (_, b) in zip(model.named_parameters(), clone.named_parameters()):
        assert_close(a, b, torch.float32, scale=5, msg=n)


def test_fused_update_equals_the_foreach_update():
    torch.manual_seed(0)
    shapes = [(4, 6), (3, 5, 2), (7,)]
    params = [torch.randn(s) for s in shapes]
    grads = [torch.randn(s) for s in shapes]
    ms = [torch.randn(s) * 0.1 for s in shapes]
    vs = [torch.rand(s) * 0.1 for s in shapes]
    copies = [[t.clone() for t in ts] for ts in (params, ms, vs)]
    hyper = (3.0, 1e-2, 0.9, 0.99, 1e-8, 0.1)  # step, lr, betas, eps, weight decay
    assert PoolAdamW._fused_update(params, grads, ms, vs, *hyper), "the fused kernel was not taken on the CPU"
    PoolAdamW._foreach_update(*copies[:1], grads, *copies[1:], *hyper)
    for got, want in zip(params + ms + vs, sum(copies, [])):
        assert_close(got, want, torch.float32)


def test_ngram_codes_name_the_last_bytes():
    from minagi.lm.model import NO_BYTE, ngram_codes
    idx = torch.tensor([[5, 6, 7]])
    prev = torch.tensor([[NO_BYTE, 4]])
    base = 257
    want = torch.tensor([[(NO_BYTE * base + 4) * base + 5, (4 * base + 5) * base + 6, (5 * base + 6) * base + 7]])
    assert torch.equal(ngram_codes(idx, prev, 3, 10**9), want)
    assert torch.equal(ngram_codes(idx, prev, 2, 97), torch.tensor([[4 * base + 5, 5 * base + 6, 6 * base + 7]]) % 97)


def test_ngram_tables_learn_and_start_silent():
    torch.manual_seed(0)
    plain = ByteModel(small(), context=8)
    model = ByteModel(small(ngram=3, ngram_buckets=31), context=8)
    missing = model.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert sorted(missing) == ["ngram_embed.0.weight", "ngram_embed.1.weight"]
    idx, tgt = torch.randint(0, 256, (2, 8)), torch.randint(0, 256, (2, 8))
    assert_close(model(idx).logits, plain(idx).logits)  # zero tables: the byte model itself
    model(idx, tgt).loss.backward()
    assert all(t.weight.grad.abs().sum() > 0 for t in model.ngram_embed)


def test_ngram_tables_decay_unless_told_not_to():
    model = ByteModel(small(ngram=3, ngram_buckets=31), context=8)
    tables = {id(t.weight) for t in model.ngram_embed}
    for ngram_decay in (True, False):
        decay, no_decay, pool = model.param_groups(0.1, ngram_decay=ngram_decay)
        assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
        assert tables <= {id(p) for p in (decay if ngram_decay else no_decay)["params"]}
        assert id(model.embed.weight) in {id(p) for p in decay["params"]}  # only the tables move
        n = sum(len(g["params"]) for g in (decay, no_decay, pool))
        assert n == len(list(model.parameters()))


def test_context_too_long_is_an_error():
    model = ByteModel(small(), context=8)
    with pytest.raises(ValueError, match="context is 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_load_balance_term_sees_the_routing():
    from minagi.lm.balance import BalanceInputs, LoadBalance
    from minagi.lm.pool import RowRoute
    term = LoadBalance()
    S, N = 8, 64
    uniform = torch.zeros(N, S, requires_grad=True)
    load = torch.full((S,), N * 2 // S)
    inputs = lambda logits, load: BalanceInputs(torch.ones(N, S) / S, torch.arange(S), S, S, [RowRoute(logits, load, N)])  # noqa: E731
    assert_close(term(inputs(uniform, load)), torch.tensor(1.0))
    sink = torch.zeros(N, S)
    sink[:, 0] = 5.0
    sink.requires_grad_()
    sink_load = torch.tensor([N] + [N // (S - 1)] * (S - 1))
    value = term(inputs(sink, sink_load))
    assert float(value.detach()) > 2.0  # the sink's load share times its probability
    value.backward()
    assert float(sink.grad[:, 0].sum()) > 0  # descending the term lowers the sink's logit
    # Padding rows (past n_valid) count for nothing, whatever their logits.
    padded = torch.cat([sink.detach(), torch.randn(N // 2, S)])
    assert_close(term(BalanceInputs(torch.ones(N, S) / S, torch.arange(S), S, S, [RowRoute(padded, sink_load, N)])),
                 value.detach())


@pytest.mark.parametrize("path", PATHS)
def test_load_balance_term_trains_the_router(path):
    # model.balance = "load": every row's router logits and load reach the term; its gradient
    # reaches the pool's router keys, and the term is the same on every dispatch path.
    idx, tgt = torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 9))
    cfg = small(balance="load", balance_coef=1.0)
    out, grads = _forward_backward(cfg, path, idx, tgt)
    ref, _ = _forward_backward(small(balance="load", balance_coef=1.0), "rectangle", idx, tgt)
    assert float(out.balance) > 0 and grads["pool.router"].abs().sum() > 0
    assert_close(out.balance, ref.balance)


@pytest.mark.parametrize("balance", ["load", "bias"])
@pytest.mark.parametrize("path", PATHS[1:])
def test_trains_under_bfloat16_autocast(path, balance):
    # The strix profiles train under bfloat16 autocast (GPUs); CPU autocast takes the same
    # route: the router's logits come out in bfloat16 while the rows are float32, and the gates
    # must follow the rows' dtype into the dispatch.
    torch.manual_seed(0)
    model = ByteModel(small(balance=balance, dispatch=path), context=16)
    idx = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(idx, idx)
    out.loss.backward()
    assert torch.isfinite(out.loss.detach()) and model.pool.w_in.grad.abs().sum() > 0


@pytest.mark.parametrize("top_k", [1, 2])
def test_gates_all_are_the_whole_cards_softmax_and_teach_the_router(top_k):
    from minagi.lm.pool import PooledMLP

    torch.manual_seed(0)
    chosen = PooledMLP(16, 24, 6, top_k).double()
    every = PooledMLP(16, 24, 6, top_k, gates="all").double()
    every.load_state_dict(chosen.state_dict())
    x = torch.randn(40, 16, dtype=torch.float64)
    logits = x @ chosen.router.t()
    idx_c, g_c = chosen.route(x, chosen.router, 40)
    idx_a, g_a = every.route(x, every.router, 40)
    assert torch.equal(idx_c, idx_a)  # the same choice; only the gates differ
    assert_close(g_c, torch.softmax(logits.gather(1, idx_c), -1), dtype=torch.float32)  # the op: float32
    assert_close(g_a, torch.softmax(logits, -1).gather(1, idx_a))
    assert bool((g_a.sum(1) < 1).all())
    every(x).pow(2).sum().backward()
    chosen(x).pow(2).sum().backward()
    assert every.router.grad.abs().sum() > 0
    # With top_k = 1 the chosen gate is 1: the loss never reaches the router.
    assert (chosen.router.grad.abs().sum() == 0) == (top_k == 1)


def test_gates_all_with_one_slot_is_the_dense_mlp():
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=16, n_heads=2, d_hidden=24, n_pool=1, n_slots=1, top_k=1, balance="none")
    a = ByteModel(cfg, 16).double()
    b = ByteModel(ModelConfig(**{**cfg.__dict__, "gates": "all"}), 16).double()
    b.load_state_dict(a.state_dict())
    idx = torch.randint(0, 256, (2, 16))
    assert_close(a(idx).logits, b(idx).logits)


def test_gates_setting_is_checked():
    from minagi.lm.config import ConfigError, load

    with pytest.raises(ConfigError, match="model.gates must be chosen or all"):
        load("cpu-tiny", ["model.gates=some"])
