"""A transformers model's decode step compiled whole (``HFTreeModel(compile_step=...)``) on real gloo ranks:
``torch.compile(fullgraph=True)`` traces it with no graph break, once over a generation's 12 steps (the
tokens' placement and positions change, the graph does not), and it gives the eager step's logits.

``fullgraph=True`` is also the no-host-sync proof of the compiled half: a host read of a device value
(``.item()``, ``.tolist()``, a data-dependent shape) is a graph break, so an error here. The two opaque
ops' bodies are the eager step's (``tests/decode/test_host_sync.py`` guards them); ``no_host_sync``
itself is a dispatch mode, under which torch.compile does not run.

``aot_eager`` runs Dynamo and AOTAutograd without Inductor's code generation, so a graph break, a host
read of a device value or a guard on a per-step value (a recompilation) shows here cheaply; its graphs
run the same aten ops as eager, so the logits are compared bit for bit. It compiles the tests whose subject is
the compiled graph (its logits bit for bit, the ops in it: ``_generate``; a user's compile of the forward in
``_user_compiled_forward`` and transformers' automatic compile) and the steps made capturable as the default
makes them on a GPU (standing in for Inductor's CUDA graphs, which run the AOTAutograd graph). The tests that
count traces or check the storage, the padding, the batch buckets or the traffic recorded use Dynamo's
``"eager"`` backend (its traced graph run as it is: about 1.5 s a trace here against 2.4 s): traces, guards,
recompilations and the recompile limit are Dynamo's under any backend, and the opaque ops that write the cache
and record the traffic run the same bodies. So do the user's compiles whose subject is not the graph but what
reaches it: a left-padded batch's masks (``_static_padded``, tokens only) and the package loop's static caches
and trace count (``_user_compiled_loop``).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import outcome, run_ranks

STEPS = 12
PROMPTS = [[5, 17, 90, 3, 42, 8, 8, 1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]


def _generate(rank, world, arch, intra=None, strategy="auto"):
    import torch

    import megatron_tree as mt
    from megatron_tree.decode.generate import GenerationHook, generate
    from megatron_tree.integrations.hf import HFTreeModel
    from torch._dynamo.testing import CompileCounterWithBackend

    class Logits(GenerationHook):
        def __init__(self):
            self.steps = []

        def after_step(self, step, logits):
            self.steps.append(logits.clone())

    groups = mt.TreeGroups.build(intra_size=intra) if intra else mt.TreeGroups.build()
    ops = []

    def backend(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return counter(gm, example_inputs)

    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    runs = {}
    from megatron_tree.integrations.hf import TreeCache

    for name, setting in (("eager", False), ("eager_static", False), ("compiled", {"backend": backend})):
        model = HFTreeModel(_model(arch), groups, strategy=strategy, compile_step=setting)
        hook = Logits()
        # the eager step over a cache of the compiled step's shape (static: every slot read, masked), and
        # over the default one (only up to the longest row: other shapes, so float32 sums in another order)
        cache = TreeCache(model.hf, groups, max_seq_len=max(map(len, PROMPTS)) + STEPS + 1, batch_size=len(PROMPTS),
                          static=True) if name == "eager_static" else None
        tokens = generate(model, PROMPTS, STEPS + 1, hook=hook, cache=cache, progress=False).tokens
        runs[name] = (tokens, torch.stack(hook.steps))
    (want, want_logits), (got, got_logits) = runs["eager_static"], runs["compiled"]
    dynamic_tokens, dynamic_logits = runs["eager"]
    reference = _greedy(PROMPTS, STEPS + 1, arch)  # unmodified transformers, one process
    return {"frames": counter.frame_count, "tokens_equal": got == want == dynamic_tokens,
            "logits_equal": torch.equal(got_logits, want_logits),
            "dynamic_close": torch.allclose(got_logits, dynamic_logits, rtol=0, atol=1e-5),
            "steps": len(got_logits), "ops": ops, "layers": len(model.hf.model.layers),
            "transformers_equal": got == reference}


def _shared_body(rank, world, names):
    """Several tests' rank bodies, one after the other, in one run of ``world`` ranks: the processes start, import
    and warm Dynamo up once instead of once per test. Each body runs as it would alone: Dynamo reset before it, the
    integrations logger's handlers put back after it, its result copied as it returns (a list it keeps, such as
    a logging handler's, must not see the next bodies). The first body that raises on a rank ends that rank's run
    (every later body reported not run there), so no body's collectives meet another body's."""
    import logging
    import pickle
    import traceback

    logger = logging.getLogger("megatron_tree.integrations")
    out = {}
    for name in names:
        body, args = _SHARED[world][name]
        torch._dynamo.reset()
        handlers = list(logger.handlers)
        try:
            out[name] = ("returned", pickle.loads(pickle.dumps(body(rank, world, *args))))
        except BaseException:  # noqa: BLE001 -- the test of this body raises it
            out[name] = ("raised", traceback.format_exc())
            break
        finally:
            logger.handlers[:] = handlers
    for name in names:
        out.setdefault(name, ("not run", "an earlier body raised on this rank"))
    return out


def _shared_results(runs, name):
    """One body's result on every rank of a shared run (:func:`_shared_body`), or the failure of the test."""
    got = []
    for rank, out in enumerate(runs):
        kind, value = out.get(name, ("not run", "not in this session's shared run"))
        if kind != "returned":
            pytest.fail(f"{name} on rank {rank}: {kind}\n{value}", pytrace=False)
        got.append(value)
    return got


def _shares(*names):
    """Marks a test that reads the bodies ``names`` of shared runs (:data:`_SHARED`): a run holds the selected
    tests'."""
    def mark(test):
        test.shared_bodies = names
        return test
    return mark


def _shared_run(request, world):
    """The bodies of ``world`` ranks that this session's selected tests read, run once (:func:`_shared_body`)."""
    wanted = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "module", None) is request.module and params.get("world", world) == world:
            wanted.update(getattr(getattr(item, "function", None), "shared_bodies", ()))
    names = tuple(name for name in _SHARED[world] if name in wanted)
    return run_ranks(_shared_body, world, names, timeout=300 * len(names))


@pytest.fixture(scope="module")
def shared(request):
    """``shared(world, name)``: the body ``name``'s result on every rank of this module's one run of ``world``
    ranks, which holds the bodies of the selected tests (:func:`_shared_run`), started at its first use."""
    runs = {}

    def results(world, name):
        if world not in runs:
            runs[world] = _shared_run(request, world)
        return _shared_results(runs[world], name)

    return results


def _model(arch):
    from tests.helpers.hf_models import hf_model

    if arch == "llama":
        return hf_model("llama")
    from benchmarks.architectures import build

    return build(arch)


_REFERENCES: dict = {}
"""Unsharded transformers' greedy tokens per (arch, prompt), the longest asked for so far in this process."""


def _greedy(prompts, new_tokens, arch="llama"):
    """``hf_greedy`` of an unmodified ``_model(arch)``: each prompt's ``new_tokens`` greedy tokens, generated once
    per process for the longest count asked for (a shared run's bodies ask for the same prompts' 12 or 13 tokens).
    A shorter count is a prefix of a longer one: ``hf_greedy``'s ``min_new_tokens`` keeps EOS out of both, and
    the first ``n`` steps of greedy decoding do not depend on how many follow."""
    from tests.helpers.hf_models import hf_greedy

    out = []
    for p in prompts:
        key = (arch, tuple(p))
        if len(_REFERENCES.get(key, ())) < new_tokens:
            _REFERENCES[key] = hf_greedy(_model(arch), [p], new_tokens)[0]
        out.append(_REFERENCES[key][:new_tokens])
    return out


def _check(results, world):
    assert len(results) == world
    for r in results:
        assert r["steps"] == STEPS
        assert r["frames"] == 1  # one trace for every step: no recompilation, no graph break (fullgraph)
        assert r["tokens_equal"] and r["logits_equal"]  # bit for bit: the eager step on a cache of the same shape
        assert r["dynamic_close"]  # and the default eager step's cache (other shapes)
        assert r["transformers_equal"]  # (the eager step shares the metadata: this checks it independently)
        # every layer's local attention and its CP merge are one opaque op each in the graph
        for op in ("megatron_tree.flash_decode", "megatron_tree.cp_merge"):
            assert sum(o.startswith(op) for o in r["ops"]) == r["layers"], op


@_shares("llama")
def test_llama_step_at_cp2_compiles_once_and_equals_eager(shared):
    _check(shared(2, "llama"), 2)


@_shares("llama_2x2")
def test_llama_step_at_2x2_compiles_once_and_equals_eager(shared):
    """Two levels (intra-node, then across nodes): the merge strategy two_level, in the graph as one op."""
    _check(shared(4, "llama_2x2"), 4)


@_shares("gemma2")
def test_windowed_softcapped_step_at_cp3_compiles_once_and_equals_eager(shared):
    """Gemma 2: sliding-window layers between full ones, soft-capping; CP 3 (not a power of two) with
    prompts longer and shorter than the window: the window starts come from the step's metadata."""
    _check(shared(3, "gemma2"), 3)


SWEEP = (4, 9, 20, 27, 44, 58, 70, 74, 101, 107)
"""Prompt lengths of an eval-like sweep: one generate call each (2 rows, the second one token shorter), sized for
the prompt + SWEEP_NEW tokens -> static caches of 64 (6 calls), 80 (2) and 112 (2) tokens (``static_length``)."""
SWEEP_NEW = 3


def _sweep(rank, world):
    import megatron_tree as mt
    from megatron_tree.decode.cache import static_length
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel
    from torch._dynamo.testing import CompileCounterWithBackend

    # (a count of Dynamo's traces: its "eager" backend runs each traced graph as it is, no AOTAutograd pass)
    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    groups = mt.TreeGroups.build()
    model = HFTreeModel(_model("llama"), groups, compile_step={"backend": counter})
    eager = HFTreeModel(_model("llama"), groups)  # (its tokens are transformers' own: the tests above)
    g = torch.Generator().manual_seed(11)
    frames, equal, sizes = [], [], []
    for n in SWEEP:
        prompts = [torch.randint(1, 120, (n - i,), generator=g).tolist() for i in range(2)]
        tokens = generate(model, prompts, SWEEP_NEW, progress=False).tokens
        frames.append(counter.frame_count)
        equal.append(tokens == generate(eager, prompts, SWEEP_NEW, progress=False).tokens)
        sizes.append(static_length(n + SWEEP_NEW))
    return {"frames": frames, "equal": equal, "sizes": sizes}


@_shares("sweep")
def test_caches_of_nearby_lengths_share_one_compiled_step(shared):
    """An eval's batches each make a cache for their longest prompt: static caches are sized by length bucket
    (``decode.cache.static_length``), so a sweep of 10 lengths compiles once per bucket (3), not once per call
    (10, before), and every call gives the eager step's tokens. (One rank: a cache's bucket and its step's traces are
    each rank's own, computed from the same lengths at every world size; the CP tests above compile their steps
    on sharded caches.)"""
    for r in shared(1, "sweep"):
        assert all(r["equal"]), r["equal"]
        assert r["sizes"] == [64] * 6 + [80] * 2 + [112] * 2
        # a new trace exactly where the bucket changes
        assert r["frames"] == [1] * 6 + [2] * 2 + [3] * 2, r["frames"]


