"""A pipeline-parallel prefill: the stage math and the per-stage pull plan, against an oracle that is
not the plan.

``VllmPipelinePrefill`` is written from vLLM 0.32, not from ``pipeline_stages`` / ``pull.plan``:

* the layers of stage ``s``: vLLM's own ``get_pp_indices`` (called, with ``VLLM_PP_LAYER_PARTITION``
  set or not); a stage's worker registers the KV caches of those layers only (``PPMissingLayer``
  elsewhere); a draft (MTP) layer past the decoder layers is on the last stage;
* the worker of (pp, pcp, tp): ``parallel_state`` numbers a DP group's workers
  ``arange(world).reshape(pp, pcp, tp)`` (transcribed with torch); worker ``g`` listens on base + g;
* heads of a TP rank: ``QKVParallelLinear`` gives rank ``r`` KV heads
  ``[(r // replicas) * per_rank, ... + per_rank)``, ``per_rank = max(1, H // tp)``,
  ``replicas = max(1, tp // H)``.

Each plan is executed on this model: every (layer, KV head, block) a PP 1 decode rank needs must be
read exactly once, from the port of a worker that registered that layer and holds that head, into
the decode's own head; and each worker must expect exactly as many DONEs as decode ranks read from
it (its own hold, its own ``finished_sending``).
"""

from __future__ import annotations

import random

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from kv_mooncake.errors import PlanError, StageError
from kv_mooncake.params import read_transfer_params
from kv_mooncake.pipeline_stages import (
    decode_stage_layers,
    layer_index,
    layers_by_stage,
    own_stage_problem,
    parse_partition,
    stage_layer_problem,
    stage_of,
    stage_partition,
    waive_stage_fields,
)
from kv_mooncake.pull.plan import plan_pulls, readers_per_prefill_rank
from kv_mooncake.rank_layout import DecodeLayout, DecodeRank, PrefillLayout
from kv_mooncake.wire import messages as P

torch = pytest.importorskip("torch")
vllm_dist_utils = pytest.importorskip("vllm.distributed.utils")

BASE_PORT = 30000


