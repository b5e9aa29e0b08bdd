"""Checkpoint sources that are hub repo ids: fetching, revision and token, and one-line failures.

Imports nothing heavy (the CLI's option layer uses it); ``huggingface_hub`` is imported on a fetch.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from pathlib import Path
from typing import Iterator

from ..errors import CheckpointError

#: Hub access for sources given as repo ids: set by ``hub_access`` (the CLI's --revision/--token).
_HUB: contextvars.ContextVar[tuple[str | None, str | None]] = contextvars.ContextVar("inkling_hub", default=(None, None))
#: What a checkpoint needs from a hub repo (configs, weights, tokenizer files).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@contextlib.contextmanager
def hub_access(revision: str | None = None, token: str | None = None) -> Iterator[None]:
    """Fetch hub sources opened inside this block at ``revision`` with ``token``.

    ``None`` keeps huggingface_hub's defaults: the main branch, and the token from ``HF_TOKEN`` or
    ``hf auth login``. A source written ``org/name@REV`` names its own revision.
    """
    reset = _HUB.set((revision, token))
    try:
        yield
    finally:
        _HUB.reset(reset)


def split_repo_id(text: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``text`` reads as ``org/name`` or ``org/name@REV``, else None."""
    repo, _, rev = text.partition("@")
    if not _REPO_ID.fullmatch(repo) or repo.startswith(".") or (_ and not rev):
        return None
    return repo, rev or None


def resolve_source(source: str | Path) -> Path:
    """A local folder, or a hub repo id fetched with only the files a checkpoint needs."""
    p = Path(source)
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(f"{p}: not a checkpoint folder")
        return p
    hub = split_repo_id(str(source))
    if hub is None:
        raise CheckpointError(f"{p}: no such checkpoint folder")
    repo, rev = hub
    revision, token = _HUB.get()
    if rev is not None and revision is not None and rev != revision:
        raise CheckpointError(f"{source}: names revision {rev!r} but --revision says {revision!r}")
    return fetch_snapshot(repo, revision=rev or revision, token=token)


def fetch_snapshot(repo: str, *, revision: str | None = None, token: str | None = None) -> Path:
    """Download (or find in the local cache) what a checkpoint needs of hub repo ``repo``.

    A failure is one CheckpointError saying why: offline mode, no such repo (or no access), a
    gated repo, no such revision, or the network.
    """
    import huggingface_hub
    from huggingface_hub import constants, errors

    at = f"{repo}@{revision}" if revision else repo
    try:
        return Path(huggingface_hub.snapshot_download(repo, revision=revision, token=token,
                                                      allow_patterns=HUB_PATTERNS))
    except errors.OfflineModeIsEnabled:
        why = "offline mode is on (HF_HUB_OFFLINE) and the repo is not in the local cache"
    except errors.GatedRepoError:
        why = ("a gated repo: accept its terms on huggingface.co, then give a token with access "
               "(HF_TOKEN, hf auth login or --token)")
    except errors.RepositoryNotFoundError:
        why = "no such repo on the hub, or it is private and the token has no access (HF_TOKEN, --token)"
    except errors.RevisionNotFoundError:
        why = f"the repo has no revision {revision!r}"
    except errors.LocalEntryNotFoundError:
        # Raised when the hub could not be asked: offline mode, or the connection failed.
        why = ("offline mode is on (HF_HUB_OFFLINE) and the repo is not in the local cache" if constants.HF_HUB_OFFLINE
               else "the hub could not be reached (network) and the repo is not in the local cache")
    except errors.HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        why = f"the hub answered HTTP {status}" if status else f"the hub request failed ({_first_line(e)})"
    except (ConnectionError, TimeoutError) as e:
        why = f"the hub could not be reached (network: {_first_line(e)})"
    except OSError as e:
        why = f"cannot store the download ({_first_line(e)})"
    except ValueError as e:  # huggingface_hub's repo id / revision validation
        why = f"not a valid repo id or revision ({_first_line(e)})"
    raise CheckpointError(f"{at}: not a local folder, and cannot fetch it from the hub: {why}")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


__all__ = ["hub_access", "resolve_source", "split_repo_id", "fetch_snapshot", "HUB_PATTERNS"]