def _refusals(rank, world):
    import megatron_tree as mt
    from megatron_tree.comm.merge import CompileError
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    groups = mt.TreeGroups.build()
    compiled = HFTreeModel(_model("llama"), groups, compile_step=True)
    out = {"shifted": outcome(lambda: generate(compiled, PROMPTS, 3, strategy="shifted", progress=False))}
    out["shifted_model"] = outcome(lambda: HFTreeModel(_model("llama"), groups, strategy="shifted", compile_step=True))
    out["fullgraph"] = outcome(lambda: HFTreeModel(_model("llama"), groups, compile_step={"fullgraph": False}))
    out["kind"] = outcome(lambda: HFTreeModel(_model("llama"), groups, compile_step="yes"))
    # CUDA graphs asked for on CPU tensors: refused at the first decode step, naming the setting
    captured = HFTreeModel(_model("llama"), groups, compile_step={"mode": "reduce-overhead"})
    out["capture_cpu"] = outcome(lambda: generate(captured, PROMPTS, 3, progress=False))
    graphs = HFTreeModel(_model("llama"), groups, compile_step={"options": {"triton.cudagraphs": True}})
    out["graphs_cpu"] = outcome(lambda: generate(graphs, PROMPTS, 3, progress=False))
    # CUDA graphs over a CP group that is not NCCL's (the merge's collectives cannot be recorded): refused by
    # name before any trace (the check reads only the device's kind, so it runs here without a GPU)
    from megatron_tree.integrations.hf.forward import _check_capturable

    cuda = torch.device("cuda")
    out["capture_gloo"] = outcome(lambda: _check_capturable({"mode": "reduce-overhead"}, cuda, groups))
    out["graphs_gloo"] = outcome(lambda: _check_capturable({"options": {"triton.cudagraphs": True}}, cuda, groups))
    out["capture_alone"] = outcome(lambda: _check_capturable({"mode": "reduce-overhead"}, cuda, None))
    out["compiled_gloo"] = outcome(lambda: _check_capturable({"mode": "default"}, cuda, groups))
    # and a model's steps pass their groups to it: a step made for a cache on a CUDA device (a stand-in with only
    # the device: no GPU here) over these gloo groups is refused before torch.compile
    from types import SimpleNamespace

    on_cuda = SimpleNamespace(storage=SimpleNamespace(k=SimpleNamespace(device=cuda)), max_seq_len=None)
    steps = HFTreeModel(_model("llama"), groups, compile_step={"mode": "reduce-overhead"})._binding.compiled
    out["capture_gloo_steps"] = outcome(lambda: steps._make(lambda: None, on_cuda))
    # the merge op's fake (what a traced step is built from) against its real body, in bf16: same shapes,
    # dtypes (the accumulation dtype: float32 out, float64 lse from a float64 partial) and strides
    from megatron_tree.comm.merge import _op_names

    g = torch.Generator().manual_seed(rank)
    part = torch.randn(2, 1, 4, 16, generator=g).bfloat16()
    lse = torch.randn(2, 4, 1, generator=g, dtype=torch.float64)
    names = _op_names(groups, None)
    out["opcheck"] = outcome(lambda: torch.library.opcheck(
        torch.ops.megatron_tree.cp_merge.default, (part, lse, names, "packed", torch.bfloat16, ""),
        test_utils=("test_schema", "test_faketensor")))
    merged = torch.ops.megatron_tree.cp_merge.default(part, lse, names, "packed", torch.bfloat16, "")
    out["dtypes"] = (str(merged[0].dtype), str(merged[1].dtype))
    return out, CompileError.__name__


@_shares("refusals")
def test_settings_a_compiled_step_cannot_hold_are_refused_on_every_rank(shared):
    results = shared(2, "refusals")
    for out, name in results:
        for key in ("shifted", "shifted_model"):
            assert out[key][0] == name and "strategy='shifted'" in out[key][1]
        assert out["fullgraph"][0] == "ValueError" and "fullgraph=False" in out["fullgraph"][1]
        assert out["kind"][0] == "TypeError" and "compile_step must be a bool, 'auto' or a dict" in out["kind"][1]
        assert "given as a dict, e.g. {'backend': 'yes'} or {'mode': 'yes'}" in out["kind"][1], out["kind"]
        for key, what in (("capture_cpu", "mode='reduce-overhead'"), ("graphs_cpu", "triton.cudagraphs")):
            assert out[key][0] == "ValueError" and what in out[key][1] and "on cpu" in out[key][1], out[key]
        for key, what in (("capture_gloo", "mode='reduce-overhead'"), ("graphs_gloo", "triton.cudagraphs"),
                          ("capture_gloo_steps", "mode='reduce-overhead'")):
            assert out[key][0] == "ValueError" and what in out[key][1] and "run on gloo" in out[key][1], out[key]
            assert "only NCCL's collectives can be captured" in out[key][1]
        assert out["capture_alone"][0] == out["compiled_gloo"][0] == "returned"  # one process; not captured
        assert out["opcheck"][0] == "returned", out["opcheck"]
        assert out["dtypes"] == ("torch.float32", "torch.float64")
    assert [{k: v[:2] for k, v in out.items() if k != "dtypes"} for out, _ in results] == \
        [{k: v[:2] for k, v in results[0][0].items() if k != "dtypes"}] * 2


def _captured_runs(runs: dict, made: dict, kept: dict) -> None:
    """The CUDA test's generate calls: eager, captured as asked, captured by default (twice, and transformers')."""
    from megatron_tree.decode.generate import GenerationHook, generate
    from megatron_tree.integrations.hf import HFTreeModel

    class Kept(GenerationHook):  # keeps every step's logits as handed over (no copy): a replay must not overwrite them
        def __init__(self):
            self.steps = []

        def after_step(self, step, logits):
            self.steps.append(logits)

    for name, setting in (("eager", False), ("captured", {"mode": "reduce-overhead"}), ("default", "auto")):
        model = HFTreeModel(_model("llama").cuda(), None, compile_step=setting)
        hook = Kept()
        runs[name] = generate(model, PROMPTS, STEPS + 1, hook=hook, progress=False).tokens
        kept[name] = torch.stack(hook.steps)
        compiled = model._binding.compiled
        made[name] = None if compiled is None else (sorted(compiled.made), compiled.failed)
        if name == "default":
            # a second call of the same shape takes over the first cache's storage and replays the graphs
            # recorded for it: no new recording (the tree manager counts each one)
            from torch._inductor import cudagraph_trees

            manager = cudagraph_trees.get_container(torch.cuda.current_device()).tree_manager
            recordings, reused = manager.debug_fail_counter, model._binding.pool.reused
            assert generate(model, PROMPTS, STEPS + 1, progress=False).tokens == runs[name]
            assert model._binding.pool.reused == reused + 1
            assert manager.debug_fail_counter == recordings, (recordings, manager.debug_fail_counter)
            # transformers' own generate on the same model: captured steps too
            ids = torch.tensor([PROMPTS[0]], device="cuda")
            runs["transformers"] = model.hf.generate(ids, max_new_tokens=STEPS, do_sample=False)[0].tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs (mode='reduce-overhead') need a CUDA device")
def test_captured_step_on_cuda_equals_eager():
    """One process on CUDA: the step compiled with mode='reduce-overhead' (Inductor's CUDA graphs), asked for
    and by default, replays with the eager step's tokens; logits a hook kept are not overwritten by the next
    replay; a second generate of the same shape replays the first one's recordings (the storage taken over);
    transformers' generate runs the default's captured steps."""
    import gc

    import megatron_tree as mt
    from torch._dynamo.utils import counters

    counters.clear()
    runs, made, kept = {}, {}, {}
    gc.disable()  # (a cache must end with its generate, not at a collection that happens to run)
    try:
        _captured_runs(runs, made, kept)
    finally:
        gc.enable()
    assert runs["captured"] == runs["eager"] == runs["default"]
    for name in ("captured", "default"):  # (Inductor's fused float32 sums: close, not bitwise)
        gap = (kept[name] - kept["eager"]).abs().max()
        assert torch.allclose(kept[name], kept["eager"], rtol=0, atol=1e-4), (name, gap)
    assert runs["transformers"] == PROMPTS[0] + runs["eager"][0][:STEPS]
    assert made["default"][0] and made["default"][1] is None, made  # the default captured, and nothing failed
    # and Inductor did not skip a capture (mutated inputs it copies, a CPU tensor, an op it cannot record)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    del mt


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_a_compiled_steps_graph_takes_every_input_but_the_token_ids_as_static(arch):
    """What lets Inductor's CUDA graphs capture a step, checked on CPU: every tensor the compiled step reads --
    weights, the cache's storage (written in place), the step's metadata, Gemma 2's window starts -- reaches
    Inductor as a static input (a CUDA graph reads it in place; a copied input that the step writes makes
    Inductor skip the capture: "mutated inputs"); only the new token ids (batch, 1) are copied per replay.
    Before: the attention read views of the storage the cache write wrote, AOTAutograd merged the aliased
    pair into one base and no input at all stayed static."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    seen = {}

    def inner(gm, example_inputs, **kwargs):
        seen["shapes"] = [tuple(t.shape) if isinstance(t, torch.Tensor) else t for t in example_inputs]
        seen["static"] = sorted(kwargs.get("static_input_idxs") or [])
        return compile_fx_inner(gm, example_inputs, **kwargs)

    def inductor(gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=inner)

    torch._dynamo.reset()
    eager = generate(HFTreeModel(_model(arch), None, compile_step=False), PROMPTS, 4, progress=False).tokens
    model = HFTreeModel(_model(arch), None, compile_step={"backend": inductor})
    # (the caches would hand back an earlier compilation without calling inner; one compile thread: the graph's
    # C++ compiled in this process, not by a pool of worker processes started for it, each importing torch)
    with torch._inductor.config.patch(fx_graph_cache=False, compile_threads=1), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        assert generate(model, PROMPTS, 4, progress=False).tokens == eager
    copied = [(i, shape) for i, shape in enumerate(seen["shapes"]) if i not in seen["static"]]
    assert copied == [(seen["shapes"].index((len(PROMPTS), 1)), (len(PROMPTS), 1))], (copied, len(seen["shapes"]))
    assert len(seen["shapes"]) > 20  # the weights, the storage and the metadata are inputs, not constants


def test_capture_needs_the_triton_kernels(monkeypatch):
    """MEGATRON_TREE_BACKEND=torch on CUDA: its kernels read the rows' lengths on the host, which a CUDA graph
    cannot record (the capture would fail inside the step). The default runs such steps eagerly; an explicit
    capturing setting is refused naming the variable. (Reads only the device's kind: no GPU needed.)"""
    from megatron_tree.integrations.hf import HFTreeModel
    from megatron_tree.integrations.hf.forward import _check_capturable

    cuda = torch.device("cuda")
    steps = HFTreeModel(_model("llama"), None)._binding.compiled
    monkeypatch.setenv("MEGATRON_TREE_BACKEND", "torch")
    assert not steps.applies(cuda)
    with pytest.raises(ValueError, match=r"runs the 'torch' kernels \(MEGATRON_TREE_BACKEND\)"):
        _check_capturable({"mode": "reduce-overhead"}, cuda, None)
    _check_capturable({"backend": "aot_eager"}, cuda, None)  # compiled, not captured: fine
    monkeypatch.setenv("MEGATRON_TREE_BACKEND", "triton")
    assert steps.applies(cuda)
    _check_capturable({"mode": "reduce-overhead"}, cuda, None)


@pytest.mark.parametrize("setting, says", [
    ({"bogus": 1}, "unexpected keyword argument 'bogus'"),
    ({"backend": "no_such_backend"}, "Invalid backend: 'no_such_backend'"),
    ({"mode": "fastest"}, "Unrecognized mode=fastest"),
    ({"mode": "reduce-overhead", "options": {"triton.cudagraphs": True}}, "Either mode or options"),
])
def test_torch_compile_arguments_it_refuses_are_an_error_naming_compile_step_when_set(setting, says):
    """A dict compile_step is handed to torch.compile at the first decode step, after the prompt's whole prefill;
    what torch.compile refuses (an argument it does not take, a backend not registered, an unknown mode, mode with
    options) is said when the setting is given -- by enable_tree_attention and HFTreeModel, before any forward --
    naming compile_step and the setting, with torch's reason."""
    import re

    from megatron_tree.integrations.hf import HFTreeModel, enable_tree_attention

    for make in (lambda: HFTreeModel(_model("llama"), None, compile_step=setting),
                 lambda: enable_tree_attention(_model("llama"), None, compile_step=setting)):
        with pytest.raises(ValueError, match=re.escape(f"compile_step={setting!r}") + ".*" + re.escape(says)):
            make()


def test_speculative_generation_on_a_compiled_model_says_its_steps_run_eagerly():
    """The package's speculative loop verifies drafts in several-token forwards, which run eagerly: a model
    enabled with an explicit compile_step compiles none of its steps there. Said once per model in a warning
    naming compile_step (the tokens are the eager model's); the default, auto, says nothing."""
    import logging

    from megatron_tree.decode.generate import generate
    from megatron_tree.decode.speculative import SpeculativeConfig
    from megatron_tree.integrations.hf import HFTreeModel

    said = []

    class Said(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logger = logging.getLogger("megatron_tree.integrations")
    handler = Said(level=logging.WARNING)
    logger.addHandler(handler)
    try:
        prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3]]
        want = generate(HFTreeModel(_model("llama"), None, compile_step=False), prompts, 6, progress=False).tokens
        default = HFTreeModel(_model("llama"), None)
        assert generate(default, prompts, 6, speculative=SpeculativeConfig(), progress=False).tokens == want
        assert said == []
        compiled = HFTreeModel(_model("llama"), None, compile_step={"backend": "eager"})
        for _ in range(2):
            assert generate(compiled, prompts, 6, speculative=SpeculativeConfig(), progress=False).tokens == want
        assert len(said) == 1, said
        assert "compile_step" in said[0] and "speculative" in said[0] and "eagerly" in said[0], said
        assert not compiled._binding.compiled.made  # nothing was compiled, as the warning says
    finally:
        logger.removeHandler(handler)


