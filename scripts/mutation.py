"""Mutation testing of the modules that decide which bytes a request gets (issue 27).

    python scripts/mutation.py [--jobs N] [--only kv_store/codec.py ...] [--list]

For each target module: parse it, enumerate small changes (a comparison flipped or negated, an
integer moved by one, ``max`` <-> ``min``, ``and`` <-> ``or``, ``+`` <-> ``-``, ``True`` <->
``False``, ``return X`` -> ``return None``, a statement replaced by ``pass``, a ``not`` removed),
write each mutant over a COPY of the package (a temporary directory first on ``PYTHONPATH``; the
repository's files are never touched) and run the module's unit tests against it
(``pytest -x``). A mutant the tests fail on (or that runs past the timeout) is killed; one they
pass on survived: it needs a test, or a line in ``mutation-equivalent.toml`` saying why the change
is no change of behaviour. Results per module go to ``.artifacts/mutation/``; the report
(``docs/mutation-report.md``) is rebuilt from all of them, so ``--only`` refreshes one module.

A mutant is named by where it is and what it does, not by its line: ``function: operator:
original -> mutated`` (plus ``#n`` when the same change occurs n times in one function), so an
equivalence entry survives edits elsewhere in the file.
"""

from __future__ import annotations

import argparse
import ast
import copy
import dataclasses
import hashlib
import itertools
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
EQUIVALENT_FILE = ROOT / "mutation-equivalent.toml"
RESULTS_DIR = ROOT / ".artifacts" / "mutation"
REPORT = ROOT / "docs" / "mutation-report.md"
TARGET_SCORE = 95.0


@dataclasses.dataclass(frozen=True)
class Target:
    package: str  # folder under packages/
    module: str  # path under the package's src/, e.g. kv_store/codec.py
    tests: tuple[str, ...]  # under packages/<package>/, fastest (most pointed) first: pytest -x stops early


def _tests(*names: str) -> tuple[str, ...]:
    return tuple(f"tests/{n}.py" for n in names)


TARGETS = [
    Target("kv-mooncake", "kv_mooncake/pull/plan.py",
           _tests("test_pull_plan_mutants", "test_pull_plan", "test_kv_layouts")),
    # Moved out of pull_plan.py with the rooms (issue 43): who the ranks are, which blocks per group.
    Target("kv-mooncake", "kv_mooncake/rank_layout.py",
           _tests("test_pull_plan_mutants", "test_pull_plan", "test_kv_layouts")),
    Target("kv-mooncake", "kv_mooncake/group_blocks.py",
           _tests("test_hybrid_groups", "test_pull_plan", "test_hybrid_pull")),
    Target("kv-mooncake", "kv_mooncake/hold/ledger.py",
           _tests("test_delayed_free_mutants", "test_delayed_free", "test_early_lease", "test_hold_protocol_model",
                  "test_hold_protocol")),
    # What must match (fingerprint, prompt digest, KV digest): one module since the rooms (issue 43).
    Target("kv-mooncake", "kv_mooncake/identity.py",
           _tests("test_fingerprint_mutants", "test_prompt_identity_mutants", "test_fingerprint_pinned",
                  "test_handshake_fingerprint", "test_prompt_identity", "test_transfer_params", "test_pull_isolation")),
    Target("kv-store", "kv_store/codec.py",
           _tests("test_codec_mutants", "test_store_integrity", "test_store_parts", "test_store_kv_layout")),
    Target("kv-store", "kv_store/keys.py",
           _tests("test_keys_mutants", "test_store_keys_lookup", "test_store_pp_namespace")),
    Target("kv-store", "kv_store/manifest.py",
           _tests("test_manifest_mutants", "test_store_manifest", "test_mooncake_manifest")),
]


# ---- mutants ------------------------------------------------------------------------------------

_COMPARE_SWAPS: dict[type, tuple[type, ...]] = {
    ast.Lt: (ast.LtE, ast.GtE), ast.LtE: (ast.Lt, ast.Gt), ast.Gt: (ast.GtE, ast.LtE),
    ast.GtE: (ast.Gt, ast.Lt), ast.Eq: (ast.NotEq,), ast.NotEq: (ast.Eq,), ast.In: (ast.NotIn,),
    ast.NotIn: (ast.In,), ast.Is: (ast.IsNot,), ast.IsNot: (ast.Is,),
}
_BINOP_SWAPS: dict[type, type] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Div: ast.Mult,
    ast.Mod: ast.FloorDiv, ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd,
}
# Statements a mutant may delete (replace by ``pass``) inside a function body.
_DELETABLE = (ast.Expr, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Raise, ast.If, ast.Delete,
              ast.Continue, ast.Break, ast.For, ast.With, ast.Try)


