"""The eval's launch and setup: command line, launcher environment, checks before launch, the run.

Invariant: everything that can be known wrong without a process group is checked here
first, identically on every rank -- the TP x CP layout against the launched world, the
topology against the launcher's nodes, the checkpoint's files, metadata and shapes,
``output_dir`` -- and reported as one line per rank (``megatron-tree-eval: rank R: error:
...``) with exit status 2, before any collective. Global rank 0 removes an earlier
``results.json`` as soon as the config is read, so a run that fails cannot leave one
behind that looks like its own.

:func:`run_eval` strings the parts together: process group, model (:mod:`.models`), tracker,
the sweep and tasks (:mod:`.run`), outputs (:mod:`.report`). Each part gets its sub-config.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path

from .config import ConfigError, ModelConfig, RunConfig, load_config, to_dict

__all__ = ["main", "run_eval", "map_slurm_env", "launcher_name", "check_launch", "single_process_topology", "check_model", "check_inputs",
           "init_distributed", "parse_args", "is_user_error", "remove_stale_results", "ExactnessError"]


class ExactnessError(RuntimeError):
    """Sharded decode disagreed with the reference beyond the configured tolerance (or ranks disagreed)."""


# --------------------------------------------------------------------------- launch environment


def map_slurm_env(env) -> dict:
    """torch's variables from Slurm's when a task was started by ``srun`` without torchrun.

    Returns the variables to add (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE); empty
    when RANK is already set or this is not a Slurm task. MASTER_ADDR/PORT come from the
    sbatch script (first host of the node list). The mapping is the one
    ``TreeGroups.from_env`` uses (:func:`megatron_tree.distributed.topology.slurm_torch_env`).
    """
    from ..distributed.topology import slurm_torch_env

    return slurm_torch_env(env)


def launcher_name(env) -> str:
    if "TORCHELASTIC_RUN_ID" in env:
        return "slurm+torchrun" if "SLURM_PROCID" in env else "torchrun"
    if "CROSS_RANK" in env and "LOCAL_SIZE" in env:
        return "deepspeed"
    if "SLURM_PROCID" in env:
        return "slurm"
    return "none"


def single_process_topology(cfg: RunConfig, world: int, prog: str = "megatron-tree-eval") -> RunConfig:
    """``cfg`` with ``topology.intra_size`` dropped (and a note printed) when one process runs.

    A single process (WORLD_SIZE unset or 1) has a CP group of one rank and no node levels, so
    the shipped configs' ``intra_size: 2`` (a simulated node layout for 4 ranks) does not apply;
    refusing it would make every ``python -m ...`` run without a launcher need
    ``topology.intra_size=null``.
    """
    intra = cfg.topology.intra_size
    if world != 1 or intra is None or intra == 1:
        return cfg
    import dataclasses

    print(f"{prog}: note: one process (WORLD_SIZE unset or 1): topology.intra_size {intra} ignored "
          "(a CP group of one rank has no node levels)", file=sys.stderr, flush=True)
    return dataclasses.replace(cfg, topology=dataclasses.replace(cfg.topology, intra_size=None))


def check_launch(cfg: RunConfig, world: int, env=None) -> int:
    """The CP size for ``world`` launched ranks, or a ConfigError that names the mismatch.

    Runs before any process group exists, identically on every rank.
    """
    topo, m = cfg.topology, cfg.model
    tp = topo.tp_size
    if tp > 1 and m.source != "megatron":
        raise ConfigError(f"topology.tp_size: {tp} needs model.source megatron (the transformers sources hf and random "
                          "are CP only)")
    if world % tp:
        raise ConfigError(
            f"topology.tp_size: {tp} does not divide the launched world of {world} rank(s); expected a divisor of {world}"
        )
    cp = topo.cp_size or world // tp
    what = f"topology.cp_size: {cp}" if tp == 1 else f"topology.tp_size x topology.cp_size: {tp} x {cp} = {tp * cp}"
    if tp * cp > world:
        raise ConfigError(
            f"{what} does not fit the launched world of {world} rank(s); launch at least {tp * cp} "
            f"processes or choose sizes whose product divides {world}"
        )
    if world % (tp * cp):
        raise ConfigError(f"{what} does not divide the launched world of {world} rank(s); "
                          f"expected a divisor of {world}")
    intra = topo.intra_size
    if intra is not None and cp % intra:
        raise ConfigError(
            f"topology.intra_size: {intra} does not factor the CP size {cp}; expected a divisor of {cp}"
        )
    if m.source == "megatron":
        for name, value in (("num_attention_heads", m.num_attention_heads),
                            ("num_key_value_heads", m.num_key_value_heads), ("vocab_size", m.vocab_size)):
            if value % tp:
                raise ConfigError(f"model.{name}: {value} is not divisible by topology.tp_size {tp}")
        from ..distributed.topology import launcher_local_size
        from .models import megatron_layout

        per_node, _ = launcher_local_size(os.environ if env is None else env)
        megatron_layout(topo, world, cp, per_node)
    return cp


def _check_output_dir(output_dir: str) -> None:
    p = Path(output_dir)
    for parent in [p, *p.parents]:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(
                    f"output_dir: {output_dir!r} cannot be created: {str(parent)!r} is a file; expected a directory"
                )
            return


def _prepare_output_dir(out_dir: Path) -> str | None:
    """Create ``out_dir`` and write a probe file in it; the error message when either fails, else None."""
    import tempfile

    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        where = f" ({e.filename})" if e.filename and str(e.filename) != str(out_dir) else ""
        return (f"output_dir: {str(out_dir)!r} is not a directory global rank 0 can create and write: {why}{where}; "
                "choose a writable output_dir")
    return None


def check_transformers_checkpoint(path: str) -> int:
    """``model.source: hf`` before launch: the checkpoint check every transformers loader runs
    (``integrations.hf.checkpoint``: config.json, the safetensors headers, the tensors against a
    meta-device model, no tensor read), then whether tree attention can replace that class's
    attention. Returns the model's ``max_position_embeddings``.
    """
    from ..integrations import hf

    try:
        checked = hf.check_checkpoint(path, check_model=hf.check_model)  # the architecture before the tensors
    except hf.CheckpointError as e:
        raise ConfigError(f"model.path: {e}") from None
    except hf.UnsupportedModelError as e:
        raise ConfigError(f"model.path: unsupported architecture: {os.path.join(path, 'config.json')}: {e}") from None
    return checked.max_position_embeddings


def past_max_position(m: ModelConfig) -> tuple[bool, bool]:
    """``(runs, dynamic)``: whether the model's CP prefill takes prompts past ``max_position_embeddings`` with
    ``eval.allow_beyond_max_position`` (Megatron's ``GPTModel`` and transformers RoPE models, whose positions
    are computed for any index; not a transformers model whose positions are a learned table), and whether its
    RoPE is dynamic NTK (frequencies from the length so far: ``integrations.hf.common.position_window``)."""
    if m.source == "megatron":
        return True, False
    from ..integrations.hf.common import position_window, rotary_positions

    if m.source == "hf":
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(m.path)
        dynamic = position_window(cfg) is None
        return dynamic or rotary_positions(cfg), dynamic
    rope = dict(m.rope_scaling or {})
    return True, rope.get("rope_type", rope.get("type")) == "dynamic"  # random: a Llama (RoPE)


def check_model(m: ModelConfig):
    """The model's files, checked before launch: ``(checkpoint, max_position_embeddings)``.

    checkpoint: the Megatron checkpoint's :class:`~megatron_tree.integrations.megatron.checkpoint.CheckpointInfo`
    (``None`` for other sources or random weights).
    """
    max_pos = m.max_position_embeddings
    checkpoint = None
    if m.source == "hf":
        max_pos = check_transformers_checkpoint(m.path)
    elif m.source == "megatron" and m.path is not None:
        from ..integrations.megatron.checkpoint import check_checkpoint
        from .models import gpt_shape

        checkpoint = check_checkpoint(m.path, gpt_shape(m))
    return checkpoint, max_pos


def check_inputs(cfg: RunConfig):
    """Files the run needs (checkpoint, tokenizer, text file, ds_config, output_dir), checked before launch.

    Returns the Megatron checkpoint's :class:`~megatron_tree.integrations.megatron.checkpoint.CheckpointInfo`
    (``None`` for other sources or random weights).
    """
    m, ev = cfg.model, cfg.eval
    _check_output_dir(cfg.output_dir)
    checkpoint, max_pos = check_model(m)
    if m.source == "megatron" and ev.prefill_method == "allgather":
        raise ConfigError("eval.prefill_method: 'allgather' is not available for model.source megatron (its core "
                          "attention prefills by decode.prefill.ring_prefill); use ring or null")
    # The sweep, then the passkey prompts and the perplexity prefix (run after the sweep: unchecked, one past the
    # window ended the run with the prefill's traceback after the whole sweep), each against the model's window.
    need = max(ev.context_lengths) + ev.warmup_steps + ev.decode_steps + 1
    beyond = [(f"eval.context_lengths: the longest run needs {need} positions (context + warmup + decode steps + 1)",
               need)]
    if ev.passkey.enabled:
        beyond += [(f"eval.passkey.context_lengths: {ctx} tokens + eval.passkey.new_tokens {ev.passkey.new_tokens} "
                    f"need {ctx + ev.passkey.new_tokens} positions", ctx + ev.passkey.new_tokens)
                   for ctx in ev.passkey.context_lengths or ev.context_lengths]
    if ev.perplexity.text_file:
        need_ppl = ev.perplexity.prefix_tokens + ev.perplexity.eval_tokens
        beyond.append((f"eval.perplexity: prefix_tokens + eval_tokens need {need_ppl} positions", need_ppl))
    past = [what for what, positions in beyond if positions > max_pos]
    if past:
        runs, dynamic = past_max_position(m)
        if not runs:
            raise ConfigError(
                f"{past[0]}, but the model has max_position_embeddings {max_pos}, and its positions are a learned "
                "table of that many rows (eval.allow_beyond_max_position applies to RoPE models); shorten it")
        if not ev.allow_beyond_max_position:
            raise ConfigError(f"{past[0]}, but the model has max_position_embeddings {max_pos}; shorten it or set "
                              "eval.allow_beyond_max_position=true")
        ex = ev.exactness
        if dynamic and ex.enabled:
            # a transformers model that runs past its window has length-dependent (dynamic-NTK) RoPE: it decodes as
            # transformers does step by step, frequencies from the length so far, while the reference is one forward
            # over prompt + generated tokens, frequencies from the whole length: different by design, never exact
            steps = ev.warmup_steps + ev.decode_steps + 1
            for ctx in ev.context_lengths:
                if (ex.max_context is None or ctx <= ex.max_context) and ctx + steps > max_pos:
                    raise ConfigError(
                        f"eval.exactness: a checked run of context {ctx} needs {ctx + steps} positions, past "
                        f"max_position_embeddings {max_pos}, where this model's dynamic-NTK RoPE picks its frequencies "
                        "from the length so far: its step-by-step decode and the reference's one forward over the "
                        "whole sequence differ by design; set eval.exactness.max_context to at most "
                        f"{max_pos - steps} or eval.exactness.enabled=false")
    if ev.passkey.enabled or ev.perplexity.text_file:
        tok = tokenizer_path(cfg)
        what = "eval.passkey.enabled" if ev.passkey.enabled else "eval.perplexity.text_file"
        if tok is None:
            raise ConfigError(
                f"{what} needs a tokenizer: set model.tokenizer to a tokenizer.json or use a checkpoint "
                "directory that has one"
            )
        if not os.path.isfile(tok):
            raise ConfigError(f"model.tokenizer: {tok!r} does not exist")
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            raise ConfigError(f"{what} needs the 'tokenizers' package to read {tok!r}; pip install tokenizers") from None
    if ev.perplexity.text_file and not os.path.isfile(ev.perplexity.text_file):
        raise ConfigError(f"eval.perplexity.text_file: {ev.perplexity.text_file!r} does not exist")
    if cfg.wandb.ds_config and not os.path.isfile(cfg.wandb.ds_config):
        raise ConfigError(f"wandb.ds_config: {cfg.wandb.ds_config!r} does not exist")
    return checkpoint


def tokenizer_path(cfg: RunConfig) -> str | None:
    if cfg.model.tokenizer:
        return cfg.model.tokenizer
    if cfg.model.path and os.path.isfile(os.path.join(cfg.model.path, "tokenizer.json")):
        return os.path.join(cfg.model.path, "tokenizer.json")
    return None


def init_distributed(cfg: RunConfig, env) -> tuple[str, "object"]:
    """Initialise torch.distributed from the launcher's env:// variables; returns (backend, device)."""
    import datetime

    import torch
    import torch.distributed as dist

    backend = cfg.dist.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("dist.backend: nccl needs CUDA, which this machine does not have; use gloo or auto")
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(env.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if cfg.model.compile_step == "reduce-overhead" and device.type != "cuda":
        # the same on every rank, before any process group or model: not a traceback per rank at the first step
        raise ConfigError(f"model.compile_step: 'reduce-overhead' captures each decode step in a CUDA graph, which "
                          f"needs CUDA devices over NCCL (dist.backend nccl, or auto on a GPU machine); this run is "
                          f"on {device.type} over {backend}: use model.compile_step=true (Inductor, not captured) "
                          f"or aot_eager")
    timeout = datetime.timedelta(seconds=cfg.topology.timeout_s)
    if "RANK" not in env:  # a single process, no launcher
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    elif cfg.dist.init == "deepspeed":
        try:  # the integration's helper skips the CPU shm op's g++ compile
            from ..integrations.deepspeed import init_distributed as ds_init
        except ImportError:
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        else:
            ds_init(dist_backend=backend, timeout_s=cfg.topology.timeout_s, env=env)
    else:
        try:
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        except (dist.DistStoreError, dist.DistNetworkError) as e:  # a rank that never came, or a wrong address
            from ..distributed.topology import rendezvous_error

            raise rendezvous_error(
                e, f"rendezvous at {env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')} (this is rank {env.get('RANK')} "
                f"of WORLD_SIZE={env.get('WORLD_SIZE')})", f"topology.timeout_s {cfg.topology.timeout_s:g} s",
                "WORLD_SIZE") from None
    return backend, device


# --------------------------------------------------------------------------- the run


def run_eval(cfg: RunConfig, env=None) -> dict | None:
    """Run the whole sweep on this rank; returns the results dict on global rank 0, else None."""
    env = os.environ if env is None else env
    t_start = time.perf_counter()
    world = int(env.get("WORLD_SIZE", 1))
    cfg = single_process_topology(cfg, world)
    cp_size = check_launch(cfg, world, env)
    checkpoint = check_inputs(cfg)

    import torch
    import torch.distributed as dist
    from tqdm.auto import tqdm

    from .tracking import make_tracker
    from . import baselines, console, models, report, run

    backend, device = init_distributed(cfg, env)
    stack = contextlib.ExitStack()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        if cp_size != check_launch(cfg, world, env):  # WORLD_SIZE lied; re-check against the real group
            raise ConfigError(f"WORLD_SIZE={env.get('WORLD_SIZE')} disagrees with the process group's {world}")
        if device.type == "cpu" and torch.get_num_threads() > 1 and world > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        out_dir = Path(cfg.output_dir)
        # rank 0 writes every output: a directory it cannot create or write is found now, on every rank, not
        # after the sweep (results.json, the plot) nor as "wandb could not start" (its folder is made first)
        err = [_prepare_output_dir(out_dir) if rank == 0 else None]
        dist.broadcast_object_list(err, src=0)
        if err[0]:
            raise ConfigError(err[0])
        ev = cfg.eval
        phases = {"setup_s": time.perf_counter() - t_start}
        t0 = time.perf_counter()
        model_cfg = cfg.model
        if model_cfg.compile_step == "auto" and ev.warmup_steps == 0:  # a capture would be timed: eager steps
            model_cfg = dataclasses.replace(model_cfg, compile_step=False)
        em = models.build(model_cfg, cfg.topology, cp_size=cp_size, rank=rank, device=device, env=env,
                          want_reference=ev.exactness.enabled, checkpoint=checkpoint, stack=stack,
                          allow_beyond_window=ev.allow_beyond_max_position)
        phases["model_s"] = time.perf_counter() - t0
        topo = em.groups.describe()
        launch = {
            "launcher": launcher_name(env), "world_size": world, "backend": backend, "device": device.type,
            "tp_size": cfg.topology.tp_size, "cp_size": cp_size, "num_cp_groups": world // cp_size,
            "level_sizes": {l["name"]: l["size"] for l in topo["levels"]}, "topology": topo,
        }
        t0 = time.perf_counter()
        tracker, err = None, [None]
        try:
            tracker = make_tracker(cfg.wandb, rank=rank, output_dir=str(out_dir),
                                   config={**to_dict(cfg), "launch": launch, "model_info": em.info},
                                   default_name=f"{cfg.name}-{cp_size}cp")
        except Exception as e:  # noqa: BLE001 -- e.g. wandb online without an API key
            err = [f"wandb could not start on rank 0: {type(e).__name__}: {e}"]
        dist.broadcast_object_list(err, src=0)  # so every rank fails, not rank 0 alone
        if err[0]:
            raise ConfigError(err[0] + " (set wandb.mode=offline or wandb.enabled=false)")
        phases["wandb_init_s"] = time.perf_counter() - t0
        combos = [(c, b, s) for c in ev.context_lengths for b in ev.batch_sizes for s in ev.strategies]
        show = console.progress_enabled(ev.progress, rank)
        if rank == 0:
            report.print_plan(cfg, launch, em, len(combos), out_dir)
        every = 0.1 if sys.stderr.isatty() else 5.0  # keep non-terminal logs (Slurm, CI) short
        t0 = time.perf_counter()
        run.warm_up(em, ev, cfg.model.seed, device)
        phases["warmup_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        sweep = tqdm(combos, desc="sweep", disable=not show, file=sys.stderr, position=0, mininterval=every)
        runs, step, ref_cache = [], 0, run._ReferenceCache()
        for ctx, batch, strategy in sweep:
            sweep.set_postfix_str(f"ctx={ctx} batch={batch} {strategy}")
            with tqdm(total=ev.warmup_steps + ev.decode_steps, desc="decode", leave=False, disable=not show,
                      file=sys.stderr, position=1, mininterval=every) as bar:
                r = run.run_one(em, ev, cfg.model.seed, device, ctx, batch, strategy, rank=rank, bar=bar,
                                ref_cache=ref_cache)
            runs.append(r)
            for ms in r["step_latency_ms"]:
                tracker.log({f"decode_latency_ms/{strategy}": ms, "context_length": ctx, "batch_size": batch}, step=step)
                step += 1
        sweep.close()
        phases["sweep_s"] = time.perf_counter() - t0
        attention = attn_dims = None
        if ev.attention_baselines:
            t0 = time.perf_counter()
            m = cfg.model
            kv = max(1, m.num_key_value_heads // cfg.topology.tp_size)
            attn_dims = (em.heads, kv if em.heads % kv == 0 else em.heads, em.head_dim)
            longest = max(ev.context_lengths)  # attention alone is cheap: reach past the sweep, to 16x (<= 64K)
            contexts = sorted(set(ev.context_lengths) | {c for c in (4 * longest, 16 * longest) if c <= 65536})
            attention = baselines.attention_sweep(
                em.groups, contexts, batch=1, heads_q=attn_dims[0], heads_kv=attn_dims[1],
                head_dim=attn_dims[2], layers=m.num_hidden_layers, device=device, dtype=getattr(torch, m.dtype))
            phases["attention_baselines_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        tok = load_tokenizer(cfg) if (ev.passkey.enabled or ev.perplexity.text_file) else None
        passkey = run.passkey_eval(em, ev, cfg.model.seed, device, tok) if ev.passkey.enabled else None
        ppl = run.perplexity_eval(em, ev, device, tok) if ev.perplexity.text_file else None

        results = None
        ok = True
        if rank == 0:
            results = report.build_results(name=cfg.name, launch=launch, config=to_dict(cfg),
                                           model={**em.info, **models.compiled_steps(em)},
                                           runs=runs, passkey=passkey, perplexity=ppl,
                                           reference=em.reference_name if ev.exactness.enabled else None,
                                           engine=ev.engine)
            results["attention_baselines"] = report.attention_summary(attention, launch, attn_dims)
            ok = report.passed(results)
            levels = " x ".join(f"{k} {v}" for k, v in launch["level_sizes"].items())
            tp = f"TP {cfg.topology.tp_size} x " if cfg.topology.tp_size > 1 else ""
            results["plot"] = report.save_plot(
                runs, out_dir / "decode_latency.png",
                f"{cfg.name}: decode latency, {tp}CP {cp_size} ({levels}), {backend}/{device.type}",
                attention=results["attention_baselines"])
            report.track(tracker, results, ev.context_lengths, results["plot"])
            results["wandb"] = report.wandb_record(tracker.run_dir, cfg.wandb.mode)
            phases["tasks_and_outputs_s"] = time.perf_counter() - t0
            results["phases_s"] = phases
            results["elapsed_s"] = time.perf_counter() - t_start
            path = report.write(results, out_dir)
            tracker.finish(exit_code=0 if ok else 1)
            report.print_summary(results, path, tracker.run_dir, cfg.wandb.mode, ev.exactness.tolerance)
        if rank != 0 and ev.log_all_ranks:
            for r in runs:
                print(f"[rank {rank}] {report.summary_line(r)}", flush=True)
        # Every rank learns the verdict, so a failed exactness check fails the whole job.
        verdict = [ok]
        dist.broadcast_object_list(verdict, src=0)
        if not verdict[0] and ev.exactness.fail_on_mismatch:
            raise ExactnessError("exactness check failed (see rank 0's output)")
        return results
    finally:
        stack.close()
        dist.destroy_process_group()


def load_tokenizer(cfg: RunConfig):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_path(cfg))


# --------------------------------------------------------------------------- command line


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="megatron-tree-eval",
        description="Context-parallel tree-decode eval; every knob is in the YAML config.",
    )
    p.add_argument("--config", default=None, help="YAML config (default: the built-in tiny CPU eval)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. eval.decode_steps=4")
    # The deepspeed launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    args, unknown = p.parse_known_args(argv)
    extra = [u for u in unknown if not u.startswith(("--local_rank", "--local-rank"))]
    if extra:
        p.error(f"unrecognised arguments: {' '.join(extra)}")
    return args


def is_user_error(e: BaseException) -> bool:
    """Config, topology and checkpoint errors: reported as one line, not a traceback."""
    from ..distributed.topology import TopologyError

    # Loaded only by the sources that raise them: model.source hf / random, megatron.
    hf = sys.modules.get("megatron_tree.integrations.hf")
    megatron = sys.modules.get("megatron_tree.integrations.megatron.checkpoint")
    extra = ((hf.UnsupportedModelError,) if hf is not None else ()) + \
        ((megatron.CheckpointError,) if megatron is not None else ())
    return isinstance(e, (ConfigError, TopologyError, *extra))


class MissingExtraError(ImportError):
    """A framework the run needs is not installed (:func:`check_extras`)."""


def check_extras(cfg: RunConfig) -> None:
    """The frameworks this run will import, all checked before launch: a :class:`MissingExtraError` naming the
    ``eval`` extra (which installs them all) and why each missing one is needed, instead of an ImportError
    from deep inside the run naming a narrower extra."""
    from ..utils.extras import require_all

    needs = {"megatron": "model.source megatron"} if cfg.model.source == "megatron" else \
        {"hf": f"model.source {cfg.model.source}"}
    if cfg.dist.init == "deepspeed":
        needs["deepspeed"] = "dist.init deepspeed"
    if cfg.wandb.enabled:
        needs["wandb"] = "wandb.enabled"
    needs["plot"] = "the decode latency plot"
    try:
        require_all(needs, "megatron-tree-eval", "eval")
    except ImportError as e:
        raise MissingExtraError(str(e)) from None


def remove_stale_results(output_dir: str, rank: str) -> None:
    """Global rank 0 deletes ``<output_dir>/results.json`` left by an earlier run (before anything can fail)."""
    path = Path(output_dir) / "results.json"
    if rank == "0" and path.is_file():
        path.unlink()


def main(argv=None) -> int:
    """Console entry point ``megatron-tree-eval``; exits non-zero on any failure."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    env = dict(os.environ)
    mapped = map_slurm_env(env)
    os.environ.update(mapped)
    env.update(mapped)
    rank = env.get("RANK", "0")
    from .console import quiet_library_bars, quiet_third_party

    quiet_third_party(int(rank) if rank.isdigit() else 0)  # before Megatron-Core / transformers are imported
    quiet_library_bars()
    try:
        cfg = load_config(args.config, args.overrides)
        if args.print_config:
            import yaml

            print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
            return 0
        remove_stale_results(cfg.output_dir, rank)
        world = int(env.get("WORLD_SIZE", 1))
        if world > 1:  # sizes that cannot fit the launch fail in a second, before the frameworks' imports
            check_launch(cfg, world, env)
        check_extras(cfg)
        run_eval(cfg, env)
    except MissingExtraError as e:
        # the same on every rank, before any collective; one line, not a traceback per rank
        print(f"megatron-tree-eval: rank {rank}: error: {e}\n", end="", file=sys.stderr, flush=True)
        return 2
    except ValueError as e:
        if not is_user_error(e):
            raise
        # one write: under PYTHONUNBUFFERED print() writes the text and its newline separately,
        # and 4 ranks sharing a pipe can then glue two ranks' lines together
        print(f"megatron-tree-eval: rank {rank}: error: {e}\n", end="", file=sys.stderr, flush=True)
        return 2
    except ExactnessError as e:
        print(f"megatron-tree-eval: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 3
    return 0