def _auto(rank, world):
    """The default compile_step ('auto') on CPU ranks over gloo: eager steps, as compile_step=False; where it
    would capture (on a GPU over NCCL or alone), a step compiled; a compilation that fails: eager from then on."""
    import logging

    import megatron_tree as mt
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    groups = mt.TreeGroups.build()
    out = {}
    eager = HFTreeModel(_model("llama"), groups, compile_step=False)
    want = generate(eager, PROMPTS, STEPS, progress=False).tokens
    default = HFTreeModel(_model("llama"), groups)
    steps = default._binding.compiled
    out["mode"] = (steps.options.get("mode"), steps.captures)  # where it applies: Inductor's CUDA graphs
    out["default"] = (steps.auto, generate(default, PROMPTS, STEPS, progress=False).tokens == want,
                      sorted(steps.made), default.new_cache(2, 32).static, default.step_batch(3, 32))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    alone = HFTreeModel(_model("llama"), None)._binding.compiled
    out["applies"] = {"cpu_gloo": steps.applies(cpu), "cuda_gloo": steps.applies(cuda),
                      "cuda_alone": alone.applies(cuda), "cpu_alone": alone.applies(cpu),
                      "cuda_alone_shifted": alone.applies(cuda, "shifted")}
    # a CP group of one process over gloo: no collective in its step, so nothing the capture cannot record
    single = HFTreeModel(_model("llama"), mt.TreeGroups.build([[0], [1]]))._binding.compiled
    out["applies"]["cuda_one_rank_gloo"] = single.applies(cuda)
    steps.capture_backends = ("gloo",)  # as NCCL groups would be (none here)
    out["applies"].update(cuda_nccl=steps.applies(cuda), cuda_nccl_shifted=steps.applies(cuda, "shifted"))
    # Where it applies (CPU and gloo made capturable here, compiled by aot_eager: Inductor's CUDA graphs need a
    # GPU), the steps compile: a trace per (batch, cache bucket), the eager tokens; 'shifted' runs eagerly on
    # the same static caches (no refusal: the user asked for nothing)
    def capturable(model, backend):
        steps = model._binding.compiled
        steps.capture_devices, steps.capture_backends = ("cpu",), ("gloo",)
        steps.options = {"backend": backend, "dynamic": False, "fullgraph": True}
        return steps

    applied = HFTreeModel(_model("llama"), groups)
    steps = capturable(applied, "aot_eager")
    got = [generate(applied, PROMPTS, STEPS, strategy=s, progress=False).tokens for s in ("packed", "shifted")]
    out["applied"] = (got == [want, want], sorted(steps.made), applied.new_cache(2, 32).static)

    # a backend that fails: one warning, the failing step and every later one eager, caches dynamic again
    def broken(gm, example_inputs):
        raise RuntimeError("no code generation for this step")

    failing = HFTreeModel(_model("llama"), groups)
    steps = capturable(failing, broken)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("megatron_tree.integrations").addHandler(handler)
    try:
        got = [generate(failing, PROMPTS, STEPS, progress=False).tokens for _ in range(2)]
    finally:
        logging.getLogger("megatron_tree.integrations").removeHandler(handler)
    out["failing"] = (got == [want, want], steps.failed, [r.getMessage() for r in records],
                      failing.new_cache(2, 32).static)
    # an explicit setting that fails raises, as before
    explicit = HFTreeModel(_model("llama"), groups, compile_step={"backend": broken})
    out["explicit"] = outcome(lambda: generate(explicit, PROMPTS, STEPS, progress=False))
    return out


@_shares("auto")
def test_the_default_compile_step_captures_only_where_it_can_and_falls_back_to_eager(shared):
    for out in shared(2, "auto"):
        auto, equal, made, static, batch = out["default"]
        assert auto and equal and made == [] and not static and batch == 3  # CPU over gloo: eager, as before
        assert out["applies"] == {"cpu_gloo": False, "cuda_gloo": False, "cuda_alone": True, "cpu_alone": False,
                                  "cuda_alone_shifted": True, "cuda_nccl": True, "cuda_nccl_shifted": False,
                                  "cuda_one_rank_gloo": True}
        assert out["mode"] == ("reduce-overhead", True), out["mode"]
        equal, made, static = out["applied"]
        assert equal and made == [(3, 64)] and static, out["applied"]
        equal, failed, messages, static = out["failing"]
        assert equal and not static
        assert failed is not None and "BackendCompilerFailed" in failed and "no code generation" in failed
        assert len(messages) == 1 and "compile_step='auto' could not compile the decode step" in messages[0]
        assert "no code generation" in messages[0] and "compile_step=False" in messages[0]
        assert out["explicit"][0] == "BackendCompilerFailed" and "no code generation" in out["explicit"][1]


def _device_backends(rank, world):
    """What the default reads of groups whose default group was made with a backend per device
    ("cpu:gloo,cuda:gloo" here, where there is no NCCL; "cpu:gloo,cuda:nccl" on a GPU machine)."""
    import torch.distributed as dist

    import megatron_tree as mt
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    groups = mt.TreeGroups.build()
    model = HFTreeModel(_model("llama"), groups)
    steps = model._binding.compiled
    out = {"name": str(dist.get_backend(groups.cp_group)), "read": steps._group_backends()}
    steps.capture_backends = ("gloo",)  # as NCCL would be (the backend serving CUDA tensors; none here)
    out["applies"] = (steps.applies(torch.device("cuda")), steps.applies(torch.device("cpu")))
    eager = HFTreeModel(_model("llama"), groups, compile_step=False)
    out["tokens"] = generate(model, PROMPTS, 4, progress=False).tokens == generate(eager, PROMPTS, 4,
                                                                                  progress=False).tokens
    explicit = HFTreeModel(_model("llama"), groups, compile_step={"mode": "reduce-overhead"})
    out["explicit"] = outcome(lambda: generate(explicit, PROMPTS, 4, progress=False))
    return out


def test_the_default_reads_the_backend_that_runs_gpu_tensors_of_a_group_with_one_per_device():
    """A group made with ``"cpu:gloo,cuda:nccl"`` (torch's way to serve CPU and CUDA tensors) runs CUDA tensors'
    collectives on NCCL: the default captures there. It reads the backend serving CUDA tensors from the group's
    backend config, not the group's name (which matched no capturable backend: eager steps on every GPU of such
    a job, and an explicit setting's refusal naming 'cpu:gloo,cuda:nccl' as not NCCL)."""
    for out in run_ranks(_device_backends, 2, backend="cpu:gloo,cuda:gloo", timeout=300):
        assert out["name"] == "cpu:gloo,cuda:gloo" and out["read"] == ("gloo",), out
        assert out["applies"] == (True, False) and out["tokens"]
        kind, message, _ = out["explicit"]
        assert kind == "ValueError" and "KV cache is on cpu" in message, out["explicit"]


def _fallback_stats(rank, world):
    """The CommStats of a generation whose first decode step the default fails to compile (CPU and gloo made
    capturable, a backend that raises), of one that compiles (Dynamo's "eager" backend: the merges' traffic is
    counted by the op bodies, which every backend runs) and of compile_step=False."""
    import megatron_tree as mt
    from megatron_tree import CommStats
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    def broken(gm, example_inputs):
        raise RuntimeError("no code generation for this step")

    groups = mt.TreeGroups.build()
    out = {}
    for name, backend in (("eager", None), ("compiled", "eager"), ("failing", broken)):
        stats = CommStats()
        model = HFTreeModel(_model("llama"), groups, compile_step=False if backend is None else "auto")
        if backend is not None:
            steps = model._binding.compiled
            steps.capture_devices, steps.capture_backends = ("cpu",), ("gloo",)
            steps.options = {"backend": backend, "dynamic": False, "fullgraph": True}
        out[name] = (generate(model, PROMPTS, 5, stats=stats, progress=False).tokens, stats.as_dict())
    return out


@_shares("fallback_stats")
@pytest.mark.parametrize("world", [1, 2])
def test_a_step_the_default_fails_to_compile_counts_its_traffic_once(world, shared):
    """The step whose compilation fails runs eagerly inside ``CompiledSteps.__call__``: its merges record their
    calls themselves, so a one-rank group's step must not add the calls a traced step leaves to be counted
    outside the graph (counted twice, the failing step's calls were double). Every run: the eager counts."""
    for out in shared(world, "fallback_stats"):
        tokens, stats = out["eager"]
        assert stats["calls"] == 4 * 2  # four decode steps (the fifth token), two layers, one merge each
        for name in ("compiled", "failing"):
            assert out[name] == (tokens, stats), (name, out[name], stats)


def test_a_captured_steps_replays_count_the_traffic_its_recording_recorded():
    """CUDA graphs replay kernels, not Python: the merge op's body, which records a step's collectives, runs when
    a captured step is traced and recorded, never at a replay. ``CompiledSteps.account`` adds to the call's
    ``CommStats`` what the op bodies recorded, or, for a step that recorded nothing (a replay), what the same
    step shape and strategy recorded when they last ran. (The captured path itself needs a GPU: the CUDA test.)"""
    from megatron_tree import CommStats
    from megatron_tree.integrations.hf import HFTreeModel

    model = HFTreeModel(_model("llama"), None, compile_step={"mode": "reduce-overhead"})
    steps = model._binding.compiled
    assert steps.captures and not HFTreeModel(_model("llama"), None, compile_step=True)._binding.compiled.captures
    cache, other = model.new_cache(2, 32), model.new_cache(4, 32)
    model.prefill([[1, 2, 3], [4, 5]], cache)  # (storage is made at the prefill)
    model.prefill([[1, 2, 3], [4, 5], [6], [7]], other)
    ids = torch.zeros(2, 1, dtype=torch.long)
    stats = CommStats()
    recorded = steps.recording()  # the trace / recording: the op bodies ran
    recorded.calls += 2
    recorded.fallbacks += 1
    recorded.record_all_reduce("intra", "all_reduce_sum", 1000, 4)
    recorded.record("inter", "all_gather", 64, 32)
    steps.account(ids, cache, "packed", recorded, stats)
    one = stats.as_dict()
    assert one["calls"] == 2 and one["levels"]["intra"]["sent_bytes"] == 1500 and one["levels"]["inter"]["ops"] == {
        "all_gather": 1}
    for _ in range(3):  # replays: nothing recorded, the recording's traffic counted again
        steps.account(ids, cache, "packed", steps.recording(), stats)
    four = stats.as_dict()
    assert four["calls"] == 8 and four["fallbacks"] == 4
    assert four["levels"]["intra"] == {"collectives": 4, "payload_bytes": 4000, "sent_bytes": 6000,
                                       "ops": {"all_reduce_sum": 4}}
    # a step of another shape or strategy that recorded nothing adds nothing: it has no recording of its own
    steps.account(torch.zeros(4, 1, dtype=torch.long), other, "packed", steps.recording(), stats)
    steps.account(ids, cache, "two_level", steps.recording(), stats)
    assert stats.as_dict() == four


