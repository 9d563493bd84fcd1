"""Corpora as bytes: the default (the Python standard library's own source, which every Python
install has) or --data PATH (a text file or a folder of them), split into train and held-out by
file, and random chunks drawn from one uint8 tensor. A folder is read as its text files
(folder_files: hidden entries, __pycache__ and files that are not text are skipped, and
counted); a file that is not text is refused unless data.binary allows it.

Legend: B batch, T context (bytes per chunk).
"""
from __future__ import annotations

import codecs
import hashlib
import json
import mmap
import os
import shlex
import sys
import sysconfig
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .config import DataConfig


class DataError(ValueError):
    """A corpus that cannot be used; the message says why and what to do."""


@dataclass
class Skipped:
    """What a folder held that is not read: files by the reason, and their bytes."""
    files: dict = field(default_factory=dict)  # reason -> files
    bytes: int = 0
    example: str = ""  # one file not read as text, for the message

    @property
    def total(self) -> int:
        return sum(self.files.values())

    def add(self, reason: str, n_files: int, n_bytes: int) -> None:
        if n_files:
            self.files[reason] = self.files.get(reason, 0) + n_files
            self.bytes += n_bytes

    def summary(self) -> str:
        why = ", ".join(f"{n:,} {reason}" for reason, n in self.files.items())
        hint = f" (e.g. {self.example}; --data-binary reads them too)" if self.example else ""
        return f"skipped {self.total:,} files ({self.bytes:,} bytes): {why}{hint}"

    def note(self, source: str) -> str | None:
        """One line saying what was skipped (None: nothing was)."""
        return f"minagi: {source}: {self.summary()}" if self.total else None


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 [bytes]
    heldout: torch.Tensor  # uint8 [bytes]
    source: str
    n_files: int
    n_heldout_files: int
    skipped: Skipped = field(default_factory=Skipped)

    def describe(self) -> str:
        return (f"{self.source}: {self.n_files} files, {self.train.numel():,} train bytes, "
                f"{self.heldout.numel():,} held-out bytes ({self.n_heldout_files} files)")


def stdlib_files() -> tuple[Path, list[Path]]:
    """The running interpreter's standard-library .py files, in a deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


TEXT_PROBE = 4096  # bytes of a file's head that decide whether it is text


def not_text(path: Path) -> str | None:
    """Why a file is not text (None: it is): a NUL byte, or bytes that are not UTF-8, in its
    first TEXT_PROBE bytes. A file that cannot be read is a DataError."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(TEXT_PROBE)
            whole = len(head) < TEXT_PROBE or not fh.read(1)
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    if b"\0" in head:
        return f"a NUL byte at offset {head.index(0):,}"
    try:  # a character cut by the probe's end is not an error; one cut by the file's end is
        codecs.getincrementaldecoder("utf-8")().decode(head, final=whole)
    except UnicodeDecodeError as exc:
        return f"not UTF-8 at offset {exc.start:,}"
    return None


def _skip_folder(path: Path, skipped: Skipped, reason: str) -> None:
    """Counts a folder that is not read (hidden, __pycache__): its files and bytes."""
    n_files = n_bytes = 0
    for dirpath, _, filenames in os.walk(path):
        for f in filenames:
            n_files += 1
            try:
                n_bytes += (Path(dirpath) / f).lstat().st_size
            except OSError:
                pass
    skipped.add(reason, n_files, n_bytes)


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def folder_files(root: Path, binary: bool = False) -> tuple[list[Path], Skipped]:
    """A folder's files to read, in path order, and what it skipped: hidden files and folders,
    __pycache__ folders, and (unless binary) files that are not text (not_text)."""
    files, skipped = [], Skipped()
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            if d.startswith(".") or d == "__pycache__":
                _skip_folder(Path(dirpath) / d, skipped, "in __pycache__" if d == "__pycache__" else "hidden")
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for f in sorted(filenames):
            path = Path(dirpath) / f
            if f.startswith("."):
                skipped.add("hidden", 1, _size(path))
            elif not binary and not_text(path):
                skipped.add("not text", 1, _size(path))
                skipped.example = skipped.example or path.relative_to(root).as_posix()
            else:
                files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix()), skipped


