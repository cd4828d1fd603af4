"""Real models from the Hugging Face hub: the shipped catalogue, the live listing of any repository, the fit
of a file on this machine from its header (fetched with ranged reads, before downloading), and verified,
resumable downloads into the user data dir.

Modules: :mod:`.catalogue` (the data file and file-name rules), :mod:`.hubapi` (huggingface_hub calls and
their errors), :mod:`.fit` and :mod:`.machine` (the estimate), :mod:`.download` (header, fit, transfer),
:mod:`.store` (what is downloaded, ``REPO:QUANT`` names), :mod:`.cli` (``pull``, ``models``). The app uses
the names imported here.
"""

from .catalogue import CatalogueModel, HubFile, catalogue, quant_of
from .download import DownloadCancelled, Progress, download_model, fit_remote, pick_file, pick_mmproj
from .fit import Fit, Machine, estimate_from_size, recommend
from .hubapi import KEYRING_SERVICE, KEYRING_USER, HubError, HubOffline, RepoListing, list_repo
from .machine import this_machine
from .store import Downloaded, ModelStore, delete_model, model_files

__all__ = ["KEYRING_SERVICE", "KEYRING_USER", "CatalogueModel", "DownloadCancelled", "Downloaded", "Fit", "HubError",
           "HubFile", "HubOffline", "Machine", "ModelStore", "Progress", "RepoListing", "catalogue", "delete_model",
           "download_model", "estimate_from_size", "fit_remote", "list_repo", "model_files", "pick_file", "pick_mmproj",
           "quant_of", "recommend", "this_machine"]
