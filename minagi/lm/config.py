"""Typed configuration: profiles in TOML (sections [model], [train], [data]) loaded into
dataclasses, `--set section.key=value` overrides checked against the fields' types, unknown keys
rejected with the close matches named. The resolved config travels with every checkpoint."""
from __future__ import annotations

import difflib
from importlib import resources
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

DEFAULT_PROFILE = "cpu-tiny"
# minagi.moe.reference.ACTIVATIONS (config stays below torch: the names only)
_ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu2", "swiglu", "swiglu_interleaved", "swiglu_oai")


class ConfigError(ValueError):
    """A profile, key or value that cannot be used; the message says which and what to do."""


@dataclass
class ModelConfig:
    d_model: int = 128
    n_heads: int = 4
    max_rows: int = 4  # applications of the shared block
    d_hidden: int = 256  # expert MLP width
    n_pool: int = 16  # experts in the pool
    n_slots: int = 16  # experts on the card each step (<= n_pool)
    top_k: int = 2
    capacity_factor: float = 0.0  # 0 = uncapped
    adaptive_rows: bool = True  # ACT-style halting per character
    ponder_cost: float = 0.01  # weight of rows used in the loss
    halt_epsilon: float = 0.01  # a character halts once its halting sum reaches 1 - epsilon
    # A pair's gate: "chosen" = softmax over the top_k chosen slots' logits (they sum to 1; with
    # top_k = 1 the gate is 1 and the loss never reaches the router); "all" = softmax over every
    # card slot, taken at the chosen ones (Switch Transformer): the loss teaches the choice.
    gates: str = "chosen"
    balance: str = "admission"  # the balance term (minagi.lm.balance.BALANCE_TERMS)
    balance_coef: float = 0.01
    bias_rate: float = 1e-3  # balance = "bias": how far a routing bias moves per step
    dispatch: str = "auto"  # expert_mlp path
    # The experts' form (minagi.moe.reference.ACTIVATIONS): "gelu", or e.g. "swiglu", whose w_in is
    # [d, 2 x d_hidden] (gate and up): 1.5x gelu's multiply-adds at the same d_hidden.
    expert_activation: str = "gelu"
    dtype: str = "float32"  # float32 | bfloat16 (autocast on GPUs)
    pool_device: str = ""  # "" = the compute device; "cpu" keeps the pool in host memory
    rope_base: float = 10000.0
    # Input n-grams: the embedding of each byte plus, for each order 2..ngram, a hashed embedding
    # of the last that-many bytes (ngram_buckets rows per order). 1 = the byte alone.
    ngram: int = 1
    ngram_buckets: int = 8191
    # Pad each row's active characters to _bucket sizes (zero rows, masked out of every result):
    # few sizes keep the allocator's heap from fragmenting, so resident memory stays flat.
    bucket_rows: bool = True


@dataclass
class TrainConfig:
    steps: int = 600
    batch: int = 16
    lr: float = 3e-3
    min_lr_frac: float = 0.1  # cosine decays to lr * min_lr_frac
    warmup: int = 30
    weight_decay: float = 0.1
    # Whether the hashed n-gram tables decay too (they are embeddings; the dense GPT of the
    # quality bench exempts its own). docs/quality.md has the study.
    ngram_decay: bool = True
    # The pool's learning rate is lr x pool_lr_scale: each expert sees only its share of the
    # characters (about top_k / n_slots), so it may want a different step than the shared weights.
    pool_lr_scale: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_chunks: int = 32  # fixed held-out chunks per evaluation
    checkpoint_every: int = 200
    seed: int = 1337
    device: str = "auto"  # auto | cpu | cuda
    threads: int = 0  # torch CPU threads; 0 = every core (under torchrun: the cores / the ranks on this machine)
    # torch.compile the model for training's forward and backward (docs/training.md, "Compiled
    # training"); held-out scoring and writing stay eager.
    compile: bool = False
    # Micro-batches per optimizer step: the gradients of grad_accum batches are averaged into one
    # step (under torchrun, synchronised across ranks on the last only). The global batch is
    # batch x grad_accum x the ranks.
    grad_accum: int = 1
    # Under torchrun: seconds a collective waits for the other ranks before it fails (a rank that
    # died or hangs stops the run with torch's timeout error instead of a silent hang).
    dist_timeout: float = 300.0
    # Under torchrun: the pool's experts sharded over groups of this many ranks (expert
    # parallelism; each rank holds n_pool / expert_parallel experts, and the characters travel to
    # them by all_to_all); data parallelism across the groups. 1 = off.
    expert_parallel: int = 1
    # Consecutive steps with a non-finite loss or gradient norm (each skipped) before the run
    # stops with exit status 3; 0 turns the guard off.
    max_bad_steps: int = 10
    # glibc's malloc_trim every this many steps (0 = never), for profiles whose heap grows.
    malloc_trim_every: int = 0


