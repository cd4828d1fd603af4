"""``python -m engine pull REPO [--file NAME | --quant Q]`` and ``python -m engine models``.

``pull`` lists the repository live, reads the header of each candidate file with ranged requests, prints
the fit estimate (:mod:`engine.hub.fit`) and downloads the chosen file and its vision tower with a
progress bar; it asks nothing. Without ``--file`` / ``--quant`` it takes the file :func:`recommend` picks.
``models`` lists what is downloaded (no network).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from ..errors import EngineError
from .download import Progress, download_model, fit_remote, pick_file, pick_mmproj
from .fit import GIB, Fit, recommend
from .hubapi import list_repo
from .machine import this_machine
from .store import ModelStore


def _bar() -> Callable[[Progress], None]:
    """A one-line progress bar on stderr: stage, bytes, rate, ETA; redrawn as :class:`Progress` arrives."""
    state = {"file": None}

    def show(p: Progress) -> None:
        if state["file"] not in (None, (p.file, p.stage)):
            print(file=sys.stderr)
        state["file"] = (p.file, p.stage)
        frac = p.done / p.total if p.total else 1.0
        eta = f"{p.eta:.0f} s left" if p.eta is not None else ""
        print(f"\r[{p.stage} {p.file}] [{'#' * int(24 * frac):<24}] {p.done / 2**20:.0f}/{p.total / 2**20:.0f} MiB "
              f"{p.rate / 2**20:.1f} MiB/s {eta}   ", end="", file=sys.stderr, flush=True)
    return show


def _fits(args: argparse.Namespace, listing, machine, mmproj) -> dict[str, Fit]:
    """name -> fit of the file the flags name, or of every model file of the listing."""
    if args.file or args.quant:
        files = [pick_file(listing, args.file, args.quant)]
    else:
        files = list(listing.models)
    out: dict[str, Fit] = {}
    for f in files:
        try:
            out[f.name] = fit_remote(listing, f, mmproj, args.context, machine)
        except EngineError as exc:
            if len(files) == 1:
                raise
            print(f"[skipped {f.name}: {exc}]", file=sys.stderr)
    return out


def cmd_pull(args: argparse.Namespace) -> int:
    """Fit, then download; exit status 2 with one line on stderr on any error. ``REPO:QUANT`` (the name
    ``--model`` takes) stands for ``REPO --quant QUANT``."""
    if args.context < 1:
        raise EngineError(f"--context must be at least 1 token, got {args.context}")
    repo, _, quant = args.repo.partition(":")
    if quant and not (args.file or args.quant):
        args.quant = quant
    listing = list_repo(repo)
    mmproj = None if args.no_mmproj else pick_mmproj(listing)
    machine = this_machine(int(args.vram_budget * GIB) if args.vram_budget else None)
    print(f"[{listing.repo} at {listing.commit[:12]}: {len(listing.models)} model files, "
          f"{len(listing.mmproj)} mmproj; this machine: {machine.ram_bytes / GIB:.1f} GiB RAM, stream read "
          f"{machine.bandwidth_gbps:.1f} GB/s]", file=sys.stderr)
    fits = _fits(args, listing, machine, mmproj)
    for name, fit in fits.items():
        print(f"  {name}: {fit.summary()}", file=sys.stderr)
    chosen = next(iter(fits)) if (args.file or args.quant) else recommend(fits)
    if not fits:
        print(f"error: {listing.repo}: none of its {len(listing.models)} model files can be used here (the reasons "
              "are above)", file=sys.stderr)
        return 2
    if chosen is None:
        print(f"error: {listing.repo}: no file fits this machine's RAM; name one with --quant or --file to "
              "download it anyway", file=sys.stderr)
        return 2
    fit = fits[chosen]
    print("\n".join(f"    {line}" for line in fit.details()), file=sys.stderr)
    if fit.verdict == "does not fit":
        print(f"[warning: {chosen} does not fit this machine's RAM: decode would read weights from disk]",
              file=sys.stderr)
    f = next(x for x in listing.models if x.name == chosen)
    t0 = time.monotonic()
    entry = download_model(listing, f, mmproj, ModelStore(), _bar())
    print(file=sys.stderr)
    print(f"[downloaded {entry.name} ({entry.size / GIB:.2f} GiB, sha256 verified"
          f"{', with ' + entry.mmproj if entry.mmproj else ''}) in {time.monotonic() - t0:.0f} s]", file=sys.stderr)
    print(f"[use it: python -m engine chat --model {entry.name}]", file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """Print the downloaded models: name, size, quant, last used, path."""
    store = ModelStore()
    models = store.models()
    if not models:
        print(f"no models downloaded yet (in {store.root}); `python -m engine pull REPO` fetches one")
        return 0
    for d in models:
        used = time.strftime("%Y-%m-%d %H:%M", time.localtime(d.last_used)) if d.last_used else "never"
        path, mmproj = store.files(d)
        print(f"{d.name:60s} {d.size / GIB:7.2f} GiB  {d.quant or '-':10s} last used {used}  {path}"
              + (f" + {mmproj.name}" if mmproj else ""))
    return 0


def add_pull(p: argparse.ArgumentParser) -> None:
    """``pull``'s arguments."""
    p.add_argument("repo", help="hub repository, e.g. unsloth/Qwen3.6-35B-A3B-GGUF (REPO:QUANT names the quant)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--file", help="the GGUF file to download (its name in the repository)")
    which.add_argument("--quant", help="the quant to download, e.g. Q4_K_M or UD-Q4_K_XL")
    p.add_argument("--context", type=int, default=8192, help="context window the fit is computed for, tokens")
    p.add_argument("--vram-budget", type=float, default=None, help="GPU VRAM budget for the fit, GiB (default: "
                   "no GPU)")
    p.add_argument("--no-mmproj", action="store_true", help="do not download the vision tower")


def add_models(p: argparse.ArgumentParser) -> None:
    """``models`` takes no arguments."""