@dataclasses.dataclass(frozen=True)
class Mutant:
    index: int  # position in this module's enumeration (this run only)
    line: int
    col: int
    name: str  # stable: function, operator, original -> mutated
    source: str  # the whole mutated module


def _short(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    if len(text) <= 90:
        return text
    return f"{text[:72]}... #{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def _is_logging_call(stmt: ast.stmt) -> bool:
    # Deleting a log line changes no behaviour the mutation run is about (it would only fill the
    # equivalence list): not generated.
    if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
        return False
    func = stmt.value.func
    return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("logger", "log")


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


# A mutation site: (node, operator name, function that applies the change to a copy of the node
# and returns the replacement node).
Site = tuple[ast.AST, str, Callable[[ast.AST], ast.AST]]


def _sites_of(node: ast.AST) -> Iterator[Site]:
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            for new in _COMPARE_SWAPS.get(type(op), ()):
                def swap(n: ast.AST, i: int = i, new: type = new) -> ast.AST:
                    assert isinstance(n, ast.Compare)
                    n.ops[i] = new()
                    return n
                yield node, "compare", swap
    elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _BINOP_SWAPS:
        def binop(n: ast.AST) -> ast.AST:
            assert isinstance(n, (ast.BinOp, ast.AugAssign))
            n.op = _BINOP_SWAPS[type(n.op)]()
            return n
        yield node, "binop" if isinstance(node, ast.BinOp) else "augop", binop
    elif isinstance(node, ast.BoolOp):
        def boolop(n: ast.AST) -> ast.AST:
            assert isinstance(n, ast.BoolOp)
            n.op = ast.Or() if isinstance(n.op, ast.And) else ast.And()
            return n
        yield node, "boolop", boolop
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield node, "not", lambda n: n.operand  # type: ignore[attr-defined]
    elif isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool):
            yield node, "bool", lambda n: ast.Constant(not value)
        elif isinstance(value, int):
            yield node, "int+1", lambda n: ast.Constant(value + 1)
            yield node, "int-1", lambda n: ast.Constant(value - 1)
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("max", "min"):
        def maxmin(n: ast.AST) -> ast.AST:
            assert isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            n.func = ast.Name("min" if n.func.id == "max" else "max", ast.Load())
            return n
        yield node, "maxmin", maxmin
    elif isinstance(node, ast.Return) and node.value is not None and not (
        isinstance(node.value, ast.Constant) and node.value.value is None
    ):
        yield node, "return-none", lambda n: ast.Return(ast.Constant(None))


def _skipped_children(node: ast.AST) -> set[int]:
    """ids of nodes not to mutate: annotations, docstrings, and the messages of exceptions and log
    lines (a changed number in an error message is not what this run is about)."""
    skip: set[int] = set()

    def mark(n: ast.AST | None) -> None:
        if n is not None:
            skip.update(id(x) for x in ast.walk(n))

    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            mark(n.returns)
            for a in (*n.args.posonlyargs, *n.args.args, *n.args.kwonlyargs, n.args.vararg, n.args.kwarg):
                if a is not None:
                    mark(a.annotation)
        elif isinstance(n, ast.AnnAssign):
            mark(n.annotation)
        elif isinstance(n, ast.Raise) or (isinstance(n, ast.stmt) and _is_logging_call(n)):
            for m in ast.walk(n):
                if isinstance(m, ast.JoinedStr):
                    mark(m)
        if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and (
            n.body and _is_docstring(n.body[0])
        ):
            mark(n.body[0])
    return skip


def _walk_with_function(tree: ast.Module) -> Iterator[tuple[ast.AST, str, ast.AST | None, str | None]]:
    """(node, enclosing qualified name, parent, field holding it) in a deterministic order."""
    def visit(node: ast.AST, qual: str) -> Iterator[tuple[ast.AST, str, ast.AST | None, str | None]]:
        for field, value in ast.iter_fields(node):
            children = value if isinstance(value, list) else [value]
            for child in children:
                if not isinstance(child, ast.AST):
                    continue
                inner = qual
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    inner = f"{qual}.{child.name}" if qual != "<module>" else child.name
                yield child, inner, node, field
                yield from visit(child, inner)
    yield from visit(tree, "<module>")