@dataclass
class DataConfig:
    context: int = 128  # bytes per chunk
    path: str = ""  # "" = the Python standard library's source
    heldout_every: int = 20  # every 20th file (by a stable hash of its path) is held out
    # A raw corpus larger than this many bytes is not read into memory: prepare it (python
    # train.py prepare SRC OUT) and train on the prepared folder, read from disk as batches need it.
    max_in_memory: int = 2 << 30
    # Read files that are not text (a NUL byte, or bytes that are not UTF-8, in the first 4 KiB):
    # a file given as data.path is otherwise refused, and a folder's are skipped (--data-binary).
    binary: bool = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    profile: str = DEFAULT_PROFILE

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        cfg = cls(profile=d.get("profile", DEFAULT_PROFILE))
        for section in SECTIONS:
            for key, value in d.get(section, {}).items():
                _set(cfg, section, key, value, source="checkpoint")
        return cfg


SECTIONS = ("model", "train", "data")


def _section(cfg: Config, name: str):
    if name not in SECTIONS:
        raise ConfigError(f"unknown section {name!r}; the sections are {', '.join(SECTIONS)}")
    return getattr(cfg, name)


def _close(word: str, choices) -> str:
    near = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.5)
    return f" (did you mean {', '.join(near)}?)" if near else ""


def _coerce(value, typ: str, where: str):
    """Value of the field's type, from TOML (typed) or from --set (a string)."""
    if typ == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
    elif typ == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
    elif typ == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif typ == "str":
        if isinstance(value, str):
            return value
    raise ConfigError(f"{where} must be {'a ' + typ if typ != 'int' else 'an int'}, got {value!r}")


def _set(cfg: Config, section: str, key: str, value, source: str) -> None:
    sec = _section(cfg, section)
    types = {f.name: f.type for f in fields(sec)}
    if key not in types:
        raise ConfigError(f"unknown key {section}.{key} in {source}{_close(key, types)}; "
                          f"the keys of [{section}] are {', '.join(types)}")
    setattr(sec, key, _coerce(value, types[key], f"{section}.{key} (from {source})"))


def _packaged(name: str):
    """A profile shipped in the package (minagi/lm/profiles/NAME.toml), found from any install."""
    return resources.files("minagi.lm").joinpath("profiles", f"{name}.toml")


def profile_names() -> list[str]:
    folder = resources.files("minagi.lm").joinpath("profiles")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def profile_path(name: str):
    """A .toml path as given, else the packaged profile of that name (a Traversable)."""
    p = Path(name)
    if p.suffix == ".toml":
        if not p.is_file():
            raise ConfigError(f"profile file {name} does not exist")
        return p
    packaged = _packaged(name)
    if not packaged.is_file():
        names = profile_names()
        raise ConfigError(f"unknown profile {name!r}{_close(name, names)}; the profiles are {', '.join(names)} "
                          "(or give a path to a .toml file)")
    return packaged


def load(profile: str = DEFAULT_PROFILE, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The profile's config with `section.key=value` overrides applied, checked by validate().
    A field the profile does not set comes from its base profile (`base = "cpu-tiny"` at the top
    of the file), else from the dataclasses' defaults above."""
    path = profile_path(profile)
    cfg = Config(profile=path.name.removesuffix(".toml"))
    _apply_profile(cfg, path, chain=())
    apply_overrides(cfg, overrides)
    validate(cfg)
    return cfg


def _apply_profile(cfg: Config, path, chain: tuple) -> None:
    """Set the fields of the profile at `path` on cfg, after those of its base (if it names one)."""
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"profile {path} is not valid TOML: {exc}") from exc
    if "base" in raw:
        _apply_profile(cfg, _base_path(raw.pop("base"), path, chain), (*chain, str(path)))
    for section, table in raw.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: top-level key {section!r} must be a [section]{_close(section, SECTIONS)} "
                              "(or base = \"PROFILE\")")
        _section(cfg, section)
        for key, value in table.items():
            _set(cfg, section, key, value, source=str(path.name))


def _base_path(base, path, chain: tuple):
    """The profile a `base = ...` line names: a packaged name, or a .toml path (relative to the
    profile that names it)."""
    if not isinstance(base, str):
        raise ConfigError(f"{path.name}: base must be a profile name or a .toml path in quotes, got {base!r}")
    given = base
    if base.endswith(".toml") and not Path(base).is_absolute() and isinstance(path, Path):
        base = str(path.parent / base)
    try:
        found = profile_path(base)
    except ConfigError as exc:
        raise ConfigError(f"{path.name}: base = {given!r}: {exc}") from None
    if str(found) in (*chain, str(path)):
        raise ConfigError(f"{path.name}: base = {given!r} leads back to itself; one of the profiles must not name a base")
    return found