def check_text(path: Path, binary: bool = False) -> None:
    """A file given as --data: refused where it is not text, unless binary allows it."""
    why = None if binary else not_text(path)
    if why:
        raise DataError(f"{path} is not text ({why} in its first {TEXT_PROBE:,} bytes); training on it "
                        "would model its binary bytes. Give a text file or folder, or pass --data-binary "
                        "(data.binary=true) to use it as it is")


def min_bytes(context: int, heldout_every: int) -> int:
    """The smallest corpus that is sure to train: a chunk of context + 1 bytes on each side of
    the split, the held-out side 1 / heldout_every of it."""
    return (context + 1) * (heldout_every + 1)


def how_big(context: int, heldout_every: int) -> str:
    return (f"give at least {min_bytes(context, heldout_every):,} bytes of text in all (a chunk of "
            f"data.context + 1 = {context + 1:,} bytes on each side of the held-out split, which holds out "
            f"1 / data.heldout_every = 1 / {heldout_every}), or lower data.context")


def is_heldout(relpath: str, every: int) -> bool:
    """Every `every`-th file by a stable hash of its relative path (the same on every machine)."""
    return zlib.crc32(relpath.encode("utf-8")) % every == 0


@dataclass
class Plan:
    """A raw corpus's files and its split, known from the files' sizes alone: by file (held-out
    files by a stable hash of their relative path), or, where that leaves one side empty, the
    last 1 / every of all bytes held out (cut: the offset in the files' concatenation)."""
    root: Path
    files: list
    sizes: list
    held: list  # per file, held out by the hash split
    cut: int | None  # None: the split is by file
    source: str
    skipped: Skipped = field(default_factory=Skipped)  # what the folder held that is not read

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def side_sizes(self) -> tuple[int, int]:
        if self.cut is not None:
            return self.cut, self.total - self.cut
        held = sum(n for n, h in zip(self.sizes, self.held) if h)
        return self.total - held, held

    def pieces(self):
        """(file, offset in it, length, side) in order, side 0 train and 1 held out: the bytes
        of each side, concatenated in file order, are that side's corpus."""
        pos = 0
        for f, n, h in zip(self.files, self.sizes, self.held):
            if self.cut is None:
                yield f, 0, n, int(h)
            else:
                head = max(0, min(n, self.cut - pos))
                if head:
                    yield f, 0, head, 0
                if n - head:
                    yield f, head, n - head, 1
            pos += n

    def digest(self) -> str:
        h = hashlib.sha256()
        for f, n in zip(self.files, self.sizes):
            h.update(f"{f.relative_to(self.root).as_posix()}\t{n}\n".encode("utf-8"))
        return h.hexdigest()

    def n_heldout_files(self) -> int:
        return 0 if self.cut is not None else sum(self.held)


def plan(path: str = "", heldout_every: int = 20, binary: bool = False,
         context: int = DataConfig.context) -> Plan:
    """The files of --data PATH (the standard library's without one) and their split. binary:
    read files that are not text too; context: the chunk an empty corpus's message sizes."""
    skipped = Skipped()
    if not path:
        root, files = stdlib_files()
        source = f"Python {'.'.join(map(str, sys.version_info[:3]))} standard library ({root})"
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise DataError(f"--data {path}: no such file or folder")
        if p.is_file():
            check_text(p, binary)
            root, files = p.parent, [p]
        else:
            root, (files, skipped) = p, folder_files(p, binary)
        source = str(p)
    if not files:
        why = skipped.summary() if skipped.total else "an empty folder"
        raise DataError(f"{source}: no text files to read ({why}); {how_big(context, heldout_every)}")
    sizes = []
    for f in files:
        try:
            sizes.append(f.stat().st_size)
        except OSError as exc:
            raise DataError(f"{f}: cannot be read ({exc.strerror or exc})") from None
    held = [is_heldout(f.relative_to(root).as_posix(), heldout_every) for f in files]
    result = Plan(root, files, sizes, held, None, source, skipped)
    train_n, held_n = result.side_sizes()
    if train_n == 0 or held_n == 0:
        result.cut = result.total - result.total // heldout_every
    if result.total == 0:
        raise DataError(f"{source}: the corpus is empty (0 bytes); {how_big(context, heldout_every)}")
    return result


