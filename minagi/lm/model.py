"""The byte model: one shared block (RMSNorm, causal attention with rotary positions, RMSNorm,
pooled MLP, residuals) applied over recurrent rows, with a learned row embedding per row and
ACT-style halting per character; the experts live in a pool, and each forward admits the
n_slots of them that sit on the card.

Legend: B batch, T positions, N characters (B * T, or the active ones), D model width, H expert
width, P pool experts, S card slots, R rows.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..moe.dispatch import DECODE_MAX_CHARS
from ..moe.reference import GATED, bucket
from .balance import BALANCE_TERMS, BalanceInputs
from .config import ModelConfig
from .pool import Card, PooledMLP, init_experts

VOCAB = 256  # every byte value: nothing is ever unknown
NO_BYTE = VOCAB  # stands for the bytes before a window's first, in the n-gram codes


def ngram_codes(idx_BT: torch.Tensor, prev_BP: torch.Tensor, order: int, buckets: int) -> torch.Tensor:
    """Each position's last `order` bytes as one bucket id [B, T]: the bytes as base-257 digits
    (NO_BYTE where they fall before the window; prev_BP holds the bytes just before it, at least
    order - 1 of them), taken modulo the bucket count."""
    x_BU = torch.cat([prev_BP[:, prev_BP.shape[1] - (order - 1):], idx_BT], dim=1)
    T = idx_BT.shape[1]
    code = torch.zeros_like(idx_BT)
    for j in range(order):  # oldest byte first
        code = code * (VOCAB + 1) + x_BU[:, j:j + T]
    return code % buckets


def rotary(x_BHTd: torch.Tensor, cos_Td: torch.Tensor, sin_Td: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BHTd.chunk(2, dim=-1)
    return x_BHTd * cos_Td + torch.cat([-x2, x1], dim=-1) * sin_Td


class Attention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def qkv_heads(self, x_BTD, cos_Td, sin_Td, qkv_t_DC=None):
        """Rotated q, k and v [B, heads, T, hd]. qkv_t_DC: the qkv weight transposed [D, 3D] (or
        its k, v columns [D, 2D], which gives k and v only), as decoding keeps it."""
        B, T, D = x_BTD.shape
        y_BTC = self.qkv(x_BTD) if qkv_t_DC is None else x_BTD @ qkv_t_DC
        parts = y_BTC.view(B, T, -1, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        if parts.shape[0] == 2:
            return rotary(parts[0], cos_Td, sin_Td), parts[1]
        q, k = rotary(parts[:2], cos_Td, sin_Td)  # one rotation for both
        return q, k, parts[2]

    def forward(self, x_BTD, cos_Td, sin_Td):
        B, T, D = x_BTD.shape
        q, k, v = self.qkv_heads(x_BTD, cos_Td, sin_Td)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class ExpertPool(nn.Module):
    """The pool's experts and admission: the n_slots experts with the highest mean affinity to
    the chunk sit on the card. With n_slots == n_pool the card is the pool itself (no gather)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_pool, self.n_slots = cfg.n_pool, cfg.n_slots
        self.router, self.w_in, self.w_out = (nn.Parameter(t) for t in init_experts(
            cfg.n_pool, cfg.d_model, cfg.d_hidden, gated=cfg.expert_activation in GATED))
        self.last_admitted = None  # pool rows on the card in the last forward: the optimizer's mask
        self.sharded = False  # expert parallelism keeps only this rank's experts (shard)
        if BALANCE_TERMS[cfg.balance].__dict__.get("adds_bias"):
            # Bias balancing: per pool expert, added to its router logit for the choice only.
            self.register_buffer("route_bias", torch.zeros(cfg.n_pool))

    def shard(self, rank: int, ranks: int) -> None:
        """Expert parallelism: keep experts [rank * P / ranks, (rank + 1) * P / ranks) of the
        expert weights (the router stays whole: routing is over every expert)."""
        n = self.n_pool // ranks
        mine = slice(rank * n, (rank + 1) * n)
        self.w_in = nn.Parameter(self.w_in.data[mine].clone())
        self.w_out = nn.Parameter(self.w_out.data[mine].clone())
        self.sharded = True

    def affinity(self, x_ND: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Each character's admission affinity [N, P]: a softmax over the pool."""
        return torch.softmax(F.rms_norm(x_ND, (x_ND.shape[-1],)) @ self.router.to(device, x_ND.dtype).t(), dim=-1)

    def top(self, mean_P: torch.Tensor) -> torch.Tensor:
        """The n_slots pool rows of highest mean affinity, in pool order (ties to the lower row)."""
        return torch.sort(torch.sort(mean_P, descending=True, stable=True).indices[: self.n_slots]).values

    def admit(self, x_ND: torch.Tensor, device: torch.device, admitted_S: torch.Tensor | None = None):
        """(card on `device`, admitted pool rows [S], affinity [N, P]). admitted_S: the card chosen
        beforehand (over a whole optimizer step: ByteModel.choose_card) instead of from x."""
        aff_NP = self.affinity(x_ND, device)
        if self.n_slots == self.n_pool:
            admitted_S = torch.arange(self.n_pool, device=device)
            card = Card(self.router, self.w_in, self.w_out)
        else:
            if admitted_S is None:
                admitted_S = self.top(aff_NP.detach().float().mean(0))
            rows = admitted_S.to(self.w_in.device)
            card = Card(*(t.index_select(0, rows).to(device) for t in (self.router, self.w_in, self.w_out)))
        # The optimizer's mask; None (every row) for a shard, which is all on the card.
        self.last_admitted = None if self.sharded else admitted_S
        return Card(*(t.to(device) for t in card)), admitted_S, aff_NP

    def card_bias(self, admitted_S: torch.Tensor, device: torch.device):
        """The admitted experts' routing biases [S] on `device`, or None without bias balancing."""
        bias = getattr(self, "route_bias", None)
        return None if bias is None else bias.index_select(0, admitted_S.to(bias.device)).to(device)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, 256]
    loss: torch.Tensor | None = None  # ce + ponder_cost * ponder + balance_coef * balance
    ce: torch.Tensor | None = None  # nats per character
    ponder: torch.Tensor | None = None  # mean rows used + remainder
    balance: torch.Tensor | None = None
    rows_used: torch.Tensor | None = None  # [B, T] rows each character took
    dispatch: list = field(default_factory=list)  # DispatchStats per row