def _name(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def vllm_stage_ranges(monkeypatch, num_layers: int, pp: int, env: str | None) -> list[tuple[int, int]]:
    if env is None:
        monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    else:
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", env)
    return [vllm_dist_utils.get_pp_indices(num_layers, s, pp) for s in range(pp)]


class VllmPipelinePrefill:
    """One PP prefill instance as vLLM lays it out: which worker (port) holds which layers and heads."""

    def __init__(self, ranges, tp, pcp, heads, attention_layers, draft_layers):
        self.tp, self.pcp, self.heads = tp, pcp, heads
        pp = len(ranges)
        grid = torch.arange(pp * pcp * tp).reshape(pp, pcp, tp)
        self.workers = {}  # port -> (stage, tp rank, layer names)
        for s, (first, end) in enumerate(ranges):
            names = {_name(i) for i in attention_layers if first <= i < end}
            if s == pp - 1:
                names |= {_name(i) for i in draft_layers}
            for p in range(pcp):
                for t in range(tp):
                    self.workers[BASE_PORT + int(grid[s, p, t])] = (s, t, names)

    def heads_of(self, tp_rank):
        per = max(1, self.heads // self.tp)
        replicas = max(1, self.tp // self.heads)
        first = (tp_rank // replicas) * per
        return list(range(first, first + per))


def decode_heads(heads, tp, tp_rank):
    per = max(1, heads // tp)
    first = (tp_rank // max(1, tp // heads)) * per
    return list(range(first, first + per))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_layers=st.integers(1, 40), pp=st.integers(1, 6), explicit=st.booleans(), seed=st.integers(0, 2**16),
       tp=st.sampled_from([1, 2, 4]), pcp=st.sampled_from([1, 2]), decode_tp=st.sampled_from([1, 2, 4]),
       heads=st.sampled_from([1, 2, 4, 8]), gaps=st.booleans(), draft=st.booleans(),
       num_blocks=st.integers(1, 5), skip=st.integers(0, 5))
def test_every_layer_head_and_block_is_read_once_from_the_stage_that_holds_it(
        monkeypatch, num_layers, pp, explicit, seed, tp, pcp, decode_tp, heads, gaps, draft, num_blocks, skip):
    assume(num_layers >= pp)
    rng = random.Random(seed)
    env = None
    if explicit:  # a random partition of the layers, as VLLM_PP_LAYER_PARTITION and the decode's key say
        cuts = sorted(rng.sample(range(1, num_layers), pp - 1))
        env = ",".join(str(b - a) for a, b in zip([0, *cuts], [*cuts, num_layers]))
    ranges = vllm_stage_ranges(monkeypatch, num_layers, pp, env)
    # Hybrid-style gaps: some layer indices hold no attention KV at all; draft (MTP) layers follow.
    attention = [i for i in range(num_layers) if not gaps or rng.random() < 0.7] or [0]
    drafts = [num_layers] if draft else []
    oracle = VllmPipelinePrefill(ranges, tp, pcp, heads, attention, drafts)
    decode_names = [_name(i) for i in attention + drafts]
    rng.shuffle(decode_names)  # the decode's own order: matched by name, never by position
    prefill = PrefillLayout(tp_size=tp, total_kv_heads=heads, pcp_size=pcp, pp_size=pp)
    decode = DecodeLayout(tp_size=decode_tp)
    try:
        plans = {d: plan_pulls(prefill, decode, DecodeRank(d), num_blocks, skip, seed) for d in range(decode_tp)}
    except PlanError:
        assume(False)  # heads that do not divide: refused before any byte moves
    partition, by_stage = decode_stage_layers(decode_names, num_layers, pp, env)
    assert [(sum(partition[:s]), sum(partition[:s + 1])) for s in range(pp)] == ranges

    readers = {port: 0 for port in oracle.workers}
    for d, pulls in plans.items():
        read = {}
        for pull in pulls:
            port = BASE_PORT + pull.source.index(prefill)
            stage, src_tp, registered = oracle.workers[port]
            assert stage == pull.source.pp_rank and src_tp == pull.source.tp_rank
            readers[port] += 1
            layers = by_stage[stage]
            # The handshake check: the stage holds exactly what the decode pulls from it.
            assert stage_layer_problem(layers, sorted(registered), stage, partition) is None
            for span in pull.spans:
                for k in range(span.num_heads):
                    head = oracle.heads_of(src_tp)[span.src_head + k]
                    assert head == decode_heads(heads, decode_tp, d)[span.dst_head + k]
                    for src_pos, dst_pos in pull.blocks:
                        assert src_pos == dst_pos
                        for layer in layers:
                            key = (layer, head, dst_pos)
                            assert key not in read, f"{key} read twice"
                            read[key] = port
        need = {(layer, h, b) for layer in decode_names for h in decode_heads(heads, decode_tp, d)
                for b in range(min(skip, num_blocks), num_blocks)}
        assert set(read) == need
    counts = readers_per_prefill_rank(prefill, decode, num_blocks, skip, seed)
    assert {BASE_PORT + r.index(prefill): n for r, n in counts.items()} == readers


def test_partition_follows_vllm_and_refuses_what_vllm_refuses(monkeypatch):
    for layers in range(1, 30):
        for pp in range(1, min(layers, 8) + 1):
            ranges = vllm_stage_ranges(monkeypatch, layers, pp, None)
            assert stage_partition(layers, pp) == tuple(end - first for first, end in ranges), (layers, pp)
    assert stage_partition(61, 2, "32,29") == (32, 29)
    with pytest.raises(StageError, match="places 60 layers, the model has 61"):
        stage_partition(61, 2, "31,29")
    with pytest.raises(StageError, match="has 3 stages, pipeline_parallel_size is 2"):
        stage_partition(61, 2, "20,20,21")
    with pytest.raises(StageError, match="comma-separated"):
        parse_partition("32 29")
    with pytest.raises(StageError, match="cannot fill 4 pipeline stages"):
        stage_partition(3, 4)


def test_layer_index_reads_the_one_integer_of_a_name():
    assert layer_index("model.layers.17.self_attn.attn") == 17
    assert layer_index("language_model.model.layers.3.attn") == 3
    for bad in ("lm_head", "model.layers.1.experts.2.attn"):
        with pytest.raises(StageError, match="no single layer index"):
            layer_index(bad)
    assert stage_of(5, (3, 3)) == 1 and stage_of(6, (3, 3)) == 1 and stage_of(2, (3, 3)) == 0


def test_a_stage_that_holds_other_layers_is_refused_by_name():
    partition = (2, 2)
    expected = layers_by_stage([_name(i) for i in range(4)], partition)
    assert expected == ((_name(0), _name(1)), (_name(2), _name(3)))
    # The prefill ran VLLM_PP_LAYER_PARTITION=1,3: its stage 0 lacks layer 1, its stage 1 has it too.
    problem = stage_layer_problem(expected[0], [_name(0)], 0, partition)
    assert problem is not None and f"it lacks {_name(1)}" in problem and "prefill.pp_layer_partition" in problem
    problem = stage_layer_problem(expected[1], [_name(1), _name(2), _name(3)], 1, partition)
    assert problem is not None and f"it also holds {_name(1)}" in problem and "layers 2..3" in problem
    # Same count, other layers: a check by position alone would pass this.
    assert stage_layer_problem(expected[1], [_name(1), _name(3)], 1, partition) is not None
    assert stage_layer_problem(expected[1], [_name(3), _name(2)], 1, partition) is None  # any order
    assert own_stage_problem([_name(2), _name(3)], 1, partition) is None
    assert "outside its layers 0..1" in own_stage_problem([_name(1), _name(2)], 0, partition)


def test_a_stage_waives_only_the_layer_count_and_the_pipeline_size():
    decode = P.Compatibility(model="m", dtype="float32", block_size=16, head_size=8, num_layers=4,
                             total_kv_heads=4, use_mla=False, pipeline_parallel_size=1)
    stage = msgspec.structs.replace(decode, num_layers=2, pipeline_parallel_size=2)
    assert waive_stage_fields(decode, stage).differences(stage) == []
    assert waive_stage_fields(msgspec.structs.replace(decode, block_size=32), stage).differences(stage) == [
        "block_size: decode 32, prefill 16"]
    # Without pipeline stages the layer count is compared as before.
    one = msgspec.structs.replace(decode, num_layers=3)
    assert waive_stage_fields(decode, one).differences(one) == ["num_layers: decode 4, prefill 3"]


def test_transfer_params_name_every_stage_rank():
    wire = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_host": "10.0.0.1", "remote_port": 20000,
            "remote_request_id": "r", "remote_block_ids": [1], "remote_tp_size": 2, "remote_pp_size": "2"}
    read = read_transfer_params(wire)
    assert read.problem is None and read.params.pp_size == 2 and read.params.source().pp_size == 2
    assert read.params.prefill_addresses() == [f"10.0.0.1:{20000 + i}" for i in range(4)]
    too_many = read_transfer_params({**wire, "remote_tp_size": 64, "remote_pp_size": 8})
    assert too_many.problem == ("remote_tp_size 64 x remote_pcp_size 1 x remote_pp_size 8 = 512 prefill ranks, "
                                "at most 256")
    assert read_transfer_params({**wire, "remote_pp_size": 0}).problem.startswith("remote_pp_size=0")