def _read_into(f: Path, offset: int, view: memoryview) -> None:
    try:
        with open(f, "rb") as fh:
            fh.seek(offset)
            got = fh.readinto(view)
    except OSError as exc:
        raise DataError(f"{f}: cannot be read ({exc.strerror or exc})") from None
    if got != len(view):
        raise DataError(f"{f} changed while it was read ({got:,} of {len(view):,} bytes); read it again")


def _read_in_memory(p: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides read straight into their final buffers: one copy of the corpus, no more."""
    bufs = [torch.empty(n, dtype=torch.uint8) for n in p.side_sizes()]
    views = [memoryview(b.numpy()) if b.numel() else memoryview(b"") for b in bufs]
    at = [0, 0]
    for f, offset, n, side in p.pieces():
        _read_into(f, offset, views[side][at[side]:at[side] + n])
        at[side] += n
    return bufs[0], bufs[1]


def load_corpus(path: str = "", heldout_every: int = 20, max_in_memory: int = 2 << 30, binary: bool = False,
                context: int = DataConfig.context) -> Corpus:
    """Train / held-out split by file. A single file (or a folder whose hash split leaves one side
    empty) holds out its last 1 / heldout_every of bytes instead. A prepared folder (its
    corpus.json; python train.py prepare) is read from disk as batches need it; a raw
    corpus larger than max_in_memory bytes is an error that says how to prepare it. binary and
    context: as plan's."""
    if path and (Path(path).expanduser() / META).exists():
        return open_prepared(path)
    p = plan(path, heldout_every, binary, context)
    if p.total > max_in_memory:
        src = shlex.quote(str(path))
        raise DataError(f"{p.source}: {p.total:,} bytes is more than data.max_in_memory = {max_in_memory:,}; "
                        f"prepare it once and train on the prepared folder, which is read from disk as "
                        f"needed: python train.py prepare {src} {shlex.quote(str(path).rstrip('/') + '.prepared')} "
                        f"(then --data {shlex.quote(str(path).rstrip('/') + '.prepared')})")
    train, heldout = _read_in_memory(p)
    return Corpus(train=train, heldout=heldout, source=p.source, n_files=len(p.files),
                  n_heldout_files=p.n_heldout_files(), skipped=p.skipped)


def run_corpus(d: DataConfig, path: str | None = None) -> Corpus:
    """A run's corpus (path, else its own data.path) with the run's data settings, checked to
    hold a chunk on each side of the split: what eval and routes score."""
    if path is None and d.path and not Path(d.path).expanduser().exists():
        raise DataError(f"the run's own corpus {d.path} (its data.path) is not there any more; "
                        "give the text to score with --data PATH")
    corpus = load_corpus(d.path if path is None else path, d.heldout_every, d.max_in_memory, d.binary, d.context)
    check_fits(corpus, d.context, d.heldout_every)
    return corpus


# --- prepared corpora: python train.py prepare SRC OUT ---------------------------------------

META = "corpus.json"
FORMAT = "minagi-corpus"
VERSION = 1
BINS = ("train.bin", "heldout.bin")
BLOCK = 8 << 20  # bytes read and written at a time: prepare's memory does not grow with the corpus


def prepare(src: str, out, heldout_every: int = 20, force: bool = False, progress=None, binary: bool = False) -> dict:
    """Write OUT/train.bin, OUT/heldout.bin and OUT/corpus.json from a raw corpus, with the split
    load_corpus would make (binary: as plan's). Streamed in blocks; written under temporary names
    and renamed at the end, corpus.json last, so a folder with a corpus.json is always complete."""
    out = Path(out).expanduser()
    if out.exists() and not out.is_dir():
        raise DataError(f"prepare: {out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not force:
        raise DataError(f"prepare: {out} is not empty; choose an empty folder, or pass --force to replace "
                        "what a prepared corpus holds there")
    p = plan(src, heldout_every, binary)
    out.mkdir(parents=True, exist_ok=True)
    (out / META).unlink(missing_ok=True)  # from here until the end the folder is not a corpus
    tmps = [out / f".{name}.tmp" for name in BINS]
    done = 0
    try:
        sinks = [open(t, "wb") for t in tmps]
        try:
            for f, offset, n, side in p.pieces():
                try:
                    fh = open(f, "rb")
                except OSError as exc:
                    raise DataError(f"{f}: cannot be read ({exc.strerror or exc})") from None
                with fh:
                    fh.seek(offset)
                    left = n
                    while left:
                        block = fh.read(min(BLOCK, left))
                        if not block:
                            raise DataError(f"{f} changed while it was read; prepare again")
                        sinks[side].write(block)
                        left -= len(block)
                        done += len(block)
                        if progress is not None:
                            progress(done, p.total)
            for s in sinks:
                s.flush()
                os.fsync(s.fileno())
        finally:
            for s in sinks:
                s.close()
        for t, name in zip(tmps, BINS):
            os.replace(t, out / name)
    except BaseException:
        for t in tmps:
            t.unlink(missing_ok=True)
        raise
    train_n, held_n = p.side_sizes()
    meta = {"format": FORMAT, "version": VERSION, "source": p.source, "train_bytes": train_n,
            "heldout_bytes": held_n, "files": len(p.files), "heldout_files": p.n_heldout_files(),
            "heldout_every": heldout_every, "split": "tail" if p.cut is not None else "by-file",
            "digest": p.digest(), "skipped_files": p.skipped.total, "skipped_bytes": p.skipped.bytes,
            "skipped": p.skipped.note(p.source)}
    tmp = out / f".{META}.tmp"
    tmp.write_text(json.dumps(meta, indent=1))
    os.replace(tmp, out / META)
    return meta


def read_meta(folder) -> dict:
    path = Path(folder).expanduser() / META
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"{folder}: no {META}: not a prepared corpus (python train.py prepare SRC {folder})") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path} cannot be read ({exc}); prepare the corpus again") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DataError(f"{path} is not a minagi corpus description; prepare the corpus again")
    if meta.get("version") != VERSION:
        raise DataError(f"{path} has format version {meta.get('version')!r}; this minagi reads version {VERSION}: "
                        "prepare the corpus again with this version")
    return meta