def _transformers_generate(rank, world):
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend

    import megatron_tree as mt
    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import hf_greedy, hf_model

    groups = mt.TreeGroups.build()
    prompts = PROMPTS[:2]
    want = _greedy(prompts, STEPS)  # unsharded transformers, this process
    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    model = enable_tree_attention(hf_model("llama"), groups, compile_step={"backend": counter})
    got = hf_greedy(model, prompts, STEPS)  # transformers' own generate, one prompt after the other
    return counter.frame_count, got == want


@_shares("transformers_generate")
def test_transformers_generate_runs_compiled_steps_with_its_own_tokens(shared):
    """``model.generate`` of a model enabled with compile_step at CP 2: the tokens of unsharded transformers,
    at most one compilation per cache shape (two prompts of different lengths: two static caches), as
    transformers' own model with a static cache needs."""
    results = shared(2, "transformers_generate")
    for frames, equal in results:
        assert equal
        assert 1 <= frames <= 2


def _generate_logits(model, prompt, **kw):
    """transformers' greedy generate of STEPS tokens: (new tokens, the logits of every step)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)


def _user_compiled_forward(rank, world, intra=None):
    """A user's ``model.forward = torch.compile(model.forward, fullgraph=True)`` on a tree-enabled model and on
    the same model without tree attention, inside transformers' ``generate`` (dynamic and static cache)."""
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend

    import megatron_tree as mt
    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import hf_model

    groups = mt.TreeGroups.build(intra_size=intra) if intra else mt.TreeGroups.build()
    prompt = PROMPTS[0]
    want = _greedy([prompt], STEPS)[0]  # unsharded, uncompiled transformers
    eager = _generate_logits(enable_tree_attention(hf_model("llama"), groups), prompt)
    # the eager step over a static TreeCache: the shapes a compiled step gets (every slot read, masked)
    eager_static = _generate_logits(enable_tree_attention(hf_model("llama"), groups), prompt,
                                    cache_implementation="static")
    out = {"eager_equal": eager[0] == want == eager_static[0]}
    for cache in ("dynamic", "static"):
        kw = {"cache_implementation": "static"} if cache == "static" else {}
        # transformers' own model compiled is one process's work, the same on every rank and in every run (no
        # groups): rank 0's of the CP-2 run (the 2x2 run's tree step is held to the counts that run checks)
        for who in ("tree", "transformers") if rank == 0 and intra is None else ("tree",):
            ops = []
            # (transformers' own model: the count of Dynamo's frames it needs, the reference the tree's is held
            # to, the same under any backend; its graph is not under test, so Dynamo's "eager" runs it)
            counter = CompileCounterWithBackend("aot_eager" if who == "tree" else "eager")

            def backend(gm, example_inputs, ops=ops, counter=counter):
                ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
                return counter(gm, example_inputs)

            torch._dynamo.reset()
            model = hf_model("llama")
            if who == "tree":
                model = enable_tree_attention(model, groups)
            model.forward = torch.compile(model.forward, fullgraph=True, backend=backend)
            tokens, logits = _generate_logits(model, prompt, **kw)
            out[who, cache] = {"frames": counter.frame_count, "tokens": tokens == want,
                               "logits": torch.equal(logits, eager_static[1]) if who == "tree" else None,
                               "close": torch.allclose(logits, eager[1], rtol=0, atol=1e-5) if who == "tree" else None,
                               "merges": sum(o.startswith("megatron_tree.cp_merge") for o in ops),
                               "attentions": sum(o.startswith("megatron_tree.flash_decode") for o in ops)}
    return out


def _check_user_compiled(results, transformers=True):
    """transformers: the run compiled transformers' own model too (rank 0 of the CP-2 run); its frame counts,
    checked there, are the ones the tree's are held to in every run."""
    for r in results:
        assert r["eager_equal"]
        for cache, theirs in (("dynamic", 3), ("static", 2)):
            tree = r["tree", cache]
            if transformers:
                hf = results[0]["transformers", cache]  # (rank 0 compiled transformers' own)
                assert hf["frames"] == theirs and hf["tokens"], (cache, hf)  # transformers' own count
            # one trace of the step's device half, one of the (empty) frame a fullgraph compile of the
            # prefill's forward counts; never more than transformers' own model needs
            assert tree["frames"] == 2 <= theirs, (cache, tree)
            # the eager step's logits: bit for bit over a cache of the same shape, and close over the default one
            assert tree["tokens"] and tree["logits"] and tree["close"], (cache, tree)
            # both layers' local attention and CP merge are in the traced step
            assert tree["merges"] == tree["attentions"] == 2, (cache, tree)


@_shares("user_compiled")
def test_user_compiled_forward_inside_transformers_generate_at_cp2(shared):
    """``model.forward = torch.compile(model.forward, fullgraph=True)`` after enable_tree_attention, then
    transformers' own ``generate`` (its dynamic cache, and cache_implementation="static"), at CP 2: no graph
    break (fullgraph), two compilations over 12 steps (transformers' own model: 3 and 2), the tokens of
    unsharded transformers and the eager tree step's logits bit for bit."""
    _check_user_compiled(shared(2, "user_compiled"))


_TRACED: list = []
"""What :func:`_recording_backend` saw: one entry per compiled frame, its graph's call targets (a module-level
list: transformers deep-copies the compile config, backend included, and a function is copied as itself)."""


def _recording_backend(gm, example_inputs, **options):
    _TRACED.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
    return gm.forward


def _automatic_compile(rank, world):
    """transformers' own automatic compile of the decode calls (cache_implementation="static" and a
    CompileConfig; ``_compile_all_devices`` lets it run on CPU, as it does on a GPU by default)."""
    import torch
    from transformers import CompileConfig

    import megatron_tree as mt
    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import hf_model

    groups = mt.TreeGroups.build()
    prompt = PROMPTS[0]
    want = _greedy([prompt], STEPS)[0]
    eager = _generate_logits(enable_tree_attention(hf_model("llama"), groups), prompt, cache_implementation="static")
    config = CompileConfig(backend=_recording_backend)
    config._compile_all_devices = True
    torch._dynamo.reset()
    _TRACED.clear()
    tokens, logits = _generate_logits(enable_tree_attention(hf_model("llama"), groups), prompt,
                                      cache_implementation="static", compile_config=config)
    return {"tokens": tokens == want, "logits": torch.equal(logits, eager[1]), "traced": list(_TRACED)}


@_shares("automatic_compile")
def test_transformers_automatic_compile_with_a_static_cache_compiles_the_tree_step(shared):
    """``generate(cache_implementation="static")`` on a tree-enabled model at CP 2 with transformers' automatic
    compile on (its default on a GPU; its mode, reduce-overhead, is CUDA graphs there): transformers compiles
    ``model.__call__``, the call reaches the tree forward (a graph break: its host half is eager) and the
    decode step's device half is traced once, with every layer's attention and CP merge in it; the tokens of
    unsharded transformers, the eager tree step's logits (over a static cache too) bit for bit."""
    for r in shared(2, "automatic_compile"):
        assert r["tokens"] and r["logits"]
        assert len(r["traced"]) == 1, [len(t) for t in r["traced"]]
        for op in ("megatron_tree.flash_decode", "megatron_tree.cp_merge"):
            assert sum(t.startswith(op) for t in r["traced"][0]) == 2, op  # one per layer


@_shares("user_compiled_2x2")
def test_user_compiled_forward_inside_transformers_generate_at_2x2(shared):
    """The same over two levels (two nodes of two ranks): the two-level merge in the user's graph. (transformers'
    own model, compiled in one process alike in every run, is counted by the CP-2 test, not again here.)"""
    _check_user_compiled(shared(4, "user_compiled_2x2"), transformers=False)


def _static_padded(rank, world):
    """``generate(cache_implementation="static")`` on a left-padded batch, eager and under a user's compile of
    ``model.forward``, for a model with ``layer_types`` (Qwen2: transformers builds a dict of masks) and one
    without (Llama: a single mask, which is None for an attention implementation it has no mask function for)."""
    import torch

    import megatron_tree as mt
    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import batch, hf_model

    groups = mt.TreeGroups.build()
    ids, mask = batch()
    out = {}

    def tokens(model):
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 pad_token_id=0, cache_implementation="static")
        return seq[:, ids.shape[1]:].tolist()

    for arch in ("qwen2", "llama"):
        want = tokens(hf_model(arch))  # unsharded transformers, its own static cache and 4-D masks
        for compiled in (False, True):
            model = enable_tree_attention(hf_model(arch), groups)
            if compiled:  # (the masks and the padding under a compile: Dynamo's trace, its "eager" backend)
                torch._dynamo.reset()
                model.forward = torch.compile(model.forward, fullgraph=True, backend="eager")
            try:
                out[arch, compiled] = tokens(model) == want
            except Exception as e:  # noqa: BLE001 -- reported, so every case shows
                out[arch, compiled] = f"{type(e).__name__}: {e}"
    return out


@_shares("static_padded")
def test_static_cache_generate_of_a_left_padded_batch(shared):
    """transformers builds the prefill's masks itself when its cache is compileable (a StaticCache), from the
    model's ``create_masks_for_generate``: without a mask function for tree attention that mask was a dict of
    Nones (Qwen2: an AttributeError in the prefill's check) or None (Llama: the padding attended, other tokens,
    no error). The tree-enabled model hands the 2-D padding mask through: transformers' tokens at CP 3 on
    rows of 29, 17 and 1 tokens, eager and under a user's compile."""
    for r in shared(3, "static_padded"):
        for case, got in r.items():
            assert got is True, (case, got)


def test_user_compile_with_dynamic_shapes_traces_the_step_static():
    """One process: ``torch.compile(model.forward, fullgraph=True, dynamic=True)`` on a left-padded batch. A
    symbolic trace of the step made the storage views' sizes symbolic: with a counting backend the tokens were
    other than transformers' (no error), with "aot_eager" itself a BackendCompilerFailed. The step is traced
    with static shapes whatever dynamic says (each step shape has its own function): transformers' tokens,
    two frames. compile_step={"dynamic": True} is refused, naming dynamic."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import batch, hf_model

    ids, mask = batch()

    def tokens(model):
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                 pad_token_id=0)
        return seq[:, ids.shape[1]:].tolist()

    want = tokens(hf_model("qwen2"))
    for backend in (CompileCounterWithBackend("aot_eager"), "aot_eager"):
        torch._dynamo.reset()
        model = enable_tree_attention(hf_model("qwen2"), None)
        model.forward = torch.compile(model.forward, fullgraph=True, dynamic=True, backend=backend)
        assert tokens(model) == want, backend
        if not isinstance(backend, str):
            assert backend.frame_count == 2
    with pytest.raises(ValueError, match="dynamic=True"):
        enable_tree_attention(hf_model("qwen2"), None, compile_step={"dynamic": True})


def _shifted_user_compile(rank, world):
    import torch

    import megatron_tree as mt
    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import hf_model

    model = enable_tree_attention(hf_model("qwen2"), mt.TreeGroups.build(), strategy="shifted")
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        return outcome(lambda: model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=3, do_sample=False,
                                              pad_token_id=0))


@_shares("shifted_user_compile")
def test_shifted_under_a_user_compile_is_refused_by_name(shared):
    """strategy='shifted' with model.forward compiled by the user, in transformers' generate at CP 2: the
    forward's own CompileError naming the strategy and what to change, on every rank (the check read only the
    package loop's step, so Dynamo traced the merge and reported "Observed exception" with the reason buried)."""
    results = shared(2, "shifted_user_compile")
    assert results[0][:2] == results[1][:2]
    kind, message, _ = results[0]
    assert kind == "CompileError", results[0]
    assert "strategy='shifted'" in message and "leave model.forward uncompiled" in message


def _split_setting(rank, world):
    import megatron_tree as mt
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    groups = mt.TreeGroups.build()
    model = HFTreeModel(_model("llama"), groups, compile_step=rank == 0)
    return outcome(lambda: generate(model, PROMPTS, 3, progress=False))


