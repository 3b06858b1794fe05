"""The multi-rank harness: run a function on N ranks of a real process group, one process per rank.

The tests and the benchmarks (``benchmarks/`` at the repository root) share this one module. Each
call starts ``world_size`` fresh processes that rendezvous through their own ``FileStore`` (no ports
to collide between calls), runs ``fn(rank, world_size, *args)`` in each with the default process
group initialised, and returns the per-rank results in rank order. Any rank that raises, exits
without a result, or outlives ``timeout`` fails the call with that rank's traceback; the remaining
ranks are killed, so a broken collective can never hang a test run or a benchmark.
:class:`RanksInBackground` runs the same harness in a thread, for ranks that serve requests
while the calling process does its own work.

The processes are forked by multiprocessing's fork server, which imports the ``preload`` modules
once per Python session: importing torch (and transformers) costs seconds of CPU per process, more
than most multi-rank tests compute. Nothing of megatron_tree should be preloaded (some of it reads
the environment when imported, e.g. ``TRITON_INTERPRET``); each rank takes the caller's current
environment and ``sys.path``, as a spawned process would.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import sys
import tempfile
import threading
import time
import traceback


PRELOAD = ("torch", "torch.distributed")
"""Imported once by the fork server unless a caller names its own ``preload``."""


GROUP_INIT_SECONDS: float | None = None
"""In a rank: wall seconds the harness took to create its default group (benchmarks that count group creation
as part of a first call add it to their own clock)."""


class RankFailure(AssertionError):
    """A rank raised, died or timed out; the message holds its traceback."""


def outcome(fn):
    """(exception type name or "returned", message, seconds) of calling fn: what a rank reports of a
    call that must fail, so the test can compare every rank's error and its time bound."""
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 -- the test asserts on type and message
        return type(e).__name__, str(e), time.monotonic() - start
    return "returned", "", time.monotonic() - start


def _worker(rank, world_size, store_path, fn, args, kwargs, env, path, pg_timeout, backend, threads, results):
    try:
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size)})
        import torch
        import torch.distributed as dist

        if threads:
            torch.set_num_threads(threads)
        if backend == "nccl":  # NCCL binds its communicators to the current device: one GPU per rank
            torch.cuda.set_device(rank % torch.cuda.device_count())
        global GROUP_INIT_SECONDS
        start = time.perf_counter()
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        GROUP_INIT_SECONDS = time.perf_counter() - start
        try:
            value = fn(rank, world_size, *args, **kwargs)
        finally:
            # No barrier here: a rank that failed must not wait for the others.
            dist.destroy_process_group()
        results.put(("ok", rank, value))
    except BaseException:  # noqa: BLE001 -- report everything, including SystemExit
        results.put(("err", rank, traceback.format_exc()))


def run_ranks(
    fn,
    world_size: int,
    *args,
    timeout: float = 180.0,
    pg_timeout: float = 60.0,
    env: dict | None = None,
    expect_dead: tuple[int, ...] = (),
    backend: str = "gloo",
    threads: int | None = 1,
    preload: tuple[str, ...] | None = None,
    watch=None,
    **kwargs,
) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    fn must be importable (a module-level function); its return value must be picklable and
    should be plain data (floats, lists, numpy arrays): a torch tensor travels as a shared-memory
    handle that dies with its rank, so the parent can fail to read it ("connection reset").
    timeout: seconds for the whole run; pg_timeout: the process group's collective timeout.
    env: extra environment variables for every rank.
    expect_dead: ranks allowed to exit without a result (tests of a rank dying mid-run);
        their slot in the returned list is ``None``.
    backend: the process group's backend (``"nccl"``: each rank first takes GPU
        ``rank % device_count``); threads: ``torch.set_num_threads`` in every rank
        (``None`` leaves torch's default).
    preload: modules the fork server imports once, read only by the first call of a Python
        session (default :data:`PRELOAD`).
    watch: called in the parent about five times a second while ranks run; a non-empty string
        it returns stops the run as a failure with that text (a run whose length is not known
        ahead, e.g. a soak, judges "stalled" by its own progress instead of one ``timeout``).
    """
    ctx = context()
    ctx.set_forkserver_preload(list(PRELOAD if preload is None else preload))  # read when the server starts: the first call of the session
    tmp = tempfile.mkdtemp(prefix="mt_store_")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, os.path.join(tmp, "store"), fn, args, kwargs, {**os.environ, **(env or {})},
                  list(sys.path), pg_timeout, backend, threads, results),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout

    def settled(r: int) -> bool:
        return r in out or r in errors or (r in expect_dead and not procs[r].is_alive())

    def drain(wait: float) -> None:
        try:
            status, rank, value = results.get(timeout=wait)
        except queue_mod.Empty:
            return
        (out if status == "ok" else errors)[rank] = value

    try:
        while not all(settled(r) for r in range(world_size)):
            drain(0.2)
            if errors:
                # Give the other ranks a moment to report their own errors, then stop.
                grace = time.monotonic() + 5
                while time.monotonic() < grace and not all(settled(r) for r in range(world_size)):
                    drain(0.2)
                break
            for r, p in enumerate(procs):
                if not settled(r) and not p.is_alive():
                    drain(2)  # its result may still be in flight through the queue
                    if not settled(r):
                        errors[r] = f"rank {r} exited with code {p.exitcode} without a result"
            why = watch() if watch is not None and not errors else None
            if why:
                errors[-1] = str(why)
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if not settled(r)]
                errors[-1] = f"timed out after {timeout:.0f}s; ranks still running: {missing}"
                break
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        msg = "\n".join(
            f"---- rank {r} ----\n{tb}" if r >= 0 else f"---- harness ----\n{tb}" for r, tb in sorted(errors.items())
        )
        raise RankFailure(f"{len(errors)} rank(s) failed in a {world_size}-rank run of {fn.__name__}:\n{msg}")
    return [out.get(r) for r in range(world_size)]


def context():
    """The multiprocessing context the ranks start from: a queue handed to ``fn`` as an argument
    must be made by it (``context().Queue()``)."""
    return mp.get_context("forkserver")


class RanksInBackground:
    """:func:`run_ranks` in a daemon thread, for ranks that serve requests while this process
    works (a benchmark timing a one-process path between requests to the CP ranks).

    Arguments are :func:`run_ranks`'s. The ranks and the caller talk through queues made by
    :func:`context`; :meth:`get` reads one and raises the ranks' failure if they stop first.
    """

    def __init__(self, fn, world_size: int, *args, **kwargs):
        self._value = self._error = None

        def target():
            try:
                self._value = run_ranks(fn, world_size, *args, **kwargs)
            except BaseException as e:  # noqa: BLE001 -- handed to result()
                self._error = e

        self._thread = threading.Thread(target=target, name=f"run_ranks:{fn.__name__}", daemon=True)
        self._thread.start()

    def result(self, timeout: float | None = None) -> list:
        """The per-rank return values once the ranks have finished; their failure if they failed."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the ranks were still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def get(self, q, timeout: float = float("inf")):
        """``q.get()``; the ranks' failure instead if they end before anything arrives, a
        ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return q.get(timeout=0.5)
            except queue_mod.Empty:
                pass
            if not self._thread.is_alive():
                try:
                    return q.get_nowait()  # put just before the ranks ended
                except queue_mod.Empty:
                    pass
                self.result()
                raise RankFailure("the ranks finished without putting anything on the queue")
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing from the ranks within {timeout:.0f} s")
