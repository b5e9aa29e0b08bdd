"""One exception hierarchy. The CLI prints ``str(error)`` on one line and exits non-zero."""

from __future__ import annotations


class InklingError(Exception):
    """Base of every error the toolkit raises on purpose (bad input, bad plan, bad output)."""

    exit_code = 2


class FormatError(InklingError):
    """A tensor cannot be encoded/decoded: unknown format, width not a block multiple, bad parts."""


class NonFiniteError(FormatError):
    """NaN or Inf in a tensor being quantized (pass ``allow_nonfinite`` to keep them).

    ``detail`` says what is wrong; ``hint`` (may be empty) how a writing command gets past it.
    Commands without that option re-raise ``detail`` with a hint of their own (``with_hint``).
    """

    def __init__(self, detail: str, hint: str = "") -> None:
        super().__init__(f"{detail}; {hint}" if hint else detail)
        self.detail = detail
        self.hint = hint

    def with_hint(self, hint: str) -> NonFiniteError:
        """The same error with another hint (or none)."""
        return NonFiniteError(self.detail, hint)


class PlanError(InklingError):
    """A precision plan or a parallel (TP/EP) plan that does not fit the model."""


class ConfigError(InklingError):
    """A model config that is missing fields or holds impossible values."""


class CheckpointError(InklingError):
    """A checkpoint on disk that is malformed, incomplete or disagrees with its config."""


class IntegrityError(CheckpointError):
    """Checksums or sizes that do not match what a manifest or index promises."""


class OutputError(InklingError):
    """The destination cannot be written (exists, read-only, full)."""


class AdapterError(CheckpointError):
    """A LoRA adapter that does not fit the schema: unknown or excluded module, a factor without
    its pair, ranks that disagree, a shared factor that differs across experts, wrong shapes."""


class RankLostError(InklingError):
    """Another rank stopped (crashed, killed, unreachable) while this one waited for it in a step
    the ranks take together. Nothing is published; unlike bad input, the staging folder is kept
    (``keeps_staging``), so rerunning the same command resumes what the ranks had finished."""

    keeps_staging = True


class DeviceError(InklingError):
    """The requested device cannot run the job: no usable GPU for ``--device cuda``, or the GPU or
    the host ran out of memory (the message names the option that shrinks what is in flight)."""