def apply_overrides(cfg: Config, overrides) -> None:
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set takes section.key=value (for example model.top_k=4), got {item!r}")
        dotted, value = item.split("=", 1)
        section, key = dotted.strip().split(".", 1)
        _set(cfg, section, key, value.strip(), source="--set")


def validate(cfg: Config) -> None:
    m, t, d = cfg.model, cfg.train, cfg.data
    checks = [
        (m.d_model > 0 and m.d_model % m.n_heads == 0, f"model.d_model ({m.d_model}) must be a positive multiple of model.n_heads ({m.n_heads})"),
        ((m.d_model // max(m.n_heads, 1)) % 2 == 0, "model.d_model / model.n_heads must be even (rotary positions rotate pairs)"),
        (m.max_rows >= 1, "model.max_rows must be >= 1"),
        (m.d_hidden >= 1, "model.d_hidden must be >= 1"),
        (1 <= m.n_slots <= m.n_pool, f"model.n_slots ({m.n_slots}) must be in [1, model.n_pool = {m.n_pool}]"),
        (1 <= m.top_k <= m.n_slots, f"model.top_k ({m.top_k}) must be in [1, model.n_slots = {m.n_slots}]"),
        (m.bias_rate >= 0, "model.bias_rate must be >= 0"),
        (m.capacity_factor >= 0, "model.capacity_factor must be >= 0 (0 = uncapped)"),
        (0 < m.halt_epsilon < 1, "model.halt_epsilon must be in (0, 1)"),
        (1 <= m.ngram <= 4, f"model.ngram must be in [1, 4] (1 = bytes alone), got {m.ngram}"),
        (m.ngram == 1 or m.ngram_buckets >= 1, "model.ngram_buckets must be >= 1"),
        (m.gates in ("chosen", "all"), f"model.gates must be chosen or all, got {m.gates!r}"),
        (m.expert_activation in _ACTIVATIONS, f"model.expert_activation must be one of {', '.join(_ACTIVATIONS)}, "
         f"got {m.expert_activation!r}"),
        (m.dtype in ("float32", "bfloat16"), f"model.dtype must be float32 or bfloat16, got {m.dtype!r}"),
        (m.dispatch in ("auto", "rectangle", "grouped", "compiled"), f"model.dispatch must be auto, rectangle, grouped or compiled, got {m.dispatch!r}"),
        (t.steps >= 1, f"train.steps must be >= 1 (the run's length in optimizer steps; --steps N sets it), "
         f"got {t.steps}"),
        (t.batch >= 1, f"train.batch must be >= 1 (chunks per micro-batch), got {t.batch}"),
        (t.lr > 0 and 0 <= t.min_lr_frac <= 1, "train.lr must be > 0 and train.min_lr_frac in [0, 1]"),
        (t.pool_lr_scale > 0, f"train.pool_lr_scale must be > 0 (the pool's lr is lr x it), got {t.pool_lr_scale}"),
        (t.eval_every >= 1 and t.checkpoint_every >= 1 and t.eval_chunks >= 1, "train.eval_every, train.checkpoint_every and train.eval_chunks must be >= 1"),
        (t.grad_accum >= 1, "train.grad_accum must be >= 1 (micro-batches per optimizer step)"),
        (t.dist_timeout > 0, "train.dist_timeout must be > 0 (seconds)"),
        (t.expert_parallel >= 1, "train.expert_parallel must be >= 1 (1 = off)"),
        (t.expert_parallel == 1 or m.n_slots == m.n_pool, f"train.expert_parallel = {t.expert_parallel} needs the whole pool "
         f"on the card: model.n_slots ({m.n_slots}) must equal model.n_pool ({m.n_pool})"),
        (m.n_pool % t.expert_parallel == 0, f"train.expert_parallel = {t.expert_parallel} must divide model.n_pool ({m.n_pool})"),
        (t.expert_parallel == 1 or m.capacity_factor == 0, "train.expert_parallel needs model.capacity_factor = 0 (uncapped)"),
        (t.expert_parallel == 1 or not m.pool_device, "train.expert_parallel needs model.pool_device empty"),
        (t.malloc_trim_every >= 0, "train.malloc_trim_every must be >= 0 (0 = never)"),
        (t.max_bad_steps >= 0, "train.max_bad_steps must be >= 0 (0 turns the divergence guard off)"),
        (t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:"), f"train.device must be auto, cpu or cuda, got {t.device!r}"),
        (d.context >= 2, "data.context must be >= 2"),
        (d.heldout_every >= 2, "data.heldout_every must be >= 2"),
        (d.max_in_memory >= 0, "data.max_in_memory must be >= 0 (bytes)"),
    ]
    from .balance import BALANCE_TERMS

    checks.append((m.balance in BALANCE_TERMS, f"model.balance must be one of {', '.join(BALANCE_TERMS)}, got {m.balance!r}"))
    for ok, msg in checks:
        if not ok:
            raise ConfigError(msg)