@_shares("split_setting")
def test_ranks_that_disagree_on_compile_step_raise_the_same_error(shared):
    """One rank compiles its steps, the other does not: a DisagreementError naming compile_step and each
    rank's value, the same on both ranks, at the prefill (before any step)."""
    results = shared(2, "split_setting")
    assert results[0][:2] == results[1][:2]
    kind, message, seconds = results[0]
    assert kind == "DisagreementError" and "compile_step" in message
    assert seconds < 30


def test_caches_of_many_sizes_each_compile_once_past_dynamos_recompile_limit():
    """Dynamo stops at ``recompile_limit`` (8) traces of one code object, and with ``fullgraph=True`` the
    next one is an error: one compiled function shared by every cache failed at the ninth cache size (an eval
    sweeping context lengths; the fault soak's compiled cases, one model after another). Each step shape
    has its own function now. The limit lowered to 2 here (a trace costs seconds; the ninth size past 8 is
    the third past 2): 3 sizes (3 length buckets: 64 to 96 tokens), 3 traces, each cache's tokens those of
    the eager step."""
    from megatron_tree.decode.cache import static_length
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel
    from torch._dynamo.testing import CompileCounterWithBackend

    limit = 2
    sizes = [64]
    while len(sizes) < limit + 1:
        sizes.append(static_length(sizes[-1] + 1))
    counter = CompileCounterWithBackend("eager")  # (Dynamo's traces and its limit: no AOTAutograd pass needed)
    compiled = HFTreeModel(_model("llama"), None, compile_step={"backend": counter})
    eager = HFTreeModel(_model("llama"), None)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=limit):
        for n, size in enumerate(sizes):
            prompt = PROMPTS[n % len(PROMPTS)]
            got = generate(compiled, [prompt], 3, cache=compiled.new_cache(1, size), progress=False)
            want = generate(eager, [prompt], 3, cache=eager.new_cache(1, size), progress=False)
            assert got.tokens == want.tokens, n
    torch._dynamo.reset()
    assert sizes == [64, 80, 96] and counter.frame_count == limit + 1


def test_compiling_a_caller_of_the_model_says_what_to_compile():
    """One process: ``torch.compile(model)`` and ``torch.compile(model.__call__)`` with fullgraph=True run
    (the forward's own frame is skipped, its host half eager) and give the eager logits; a fullgraph
    compile of a user function that calls the model is Dynamo's graph-break error, carrying the reason
    that says to compile model.forward itself; without fullgraph that function runs, with the same logits."""
    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import hf_model

    model = enable_tree_attention(hf_model("llama"), None)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        want = model(ids).logits
        torch._dynamo.reset()
        for compiled in (torch.compile(model, fullgraph=True, backend="aot_eager"),
                         torch.compile(model.__call__, fullgraph=True, backend="aot_eager")):
            assert torch.equal(compiled(ids).logits, want)

        def user_step(x):
            return model(x).logits

        with pytest.raises(Exception, match=r"(?s)Skip inlining.*called the forward of a model running tree "
                                            r"attention.*Compile model.forward itself"):
            torch.compile(user_step, fullgraph=True, backend="aot_eager")(ids)
        torch._dynamo.reset()
        assert torch.equal(torch.compile(user_step, backend="aot_eager")(ids), want)


def test_a_user_compiled_forward_traces_each_step_shape_once_under_a_recompile_limit_of_one():
    """One process: ``model.forward = torch.compile(model.forward, fullgraph=True)`` through transformers'
    generate for prompts of three lengths (three static caches of three length buckets, three step shapes) with
    Dynamo's ``recompile_limit`` at 1: each step shape is a function of its own, traced once (a shared one would
    be recompiled, an error at the limit under fullgraph=True); the tokens of unsharded transformers."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from megatron_tree.decode.cache import static_length
    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import hf_greedy, hf_model

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 120, (n,), generator=g).tolist() for n in (40, 60, 90)]
    assert [static_length(len(p) + STEPS) for p in prompts] == [64, 80, 112]
    counter = CompileCounterWithBackend("eager")  # (Dynamo's traces and its limit: no AOTAutograd pass needed)
    model = enable_tree_attention(hf_model("llama"), None)
    model.forward = torch.compile(model.forward, fullgraph=True, backend=counter)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=1):
        for prompt in prompts:
            assert _generate_logits(model, prompt)[0] == hf_greedy(hf_model("llama"), [prompt], STEPS)[0], prompt
    torch._dynamo.reset()
    assert counter.frame_count == len(prompts) + 1  # a trace per step shape, one of a prefill's empty frame


def _continue_within_bucket(rank, world):
    """generate 4 tokens after an 11-token prompt (a static cache sized for 15: storage of 64), then a second
    generate on the same cache that needs 24 (the cache's length doubles to 30: still the 64 bucket)."""
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend

    import megatron_tree as mt
    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import hf_model

    groups = mt.TreeGroups.build()
    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    model = enable_tree_attention(hf_model("llama"), groups, compile_step={"backend": counter})
    prompt = torch.randint(1, 128, (1, 11), generator=torch.Generator().manual_seed(1))
    follow = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=4, min_new_tokens=4, **kw)
        cache = out.past_key_values
        before = (cache.storage.k.data_ptr(), cache.storage.capacity)
        ids = torch.cat([out.sequences, follow], dim=1)
        out2 = model.generate(ids, past_key_values=cache, max_new_tokens=8, min_new_tokens=8, **kw)
        want = hf_model("llama").generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    return {"storage_kept": (cache.storage.k.data_ptr(), cache.storage.capacity) == before,
            "frames": counter.frame_count, "equal": out2.sequences.tolist() == want.tolist(), "lengths": cache.lengths}


@_shares("continue_within_bucket")
def test_a_static_cache_growing_within_its_bucket_keeps_its_storage(shared):
    """A second generate continuing a static cache past the length it was sized for, but within its storage's
    bucket (``static_length``), keeps the storage (no copy, the step's buffers stay where a captured step reads
    them), compiles no second step and gives transformers' tokens."""
    for r in shared(2, "continue_within_bucket"):
        assert r["storage_kept"] and r["frames"] == 1 and r["equal"], r
        assert r["lengths"] == [11 + 4 + 5 + 8 - 1]  # the last new token is not stored


def test_a_models_next_cache_of_the_same_shape_takes_over_the_last_ones_storage():
    """A captured step replays on the addresses it was recorded with, so each new cache of a model with compiled
    steps takes over the storage its last cache of that shape left when it ended (``decode.cache.StoragePool``):
    every generate call of an eval or of lm-eval's requests then replays the recorded step instead of recording
    it anew. The cache ends when its generate returns (no garbage-collector pass: the trace's own reference
    cycles are collected once, after a step's first call); a cache still alive keeps its storage; a cache of
    another shape drops the kept one; ``reset`` hands one back. Tokens stay eager's throughout."""
    import gc
    import weakref

    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    torch._dynamo.reset()
    eager = generate(HFTreeModel(_model("llama"), None, compile_step=False), PROMPTS, 4, progress=False).tokens
    model = HFTreeModel(_model("llama"), None, compile_step={"backend": "eager"})
    pool = model._binding.pool
    made = []
    new_cache = model.new_cache
    model.new_cache = lambda *a, **k: made.append(new_cache(*a, **k)) or made[-1]

    def storage_of(cache):
        return cache.storage._k.data_ptr(), cache.storage.step_buffers()[-1].data_ptr()

    gc.disable()  # every cache below must end when its last reference goes
    try:
        addresses, alive = [], []
        for _ in range(3):
            assert generate(model, PROMPTS, 4, progress=False).tokens == eager
            addresses.append(storage_of(made[-1]))
            alive.append(weakref.ref(made.pop()))
            assert alive[-1]() is None  # (the loop's cache ended with its generate)
        assert pool.reused == 2 and len(set(addresses)) == 1, (pool.reused, addresses)

        # a cache the caller still holds keeps its storage: the next cache gets storage of its own
        held = model.new_cache(len(PROMPTS), 64)
        assert generate(model, PROMPTS, 4, progress=False, cache=held).tokens == eager
        assert storage_of(held) == addresses[0] and pool.reused == 3
        assert generate(model, PROMPTS, 4, progress=False).tokens == eager
        assert storage_of(made.pop()) != storage_of(held) and pool.reused == 3
        assert generate(model, PROMPTS[:1], 4, progress=False).tokens == eager[:1]  # another shape (batch 1)
        made.clear()
        assert pool.reused == 3 and pool.holds > 0
        held.reset()  # hands the storage back: the next cache of its shape takes it
        assert generate(model, PROMPTS, 4, progress=False).tokens == eager
        assert storage_of(made.pop()) == addresses[0] and pool.reused == 4
        # transformers' generate: the cache its prefill makes ends with it, the next call takes the storage over
        ids = torch.tensor([PROMPTS[0]])
        first = model.hf.generate(ids, max_new_tokens=4, do_sample=False)
        before = pool.reused
        assert torch.equal(model.hf.generate(ids, max_new_tokens=4, do_sample=False), first)
        assert pool.reused == before + 1
        assert first[0, len(PROMPTS[0]):].tolist() == eager[0]
    finally:
        gc.enable()
    from megatron_tree.integrations.hf import release_cache_storage

    kept = pool.holds
    assert kept == pool._kept[1].kv_nbytes > 0 and release_cache_storage(model.hf) == kept
    assert pool.holds == 0 and release_cache_storage(model.hf) == 0


