"""The ``inkling-ckpt`` command: a thin typer layer over :mod:`inkling_ckpt.api`.

Every command module registers itself on :data:`app` and imports the library inside its
command body, so ``--help``, ``--version`` and shell completion answer without torch.
:func:`main` turns each :class:`~inkling_ckpt.errors.InklingError` into one line on stderr and
a non-zero exit (``-vv`` adds the traceback).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import traceback
from typing import Any, Callable, Optional, Sequence

import typer

from .. import __version__
from ..errors import InklingError
from .options import setup, verbosity

app = typer.Typer(
    name="inkling-ckpt",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"inkling-ckpt {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Optional[bool] = typer.Option(None, "--version", callback=_version, is_eager=True,
                                           help="Print the version and exit."),
) -> None:
    """Convert, quantize (NVFP4/MXFP8), shard and verify Inkling 2 Small checkpoints.

    Every command takes --json (a report with a versioned 'schema' key) and -v; every command that
    writes takes --dry-run (validate, report, write nothing). Sizes people read are decimal (GB = 10^9 B).
    """


def declares(*, reads: Sequence[str] = (), writes: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare which parameters of a command are paths it reads and which it writes. Before the
    command runs, one check refuses any written path that is, contains or lies inside a read one
    (:func:`~inkling_ckpt.layouts.paths.check_outputs`): sources, ``--config``, ``--reference``,
    ``--tokens`` and adapters all count, ``--force`` or not."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            from ..layouts.paths import check_outputs  # no torch: --help stays light

            given = sig.bind_partial(*args, **kwargs).arguments
            check_outputs([given.get(n) for n in writes], [given.get(n) for n in reads])
            return fn(*args, **kwargs)
        run.declared = (tuple(reads), tuple(writes))  # type: ignore[attr-defined]
        return run
    return wrap


def _register() -> None:
    # Import for their side effect: each module adds its commands to ``app``.
    from . import checkpoint  # noqa: F401
    from . import shard  # noqa: F401
    from . import memory  # noqa: F401
    from . import verify  # noqa: F401
    from . import convert  # noqa: F401
    from . import lora  # noqa: F401


def one_line(text: str) -> str:
    """``text`` with every control character escaped as ``repr`` shows it: a name read from a
    stranger's file or argument (a newline in a hub id, an ANSI escape) never splits or paints the line."""
    return "".join(repr(c)[1:-1] if (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0) else c for c in text)


def _say(line: str) -> None:
    """One line to stderr in one write: under torchrun every rank may fail at once into the same
    stream, and print's separate write of the newline let two ranks' lines run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _huge_pages() -> None:
    """Let torch back its large CPU buffers with transparent huge pages (``THP_MEM_ALLOC_ENABLE``;
    torch reads it once, at its first allocation, so only a process that has not imported torch
    yet can set it; a user's own setting wins). Every slice a command moves lands in fresh memory,
    and first touching it page by page ran at 1.1-1.9 GB/s on the machines measured, 4.5-4.8 GB/s
    in huge pages (a device-to-host copy into it: 1.3 -> 3.0 GB/s on the H200 machine)."""
    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    _huge_pages()
    _register()
    setup(0)  # each run starts quiet (in-process callers run several)
    try:
        code = app(args=argv, standalone_mode=False)
    except InklingError as e:
        if verbosity() >= 2:
            traceback.print_exc()
        _say(f"inkling-ckpt: error: {one_line(str(e))}")
        sys.exit(e.exit_code)
    except typer.TyperException as e:  # a usage error: unknown option, bad choice, missing argument
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare group (`inkling-ckpt convert`): its help
            e.show()  # type: ignore[attr-defined]
        else:
            message = " ".join(e.format_message().replace("Value error, ", "").split())
            ctx = getattr(e, "ctx", None)
            where = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            _say(f"inkling-ckpt: error: {one_line(message.rstrip('.'))}{where}")
        sys.exit(getattr(e, "exit_code", 2))
    except (KeyboardInterrupt, typer.Abort):
        _say("inkling-ckpt: interrupted; rerun the same command to resume")
        sys.exit(130)
    if isinstance(code, int) and code:
        sys.exit(code)


def console() -> None:
    """The ``inkling-ckpt`` executable: :func:`main`, then a prompt exit with its status.

    When a command returns, what it wrote is closed, synced and published (its process group
    too); what is left is the interpreter tearing down ~2000 modules and torch's libraries,
    0.7-1.3 s on the 2-core box (1.3 s of a 13.6 s hf-to-megatron), longer with CUDA loaded, and
    paid by every rank. The process leaves at once instead, after flushing its streams. An
    unexpected exception (a bug) goes the usual way, traceback and all.
    """
    try:
        main()
        code: Any = 0
    except SystemExit as e:
        code = e.code
    if code is not None and not isinstance(code, int):
        _say(str(code))  # what Python does with sys.exit("message")
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): nothing more can reach it
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    console()