def _enumerate_sites(tree: ast.Module) -> list[tuple[ast.AST, str, str, Callable[[ast.AST], ast.AST]]]:
    """Every (node, function, operator, apply) of ``tree``, in a fixed order."""
    skip = _skipped_children(tree)
    sites = []
    for node, qual, parent, _field in _walk_with_function(tree):
        if id(node) in skip:
            continue
        for site_node, op, apply in _sites_of(node):
            sites.append((site_node, qual, op, apply))
        in_function = isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.If, ast.For, ast.While,
                                          ast.With, ast.Try, ast.ExceptHandler))
        if (in_function and qual != "<module>" and isinstance(node, _DELETABLE) and not _is_docstring(node)
                and not _is_logging_call(node)):
            sites.append((node, qual, "delete", lambda n: ast.Pass()))
    return sites


def mutants(source: str) -> list[Mutant]:
    """All mutants of ``source`` (a module's text); each is the whole mutated module."""
    tree = ast.parse(source)
    count = len(_enumerate_sites(tree))
    out: list[Mutant] = []
    seen: dict[str, int] = {}
    for index in range(count):
        # Apply the index-th change to a fresh copy: the copy enumerates in the same order.
        work = copy.deepcopy(tree)
        node, qual, op, apply = _enumerate_sites(work)[index]
        original = ast.get_source_segment(source, node) or ast.unparse(node)
        line, col = getattr(node, "lineno", 0), getattr(node, "col_offset", 0)
        replacement = apply(copy.deepcopy(node))
        mutated = ast.unparse(replacement)
        if not _replace(work, node, replacement):
            continue
        try:
            text = ast.unparse(ast.fix_missing_locations(work))
            compile(text, "<mutant>", "exec")
        except (SyntaxError, ValueError):
            continue
        name = f"{qual}: {op}: {_short(original)} -> {_short(mutated)}"
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name += f" #{seen[name]}"
        out.append(Mutant(len(out), line, col, name, text))
    return out


def _replace(tree: ast.AST, old: ast.AST, new: ast.AST) -> bool:
    for parent in ast.walk(tree):
        for field, value in ast.iter_fields(parent):
            if value is old:
                setattr(parent, field, new)
                return True
            if isinstance(value, list):
                for i, item in enumerate(value):
                    if item is old:
                        value[i] = new
                        return True
    return False


# ---- running ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed | timeout | survived | equivalent
    seconds: float


def _src_paths(root: Path) -> list[str]:
    return [str(p) for p in sorted((root / "packages").glob("*/src"))]


# A fork server per job: it imports pytest and the third-party modules the tests use once, then
# forks a fresh child per test run (start-up was most of a mutant's time on a loaded machine). It
# never imports the package under test: each child puts its mutant copy first on sys.path.
_SERVER = r"""
import os, signal, sys
sys.dont_write_bytecode = True  # a stale .pyc must never stand in for a mutant
for name in ("pytest", "hypothesis", "msgspec", "numpy", "xxhash", "kv_common", "kv_common.backend"):
    try:
        __import__(name)
    except ImportError:
        pass
for line in sys.stdin:
    tmp, timeout, cwd, *tests = line.rstrip("\n").split("\t")
    pid = os.fork()
    if pid == 0:
        os.setpgrp()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        signal.alarm(max(1, int(float(timeout))))
        sys.path[:0] = [tmp]
        os.environ["HYPOTHESIS_STORAGE_DIRECTORY"] = os.path.join(tmp, ".hypothesis")  # no replay between mutants
        os.chdir(cwd)
        import pytest
        os._exit(int(pytest.main(["-x", "-q", "-p", "no:cacheprovider", *tests])))
    _, status = os.waitpid(pid, 0)
    try:
        os.killpg(pid, signal.SIGKILL)  # whatever the tests left running
    except ProcessLookupError:
        pass
    if os.WIFSIGNALED(status):
        print("timeout" if os.WTERMSIG(status) == signal.SIGALRM else "killed", flush=True)
    else:
        print("survived" if os.WEXITSTATUS(status) == 0 else "killed", flush=True)
"""


