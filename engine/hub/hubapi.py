"""Talking to the Hugging Face hub through ``huggingface_hub``: the endpoint, the token, a repository's
live file listing, ranged reads of a file's first bytes, and one clear error for every way a call fails.

``HF_ENDPOINT`` (a mirror) is read at each call, not at import; ``HF_HUB_OFFLINE=1`` stops every call
with :class:`HubOffline` (downloaded models still load, see :mod:`engine.hub.store`). The token is
``HF_TOKEN``, else the one kept in the system keyring under :data:`KEYRING_SERVICE`, else the one
``huggingface-cli login`` stored.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import EngineError
from .catalogue import HubFile

KEYRING_SERVICE = "DeltaDesk Hugging Face"
KEYRING_USER = "token"
DEFAULT_ENDPOINT = "https://huggingface.co"


class HubError(EngineError):
    """A hub call failed; the message says which repository or file and what to do."""


class HubOffline(HubError):
    """The hub cannot be reached (or offline mode is on): only downloaded models can be used."""


def endpoint() -> str:
    """The hub's base URL: ``HF_ENDPOINT`` when set (a mirror), else huggingface.co."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def token() -> str | None:
    """``HF_TOKEN``, else the keyring's token (:data:`KEYRING_SERVICE`), else the one ``huggingface-cli login``
    stored; None without any. A keyring that fails counts as none."""
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"]
    try:
        import keyring
        stored = keyring.get_password(KEYRING_SERVICE, KEYRING_USER)
    except Exception:  # noqa: BLE001 - no keyring backend is the same as no token there
        stored = None
    if stored:
        return stored
    from huggingface_hub import get_token
    return get_token()


def offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` is set to a true value."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def hub_errors(what: str) -> Iterator[None]:
    """Turn every ``huggingface_hub`` / network failure inside the block into a :class:`HubError` about ``what``.

    Raises:
        HubOffline: offline mode, or the hub could not be reached.
        HubError: no such repository or file, a gated repository without access, a token the hub rejects,
            any other HTTP error.
    """
    import httpx2
    from huggingface_hub import errors as e

    if offline():
        raise HubOffline(f"{what}: offline mode is on (HF_HUB_OFFLINE); downloaded models still work "
                         "(`engine models` lists them)")
    try:
        yield
    except e.GatedRepoError as exc:
        has = "your token has no access yet" if token() else "no token is set"
        raise HubError(f"{what}: the repository is gated and {has}: accept its terms on the hub, then set HF_TOKEN "
                       "(or store a token in the settings)") from exc
    except e.RepositoryNotFoundError as exc:
        raise HubError(f"{what}: no such repository on {endpoint()} (or it is private and the token has no "
                       "access)") from exc
    except (e.RemoteEntryNotFoundError, e.RevisionNotFoundError) as exc:
        raise HubError(f"{what}: no such file in the repository") from exc
    except (e.OfflineModeIsEnabled, httpx2.ConnectError, httpx2.TimeoutException, httpx2.NetworkError) as exc:
        raise HubOffline(f"{what}: the hub at {endpoint()} cannot be reached ({type(exc).__name__}); downloaded "
                         "models still work (`engine models` lists them)") from exc
    except e.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        if status == 401:
            raise HubError(f"{what}: the hub rejected the token (HTTP 401, invalid credentials): check HF_TOKEN "
                           "or the token in the settings") from exc
        raise HubError(f"{what}: the hub answered HTTP {status}: {str(exc).splitlines()[0]}") from exc
    except httpx2.TooManyRedirects as exc:
        raise HubError(f"{what}: the hub's redirects go round in a loop ({exc}); try again later or another "
                       "HF_ENDPOINT") from exc
    except httpx2.UnsupportedProtocol as exc:
        raise HubError(f"{what}: the hub address {endpoint()!r} is not an http:// or https:// URL (check "
                       "HF_ENDPOINT)") from exc
    except httpx2.RequestError as exc:
        raise HubError(f"{what}: the transfer failed ({type(exc).__name__}: {exc}); try again") from exc


@dataclass(frozen=True)
class RepoListing:
    """A repository's GGUF files as the hub lists them now.

    Attributes:
        repo: ``owner/name``. commit: the commit the listing is of (downloads pin it).
        models: the text-model GGUFs (not mmproj, not split parts), by name. mmproj: the projector GGUFs.
        split: names of split GGUF parts (listed, not loadable). gated: the repository is gated.
    """

    repo: str
    commit: str
    models: tuple[HubFile, ...]
    mmproj: tuple[HubFile, ...]
    split: tuple[str, ...]
    gated: bool


def list_repo(repo: str) -> RepoListing:
    """The live listing of ``repo``: every ``.gguf`` file with its size and LFS sha256.

    Raises:
        HubError: see :func:`hub_errors`; also a repository that holds no GGUF file.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    from .catalogue import is_mmproj, is_split
    try:
        validate_repo_id(repo)
        valid = repo.count("/") == 1
    except HFValidationError:
        valid = False
    if not valid:
        raise HubError(f"{repo!r} is not a repository id: expected owner/name (letters, digits, '-', '_', '.'), "
                       "e.g. unsloth/Qwen3.6-35B-A3B-GGUF")
    with hub_errors(repo):
        info = HfApi(endpoint=endpoint(), token=token() or False).model_info(repo, files_metadata=True)
    files = [HubFile(repo, s.rfilename, s.size, _sha256(s.lfs.sha256) if s.lfs is not None else None)
             for s in info.siblings or [] if s.rfilename.lower().endswith(".gguf") and _plain_path(s.rfilename)]
    if not files:
        raise HubError(f"{repo}: the repository holds no GGUF file (DeltaDesk loads GGUF models only)")
    whole = [f for f in files if not is_split(f.name)]
    return RepoListing(repo, info.sha or "main", tuple(f for f in whole if not is_mmproj(f.name)),
                       tuple(f for f in whole if is_mmproj(f.name)),
                       tuple(f.name for f in files if is_split(f.name)), bool(info.gated))


def _plain_path(name: str) -> bool:
    """True for a file path a repository can hold: relative, no ``..`` or empty parts, no backslash or NUL (a
    listing naming another is left out: its URL would leave the repository and its name the store)."""
    parts = name.split("/")
    return not any(p in ("", ".", "..") for p in parts) and "\\" not in name and "\0" not in name


def _sha256(value: object) -> str | None:
    """A listing's LFS sha256 when it is 64 hex digits (lower-cased), else None: the value names staging
    files, so anything else is treated as unknown (such a file is not downloaded)."""
    return value.lower() if isinstance(value, str) and re.fullmatch(r"[0-9a-fA-F]{64}", value) else None


def read_range(repo: str, filename: str, revision: str, start: int, stop: int) -> bytes:
    """Bytes ``[start, stop)`` of a file on the hub, by a ranged GET of its ``resolve`` URL (redirects followed).

    Raises:
        HubError: see :func:`hub_errors`; also an answer of another length than asked (a server that ignores
            ranges is read only up to ``stop``).
    """
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(repo, filename, revision=revision, endpoint=endpoint())
    headers = build_hf_headers(token=token() or False)
    headers.update({"Range": f"bytes={start}-{stop - 1}", "Accept-Encoding": "identity"})
    with hub_errors(f"{repo}/{filename}"), \
            get_session().stream("GET", url, headers=headers, follow_redirects=True) as response:
        hf_raise_for_status(response)
        skip = start if response.status_code == 200 else 0
        out = bytearray()
        for chunk in response.iter_bytes():
            out += chunk
            if len(out) >= skip + stop - start:
                break
    data = bytes(out[skip:skip + stop - start])
    if len(data) != stop - start:
        raise HubError(f"{repo}/{filename}: asked the hub for bytes {start}-{stop - 1}, got {len(data)} bytes")
    return data
