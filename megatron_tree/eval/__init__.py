"""Long-context decode eval: ``python -m megatron_tree.eval --config configs/<name>.yaml [key=value ...]``.

Invariant: one process per rank, launched by torchrun, the deepspeed launcher or Slurm
(or none, for a single process); everything the run does is in the resolved
:class:`~megatron_tree.eval.config.RunConfig`. A configuration that cannot run -- an unknown
key, a wrong type, a TP x CP layout that does not fit the launched world, a topology that
does not factor, a checkpoint that is missing, unreadable or of another shape, an
``output_dir`` that is a file -- fails on *every* rank with the same one-line message and
exit status 2 before any collective is issued, so a launcher never hangs on a half-failed
job. Global rank 0 removes an earlier ``results.json`` first, so a failed run never leaves
one that could be mistaken for its own.

The package is split the way a run goes:

* :mod:`.launch` -- command line, launcher environment, checks before launch, process
  group, and :func:`run_eval`, which strings the parts together;
* :mod:`.models` -- the model per ``model.source`` (Megatron-Core ``GPTModel`` at TP x CP,
  transformers models) and the reference the run is held to;
* :mod:`.run` -- the sweep over (context length, batch size, merge strategy), each a
  CP prefill and timed decode steps through :func:`megatron_tree.decode.generate` (the
  one decode loop) with a timing hook; exactness; passkey; perplexity;
* :mod:`.baselines` -- the decode step's attention alone beside the ring and all-gather
  baselines, and where tree decode overtakes each;
* :mod:`.report` -- results.json (schema: docs/eval.md), the plot, wandb, what is printed
  (the plan, the table, the verdict line);
* :mod:`.console` -- third-party warnings once, progress bars only on a terminal (entry point only).
"""

from .launch import ExactnessError, check_launch, launcher_name, main, map_slurm_env, parse_args, run_eval, single_process_topology
from .run import percentile

__all__ = ["main", "run_eval", "map_slurm_env", "check_launch", "launcher_name", "parse_args", "percentile",
           "ExactnessError", "single_process_topology"]
