"""The dynamic engine's stall workload and call agreement at CP 2 on megatron-core 0.19 (the 0.19 lane).

tests/integrations/megatron/test_megatron_dynamic.py checks both on 0.16.1 inside its one 4-rank run, which leans on
0.16.1-only pieces (the source patches, Megatron's keyword-built context); this 2-rank run
repeats the two checks on the other release so the lane covers them: a chunked prefill that
stalls for lack of KV blocks gives Megatron CP = 1's tokens at CP 2 (and those equal a pool
that never stalls), and ranks handed different prompts all raise one DisagreementError
promptly. Skipped on 0.16.1, where the main file already runs it.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers.ranks import run_ranks
from tests.helpers.megatron_dynamic import STALL, STALL_ENGINE, build_dynamic_model, error_text, gb, IdTokenizer, run_dynamic


def _stall_rank(rank, world):
    from megatron.core import parallel_state

    from megatron_tree.integrations import megatron as mt
    from megatron_tree.integrations.megatron import dynamic as md
    from megatron_tree.integrations.megatron.cpu import megatron_on_cpu

    tok, res = IdTokenizer(), {}
    e = STALL_ENGINE

    def engine(model, cp, blocks=e["blocks"]):
        return md.build_dynamic_engine(model, tok, max_sequence_length=e["max_len"],
                                       buffer_size_gb=gb(blocks, e["block"]) / cp, block_size_tokens=e["block"] // cp,
                                       max_tokens=e["max_tokens"], max_requests=8)

    with megatron_on_cpu():
        mt.initialize_model_parallel(1)
        if rank == 0:
            model = build_dynamic_model(1, None, tree=False)
            res["ref"] = run_dynamic(engine(model, 1), **STALL)
            res["free"] = run_dynamic(engine(model, 1, blocks=60), **STALL)
        parallel_state.destroy_model_parallel()
        mt.initialize_model_parallel(2)
        model = build_dynamic_model(2, None, tree=True, strategy="packed")
        eng = engine(model, 2)
        res["cp2"] = run_dynamic(eng, **STALL)
        t0 = time.perf_counter()
        res["disagree"] = (error_text(run_dynamic, eng, prompts=[[rank, 5, 9], [3, 4]], counts=[4, 4], arrivals=[0, 0]),
                           time.perf_counter() - t0)
        parallel_state.destroy_model_parallel()
    return res


@pytest.fixture(scope="module")
def stall():
    from megatron_tree.integrations.megatron import version as compat

    if not compat.megatron_api().inference_config:
        pytest.skip("megatron-core 0.16.1: tests/integrations/megatron/test_megatron_dynamic.py runs these checks")
    return run_ranks(_stall_rank, 2, timeout=300, pg_timeout=200)


def test_stalled_chunked_prefill_at_cp2_equals_megatron_cp1(stall):
    ref, free = stall[0]["ref"], stall[0]["free"]
    assert ref["tokens"] == free["tokens"] and ref["steps"] > free["steps"]  # the stall cost steps, not tokens
    assert set(ref["status"].values()) == {"COMPLETED"}
    for rank in range(2):
        got = stall[rank]["cp2"]
        assert got["tokens"] == ref["tokens"] and got["finished"] == ref["finished"], rank
        assert got["errors"] == {} and got["blocks"][-1] == [0, 0]


def test_ranks_with_different_prompts_raise_one_error_promptly(stall):
    messages = {stall[rank]["disagree"][0] for rank in range(2)}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("DisagreementError") and "generate_dynamic" in message and "prompt_ids" in message
    assert all(stall[rank]["disagree"][1] < 10 for rank in range(2))