def test_a_cache_on_storage_taken_over_reads_none_of_the_keys_left_there():
    """A cache that takes a storage over (its own again for new prompts, or the model's last cache's) finds the
    keys and values of the prompts before it in the slots, of longer prompts too: its tokens are eager's all the
    same (its rows' free slots are never read, whatever they hold). A cache that grew out of its length bucket
    hands back its last storage (the larger one), which the next cache of that length takes over; a static cache
    made without the model's pool keeps its own across ``reset``; disabling tree attention lets the kept storage go."""
    import gc

    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel, TreeCache, disable_tree_attention

    g = torch.Generator().manual_seed(7)
    long = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (57, 44, 60)]  # + 4 new: the 64 bucket
    torch._dynamo.reset()
    ref = HFTreeModel(_model("llama"), None, compile_step=False)
    want = {"long": generate(ref, long, 4, progress=False).tokens,
            "short": generate(ref, PROMPTS, 4, progress=False).tokens,
            "grown": generate(ref, long[:1], 10, progress=False).tokens}
    model = HFTreeModel(_model("llama"), None, compile_step={"backend": "eager"})
    pool = model._binding.pool
    gc.disable()  # every cache below must end when its last reference goes
    try:
        held = model.new_cache(len(PROMPTS), 64)
        address = None
        for name, prompts in (("long", long), ("short", PROMPTS), ("long", long), ("short", PROMPTS)):
            assert generate(model, prompts, 4, progress=False, cache=held).tokens == want[name], name
            address = address or held.storage._k.data_ptr()
            assert held.storage._k.data_ptr() == address, name  # (its own storage, for each new prompt)
        reused = pool.reused
        del held
        for name, prompts in (("long", long), ("short", PROMPTS)):  # new caches on the storage held filled
            assert generate(model, prompts, 4, progress=False).tokens == want[name], name
        assert pool.reused == reused + 2 and pool._kept[1]._k.data_ptr() == address

        # sized for 4 new tokens (64 slots), grown to 128 slots by 10: the 128-slot storage goes back
        # (through transformers' generate: decode.generate takes caches of a fixed max_seq_len only)
        grown = TreeCache(model.hf, None, new_tokens=4, batch_size=1, static=True, pool=pool)
        ids = torch.tensor(long[:1])
        out = model.hf.generate(ids, past_key_values=grown, max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert [out[0, ids.shape[1]:].tolist()] == want["grown"] and grown.storage.max_seq_len == 128
        kept, address = grown.kv_nbytes, grown.storage._k.data_ptr()
        del grown
        assert pool.holds == kept and pool._kept[1]._k.data_ptr() == address
        reused = pool.reused
        cache = model.new_cache(1, 128)
        assert generate(model, long[:1], 10, progress=False, cache=cache).tokens == want["grown"]
        assert pool.reused == reused + 1 and cache.storage._k.data_ptr() == address
        del cache
        # a static cache the user made without the model's pool keeps its own storage across reset and new prompts
        own = TreeCache(model.hf, None, max_seq_len=64, batch_size=len(PROMPTS), static=True)
        storages = []  # (the objects, not their addresses: a freed storage's memory may come back at the same one)
        for name, prompts in (("long", long), ("short", PROMPTS), ("long", long)):
            assert generate(model, prompts, 4, progress=False, cache=own).tokens == want[name], name
            storages.append(own.storage)
            own.reset()
        assert all(st is storages[0] for st in storages) and pool.reused == reused + 1  # (not the model's pool)
    finally:
        gc.enable()
    assert pool.holds > 0
    disable_tree_attention(model.hf)
    assert pool.holds == 0


def _after_longer_prompts(rank, world):
    """Tokens of longer prompts, then of the short PROMPTS on the storage they left, compiled and eager."""
    import gc

    import megatron_tree as mt
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    groups = mt.TreeGroups.build()
    g = torch.Generator().manual_seed(7)
    long = [torch.randint(1, 128, (n,), generator=g).tolist() for n in (57, 44, 60)]
    torch._dynamo.reset()
    runs = {}
    for name, setting in (("eager", False), ("compiled", {"backend": "eager"})):
        model = HFTreeModel(_model("llama"), groups, compile_step=setting)
        gc.disable()  # (the long prompts' cache ends with its generate)
        try:
            runs[name] = [generate(model, p, 4, progress=False).tokens for p in (long, PROMPTS)]
        finally:
            gc.enable()
    return {"equal": runs["compiled"] == runs["eager"], "reused": model._binding.pool.reused}


@_shares("after_longer_prompts")
def test_at_cp2_a_cache_on_the_storage_of_longer_prompts_reads_none_of_their_keys(shared):
    """At CP 2 a rank's slot holds another position for another prompt length (the load-balanced layout's
    chunks): the slots the long prompts filled past the short ones' tokens hold positions the short prompts'
    steps come to, so a cache that took the storage over must not see them (the placement starts afresh)."""
    for r in shared(2, "after_longer_prompts"):
        assert r == {"equal": True, "reused": 1}, r


def test_a_user_compiled_forwards_cache_ends_with_its_generate():
    """Under a user's ``torch.compile`` of the forward the cache transformers' generate makes ends when the call
    returns (the step's trace is collected after its first call): the next call takes its storage over."""
    import gc

    from megatron_tree.integrations.hf import enable_tree_attention
    from megatron_tree.integrations.hf.common import _MARK

    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        want = _model("llama").generate(ids, max_new_tokens=4, do_sample=False)
    torch._dynamo.reset()
    model = enable_tree_attention(_model("llama"), None)
    model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    pool = getattr(model, _MARK).pool
    gc.disable()
    try:
        with torch.no_grad():
            for call in range(3):
                assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want), call
                assert pool.reused == call, (call, pool.reused)
    finally:
        gc.enable()


