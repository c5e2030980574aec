"""The shape of the house: no import cycle between the project's modules, no
oversized module, and standard packaging (a regular install used from elsewhere
imports cp_rope.parallel / cp_rope.launch; ``parallel`` / ``launch`` are never
top-level modules).

The import graph is read with ``ast`` from the source, not by importing it:
every ``import`` / ``from ... import`` counts, also one inside a function (a
function-local import does not make a cycle go away), except those under
``if TYPE_CHECKING:``.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# folder -> import name (pyproject.toml's package-dir)
PACKAGES = {"cp_rope": "cp_rope", "parallel": "cp_rope.parallel", "launch": "cp_rope.launch"}
MAX_LINES = 500
# Folders whose modules must stay under MAX_LINES.
SIZE_CHECKED = ("cp_rope", "parallel", "launch")


def _modules() -> dict[str, str]:
    """Import name -> file path of every project module."""
    mods = {}
    for folder, pkg in PACKAGES.items():
        for name in sorted(os.listdir(os.path.join(REPO, folder))):
            if name.endswith(".py"):
                mod = pkg if name == "__init__.py" else f"{pkg}.{name[:-3]}"
                mods[mod] = os.path.join(REPO, folder, name)
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(mod: str, path: str, known: set[str]) -> set[str]:
    """Project modules that ``mod`` imports (anywhere in the file)."""
    tree = ast.parse(open(path).read(), path)
    package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            # `from pkg import sub` imports the module pkg.sub when there is one (pkg
            # itself is its parent, imported first anyway), else a name of pkg.
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target
                     for a in node.names]
        else:
            continue
        for name in names:
            # `import cp_rope.parallel.sharding` is an edge to that module.
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != mod:
                out.add(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def test_import_graph_reader_sees_relative_local_and_aliased_imports(tmp_path):
    """The reader itself: a cycle through a function-local relative import is found."""
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import x\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from .a import x\n")
    known = {"p", "p.a", "p.b", "p.c"}
    graph = {f"p.{m}": _imports(f"p.{m}", str(tmp_path / f"{m}.py"), known) for m in "abc"}
    assert graph == {"p.a": {"p.b"}, "p.b": {"p.a"}, "p.c": set()}
    assert _cycles(graph) == [["p.a", "p.b"]]


def test_no_import_cycle_between_project_modules():
    mods = _modules()
    graph = {m: _imports(m, p, set(mods)) for m, p in mods.items()}
    # Sanity: the reader sees the edges it must (an empty graph would pass trivially).
    assert "cp_rope.parallel.batch" in graph["cp_rope.parallel.sharding"]
    assert "cp_rope.validation" in graph["cp_rope.parallel.sharding"]
    # A package's __init__ importing its own submodules is how packages work; a
    # submodule importing its package's __init__ back would close a cycle.
    assert _cycles(graph) == [], "import cycles between project modules"


@pytest.mark.parametrize("folder", SIZE_CHECKED)
def test_no_module_over_500_lines(folder):
    sizes = {os.path.join(folder, name): sum(1 for _ in open(os.path.join(REPO, folder, name)))
             for name in sorted(os.listdir(os.path.join(REPO, folder))) if name.endswith(".py")}
    assert sizes, folder
    over = {k: v for k, v in sizes.items() if v > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def _run(args, cwd, env=None):
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr


def test_regular_install_used_from_elsewhere(tmp_path):
    """A wheel (regular, non-editable install) holds cp_rope, cp_rope.parallel and
    cp_rope.launch only; installed into a fresh directory and used from elsewhere
    or from a checkout, it imports them, and ``import parallel`` / ``import launch``
    fail."""
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    for folder in PACKAGES:
        shutil.copytree(os.path.join(REPO, folder), src / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))
    rc, out = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(src)], tmp_path)
    assert rc == 0, out
    (wheel,) = (tmp_path / "dist").iterdir()
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert tops == {"cp_rope", "cp_rope-0.1.0.dist-info"}, tops
    rc, out = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(tmp_path / "site"), str(wheel)], tmp_path)
    assert rc == 0, out
    work = tmp_path / "elsewhere"
    work.mkdir()
    code = (
        "import cp_rope, cp_rope.parallel, cp_rope.launch\n"
        "from cp_rope.parallel import PackingCollator, shard_batch\n"
        "print(cp_rope.__file__); print(cp_rope.parallel.__file__); print(cp_rope.launch.__file__)\n"
        "for name in ('parallel', 'launch'):\n"
        "    try:\n"
        "        __import__(name)\n"
        "    except ImportError:\n"
        "        print(name, 'refused')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"))
    rc, out = _run([sys.executable, "-c", code], work, env)
    assert rc == 0, out
    lines = out.splitlines()
    site = str(tmp_path / "site" / "cp_rope")
    assert lines[0] == os.path.join(site, "__init__.py"), out  # the installed copy, not the repo
    assert lines[1] == os.path.join(site, "parallel", "__init__.py"), out
    assert lines[2] == os.path.join(site, "launch", "__init__.py"), out
    assert lines[3:] == ["parallel refused", "launch refused"], out
    # Used from a checkout (its cp_rope/ first on sys.path, without parallel/ or
    # launch/ inside): cp_rope.parallel / cp_rope.launch come from the install.
    rc, out = _run([sys.executable, "-c", code], src, env)
    assert rc == 0, out
    lines = out.splitlines()
    assert lines[0] == str(src / "cp_rope" / "__init__.py"), out
    assert lines[1] == os.path.join(site, "parallel", "__init__.py"), out
    assert lines[2] == os.path.join(site, "launch", "__init__.py"), out
    assert lines[3:] == ["parallel refused", "launch refused"], out


def test_top_level_parallel_and_launch_refused_in_the_checkout():
    """From the repository root the folders are importable by path: they refuse, naming
    the right import, instead of making a second copy of every class."""
    for name in ("parallel", "launch"):
        rc, out = _run([sys.executable, "-c", f"import {name}"], REPO,
                       dict(os.environ, PYTHONPATH=REPO))
        assert rc != 0 and "ImportError" in out and f"import cp_rope.{name}" in out, out


def test_no_import_hook_in_the_package():
    for path in _modules().values():
        text = open(path).read()
        assert "meta_path" not in text and "path_hooks" not in text, path


@pytest.mark.parametrize("script", ["scripts/test.sh", ".ci/run"])
def test_test_scripts_pass_paths_to_pytest_alone(tmp_path, script):
    """``scripts/test.sh tests/test_x.py -q`` runs that file only: the script adds
    no ``tests`` path of its own (pytest then ran the whole suite plus the file), only the
    pytest-xdist workers (scripts/pytest_workers.sh), and says how many run. The venv's python
    is a stub that records its arguments (and so "has" xdist), so set-up is a no-op."""
    log = tmp_path / "calls.txt"
    stub = tmp_path / "venv" / "bin" / "python"
    stub.parent.mkdir(parents=True)
    stub.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n')
    stub.chmod(0o755)
    two = ["tests/test_structure.py", "tests/test_rope_cache.py::test_x"]
    one_process = [  # (CP_ROPE_TEST_WORKERS, args, PYTEST_ADDOPTS, why)
        ("1", [*two, "-q"], "", "one worker"),
        ("3", [*two, "-n", "0"], "", "the arguments choose the workers"),
        ("3", [*two, "-pno:xdist"], "", "the arguments choose the workers"),
        ("3", two, "-p no:xdist", "the arguments choose the workers"),
        ("3", [*two, "-vx"], "", "-vx needs one process"),
        ("3", [*two, "-s"], "", "-s needs one process"),
        ("3", [*two, "--maxfail=2"], "", "--maxfail=2 needs one process"),
        ("3", two, "--pdb", "--pdb needs one process"),
        ("3", ["tests/test_structure.py", "-q"], "", "one test file or id"),
    ]
    cases = [("3", [*two, "-q", "-rs"], "", "-n 3 --dist loadscope ",
              "pytest: 3 pytest-xdist workers")]
    cases += [(w, a, o, "", f"pytest: one process: {why}") for w, a, o, why in one_process]
    cores = min(len(os.sched_getaffinity(0)), 4)  # the default: cores, not OMP_NUM_THREADS (1)
    cases.append(("", two, "", f"-n {cores} --dist loadscope " if cores > 1 else "",
                  f"pytest: {cores} pytest-xdist" if cores > 1 else "pytest: one process"))
    for workers, args, addopts, xdist, said in cases:
        env = dict(os.environ, CP_ROPE_VENV=str(tmp_path / "venv"), CP_ROPE_TEST_WORKERS=workers,
                   PYTEST_ADDOPTS=addopts, OMP_NUM_THREADS="1")
        rc, out = _run(["bash", os.path.join(REPO, script), *args], tmp_path, env)
        assert rc == 0 and said in out, (args, addopts, out)
        calls = log.read_text().splitlines()
        assert calls[-1] == f"-m pytest {xdist}{' '.join(args)}", calls
    n_calls = len(log.read_text().splitlines())
    for bad in ["0", "two", "-1", "99999999999999999999"]:  # refused before set-up and pytest
        env = dict(os.environ, CP_ROPE_VENV=str(tmp_path / "venv"), CP_ROPE_TEST_WORKERS=bad)
        rc, out = _run(["bash", os.path.join(REPO, script), *two], tmp_path, env)
        assert rc == 4 and f"CP_ROPE_TEST_WORKERS={bad}: expected a whole number" in out, out
        assert len(log.read_text().splitlines()) == n_calls  # the stub never ran


def test_cpu_use_without_triton(tmp_path):
    """Triton is a dependency on Linux only (pyproject) and is needed only on CUDA: with
    ``import triton`` failing, the packages import, ``pretrain --help`` works, and RoPE and
    CP attention run on CPU (the PyTorch paths)."""
    code = (
        "import sys; sys.modules['triton'] = None  # import triton -> ImportError\n"
        "import torch, cp_rope, cp_rope.parallel, cp_rope.launch.pretrain\n"
        "from cp_rope.parallel import context_parallel_attention\n"
        "cu = torch.tensor([0, 3, 8], dtype=torch.int32)\n"
        "q, k = torch.randn(8, 2, 4), torch.randn(8, 1, 4)\n"
        "cos, sin = cp_rope.rope_cache(8, 4)\n"
        "q, k = cp_rope.apply_rotary_emb_qk(q, k, cos, sin, cu)\n"
        "out = context_parallel_attention(q, k, k, cu, 5, group=None)\n"
        "assert out.shape == q.shape and out.isfinite().all()\n"
        "sys.argv = ['pretrain', '--help']\n"
        "cp_rope.launch.pretrain.main()\n"
    )
    rc, out = _run([sys.executable, "-c", code], tmp_path)
    assert rc == 0, out
    assert "--cp-size" in out, out


def test_gpu_scripts_say_they_need_a_gpu(tmp_path):
    """The GPU benchmark scripts stop with a sentence, not a CUDA traceback, without a GPU."""
    scripts = ["bench_rope.py", "bench_cp_attention.py", "sweep_rope.py"]
    code = (
        "import runpy, sys\n"
        f"for name in {scripts!r}:\n"
        "    sys.argv = [name]\n"
        "    try:\n"
        f"        runpy.run_path({os.path.join(REPO, 'scripts')!r} + '/' + name, run_name='__main__')\n"
        "    except SystemExit as e:\n"
        "        print(name, '->', e.code)\n"
    )
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    rc, out = _run([sys.executable, "-c", code], tmp_path, env)
    assert rc == 0, out
    for name in scripts:
        assert re.search(rf"^{re.escape(name)} -> .*needs (a )?CUDA GPU", out, re.M), out


def test_demo_outside_torchrun_says_how_to_run_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    rc, out = _run([sys.executable, os.path.join(REPO, "scripts", "demo_cp.py")], tmp_path, env)
    assert rc == 1 and "torchrun --standalone --nproc-per-node 2 scripts/demo_cp.py" in out, out


def test_names_of_the_parallel_docs_table_are_importable():
    """docs/parallel.md: "Every name below is importable from cp_rope.parallel": each
    backquoted name of its module table that the module defines is exported."""
    import importlib

    import cp_rope.parallel as par

    with open(os.path.join(REPO, "docs", "parallel.md")) as f:
        text = f.read()
    rows = re.findall(r"^\| `(\w+)\.py`[^|]*\| (.*) \|$", text, re.M)
    assert len(rows) > 10
    missing = []
    for module, cell in rows:
        mod = importlib.import_module(f"cp_rope.parallel.{module}")
        for name in re.findall(r"`(\w+)`", cell):
            if hasattr(mod, name) and not name.startswith("_") and name not in par.__all__:
                missing.append(f"{module}.{name}")
    assert not missing, f"named in docs/parallel.md's table, not exported: {missing}"
