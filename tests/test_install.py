"""Installing like a library: profiles shipped in the package, the minagi command and its
subcommands, and the message when a source tree shadows an installed build. (CI also builds a
wheel, installs it in a fresh venv and trains from an empty folder: .ci/run.)"""
import argparse
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

from minagi.moe import _backend

from minagi.lm import config
from minagi.lm.prog import shows_default

ROOT = Path(__file__).resolve().parent.parent
SUBCOMMANDS = ["train", "write", "eval", "plot", "routes", "bench"]


def test_profiles_come_from_the_package():
    packaged = resources.files("minagi.lm").joinpath("profiles")
    assert set(config.profile_names()) >= {"cpu-tiny", "cpu-small", "strix-small", "strix-large"}
    path = config.profile_path("cpu-tiny")
    assert path.is_file() and path.read_text() == packaged.joinpath("cpu-tiny.toml").read_text()
    assert Path(str(path)).resolve().parent == Path(config.__file__).resolve().parent / "profiles"
    assert config.load().profile == "cpu-tiny"


def test_a_profile_path_still_works(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text('[model]\ntop_k = 1\n[train]\nsteps = 7\n')
    cfg = config.load(str(mine))
    assert (cfg.profile, cfg.model.top_k, cfg.train.steps) == ("mine", 1, 7)
    with pytest.raises(config.ConfigError, match="does not exist"):
        config.load(str(tmp_path / "missing.toml"))
    with pytest.raises(config.ConfigError, match=r"unknown profile 'cpu-tinyy' \(did you mean cpu-tiny"):
        config.load("cpu-tinyy")


def test_a_profile_names_its_base(tmp_path):
    mine = tmp_path / "mine.toml"
    mine.write_text('base = "cpu-tiny"\n[model]\ntop_k = 4\n')
    cfg, tiny = config.load(str(mine)), config.load("cpu-tiny")
    assert (cfg.profile, cfg.model.top_k) == ("mine", 4)
    assert cfg.model.ngram == tiny.model.ngram and cfg.train.steps == tiny.train.steps  # the rest from the base
    (tmp_path / "more.toml").write_text('base = "mine.toml"\n[train]\nsteps = 9\n')  # a path, from the file's folder
    more = config.load(str(tmp_path / "more.toml"))
    assert (more.model.top_k, more.model.ngram, more.train.steps) == (4, tiny.model.ngram, 9)
    mine.write_text('[model]\ntop_k = 4\n')  # no base: the dataclasses' defaults
    assert config.load(str(mine)).model.ngram == config.ModelConfig().ngram


@pytest.mark.parametrize("base,message", [
    ('"cpu-tinyy"', r"mine.toml: base = 'cpu-tinyy': unknown profile 'cpu-tinyy' \(did you mean cpu-tiny"),
    ('"mine.toml"', r"mine.toml: base = 'mine.toml' leads back to itself"),
    ("4", r"mine.toml: base must be a profile name or a .toml path in quotes, got 4"),
])
def test_a_bad_base_is_one_line(tmp_path, base, message):
    (tmp_path / "mine.toml").write_text(f"base = {base}\n")
    with pytest.raises(config.ConfigError, match=message) as info:
        config.load(str(tmp_path / "mine.toml"))
    assert "\n" not in str(info.value)


def _parser_of(monkeypatch, command, argv=()):
    """The ArgumentParser a command builds, caught as it parses."""
    caught = []

    def catch(self, args=None, namespace=None):
        caught.append(self)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    with pytest.raises(SystemExit):
        command(list(argv))
    return caught[0]


def _commands():
    from minagi.lm import cli
    from minagi.bench.__main__ import entry
    from minagi.lm.prog import BENCHES

    found = {"train": lambda argv: cli.train_parser().parse_args(argv)}
    found.update(cli.COMMANDS)
    found.update({f"bench {name}": entry(name) for name in BENCHES})
    return found


@pytest.mark.parametrize("name", list(_commands()))
def test_every_option_has_a_help_line_and_its_default(monkeypatch, name):
    parser = _parser_of(monkeypatch, _commands()[name])
    formatter = parser._get_formatter()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        where = f"{name} {'/'.join(action.option_strings) or action.dest}"
        assert action.help, f"{where} has no help line"
        assert not shows_default(action) or "default" in formatter._get_help_string(action), \
            f"{where} does not show its default"


def test_the_top_level_help_names_every_command_and_bench():
    from minagi.lm import cli
    from minagi.__main__ import commands, usage
    from minagi.lm.prog import BENCHES

    for text in (cli.train_parser().format_help(), usage("minagi")):
        for name in [*cli.COMMANDS, *BENCHES]:
            assert f"\n  {name} " in text, f"{name} missing from the help"
    assert all(f"\n  {name} " in usage("minagi") for name in commands())


@pytest.mark.parametrize("cmd", SUBCOMMANDS)
def test_every_subcommand_has_help(cmd, capsys):
    from minagi.__main__ import main

    try:
        rc = main([cmd, "--help"])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr().out
    assert rc in (0, None) and "usage:" in out
    if cmd != "bench":
        assert f"python -m minagi {cmd}" in out  # the usage line names the command as it was called


@pytest.mark.slow  # the script's own process: outside the core's fast tier
def test_the_minagi_command():
    exe = shutil.which("minagi", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("no minagi script next to this python (the project is not pip-installed here)")
    r = subprocess.run([exe, "write", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "usage: minagi write" in r.stdout
    r = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "routes" in r.stderr and "doctor" in r.stderr
    r = subprocess.run([exe, "trian"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "did you mean train" in r.stderr


class _FakeDist:
    """importlib.metadata's view of a minagi installed in site-packages, with its extension."""

    def __init__(self, site):
        self.site = site
        from importlib.metadata import PackagePath
        self.files = [PackagePath("minagi/__init__.py"), PackagePath("minagi/_C.cpython-311-x86_64-linux-gnu.so")]

    def locate_file(self, f):
        return self.site / f


def test_shadowed_install_is_named(tmp_path, monkeypatch):
    (tmp_path / "minagi").mkdir()
    (tmp_path / "minagi" / "_C.cpython-311-x86_64-linux-gnu.so").write_bytes(b"")
    monkeypatch.setattr(_backend.metadata, "distribution", lambda name: _FakeDist(tmp_path))

    def no_extension(name):
        raise ModuleNotFoundError("No module named 'minagi._C'")

    monkeypatch.setattr(_backend.importlib, "import_module", no_extension)
    monkeypatch.delenv("MINAGI_DISABLE_EXT", raising=False)
    st = _backend._try_load()
    assert not st.loaded and "shadows the installed build in" in st.reason and str(tmp_path / "minagi") in st.reason
    assert "run from another directory" in st.reason
    # An editable install (no _C among its files) or none at all: the plain message.
    monkeypatch.setattr(_backend.metadata, "distribution", lambda name: (_ for _ in ()).throw(ImportError()))
    assert "shadows" not in _backend._try_load().reason


def _setup_build_class():
    """setup.py's build_ext class, taken from the file (importing setup.py would run setup())."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_build_ext_class")
    ns = {"os": __import__("os"), "sys": sys, "shutil": shutil}
    exec(compile(ast.Module([fn], []), str(ROOT / "setup.py"), "exec"), ns)
    from setuptools import Distribution

    cmd = ns["_build_ext_class"]()(Distribution())
    cmd.force = True  # copy whatever the files' times (setuptools skips a target newer than its source)
    return cmd


def _setup_module():
    """setup.py's definitions, without its last statement (the call of setup(), which builds)."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                                          and getattr(n.value.func, "id", "") == "setup")]
    ns = {"__file__": str(ROOT / "setup.py"), "__name__": "minagi_setup"}
    exec(compile(ast.Module(body, []), str(ROOT / "setup.py"), "exec"), ns)
    return ns


def _project(root: Path) -> Path:
    (root / "csrc" / "cpu").mkdir(parents=True)
    (root / "setup.py").write_text("setup()\n")
    (root / "csrc" / "ops.cpp").write_text("int f();\n")
    (root / "csrc" / "cpu" / "rows.h").write_text("#pragma once\n")
    return root


def test_the_build_cache_key_is_the_sources_and_what_built_them(tmp_path):
    key = _setup_module()["_cache_key"]
    root, inputs = _project(tmp_path), {"torch": ["2.13.0+cpu"], "compiler": "c++ (GCC) 14.2"}
    first = key(root, inputs)
    assert key(root, dict(reversed(inputs.items()))) == first  # the same sources and inputs: the same build
    (root / "csrc" / ".rows.h.swp").write_text("an editor's file")
    (root / "csrc" / "__notes").mkdir()
    (root / "csrc" / "__notes" / "x.txt").write_text("x")
    changed = [key(root, {**inputs, "torch": ["2.14.0+cpu"]}), key(root, {**inputs, "compiler": "clang 19"})]
    assert key(root, inputs) != first  # a file under csrc/ (any, not only sources): another build
    (root / "csrc" / "__notes" / "x.txt").unlink()
    (root / "csrc" / "__notes").rmdir()
    assert key(root, inputs) == first  # hidden files do not count
    for path, text in [("csrc/cpu/rows.h", "#pragma once\n// x\n"), ("setup.py", "setup(x=1)\n")]:
        old = (root / path).read_text()
        (root / path).write_text(text)
        changed.append(key(root, inputs))
        (root / path).write_text(old)
    (root / "csrc" / "cpu" / "rows.h").rename(root / "csrc" / "rows.h")  # the same bytes, another path
    changed.append(key(root, inputs))
    assert len({first, *changed}) == 1 + len(changed), changed


def test_an_unchanged_build_is_copied_not_compiled(tmp_path, monkeypatch):
    # pip builds an editable install in a fresh temporary folder, so adding an extra
    # (pip install -e ".[hf]") compiled everything again; now the build of the same sources is copied.
    from setuptools import Distribution
    from setuptools.extension import Extension
    from torch.utils.cpp_extension import BuildExtension

    ns = _setup_module()
    root = _project(tmp_path / "project")
    ns["ROOT"], ns["_build_inputs"] = str(root), lambda ext: {"torch": "x"}
    compiled = []

    def compile_(self, ext):  # what the compiler would make: the sources' bytes
        compiled.append(ext.name)
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes((root / "csrc" / "ops.cpp").read_bytes())

    monkeypatch.setattr(BuildExtension, "build_extension", compile_)
    monkeypatch.setenv("MINAGI_BUILD_QUIET", "1")
    monkeypatch.delenv("MINAGI_REBUILD", raising=False)

    def build(lib):
        cmd = ns["_build_ext_class"]()(Distribution())
        cmd.build_lib = str(tmp_path / lib)
        cmd.build_extension(Extension("minagi._C", ["csrc/ops.cpp"]))
        return Path(cmd.get_ext_fullpath("minagi._C"))

    assert build("a").read_bytes() == b"int f();\n" and compiled == ["minagi._C"]
    assert build("b").read_bytes() == b"int f();\n" and compiled == ["minagi._C"]  # copied from the cache
    (root / "csrc" / "ops.cpp").write_text("int g();\n")
    assert build("c").read_bytes() == b"int g();\n" and len(compiled) == 2  # a changed source compiles
    monkeypatch.setenv("MINAGI_REBUILD", "1")
    assert build("d").read_bytes() == b"int g();\n" and len(compiled) == 3  # asked to compile
    monkeypatch.delenv("MINAGI_REBUILD")
    for i in range(4):
        (root / "csrc" / "ops.cpp").write_text(f"int h{i}();\n")
        build(f"e{i}")
    assert len(list((root / ns["CACHE"]).iterdir())) == ns["CACHE_KEEP"]  # the newest builds are kept


def test_ninja_lines_become_a_file_a_line():
    line = _setup_module()["progress_line"]
    root = "/src/minagi"
    compile_ = ("[3/10] c++ -MMD -MF /src/minagi/build/temp/csrc/cpu/decode.o.d -O3 -I/venv/torch/include "
                "-c -c /src/minagi/csrc/cpu/decode.cpp -o /src/minagi/build/temp/csrc/cpu/decode.o -fopenmp")
    assert line(compile_, root, 72.4) == "[3/10] compiled csrc/cpu/decode.cpp (1m12s)"
    assert line("[1/2] /usr/bin/nvcc -c /src/minagi/csrc/cuda/gather.cu -o x.o\n", root, 5) == (
        "[1/2] compiled csrc/cuda/gather.cu (0m05s)")
    assert line("[9/9] c++ a.o b.o -shared -o build/lib/minagi/_C.so -fopenmp", root, 0) == "[9/9] linked _C.so (0m00s)"
    assert line("csrc/cpu/decode.cpp:12: warning: unused variable", root, 0) is None


def test_a_build_in_place_never_leaves_the_extension_missing_or_partial(tmp_path):
    # setuptools deletes the target and writes it in 16 KiB pieces; a process starting then found
    # no extension and ran on the pure-torch ops (other numerics). minagi's build renames a
    # finished copy over it, so a reader sees the old file or the new one, whole.
    import threading

    old, new = tmp_path / "old.so", tmp_path / "new.so"
    old.write_bytes(b"o" * (32 << 20))
    new.write_bytes(b"n" * (48 << 20))
    target = tmp_path / "_C.so"
    shutil.copy(old, target)
    sizes, done = set(), threading.Event()

    def watch():
        while not done.is_set():
            try:
                sizes.add(target.stat().st_size)
            except FileNotFoundError:
                sizes.add(-1)

    t = threading.Thread(target=watch)
    t.start()
    try:
        for _ in range(3):
            _setup_build_class().copy_file(str(new), str(target))
            _setup_build_class().copy_file(str(old), str(target))
    finally:
        done.set()
        t.join()
    assert sizes <= {32 << 20, 48 << 20}, sorted(sizes)
    assert target.read_bytes() == old.read_bytes() and sorted(p.name for p in tmp_path.iterdir()) == [
        "_C.so", "new.so", "old.so"]  # no temporary left behind


@pytest.mark.skipif(not _backend.loaded() or not (shutil.which("objcopy") and shutil.which("readelf")),
                    reason="needs the built extension and binutils (objcopy, readelf)")
def test_the_build_digest_is_of_the_code_not_of_the_debug_information(tmp_path):
    # Two builds of the same sources differ in their debug information and build-id (the build
    # directory is named there): the same code, the same digest. One changed byte of code: another.
    so = Path(sys.modules["minagi._C"].__file__)
    stripped = tmp_path / "stripped.so"
    subprocess.run(["objcopy", "--strip-debug", "--remove-section=.note.gnu.build-id", str(so), str(stripped)],
                   check=True)
    assert stripped.stat().st_size < so.stat().st_size
    assert _backend.code_digest(stripped) == _backend.code_digest(so)
    text = subprocess.run(["readelf", "-S", "-W", str(so)], capture_output=True, text=True, check=True).stdout
    # "[Nr] Name Type Address Off ...": the fields after the bracket
    offset = int(next(line for line in text.splitlines() if " .text " in line).split("]", 1)[1].split()[3], 16)
    changed = bytearray(so.read_bytes())
    changed[offset + 100] ^= 1
    (tmp_path / "changed.so").write_bytes(changed)
    assert _backend.code_digest(tmp_path / "changed.so") != _backend.code_digest(so)
    assert _backend.build_id() == "extension " + _backend.code_digest(so)