class FileBytes:
    """A prepared corpus file, memory-mapped read-only for each gather and unmapped after it.
    Batches copy their chunks straight out of the map, so nothing copies the corpus, and every
    process on the machine reads the operating system's one cached copy (the page cache). The map
    lives for one gather only (nanoGPT's habit): a map held for the whole run kept every page it
    had touched in the process's resident memory (~1.4 GB after 200 steps on a 2 GB corpus, the
    kernel mapping the pages around each fault, readahead off or not), where one per gather
    leaves resident memory flat."""

    def __init__(self, path: Path, n: int):
        self.path, self.n = Path(path), n
        self._file = open(path, "rb")

    def numel(self) -> int:
        return self.n

    def chunks(self, starts, length: int) -> torch.Tensor:
        """uint8 [len(starts), length]: the bytes from each start."""
        starts = np.asarray(starts.tolist() if isinstance(starts, torch.Tensor) else starts, dtype=np.int64)
        end = int(starts.max()) + length if starts.size else 0
        if end > self.n:
            raise DataError(f"{self.path}: chunk at {end - length:,} + {length:,} bytes is past its {self.n:,} bytes")
        if os.fstat(self._file.fileno()).st_size < self.n:  # a map past the end would die with SIGBUS
            raise DataError(f"{self.path} is shorter than it was: copy or prepare it again")
        if not starts.size or not length:
            return torch.empty(len(starts), length, dtype=torch.uint8)
        with mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) as m:
            view = np.frombuffer(m, dtype=np.uint8, count=self.n)
            try:
                out = view[starts[:, None] + np.arange(length)]  # a copy: the map can go
            finally:
                del view  # the map closes only once nothing looks into it
        return torch.from_numpy(out)

    def read(self) -> torch.Tensor:
        """All of it, in memory."""
        out = torch.empty(self.n, dtype=torch.uint8)
        if self.n:
            _read_into(self.path, 0, memoryview(out.numpy()))
        return out


