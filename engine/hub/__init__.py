"""Real models from the Hugging Face hub: the shipped catalogue, the live listing of any repository, the fit
of a file on this machine from its header (fetched with ranged reads, before downloading), and verified,
resumable downloads into the user data dir.

Modules: :mod:`.catalogue` (the data file and file-name rules), :mod:`.hubapi` (huggingface_hub calls and
their errors), :mod:`.fit` and :mod:`.machine` (the estimate), :mod:`.download` (header, fit, transfer),
:mod:`.store` (what is downloaded, ``REPO:QUANT`` names), :mod:`.cli` (``pull``, ``models``).
"""
