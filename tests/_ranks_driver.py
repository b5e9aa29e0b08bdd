"""Runs several inkling-ckpt commands in one torchrun launch (one process-group start for all).

Usage: torchrun --nproc_per_node N tests/_ranks_driver.py JOBS.json [--die-after K] [--die-in-step DIR]
       [--dense-chunk-bytes B] [--keep-going]

JOBS.json: a list of argument lists, run in order through the CLI. ``--die-after K``: rank 1
exits hard (``os._exit``) after writing K units, as a crashed rank would. ``--die-in-step DIR``: rank 1
exits hard once its share is written, while rank 0 waits for it in the step the ranks take together
after writing (rank 0 leaves a file in DIR as it goes in). ``--dense-chunk-bytes B``:
torch_dist outputs store non-expert tensors over B bytes in row ranges (``model.mapping.DENSE_CHUNK_BYTES``,
so the tiny fixtures exercise the layout of the real embeddings). ``--keep-going``: run every job
even after one fails. Rank 0 prints each job's exit code and, for every job, its report as JSON
(``"ranks"`` included); every rank prints its own exit code (``RANK r EXIT code``).
"""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from inkling_ckpt.cli import checkpoint as cli_checkpoint
from inkling_ckpt.cli.app import main
from inkling_ckpt.pipeline import executor


def _die_after(k: int) -> None:
    done = executor.Executor.note_done

    def note_done(self, unit):  # type: ignore[no-untyped-def]
        done(self, unit)
        if self.world.rank == 1 and self.stats.units >= k:
            os._exit(3)

    executor.Executor.note_done = note_done  # type: ignore[method-assign]


def _die_in_step(folder: str) -> None:
    import time

    from inkling_ckpt.layouts import megatron_dcp
    from inkling_ckpt.pipeline import publish

    waiting = os.path.join(folder, "rank0-waiting")

    def first_step(step):  # type: ignore[no-untyped-def]
        def run(*args, **kwargs):  # type: ignore[no-untyped-def]
            if int(os.environ["RANK"]) == 0:
                open(waiting, "w").close()
            else:
                while not os.path.exists(waiting):
                    time.sleep(0.02)
                time.sleep(0.2)  # rank 0 is inside the collective by now
                os._exit(3)
            return step(*args, **kwargs)
        return run

    # After writing: the pipeline's own step (HF outputs), or DCP's (hf-to-megatron's .metadata).
    publish.all_ok = first_step(publish.all_ok)
    megatron_dcp.save_metadata = first_step(megatron_dcp.save_metadata)


def _capture_results() -> list:
    seen: list = []
    report = cli_checkpoint.report

    def capture(rep, as_json):  # type: ignore[no-untyped-def]
        seen.append(rep)
        report(rep, as_json)

    cli_checkpoint.report = capture
    import inkling_ckpt.cli.convert as cli_convert
    cli_convert.report = capture
    import inkling_ckpt.cli.lora as cli_lora
    emit = cli_lora.emit

    def capture_emit(rep, as_json, render):  # type: ignore[no-untyped-def]
        seen.append(rep)
        emit(rep, as_json, render)

    cli_lora.emit = capture_emit
    import inkling_ckpt.cli.shard as cli_shard
    cli_shard.emit = capture_emit
    import inkling_ckpt.cli.verify as cli_verify
    cli_verify.emit = capture_emit
    return seen


if __name__ == "__main__":
    jobs = json.loads(open(sys.argv[1]).read())
    if "--die-after" in sys.argv:
        _die_after(int(sys.argv[sys.argv.index("--die-after") + 1]))
    if "--die-in-step" in sys.argv:
        _die_in_step(sys.argv[sys.argv.index("--die-in-step") + 1])
    if "--dense-chunk-bytes" in sys.argv:
        from inkling_ckpt.model import mapping

        mapping.DENSE_CHUNK_BYTES = int(sys.argv[sys.argv.index("--dense-chunk-bytes") + 1])
    results = _capture_results()
    rank = int(os.environ.get("RANK", "0"))
    # One process group for every job (each command joins it instead of starting its own:
    # re-creating gloo groups back to back in one process is slow and races on the ports).
    dist.init_process_group("gloo")
    keep_going = "--keep-going" in sys.argv  # run every job even after one fails (an exit status is the check)
    worst = 0
    for args in jobs:
        try:
            main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if rank == 0:
            print(f"EXIT {code} {' '.join(args[:2])}", flush=True)
        print(f"RANK {rank} EXIT {code}", flush=True)  # every rank's status, for commands that must agree
        worst = max(worst, code)
        if code and not keep_going:
            sys.exit(code)
    dist.barrier()  # every rank's lines are out before rank 0's long RESULT line (one pipe, no interleaving)
    if rank == 0 and results:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()
    # Out without the interpreter's finalization: under load, one rank in a few dozen aborted there
    # ("terminate called without an active exception", SIGABRT; every job already published and the
    # RESULT line out), which gloo's threads are known to do when Python objects they hold are freed
    # during finalization (pytorch/pytorch#179291). What the test checks is done by then.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(worst)