class _Runner:
    def __init__(self, root: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(_src_paths(root)), "MC_LOG_LEVEL": "ERROR",
               "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, text=True)

    def run(self, tmp: str, timeout: float, cwd: Path, tests: list[str]) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\t".join([tmp, str(timeout), str(cwd), *tests]) + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def _run_tests(root: Path, runner: _Runner, target: Target, mutated: str | None,
               timeout: float) -> tuple[str, float]:
    """Run the target's tests against a copy of its package with the module replaced by ``mutated``
    (None: unchanged). Returns (killed | timeout | survived, seconds)."""
    src = root / "packages" / target.package / "src"
    top = target.module.split("/")[0]
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        shutil.copytree(src / top, Path(tmp) / top, ignore=shutil.ignore_patterns("__pycache__"))
        if mutated is not None:
            (Path(tmp) / target.module).write_text(mutated)
        tests = _existing_tests(root, target)
        # The first file (the module's pointed tests) alone first: pytest imports every listed file
        # before it runs one test, and the later files import heavy engines. Most mutants die here.
        stages = [tests[:1], tests[1:]] if mutated is not None else [tests]
        start = time.monotonic()
        for stage in filter(None, stages):
            left = max(1.0, timeout - (time.monotonic() - start))
            status = runner.run(tmp, left, root / "packages" / target.package, stage)
            if status != "survived":
                return status, time.monotonic() - start
        return "survived", time.monotonic() - start


def _existing_tests(root: Path, target: Target) -> list[str]:
    return [t for t in target.tests if (root / "packages" / target.package / t).exists()]


def _check_copy_is_imported(root: Path, target: Target) -> None:
    top = target.module.split("/")[0]
    with tempfile.TemporaryDirectory(prefix="mutant-") as tmp:
        shutil.copytree(root / "packages" / target.package / "src" / top, Path(tmp) / top)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, *_src_paths(root)])}
        out = subprocess.run([sys.executable, "-c", f"import {top}; print({top}.__file__)"], env=env,
                             capture_output=True, text=True, check=True).stdout.strip()
        if not out.startswith(tmp):
            raise SystemExit(f"{top} is imported from {out}, not from the mutant copy: check PYTHONPATH")


def load_equivalents(path: Path = EQUIVALENT_FILE) -> dict[tuple[str, str], str]:
    """(module, mutant name) -> reason."""
    if not path.exists():
        return {}
    data = tomllib.loads(path.read_text())
    return {(e["module"], e["mutant"]): e["reason"] for e in data.get("equivalent", [])}


def run_target(root: Path, target: Target, jobs: int, equivalents: dict[tuple[str, str], str],
               log: Callable[[str], None] = lambda line: print(line, flush=True)) -> dict:
    source = (root / "packages" / target.package / "src" / target.module).read_text()
    found = mutants(source)
    _check_copy_is_imported(root, target)
    missing = sorted(set(target.tests) - set(_existing_tests(root, target)))
    if missing:
        log(f"{target.module}: mapped test files missing, run without them: {missing}")
    runners: queue.Queue[_Runner] = queue.Queue()
    for _ in range(max(1, jobs)):
        runners.put(_Runner(root))
    first = runners.get()
    status, base = _run_tests(root, first, target, None, timeout=1800)
    runners.put(first)
    if status != "survived":
        raise SystemExit(f"{target.module}: the unmutated tests fail ({' '.join(target.tests)})")
    timeout = max(60.0, 4 * base)
    log(f"{target.module}: {len(found)} mutants, tests take {base:.1f} s (timeout {timeout:.0f} s)")

    done = itertools.count(1)

    def one(m: Mutant) -> Outcome:
        if (target.module, m.name) in equivalents:
            return Outcome(m, "equivalent", 0.0)
        runner = runners.get()
        try:
            st, secs = _run_tests(root, runner, target, m.source, timeout)
        finally:
            runners.put(runner)
        if st == "survived":
            log(f"  survived {m.line}:{m.col} {m.name}")
        if (n := next(done)) % 25 == 0:
            log(f"  {n} run")
        return Outcome(m, st, secs)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        outcomes = list(pool.map(one, found))
    while not runners.empty():
        runners.get().close()
    names = {m.name for m in found}
    stale = sorted(n for (mod, n) in equivalents if mod == target.module and n not in names)
    return {
        "module": target.module,
        "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "tests": list(target.tests),
        "mutants": [
            {"line": o.mutant.line, "col": o.mutant.col, "name": o.mutant.name, "status": o.status,
             "seconds": round(o.seconds, 2)}
            for o in outcomes
        ],
        "stale_equivalents": stale,
    }