def take(data, starts_B: torch.Tensor, length: int) -> torch.Tensor:
    """uint8 [B, length]: the chunks of `data` (a tensor or a FileBytes) from each start."""
    if isinstance(data, FileBytes):
        return data.chunks(starts_B, length)
    return data[starts_B.unsqueeze(1) + torch.arange(length)]


def open_prepared(folder) -> Corpus:
    """A prepared corpus, read from disk as batches need it (FileBytes): nothing is read until a
    batch gathers its bytes, and every process on the machine shares the operating system's one
    cached copy."""
    folder = Path(folder).expanduser()
    meta = read_meta(folder)
    sides = []
    for name, key in zip(BINS, ("train_bytes", "heldout_bytes")):
        path, want = folder / name, int(meta[key])
        have = path.stat().st_size if path.exists() else None
        if have != want:
            raise DataError(f"{path} holds {'no file' if have is None else f'{have:,} bytes'} but {META} says "
                            f"{want:,}: a truncated or partial copy; copy or prepare the corpus again")
        sides.append(FileBytes(path, want) if want else torch.empty(0, dtype=torch.uint8))
    return Corpus(train=sides[0], heldout=sides[1], source=f"{folder} (prepared from {meta['source']})",
                  n_files=int(meta["files"]), n_heldout_files=int(meta["heldout_files"]))


def check_fits(corpus: Corpus, context: int, heldout_every: int = DataConfig.heldout_every) -> None:
    need = context + 1
    for name, data in (("training", corpus.train), ("held-out", corpus.heldout)):
        if data.numel() < need:
            total = corpus.train.numel() + corpus.heldout.numel()
            raise DataError(
                f"{corpus.source}: {data.numel():,} bytes of {name} text (of {total:,}), but one chunk needs "
                f"data.context + 1 = {need:,} bytes; {how_big(context, heldout_every)}")


class Batches:
    """Random chunks of context + 1 bytes drawn with the run's own generator, whose state is the
    data position a checkpoint saves.

    Under data parallelism every rank draws the whole step's starts from the same generator
    (seeded by train.seed) and takes its own share (the rank's place in the stream), so the
    ranks' chunks together are exactly the chunks one process would train on with the global
    batch, and the data position is one generator state for every rank and world size."""

    def __init__(self, data: torch.Tensor, context: int, batch: int, seed: int, *, rank: int = 0,
                 world: int = 1, accum: int = 1):
        self.data, self.context, self.batch = data, context, batch
        self.rank, self.world, self.accum = rank, world, accum
        self.generator = torch.Generator().manual_seed(seed)

    def next(self):
        """(inputs, targets) [batch, context]: one process, one micro-batch per step."""
        return self.next_step()[0]

    def next_step(self) -> list:
        """This rank's accum micro-batches of one optimizer step, each (inputs, targets) [batch,
        context]: the step draws batch x accum x world starts, [world, accum, batch] in order."""
        start_WAB = torch.randint(0, self.data.numel() - self.context, (self.world * self.accum * self.batch,),
                                  generator=self.generator).view(self.world, self.accum, self.batch)
        micro = []
        for start_B in start_WAB[self.rank]:
            chunk_BT = take(self.data, start_B, self.context + 1).long()
            micro.append((chunk_BT[:, :-1], chunk_BT[:, 1:]))
        return micro

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def fixed_chunks(data: torch.Tensor, context: int, n: int, seed: int):
    """The same n held-out chunks for every evaluation of a run: (inputs, targets), [n, T]."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, data.numel() - context, (n,), generator=g)
    chunk = take(data, start, context + 1).long()
    return chunk[:, :-1], chunk[:, 1:]
