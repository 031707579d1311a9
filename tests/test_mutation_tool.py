"""scripts/mutation.py on a toy package: mutants are generated, a tested change is killed, an
untested one survives, an equivalence entry takes its mutant out of the score, and the repository's
copy of the module is never changed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TOY = '''\
def clamp(x):
    return max(0, x)


def untested(x):
    return x + 1
'''

TOY_TEST = '''\
from toy.calc import clamp


def test_clamp():
    assert clamp(-3) == 0
    assert clamp(5) == 5
'''


def _tool():
    spec = importlib.util.spec_from_file_location("mutation_tool", ROOT / "scripts" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutation_tool"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_mutants_of_a_toy_module_are_generated_killed_and_survive(tmp_path):
    tool = _tool()
    src = tmp_path / "packages" / "toy" / "src" / "toy"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("")
    (src / "calc.py").write_text(TOY)
    tests = tmp_path / "packages" / "toy" / "tests"
    tests.mkdir()
    (tests / "test_calc.py").write_text(TOY_TEST)

    names = [m.name for m in tool.mutants(TOY)]
    assert "clamp: maxmin: max(0, x) -> min(0, x)" in names
    assert "untested: binop: x + 1 -> x - 1" in names
    assert "clamp: return-none: return max(0, x) -> return None" in names

    target = tool.Target("toy", "toy/calc.py", ("tests/test_calc.py",))
    equivalent = {("toy/calc.py", "untested: int+1: 1 -> 2"): "a toy reason"}
    result = tool.run_target(tmp_path, target, jobs=2, equivalents=equivalent, log=lambda _: None)
    status = {m["name"]: m["status"] for m in result["mutants"]}
    assert status["clamp: maxmin: max(0, x) -> min(0, x)"] == "killed"
    assert status["untested: binop: x + 1 -> x - 1"] == "survived"
    assert status["untested: int+1: 1 -> 2"] == "equivalent"
    n, killed, survived, equivalent_count, pct = tool.score(result)
    assert (equivalent_count, killed + survived + equivalent_count) == (1, n)
    assert 0 < pct < 100
    assert (src / "calc.py").read_text() == TOY  # mutants went to a copy
    report = tool.render_report(tmp_path, [result], equivalent)
    assert "untested: binop: x + 1 -> x - 1" in report and "a toy reason" in report