def score(result: dict) -> tuple[int, int, int, int, float]:
    """(mutants, killed, survived, equivalent, score %): equivalent mutants are left out of the score."""
    statuses = [m["status"] for m in result["mutants"]]
    killed = sum(s in ("killed", "timeout") for s in statuses)
    survived = statuses.count("survived")
    equivalent = statuses.count("equivalent")
    scored = killed + survived
    return len(statuses), killed, survived, equivalent, (100.0 * killed / scored if scored else 100.0)


def render_report(root: Path, results: list[dict], equivalents: dict[tuple[str, str], str]) -> str:
    lines = [
        "# Mutation report",
        "",
        "Generated by `nox -s mutation` (`scripts/mutation.py`); do not edit by hand. Each mutant is one",
        "small change to a module (a comparison flipped, a constant moved by one, `max` <-> `min`, a",
        "statement deleted, ...) run against that module's unit tests; a mutant no test fails on",
        "survived. Equivalent mutants (no change of behaviour; reasons in `mutation-equivalent.toml`)",
        f"are left out of the score. Target: {TARGET_SCORE:g} % per module.",
        "",
        "| module | mutants | killed | survived | equivalent | score |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    details: list[str] = []
    for r in results:
        n, killed, survived, equivalent, pct = score(r)
        path = next((t for t in TARGETS if t.module == r["module"]), None)
        current = path is None or hashlib.sha256(
            (root / "packages" / path.package / "src" / path.module).read_bytes()).hexdigest() == r["source_sha256"]
        flag = "" if current else " (stale: the module changed since)"
        lines.append(f"| `{r['module']}`{flag} | {n} | {killed} | {survived} | {equivalent} | {pct:.1f} % |")
        survivors = [m for m in r["mutants"] if m["status"] == "survived"]
        equiv = [m for m in r["mutants"] if m["status"] == "equivalent"]
        details += ["", f"## `{r['module']}`", "", "Tests: " + ", ".join(f"`{t}`" for t in r["tests"]), ""]
        if survivors:
            details.append("Survivors:")
            details += [f"- line {m['line']}: `{m['name']}`" for m in survivors]
        else:
            details.append("No survivors.")
        if equiv:
            details += ["", "Equivalent:"]
            details += [f"- `{m['name']}`: {equivalents.get((r['module'], m['name']), '')}" for m in equiv]
        if r.get("stale_equivalents"):
            details += ["", "Equivalence entries that match no mutant any more (remove them):"]
            details += [f"- `{n}`" for n in r["stale_equivalents"]]
    return "\n".join(lines + details) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1, help="mutants run in parallel (default 1)")
    parser.add_argument("--only", nargs="*", default=[], help="module paths, e.g. kv_store/codec.py")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from the saved results")
    parser.add_argument("--check", action="store_true", help=f"exit 1 when a module scores below {TARGET_SCORE:g} %%")
    args = parser.parse_args(argv)
    targets = [t for t in TARGETS if not args.only or t.module in args.only]
    if args.only and len(targets) != len(args.only):
        parser.error(f"unknown module in {args.only}; known: {[t.module for t in TARGETS]}")
    equivalents = load_equivalents()
    if args.list:
        for t in targets:
            for m in mutants((ROOT / "packages" / t.package / "src" / t.module).read_text()):
                mark = "  [equivalent]" if (t.module, m.name) in equivalents else ""
                print(f"{t.module}:{m.line}:{m.col}: {m.name}{mark}")
        return 0
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    for t in [] if args.report_only else targets:
        result = run_target(ROOT, t, args.jobs, equivalents)
        (RESULTS_DIR / (t.module.replace("/", "__") + ".json")).write_text(json.dumps(result, indent=1))
    results = []
    for t in TARGETS:
        path = RESULTS_DIR / (t.module.replace("/", "__") + ".json")
        if path.exists():
            result = json.loads(path.read_text())
            for m in result["mutants"]:  # an equivalence entry added since the run counts too
                if m["status"] == "survived" and (result["module"], m["name"]) in equivalents:
                    m["status"] = "equivalent"
            results.append(result)
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    REPORT.write_text(render_report(ROOT, results, equivalents))
    low = []
    for r in results:
        n, killed, survived, equivalent, pct = score(r)
        print(f"{r['module']}: {n} mutants, {killed} killed, {survived} survived, {equivalent} equivalent, {pct:.1f} %")
        if pct < TARGET_SCORE:
            low.append(r["module"])
    print(f"report: {REPORT.relative_to(ROOT)}")
    return 1 if args.check and low else 0


if __name__ == "__main__":
    raise SystemExit(main())