class ByteModel(nn.Module):
    # Data parallelism sets a minagi.lm.distributed.Sum here: in training, the balance terms and
    # choose_card then look across every rank's characters (evaluation and decoding stay local).
    sync = None

    def __init__(self, cfg: ModelConfig, context: int):
        super().__init__()
        self.cfg, self.context = cfg, context
        D = cfg.d_model
        self.embed = nn.Embedding(VOCAB, D)
        self.ngram_embed = nn.ModuleList(nn.Embedding(cfg.ngram_buckets, D) for _ in range(cfg.ngram - 1))
        self.row_embed = nn.Parameter(torch.randn(cfg.max_rows, D) * 0.02)
        self.norm_attn, self.norm_mlp, self.norm_out = nn.RMSNorm(D), nn.RMSNorm(D), nn.RMSNorm(D)
        self.attn = Attention(D, cfg.n_heads)
        self.pool = ExpertPool(cfg)
        self.mlp = PooledMLP(D, cfg.d_hidden, cfg.n_slots, cfg.top_k, capacity_factor=cfg.capacity_factor,
                             path=cfg.dispatch, own_card=False, gates=cfg.gates, activation=cfg.expert_activation)
        self.halt = nn.Linear(D, 1)
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.balance_term = BALANCE_TERMS[cfg.balance]()
        self._init_weights()

    def _init_weights(self) -> None:
        nn.init.normal_(self.embed.weight, std=1.0)
        for e in self.ngram_embed:  # they start silent and learn what the byte alone lacks
            nn.init.zeros_(e.weight)
        for lin in (self.attn.qkv, self.head):
            nn.init.normal_(lin.weight, std=1.0 / math.sqrt(lin.in_features))
        # Residual outputs start small: each row nudges the state rather than replacing it.
        nn.init.normal_(self.attn.proj.weight, std=0.5 / math.sqrt(self.cfg.d_model * self.cfg.max_rows))
        with torch.no_grad():
            self.pool.w_out.mul_(0.5 / math.sqrt(self.cfg.max_rows))
        nn.init.zeros_(self.halt.weight)
        nn.init.constant_(self.halt.bias, -1.0)  # p = 0.27 per row: new characters use most rows

    def rotary_tables(self, T: int, device, dtype, offset: int = 0):
        hd = self.cfg.d_model // self.cfg.n_heads
        inv = 1.0 / (self.cfg.rope_base ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        ang = torch.arange(offset, offset + T, device=device, dtype=torch.float32)[:, None] * inv[None]
        ang = torch.cat([ang, ang], dim=-1)
        return ang.cos().to(dtype), ang.sin().to(dtype)

    def embed_bytes(self, idx_BT: torch.Tensor, prev_BP: torch.Tensor | None = None) -> torch.Tensor:
        """The rows' input [B, T, D]: each byte's embedding plus its n-grams'. prev_BP: the
        ngram - 1 bytes before the window (NO_BYTE for none; None = none known)."""
        h = self.embed(idx_BT)
        if not len(self.ngram_embed):
            return h
        if prev_BP is None:
            prev_BP = idx_BT.new_full((idx_BT.shape[0], self.cfg.ngram - 1), NO_BYTE)
        for order, table in enumerate(self.ngram_embed, start=2):
            h = h + table(ngram_codes(idx_BT, prev_BP, order, self.cfg.ngram_buckets))
        return h

    def _mlp(self, x_BTD, card, active_BT, stats, bias_S=None):
        """The pooled MLP on the active characters only; halted ones get no update. Dispatch
        statistics (device tensors, read when asked for) are appended to `stats` unless it is None
        (decoding skips counting them).
        bias_S: the card's routing biases (bias balancing) or None."""
        B, T, D = x_BTD.shape
        x_ND = x_BTD.reshape(B * T, D)
        want = stats is not None
        mlp = functools.partial(self.mlp, card=card, route_bias=bias_S)
        if active_BT is None or bool(active_BT.all()):
            y_ND, st = mlp(x_ND, return_stats=True) if want else (mlp(x_ND), None)
            if want:
                stats.append(st)
            return y_ND.view(B, T, D)
        sel = active_BT.reshape(-1).nonzero().squeeze(1)
        n = sel.numel()
        n_pad = self.padded_count(n, B * T)
        # Padding: index B * T is a zero row past the end, gathered as a zero character and
        # absorbing the padding rows' outputs, which are cut off with it.
        sel = torch.cat([sel, sel.new_full((n_pad - n,), B * T)]) if n_pad > n else sel
        x_sel = F.pad(x_ND, (0, 0, 0, 1)).index_select(0, sel) if n_pad > n else x_ND.index_select(0, sel)
        y_sel, st = mlp(x_sel, return_stats=True, n_valid=n) if want else (mlp(x_sel, n_valid=n), None)
        if want:
            stats.append(st)
        y_ND = x_ND.new_zeros(B * T + (n_pad > n), D).index_copy(0, sel, y_sel.to(x_ND.dtype))
        return y_ND[:B * T].view(B, T, D)

    def _rows_left(self, active_BT: torch.Tensor) -> bool:
        """Whether another row runs: while any character is active; under expert parallelism,
        any character of any rank of the group (every rank takes part in every row's all_to_all,
        with no rows of its own if need be)."""
        left = bool(active_BT.any())
        group = self.mlp.ep_group
        if group is None:
            return left
        flag = torch.tensor([float(left)], device=active_BT.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(flag)

    def padded_count(self, n: int, total: int) -> int:
        """Rows the pooled MLP runs for n active characters of `total`. With model.bucket_rows,
        _bucket(n): with adaptive rows the active count changes every row and step, and glibc's
        heap fragments under so many sizes (resident memory grew to 3.3 GB in a 4,500-step run,
        ~600 MB with the few bucketed sizes). A handful of characters (decoding) stays exact, so
        writing still reads only its top_k experts."""
        if not self.cfg.bucket_rows or n <= DECODE_MAX_CHARS:
            return n
        return min(bucket(n), total)

    def _halt(self, h, r, active, cum, out, remainder):
        """One ACT row: the halting probability of the row's state; characters whose sum would
        pass 1 - epsilon (or that reach the last row) stop, weighted by what remains of 1; the
        others add their state weighted by p. Returns (active, cum, out, remainder)."""
        p = torch.sigmoid(self.halt(h).squeeze(-1).float())
        stop = active & ((cum + p > 1 - self.cfg.halt_epsilon) | (r == self.cfg.max_rows - 1))
        go_on = active & ~stop
        w = torch.where(stop, 1 - cum, torch.where(go_on, p, torch.zeros_like(p)))
        out = out + w.unsqueeze(-1).to(h.dtype) * h
        remainder = torch.where(stop, 1 - cum, remainder)
        cum = cum + torch.where(go_on, p, torch.zeros_like(p))
        return go_on, cum, out, remainder

    @torch.no_grad()
    def choose_card(self, idx_list) -> torch.Tensor | None:
        """The card of one optimizer step made of several batches (micro-batches, and under data
        parallelism every rank's): the n_slots experts of highest mean affinity over all their
        characters, as one batch of them all would admit. None when the whole pool is the card."""
        if self.cfg.n_slots == self.cfg.n_pool:
            return None
        sum_P, n = 0.0, 0
        for idx_BT in idx_list:
            h = self.embed_bytes(idx_BT)
            aff_NP = self.pool.affinity(h.reshape(-1, h.shape[-1]), h.device)
            sum_P, n = sum_P + aff_NP.double().sum(0), n + aff_NP.shape[0]
        both = torch.cat([sum_P, sum_P.new_full((1,), n)])
        if self.sync is not None:
            self.sync(both)
        return self.pool.top((both[:-1] / both[-1]).float())

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None,
                admitted_S: torch.Tensor | None = None) -> ModelOutput:
        """Logits, and with targets the loss. admitted_S: the pool rows on the card, chosen
        beforehand (choose_card); None admits from this batch."""
        cfg = self.cfg
        B, T = idx_BT.shape
        if T > self.context:
            raise ValueError(f"ByteModel: {T} positions but the model's context is {self.context}")
        h = self.embed_bytes(idx_BT)
        dev = h.device
        card, admitted, aff_NP = self.pool.admit(h.reshape(B * T, -1), dev, admitted_S)
        bias_S = self.pool.card_bias(admitted, dev)
        cos, sin = self.rotary_tables(T, dev, h.dtype)
        adaptive = cfg.adaptive_rows
        active = torch.ones(B, T, dtype=torch.bool, device=dev)
        cum = torch.zeros(B, T, device=dev)
        remainder = torch.zeros(B, T, device=dev)
        rows_used = torch.zeros(B, T, device=dev)
        out = torch.zeros_like(h) if adaptive else None
        stats = []
        # A load-aware balance term reads every row's router logits and load.
        self.mlp.route_log = [] if targets_BT is not None and getattr(self.balance_term, "needs_routes", False) else None
        for r in range(cfg.max_rows):
            u = h + self.row_embed[r].to(h.dtype)
            a = u + self.attn(self.norm_attn(u), cos, sin)
            new = a + self._mlp(self.norm_mlp(a), card, active if adaptive else None, stats, bias_S)
            rows_used = rows_used + active.float()
            if not adaptive:
                h = new
                continue
            h = torch.where(active.unsqueeze(-1), new, h)  # a halted character keeps its state
            active, cum, out, remainder = self._halt(h, r, active, cum, out, remainder)
            if not self._rows_left(active):
                break
        final = out if adaptive else h
        logits = self.head(self.norm_out(final))
        result = ModelOutput(logits=logits, rows_used=rows_used, dispatch=stats)
        if targets_BT is None:
            return result
        ce = F.cross_entropy(logits.float().view(-1, VOCAB), targets_BT.reshape(-1))
        ponder = (rows_used + remainder).mean() if adaptive else rows_used.mean()
        routes, self.mlp.route_log = self.mlp.route_log or [], None
        sync = self.sync if self.training else None
        balance = self.balance_term(BalanceInputs(aff_NP, admitted, cfg.n_pool, cfg.n_slots, routes, sync, cfg.max_rows))
        loss = ce + (cfg.ponder_cost * ponder if adaptive else 0.0) + cfg.balance_coef * balance
        result.loss, result.ce, result.ponder, result.balance = loss, ce, ponder.detach(), balance.detach()
        return result

    def balance_step(self, applied: bool = True) -> None:
        """After an optimizer step (applied=False: a step the divergence guard skipped): the
        balance term's own update outside the gradient (bias balancing moves its biases)."""
        update = getattr(self.balance_term, "update", None)
        if update is not None:
            update(self.pool.route_bias, self.cfg.bias_rate, apply=applied, sync=self.sync)

    def new_cache(self) -> "RowCache":
        return RowCache(self)

    @torch.no_grad()
    def step(self, idx_B1: torch.Tensor, cache: "RowCache") -> ModelOutput:
        """Next-character logits [B, 1, 256] for one new character per stream; updates the cache."""
        return _step_impl(self, idx_B1, cache)

    @torch.no_grad()
    def score(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Log-probabilities [B, T, 256] of each next byte, from a full forward pass."""
        return torch.log_softmax(self(idx_BT).logits.float(), dim=-1)

    def param_groups(self, weight_decay: float, pool_lr: float | None = None, ngram_decay: bool = True):
        """AdamW groups: matrices decay, norms / biases / row embeddings do not, nor the n-gram
        tables unless ngram_decay; the pool's tensors are marked so the optimizer touches only the
        experts that were on the card, and take pool_lr where it is given (else the optimizer's
        lr)."""
        pool_ids = {id(p) for p in self.pool.parameters()}
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if id(p) in pool_ids:
                continue
            exempt = name == "row_embed" or (not ngram_decay and name.startswith("ngram_embed."))
            (decay if p.dim() >= 2 and not exempt else no_decay).append(p)
        return [
            {"params": decay, "weight_decay": weight_decay, "pool": False},
            {"params": no_decay, "weight_decay": 0.0, "pool": False},
            {"params": list(self.pool.parameters()), "weight_decay": weight_decay, "pool": True,
             **({} if pool_lr is None else {"lr": pool_lr})},
        ]


class RowCache:
    """Per-row key/value caches for incremental decoding: per row, a ring of the model's context
    in positions ([B, heads, window, hd]), written in place, so a new character costs one row
    write instead of a copy of the whole cache. Attention has no mask here (every cached position
    is earlier) and rotary angles are absolute, so the ring's order does not matter. A character
    that halts at row r keeps its state, so its keys and values for every later row are computed
    then, from that frozen state."""

    def __init__(self, model: "ByteModel"):
        self.k = [None] * model.cfg.max_rows
        self.v = [None] * model.cfg.max_rows
        self.pos = 0  # absolute position of the next character
        self.n_prev = model.cfg.ngram - 1
        self.prev = None  # [B, ngram - 1]: the bytes before the next character, for its n-grams
        self.window = model.context
        self.card = None  # the card admitted for this stream (from its first characters)
        self.card_bias = None  # its routing biases (bias balancing)
        # The dense weights transposed, [in, out] row-major: a one-row product then streams each
        # weight once (faster than F.linear's strided read from a cold cache). Like the
        # card, they belong to the weights the cache was made with.
        w = model.attn.qkv.weight.detach()
        self.qkv_t = w.t().contiguous()
        self.kv_t = self.qkv_t[:, w.shape[1]:]  # k and v columns: frozen rows need no queries
        self.proj_t = model.attn.proj.weight.detach().t().contiguous()
        self.head_t = model.head.weight.detach().t().contiguous()
        self.track_stats = False  # per-row DispatchStats in step()'s output (costs counting per row)

    def append(self, r: int, k, v) -> None:
        """Store row r's keys and values [B, heads, 1, hd] for the character at self.pos."""
        if self.k[r] is None:
            B, H, _, hd = k.shape
            self.k[r] = k.new_empty(B, H, self.window, hd)
            self.v[r] = v.new_empty(B, H, self.window, hd)
        slot = self.pos % self.window
        self.k[r][:, :, slot] = k[:, :, 0]
        self.v[r][:, :, slot] = v[:, :, 0]

    def prev_bytes(self, idx_B1: torch.Tensor):
        """The n-gram history before this character (None without n-grams); then records it."""
        if not self.n_prev:
            return None
        if self.prev is None:
            self.prev = idx_B1.new_full((idx_B1.shape[0], self.n_prev), NO_BYTE)
        prev = self.prev
        self.prev = torch.cat([prev[:, 1:], idx_B1], dim=1)
        return prev

    def keys_values(self, r: int):
        """Row r's cached keys and values, the current character's included."""
        n = min(self.pos + 1, self.window)
        return self.k[r][:, :, :n], self.v[r][:, :, :n]


def _frozen_rows(model: ByteModel, h_B1D, r0: int, cos, sin, cache: RowCache) -> None:
    """Every stream has halted before row r0: its state is frozen, so rows r0.. only need their
    keys and values for later characters. All of them in one pass (one read of the qkv weights),
    the rows standing in for positions (they share this character's rotary angle)."""
    B, _, D = h_B1D.shape
    R = model.cfg.max_rows - r0
    u_BRD = h_B1D + model.row_embed[r0:].to(h_B1D.dtype).unsqueeze(0)
    k, v = model.attn.qkv_heads(model.norm_attn(u_BRD), cos.expand(R, -1), sin.expand(R, -1), cache.kv_t)
    for i in range(R):
        cache.append(r0 + i, k[:, :, i:i + 1], v[:, :, i:i + 1])


def _step_impl(model: ByteModel, idx_B1: torch.Tensor, cache: RowCache) -> ModelOutput:
    """One new character per stream: its rows run against the cached rows of the characters
    before it. The pooled MLP sees one character, a single group of its top_k experts."""
    cfg, attn = model.cfg, model.attn
    h = model.embed_bytes(idx_B1, cache.prev_bytes(idx_B1))
    B, _, D = h.shape
    dev = h.device
    if cache.card is None:
        cache.card, admitted, _ = model.pool.admit(h.reshape(B, D), dev)
        cache.card_bias = model.pool.card_bias(admitted, dev)
    cos, sin = model.rotary_tables(1, dev, h.dtype, offset=cache.pos)
    active = torch.ones(B, 1, dtype=torch.bool, device=dev)
    cum = torch.zeros(B, 1, device=dev)
    rows_used = torch.zeros(B, 1, device=dev)
    out = torch.zeros_like(h)
    stats = []
    for r in range(cfg.max_rows):
        if not bool(active.any()):
            _frozen_rows(model, h, r, cos, sin, cache)
            break
        u = h + model.row_embed[r].to(h.dtype)
        q, k, v = attn.qkv_heads(model.norm_attn(u), cos, sin, cache.qkv_t)
        cache.append(r, k, v)
        y = F.scaled_dot_product_attention(q, *cache.keys_values(r))  # every cached position is earlier
        a = u + y.transpose(1, 2).reshape(B, 1, D) @ cache.proj_t
        new = a + model._mlp(model.norm_mlp(a), cache.card, active if cfg.adaptive_rows else None,
                             stats if cache.track_stats else None, cache.card_bias)
        rows_used = rows_used + active.float()
        if not cfg.adaptive_rows:
            h = new
            continue
        h = torch.where(active.unsqueeze(-1), new, h)
        active, cum, out, _ = model._halt(h, r, active, cum, out, cum)
    cache.pos += 1
    final = out if cfg.adaptive_rows else h
    return ModelOutput(logits=model.norm_out(final) @ cache.head_t, rows_used=rows_used, dispatch=stats)

