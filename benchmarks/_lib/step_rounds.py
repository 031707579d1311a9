"""Rounds of fresh prompts on one in-process engine: the step-time workload of the overhead section.

A random 8-layer float32 Llama (the TTFT model's width) whose engine step takes tens of
milliseconds on one core, rounds of fresh random prompts (nothing to hit), and per round the mean
step time, request throughput and the shares of the step spent in the connector's hooks. Used by
``connectors/overhead`` (every connector against none) and ``p2p/producer_hold`` (one producer
holding blocks against holding none).
"""

from __future__ import annotations

import random

from benchmarks._lib.engine import BenchEngine, core_env, random_llama

# 8 layers of the TTFT model's width: a step of tens of milliseconds on one core.
MODEL = random_llama(num_layers=8, max_position_embeddings=1024, seed=4321)
MAX_TOKENS = 16
MAX_NUM_SEQS = 32
PROMPT_LEN = (64, 320)


class PromptSource:
    """Fresh random prompts, the same sequence for every row (seeded)."""

    def __init__(self, seed: int = 11, vocab: int = 1024) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def take(self, n: int) -> list[list[int]]:
        return [
            [self.rng.randrange(4, self.vocab) for _ in range(self.rng.randint(*PROMPT_LEN))]
            for _ in range(n)
        ]


class RowResult:
    def __init__(self) -> None:
        self.step_ms: list[float] = []  # mean step time per round
        self.req_per_s: list[float] = []
        self.lookup_us: list[float] = []
        self.rss: list[tuple[int, float]] = []  # (requests done, MiB)
        self.hits = 0
        # per round: share of the step time spent in the connector's scheduler-side hooks (lookup
        # included), its worker-side load hooks and its worker-side save hooks
        self.sched_share: list[float] = []
        self.load_share: list[float] = []
        self.save_share: list[float] = []
        self.leaks: list[dict | None] | None = None


def start_engine(model_dir, cfg: dict | None, env: dict[str, str], kv_cache_bytes: int = 128 << 20) -> BenchEngine:
    """An in-process engine of this section's model and batch, started and warmed up."""
    # One OpenMP thread, unbound (every row's engine is up at once): the tiny model gains nothing
    # from two.
    env = {**env, **core_env(None)}
    eng = BenchEngine(
        model_dir,
        name="overhead",
        kv_transfer_config=cfg,
        env=env,
        max_tokens=MAX_TOKENS,
        max_model_len=512,
        kv_cache_bytes=kv_cache_bytes,
        extra_llm_kwargs={"max_num_seqs": MAX_NUM_SEQS},
    )
    try:
        eng.start()
        eng.generate(PromptSource(seed=99).take(64), timeout_s=300)  # warm-up
        eng.timings()
    except BaseException:
        eng.close()
        raise
    return eng


def measure_round(eng: BenchEngine, prompts: list[list[int]], res: RowResult) -> None:
    r = eng.generate(prompts, timeout_s=300)
    t = eng.timings()
    steps = t["step_s"]
    res.step_ms.append(1e3 * sum(steps) / max(1, len(steps)))
    total = sum(steps) or float("nan")
    res.sched_share.append((sum(t.get("sched_hook_s", [])) + sum(t["lookup_s"])) / total)
    res.load_share.append(sum(t.get("worker_load_s", [])) / total)
    res.save_share.append(sum(t.get("worker_save_s", [])) / total)
    res.req_per_s.append(len(prompts) / r.wall_s)
    res.lookup_us += [1e6 * x for x in t["lookup_s"]]
    res.hits += sum(1 for c in r.num_cached_tokens if c)  # should stay 0: fresh prompts