def _batches(rank, world):
    """Batch sizes of compiled steps: the lazy default and explicit buckets (the traces and paddings of one rank:
    a batch's padding at CP is the padded_rows test's, at CP 3)."""
    import logging

    import megatron_tree as mt
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel
    from torch._dynamo.testing import CompileCounterWithBackend

    said = []

    class Said(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    logging.getLogger("megatron_tree.integrations").addHandler(Said())
    torch._dynamo.reset()
    groups = mt.TreeGroups.build()
    g = torch.Generator().manual_seed(5)
    pool = [torch.randint(1, 120, (n,), generator=g).tolist() for n in (13, 7, 11, 4, 9)]
    eager = HFTreeModel(_model("llama"), groups)
    out = {}

    def run(name, model, counter, prompts):
        tokens = generate(model, prompts, SWEEP_NEW, progress=False).tokens
        padded_to = model.step_batch(len(prompts), max(map(len, prompts)) + SWEEP_NEW)  # (after: as it was)
        out[name] = {"padded_to": padded_to, "frames": counter.frame_count,
                     "equal": tokens == generate(eager, prompts, SWEEP_NEW, progress=False).tokens,
                     "rows": len(tokens), "said": len(said)}

    lazy_counter = CompileCounterWithBackend("eager")
    lazy = HFTreeModel(_model("llama"), groups, compile_step={"backend": lazy_counter})
    run("lazy4", lazy, lazy_counter, pool[:4])  # the first batch: traced at 4
    run("lazy3", lazy, lazy_counter, pool[:3])  # padded to 4: no new trace
    run("lazy1", lazy, lazy_counter, pool[4:])  # 4 > 2 x 1: traced at 1
    run("lazy2", lazy, lazy_counter, pool[1:3])  # padded to 4 (<= 2 x 2)
    long = [torch.randint(1, 120, (n,), generator=g).tolist() for n in (70, 66, 61)]
    run("lazy3_long", lazy, lazy_counter, long)  # a cache of another length bucket: a new trace, so not padded
    run("lazy5", lazy, lazy_counter, pool)  # 4 < 5: traced at 5
    # the smallest size traced for this length bucket in [n, 2n]
    out["lazy_fits"] = [lazy.step_batch(n, 13 + SWEEP_NEW) for n in (1, 2, 3, 4, 5)]
    # a cache of the caller's own: the batch runs as it is (no extra rows), a new trace at 3
    own = generate(lazy, pool[:3], SWEEP_NEW, cache=lazy.new_cache(3, 13 + SWEEP_NEW), progress=False).tokens
    out["own_cache"] = (own == generate(eager, pool[:3], SWEEP_NEW, progress=False).tokens, lazy_counter.frame_count)
    bucket_counter = CompileCounterWithBackend("eager")
    bucketed = HFTreeModel(_model("llama"), groups, compile_step={"backend": bucket_counter}, batch_buckets=[2])
    run("bucket1", bucketed, bucket_counter, pool[4:])  # padded to the bucket 2
    run("bucket3", bucketed, bucket_counter, pool[:3])  # larger than every bucket: eager, said once
    run("bucket5", bucketed, bucket_counter, pool)  # eager, not said again
    two_counter = CompileCounterWithBackend("eager")
    two = HFTreeModel(_model("llama"), groups, compile_step={"backend": two_counter}, batch_buckets=[4, 2])
    out["two_fits"] = [two.step_batch(n) for n in (1, 2, 3, 4, 5)]  # the smallest bucket holding n (unsorted given)
    run("two3", two, two_counter, pool[:3])  # padded to the bucket 4
    # transformers' generate does not pad: 3 rows, not a bucket, run eagerly (no trace), said once
    ids = torch.tensor([p[:4] for p in pool[:3]])
    kw = dict(max_new_tokens=SWEEP_NEW, min_new_tokens=SWEEP_NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        seq = two.hf.generate(ids, **kw)
        out["hf3"] = (seq.tolist() == _model("llama").generate(ids, **kw).tolist(), two_counter.frame_count)
    out["said"] = said
    return out


def _batch_settings(rank, world):
    """What the ranks must agree on (buckets, torch.compile arguments) and the batch settings refused."""
    import megatron_tree as mt
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel
    from torch._dynamo.testing import CompileCounterWithBackend

    groups = mt.TreeGroups.build()
    g = torch.Generator().manual_seed(5)
    pool = [torch.randint(1, 120, (n,), generator=g).tolist() for n in (13, 7, 11, 4, 9)]  # (_batches' prompts)
    out = {}
    # every CP rank must hold the same compile setting: buckets, then torch.compile arguments
    odd = HFTreeModel(_model("llama"), groups, compile_step={"backend": "aot_eager"},
                      batch_buckets=(2,) if rank == 0 else (2, 4))
    out["disagree_buckets"] = outcome(lambda: generate(odd, pool[:2], 2, progress=False))
    modes = HFTreeModel(_model("llama"), groups, compile_step={"backend": "aot_eager"} if rank else True)
    out["disagree_backend"] = outcome(lambda: generate(modes, pool[:2], 2, progress=False))
    # callable backends of one class are told apart by their settings (not by the class name alone)
    counted = HFTreeModel(_model("llama"), groups,
                          compile_step={"backend": CompileCounterWithBackend("aot_eager" if rank else "eager")})
    out["disagree_counter"] = outcome(lambda: generate(counted, pool[:2], 2, progress=False))
    import numpy as np

    out["accepted"] = [HFTreeModel(_model("llama"), groups, compile_step=True,
                                   batch_buckets=b)._binding.compiled.batches for b in (range(1, 3), [np.int64(4), 1])]
    # a callable backend is named by its name; a dict option by its values
    named = HFTreeModel(_model("llama"), groups, compile_step={"backend": CompileCounterWithBackend("aot_eager")
                                                              if rank else _other_backend})
    out["disagree_callable"] = outcome(lambda: generate(named, pool[:2], 2, progress=False))
    nested = HFTreeModel(_model("llama"), groups, compile_step={"backend": "inductor",
                                                               "options": {"max_autotune": bool(rank)}})
    out["disagree_options"] = outcome(lambda: generate(nested, pool[:2], 2, progress=False))
    short = HFTreeModel(_model("llama"), groups)
    short.step_batch = lambda n, max_seq_len: n - 1  # a model's step_batch must not drop prompts
    out["bad_step_batch"] = outcome(lambda: generate(short, pool[:2], 2, progress=False))
    for name, kwargs in (("zero", {"compile_step": True, "batch_buckets": [0, 2]}),
                         ("repeated", {"compile_step": True, "batch_buckets": (2, 2)}),
                         ("text", {"compile_step": True, "batch_buckets": "4"}),
                         ("flag", {"compile_step": True, "batch_buckets": [True, 2]}),
                         ("fraction", {"compile_step": True, "batch_buckets": [1, 2.5]}),
                         ("uncompiled", {"compile_step": False, "batch_buckets": (1, 2)}),
                         ("default", {"batch_buckets": (1, 2)})):  # (auto: the buckets of its captured steps)
        out[name] = outcome(lambda kw=kwargs: HFTreeModel(_model("llama"), groups, **kw))
    return out


def _other_backend(gm, example_inputs):
    """A torch.compile backend of another name (its graph runs as traced)."""
    return gm.forward


@_shares("batches", "batch_settings")
def test_compiled_steps_bucket_batches_and_ranks_agree_on_the_setting(shared):
    """An eval's last, partial batch reuses the full batches' compiled step (padded with copies of its shortest
    prompt; not where the cache's length bucket has no step to reuse), explicit ``batch_buckets`` pad up to a
    bucket and run a batch beyond them eagerly, saying so once; tokens equal the eager model's every time.
    Ranks whose compile settings differ all raise the same DisagreementError at the prefill; bad buckets are
    refused, naming the setting. (The traces and paddings on one rank, the settings at CP 2.)"""
    for r in shared(1, "batches"):
        expect = {"lazy4": (4, 1), "lazy3": (4, 1), "lazy1": (1, 2), "lazy2": (4, 2), "lazy3_long": (3, 3),
                  "lazy5": (5, 4), "bucket1": (2, 1), "bucket3": (3, 1), "bucket5": (5, 1), "two3": (4, 1)}
        for name, (padded, frames) in expect.items():
            assert (r[name]["padded_to"], r[name]["frames"]) == (padded, frames), (name, r[name])
            assert r[name]["equal"], name
        assert [r[n]["rows"] for n in ("lazy4", "lazy3", "lazy1", "lazy2", "lazy3_long", "lazy5", "two3")] == \
            [4, 3, 1, 2, 3, 5, 3]
        assert r["lazy_fits"] == [1, 4, 4, 4, 5] and r["two_fits"] == [2, 2, 4, 4, 5], r
        assert r["own_cache"] == (True, 5), r["own_cache"]
        assert r["hf3"] == (True, 1), r["hf3"]
        # said once, at the first eager step, naming the batch and the buckets
        assert [r[n]["said"] for n in ("lazy2", "bucket1", "bucket3", "bucket5")] == [0, 0, 1, 1]
        assert "3 rows runs eagerly" in r["said"][0] and "batch_buckets=(2,)" in r["said"][0], r["said"]
        assert "larger than every bucket" in r["said"][0], r["said"]
        assert len(r["said"]) == 2 and "3 rows runs eagerly" in r["said"][1], r["said"]
        assert "not one of batch_buckets=(2, 4)" in r["said"][1], r["said"]
    results = shared(2, "batch_settings")
    for r in results:
        for key, what in (("disagree_buckets", "batch_buckets="), ("disagree_backend", "backend="),
                          ("disagree_callable", "_other_backend"), ("disagree_options", "max_autotune"),
                          ("disagree_counter", "CompileCounterWithBackend(backend='aot_eager')")):
            assert r[key][0] == "DisagreementError" and "compile_step" in r[key][1] and what in r[key][1], r[key]
        assert r["accepted"] == [(1, 2), (1, 4)]  # a range, numpy integers: sorted ints
        for key in ("zero", "repeated", "text", "flag", "fraction"):
            assert r[key][0] == "ValueError" and "batch_buckets must be" in r[key][1], r[key]
        assert r["uncompiled"][0] == "ValueError" and "set compile_step" in r["uncompiled"][1]
        assert r["default"][0] == "returned", r["default"]
        bad = r["bad_step_batch"]
        assert bad[0] == "ValueError" and "step_batch(2, " in bad[1] and "returned 1" in bad[1], bad
    assert results[0]["disagree_buckets"][1] == results[1]["disagree_buckets"][1]


def _padded_rows(rank, world):
    """A batch of 3 padded to the bucket 4 against the eager model's unpadded batch of 3: greedy (a hook's
    logits), sampled with a seed, stopping on a token of the padded (last) row and of another row, teacher-forced;
    then a cache passed in (not padded: eager, said once, naming the cache)."""
    import logging

    import megatron_tree as mt
    from megatron_tree.decode.generate import GenerationHook, generate
    from megatron_tree.integrations.hf import HFTreeModel
    from torch._dynamo.testing import CompileCounterWithBackend

    said = []

    class Said(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    class Logits(GenerationHook):
        def __init__(self):
            self.seen = []

        def after_prefill(self, logits):
            self.seen.append(logits.clone())

        def after_step(self, step, logits):
            self.seen.append(logits.clone())

    logging.getLogger("megatron_tree.integrations").addHandler(Said())
    torch._dynamo.reset()
    groups = mt.TreeGroups.build()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 90, (n,), generator=g).tolist() for n in (9, 4, 7)]  # around gemma2's window 5
    counter = CompileCounterWithBackend("eager")
    compiled = HFTreeModel(_model("gemma2"), groups, compile_step={"backend": counter}, batch_buckets=(4,))
    eager = HFTreeModel(_model("gemma2"), groups)

    def both(**kw):
        """(compiled, eager): tokens and the hook's logits of each."""
        runs = []
        for model in (compiled, eager):
            hook = Logits()
            runs.append((generate(model, prompts, SWEEP_NEW + 3, hook=hook, progress=False, **kw).tokens, hook.seen))
        return runs

    out = {"padded_to": compiled.step_batch(3)}
    (got, got_logits), (greedy, want_logits) = both()
    out["greedy"] = got == greedy
    out["shapes"] = [tuple(x.shape) for x in got_logits] == [tuple(x.shape) for x in want_logits] == \
        [(3, compiled.config.vocab_size)] * len(want_logits)
    out["logits"] = max(float((a - b).abs().max()) for a, b in zip(got_logits, want_logits))
    (got, _), (want, _) = both(do_sample=True, temperature=1.3, top_k=40, top_p=0.95, seed=11)
    out["sampled"] = (got == want, len({tuple(r) for r in got}) > 1)
    # row 1 is the shortest: the padded row copies it (and produces its tokens)
    for name, stop in (("stop_copied", greedy[1][1]), ("stop_first", greedy[0][2])):
        (got, _), (want_stop, _) = both(stop_token_ids=[stop])
        out[name] = (got == want_stop, [len(r) for r in want_stop])
    forced = torch.randint(3, 90, (3, SWEEP_NEW + 3), generator=g)
    (_, got_logits), (_, want_logits) = both(forced_tokens=forced)
    out["forced"] = max(float((a - b).abs().max()) for a, b in zip(got_logits, want_logits))
    out["frames"] = counter.frame_count
    before = len(said)
    tokens = generate(compiled, prompts, SWEEP_NEW, cache=compiled.new_cache(3, 32), progress=False).tokens
    out["own_cache"] = (tokens == generate(eager, prompts, SWEEP_NEW, progress=False).tokens, said[before:],
                        counter.frame_count)
    return out


@_shares("padded_rows")
def test_padded_rows_leave_sampling_stops_forcing_and_hooks_to_the_real_rows(shared):
    """CP 3 (not a power of two), Gemma 2 (windows, soft-capping): the rows a batch is padded with are invisible
    to everything the caller sees: a hook gets the real rows' logits (those of the unpadded eager batch), a
    seeded sample draws the same tokens (the generator sees only the real rows), a stop token of the shortest
    row (which the padded copy of it also produces) stops that row only, and teacher forcing feeds the real rows. A cache
    the caller passes in is not padded: its 3-row step runs eagerly, the warning saying why."""
    for r in shared(3, "padded_rows"):
        assert r["padded_to"] == 4 and r["greedy"] and r["shapes"], r
        assert r["logits"] <= 1e-5 and r["forced"] <= 1e-5, r
        assert r["sampled"] == (True, True), r["sampled"]
        for name in ("stop_copied", "stop_first"):
            equal, lengths = r[name]
            assert equal and min(lengths) < SWEEP_NEW + 3, (name, r[name])  # a row did stop early
        assert r["frames"] == 1, r["frames"]  # every padded call: the one trace at 4 rows
        equal, said, frames = r["own_cache"]
        assert equal and frames == 1, r["own_cache"]
        assert len(said) == 1 and "3 rows runs eagerly" in said[0] and "not in a cache passed to it" in said[0], said


def test_padded_rows_are_copies_of_the_shortest_prompt_fed_its_own_tokens():
    """The extra rows of a padded batch prefill the shortest prompt (the first of equals: the cheapest rows to
    add), and every decode step feeds them that row's token, so each extra row decodes exactly as the row it
    copies (one process; the rows the caller sees are the unpadded batch's)."""
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel

    class Padded(HFTreeModel):
        """An eager model that asks for two extra rows and keeps what it is given."""

        def step_batch(self, batch, max_seq_len=None):
            return batch + 2

        def prefill(self, prompts, cache, **kw):
            self.rows, self.fed = [list(p) for p in prompts], []
            return super().prefill(prompts, cache, **kw)

        def decode_step(self, next_ids, cache, step=None, **kw):
            self.fed.append(next_ids.tolist())
            return super().decode_step(next_ids, cache, step, **kw)

    prompts = [[5, 17, 90, 3, 42, 8], [9, 10, 11], [1, 2, 3, 4], [7, 7, 7]]  # row 1 the shortest (row 3: as short)
    model = Padded(_model("llama"), None)
    tokens = generate(model, prompts, 5, progress=False).tokens
    assert tokens == generate(HFTreeModel(_model("llama"), None), prompts, 5, progress=False).tokens
    assert model.rows == prompts + [prompts[1]] * 2, model.rows
    assert len(model.fed) == 4 and all(ids[4:] == [ids[1]] * 2 for ids in model.fed), model.fed
    assert [ids[1] for ids in model.fed] == tokens[1][:4]


def _stats(rank, world):
    import megatron_tree as mt
    from megatron_tree.comm.merge import CommStats
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    groups = mt.TreeGroups.build(intra_size=2) if world == 4 else mt.TreeGroups.build()
    counter = CompileCounterWithBackend("eager")
    strategy = "two_level" if world == 4 else "packed"
    compiled = HFTreeModel(_model("llama"), groups, strategy=strategy, compile_step={"backend": counter})
    eager = HFTreeModel(_model("llama"), groups, strategy=strategy)
    wants = {}  # the eager model's traffic for n tokens, generated once per n (the same calls every time)

    def eager_stats(n):
        if n not in wants:
            wants[n] = CommStats()
            generate(eager, PROMPTS, n, stats=wants[n], progress=False)
        return wants[n].as_dict()

    frames, same = [], []
    for n in (4, 3, None, 5, 4):  # a new CommStats per call, as the eval makes one per run (None: no stats)
        got = None if n is None else CommStats()
        generate(compiled, PROMPTS, n or 3, stats=got, progress=False)
        frames.append(counter.frame_count)
        if got is not None:
            same.append((got.as_dict() == eager_stats(n), got.calls))
    # a step of a batch beyond every bucket runs uncompiled, through the same slot: it records into the call's
    # CommStats, not into the slot
    bucketed = HFTreeModel(_model("llama"), groups, strategy=strategy, compile_step={"backend": "eager"},
                           batch_buckets=(1,))
    got = CommStats()
    generate(bucketed, PROMPTS, 3, stats=got, progress=False)
    same.append((got.as_dict() == eager_stats(3), got.calls))
    # transformers' own generate with the model's stats (stats=): each compiled step records into them, and the
    # steps after it are plain ones of the model's strategy and stats again
    ids = torch.tensor([p[:3] for p in PROMPTS])
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    hf_stats = []
    for compile_step in ({"backend": "eager"}, False):
        st = CommStats()
        hf = HFTreeModel(_model("llama"), groups, strategy=strategy, stats=st, compile_step=compile_step).hf
        with torch.no_grad():
            seq = hf.generate(ids, **kw).tolist()
            seq += hf.generate(ids, **kw).tolist()
        hf_stats.append((seq, st.as_dict(), st.calls))
    (seq, got, calls), (want_seq, want, _) = hf_stats
    same.append((seq == want_seq and got == want, calls))
    return frames, same


@_shares("stats")
@pytest.mark.parametrize("world", [1, 2, 4])
def test_compiled_steps_record_each_calls_stats_without_tracing_again(world, shared):
    """Each ``generate(stats=CommStats())`` of a compiled model records the same traffic as the eager model's (one
    merge per layer per step, its collectives per level), and a new CommStats is not a new trace: the traced
    step holds the model's one ``StatsSlot``, which points at the call's CommStats while it runs. One trace
    with stats and one without, whatever the number of calls (before: one more per CommStats, and Dynamo's
    recompile limit of 8 per step shape ended an eval of 9 runs with an error). A one-rank group too: its merges
    are no collectives, but the compiled step counts its merge calls as the eager one does (before: none)."""
    for frames, same in shared(world, "stats"):
        assert frames == [1, 1, 2, 2, 2], frames
        assert all(equal and calls > 0 for equal, calls in same), same


def _user_compiled_loop(rank, world):
    import megatron_tree as mt
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    groups = mt.TreeGroups.build()
    counter = CompileCounterWithBackend("eager")  # (Dynamo's traces counted, the caches' kind: no AOTAutograd pass)
    model = HFTreeModel(_model("llama"), groups)
    model.hf.forward = torch.compile(model.hf.forward, fullgraph=True, backend=counter)
    eager = HFTreeModel(_model("llama"), groups)
    tokens, frames = [], []
    for _ in range(2):
        tokens.append(generate(model, PROMPTS, STEPS, progress=False).tokens)
        frames.append(counter.frame_count)
    return {"equal": tokens[0] == tokens[1] == generate(eager, PROMPTS, STEPS, progress=False).tokens,
            "static": model.new_cache(3, 32).static, "frames": frames}


@_shares("user_compiled_loop")
def test_the_package_loop_runs_a_users_compiled_forward(shared):
    """A user's ``model.hf.forward = torch.compile(model.hf.forward, fullgraph=True)`` on an ``HFTreeModel`` and the
    package's ``generate`` (not transformers'): the loop's caches are static, so the decode step's device half is
    traced once for both calls (it was refused: "needs a static TreeCache"), the eager model's tokens, at CP 3."""
    for r in shared(3, "user_compiled_loop"):
        assert r["equal"] and r["static"], r
        # as under transformers' generate (_check_user_compiled): one trace of the step's device half and one of
        # the (empty) frame a fullgraph compile of the prefill's forward counts -- none more in the second call
        assert r["frames"] == [2, 2], r["frames"]


def _auto_edges(rank, world):
    """The default compile_step's edges on CPU ranks over gloo: what it leaves eager (a cache transformers' forward
    makes, a batch bucket, a model of strategy shifted, a dynamic cache its caller made), a graph that fails as it
    runs (not a compilation: raised, not swallowed), and the traffic of the steps it captures counted as the eager
    steps' (CPU and gloo made capturable here, as in _auto)."""
    import megatron_tree as mt
    from megatron_tree import CommStats
    from megatron_tree.decode.generate import generate
    from megatron_tree.integrations.hf import HFTreeModel
    from megatron_tree.integrations.hf.cache import TreeCache

    groups = mt.TreeGroups.build()
    out = {}
    default = HFTreeModel(_model("llama"), groups, batch_buckets=(4,))
    with torch.no_grad():
        made = default.hf(torch.tensor([PROMPTS[1]]), use_cache=True).past_key_values
    out["eager"] = (made.static, default.step_batch(3, 32))
    # a model of strategy 'shifted' at CP 2: eager steps by default (an explicit setting is refused at enable)
    eager = HFTreeModel(_model("llama"), groups, compile_step=False)
    want = CommStats()  # (a strategy other than the model's: the traffic is remembered per step's strategy)
    tokens = generate(eager, PROMPTS, STEPS, strategy="packed", stats=want, progress=False).tokens
    shifted = HFTreeModel(_model("llama"), groups, strategy="shifted")
    out["shifted"] = (shifted._binding.compiled.auto, generate(shifted, PROMPTS, STEPS, progress=False).tokens ==
                      generate(eager, PROMPTS, STEPS, strategy="shifted", progress=False).tokens)

    def capturable(model, backend):
        steps = model._binding.compiled
        steps.capture_devices, steps.capture_backends = ("cpu",), ("gloo",)
        steps.options = {"backend": backend, "dynamic": False, "fullgraph": True}
        return steps

    def fails_as_it_runs(gm, example_inputs):
        def run(*args):
            raise RuntimeError("the step's graph failed as it ran")
        return run

    running = HFTreeModel(_model("llama"), groups)
    steps = capturable(running, fails_as_it_runs)
    out["runtime"] = (outcome(lambda: generate(running, PROMPTS, STEPS, progress=False)), steps.failed)

    captured = HFTreeModel(_model("llama"), groups)
    steps = capturable(captured, "aot_eager")
    steps.captures = True  # as a CUDA graph's steps: their traffic goes through account (here every step records)
    runs = []
    for _ in range(2):
        got = CommStats()
        ran = generate(captured, PROMPTS, STEPS, strategy="packed", stats=got, progress=False)
        runs.append((ran.tokens == tokens, got.as_dict() == want.as_dict(), got.calls))
    out["captured"] = (runs, want.calls, [strategy for _, strategy in steps.traffic])
    # a dynamic cache its caller made: the default runs its steps eagerly (an explicit setting refuses it)
    made = sorted(steps.made)
    dynamic = TreeCache(captured.hf, groups, max_seq_len=32, batch_size=len(PROMPTS), static=False)
    out["dynamic"] = (generate(captured, PROMPTS, STEPS, cache=dynamic, progress=False).tokens == tokens,
                      sorted(steps.made) == made)
    return out


@_shares("auto_edges")
def test_the_default_leaves_eager_what_it_cannot_capture_and_raises_what_fails_as_it_runs(shared):
    for out in shared(2, "auto_edges"):
        static, batch = out["eager"]
        assert not static and batch == 3, out["eager"]  # eager on CPU: a dynamic cache, no bucket padding
        assert out["shifted"] == (True, True), out["shifted"]
        (kind, message, _), failed = out["runtime"]
        assert kind == "RuntimeError" and "failed as it ran" in message and failed is None, out["runtime"]
        runs, calls, keys = out["captured"]
        assert calls > 0 and runs == [(True, True, calls)] * 2, out["captured"]
        assert keys and set(keys) == {"packed"}, keys
        assert out["dynamic"] == (True, True), out["dynamic"]


def test_a_model_whose_layers_store_other_shapes_than_its_config_still_reuses_the_kept_storage():
    """A config that misdescribes the layers' KV shapes (here num_key_value_heads set after the model was built:
    the layers keep 2 heads) sizes each cache's first storage wrongly, and the first write re-makes it
    (``TreeCache._reshape``). The model's pool remembers the layers' shapes: its later caches start with them and
    take over the storage the last one left (before, each one dropped the kept storage when it allocated for the
    config's shapes, so a captured step re-recorded at every generate). Tokens stay transformers' own."""
    import gc

    from megatron_tree.integrations.hf import enable_tree_attention
    from megatron_tree.integrations.hf.common import _MARK
    from tests.helpers.hf_models import hf_model

    def model(**kw):
        m = hf_model("llama")
        m.config.num_key_value_heads = 4  # (the layers keep their 2 KV heads)
        return m if not kw else enable_tree_attention(m, None, **kw)

    torch._dynamo.reset()
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        want = model().generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        compiled = model(compile_step={"backend": "eager"})
        pool = getattr(compiled, _MARK).pool
        for _ in range(3):
            got = compiled.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(got, want)
            gc.collect()
    assert pool.reused == 2, pool.reused  # (0 before: every cache allocated twice)
    assert pool.layer_shapes == {(4, 16, 16): (2, 16, 16)}


def test_a_deep_copy_of_a_static_cache_is_a_cache_of_its_own():
    """transformers' prefix reuse (``copy.deepcopy(prompt_cache)``, then a generate per continuation) on a model
    with compiled steps: the copy's layers answer for the copy (not for the cache copied, which they pointed to
    once the layers held their cache weakly), the copy shares the model's storage pool (a deep copy had copied
    the pool, with the storage it kept), and it hands its own storage back when it ends. Tokens: eager's."""
    import copy
    import gc

    from megatron_tree.integrations.hf import enable_tree_attention
    from megatron_tree.integrations.hf.common import _MARK
    from tests.helpers.hf_models import hf_model

    torch._dynamo.reset()
    prefix = torch.tensor([PROMPTS[0]])
    tails = ([7, 8], [9, 10, 11])
    runs = {}
    for name, setting in (("eager", False), ("compiled", {"backend": "eager"})):
        model = enable_tree_attention(hf_model("llama"), None, compile_step=setting)
        pool = getattr(model, _MARK).pool
        with torch.no_grad():
            model.generate(prefix, max_new_tokens=4, do_sample=False, pad_token_id=0)  # (the pool keeps its storage)
            gc.collect()
            prompt_cache = model(prefix, use_cache=True).past_key_values
            out = []
            for tail in tails:
                cache = copy.deepcopy(prompt_cache)
                if name == "compiled":
                    assert cache._pool is pool and cache.storage is not prompt_cache.storage
                    assert [layer.get_seq_length() for layer in cache.layers] == [len(PROMPTS[0])] * 2
                ids = torch.cat([prefix, torch.tensor([tail])], dim=1)
                out.append(model.generate(ids, past_key_values=cache, max_new_tokens=5, do_sample=False,
                                          pad_token_id=0).tolist())
                if name == "compiled":  # the copy grew; the prompt's cache and its layers did not
                    assert [layer.get_seq_length() for layer in cache.layers] == [cache.get_seq_length()] * 2
                    assert cache.get_seq_length() > prompt_cache.get_seq_length() == len(PROMPTS[0])
                del cache
                gc.collect()
            runs[name] = out
        if name == "compiled":
            reused = pool.reused
            del prompt_cache
            gc.collect()
            assert pool.holds > 0 and pool.reused == reused
    assert runs["compiled"] == runs["eager"]


def test_a_shallow_copy_keeps_the_storage_from_the_pool():
    """``copy.copy(cache)`` shares the cache's storage. The cache copied ending must not hand that storage to the
    model's pool while the copy still decodes on it: the model's next cache of the same shape would take it over
    and the two conversations would write each other's keys (before: both went on silently with wrong tokens).
    Both conversations, interleaved step by step, give the eager model's tokens."""
    import copy
    import gc

    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import hf_model

    torch._dynamo.reset()

    def run(setting):
        model = enable_tree_attention(hf_model("llama"), None, compile_step=setting)
        seqs = [torch.tensor([PROMPTS[0]]), torch.tensor([[9, 8, 7, 6, 5]])]
        with torch.no_grad():
            out = model(seqs[0], use_cache=True)
            alias = copy.copy(out.past_key_values)
            seqs[0] = torch.cat([seqs[0], out.logits[:, -1:].argmax(-1)], 1)
            del out
            gc.collect()  # the cache copied ends; its copy goes on
            out = model(seqs[1], use_cache=True)  # a new conversation, a cache of the same shape
            caches = [alias, out.past_key_values]
            seqs[1] = torch.cat([seqs[1], out.logits[:, -1:].argmax(-1)], 1)
            shared = caches[0].storage is caches[1].storage
            for _ in range(6):
                for i in (0, 1):
                    last = torch.tensor([[int(seqs[i][0, -1])]])
                    logits = model(last, past_key_values=caches[i], use_cache=True).logits
                    seqs[i] = torch.cat([seqs[i], logits[:, -1:].argmax(-1)], 1)
        return [s.tolist() for s in seqs], shared

    (want, _), (got, shared) = run(False), run({"backend": "eager"})
    assert not shared and got == want


def test_a_step_fed_a_slice_of_its_sequence_compiles_once():
    """The usual hand-written decode loop feeds ``seq[:, -1:]``: a (batch, 1) view whose stride is the sequence's
    length, one more at every step. The compiled step is traced once all the same (it takes a contiguous copy):
    before, Dynamo recompiled it at every step on the stride of the ids and an explicit compile_step raised at
    the 9th ("recompile limit exceeded"). Tokens: eager's."""
    from megatron_tree.integrations.hf import enable_tree_attention
    from tests.helpers.hf_models import hf_model
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    runs = {}
    for name, setting in (("eager", False), ("compiled", {"backend": counter})):
        model = enable_tree_attention(hf_model("llama"), None, compile_step=setting)
        seq = torch.tensor([PROMPTS[0]])
        with torch.no_grad():
            out = model(seq, use_cache=True)
            cache = out.past_key_values
            for _ in range(STEPS):
                seq = torch.cat([seq, out.logits[:, -1:].argmax(-1)], 1)
                out = model(seq[:, -1:], past_key_values=cache, use_cache=True)
        runs[name] = seq.tolist()
    assert runs["compiled"] == runs["eager"]
    assert counter.frame_count == 1, counter.frame_count



_SHARED = {
    1: {"stats": (_stats, ()), "fallback_stats": (_fallback_stats, ()), "sweep": (_sweep, ()),
        "batches": (_batches, ())},
    2: {"llama": (_generate, ("llama",)), "refusals": (_refusals, ()), "auto": (_auto, ()),
        "auto_edges": (_auto_edges, ()), "fallback_stats": (_fallback_stats, ()), "stats": (_stats, ()),
        "transformers_generate": (_transformers_generate, ()), "user_compiled": (_user_compiled_forward, ()),
        "automatic_compile": (_automatic_compile, ()), "shifted_user_compile": (_shifted_user_compile, ()),
        "split_setting": (_split_setting, ()), "continue_within_bucket": (_continue_within_bucket, ()),
        "after_longer_prompts": (_after_longer_prompts, ()), "batch_settings": (_batch_settings, ())},
    3: {"gemma2": (_generate, ("gemma2",)), "static_padded": (_static_padded, ()), "padded_rows": (_padded_rows, ()),
        "user_compiled_loop": (_user_compiled_loop, ())},
    4: {"llama_2x2": (_generate, ("llama", 2, "two_level")), "user_compiled_2x2": (_user_compiled_forward, (2,)),
        "stats": (_stats, ())},
}
"""Per number of ranks, the bodies of this module's tests that run together in one run of that many ranks
(the ``shared`` fixture; run_ranks' defaults: gloo, one thread per rank)."""
