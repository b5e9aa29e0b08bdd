"""The ``inkling-ckpt`` command: a thin typer layer over the library.

Every command module registers itself on :data:`app`; :func:`main` turns each
:class:`~inkling_ckpt.errors.InklingError` into one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Sequence

import typer

from ..errors import InklingError

app = typer.Typer(
    name="inkling-ckpt",
    help="Convert, quantize (NVFP4/MXFP8), shard and verify Inkling 2 Small checkpoints.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def declares(*, reads: Sequence[str] = (), writes: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare which parameters of a command are paths it reads and which it writes. Before the
    command runs, one check refuses any written path that is, contains or lies inside a read one
    (:func:`~inkling_ckpt.layouts.paths.check_outputs`): sources, ``--config``, ``--reference``,
    ``--tokens`` and adapters all count, ``--force`` or not."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            from ..layouts.paths import check_outputs

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


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    _register()
    try:
        app(args=argv, standalone_mode=True)
    except InklingError as e:
        print(f"inkling-ckpt: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("inkling-ckpt: interrupted; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
