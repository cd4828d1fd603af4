# Sourced by scripts/run and scripts/test (not run on its own): the project's venv, installed only
# when needed. Needs bash with `set -euo pipefail` and the repository root as the working dir.
#
# deltadesk_venv SPEC: make sure "${DELTADESK_VENV:-.venv}" exists and holds `pip install -e SPEC`
# (SPEC: "." or ".[dev]") for the current install-defining files; sets $venv to its path.
# The editable install serves Python edits as they are made; only the files that define the
# install (pyproject.toml, setup.py, native/cpu/: the cffi build script and the C sources and
# headers it compiles) need a reinstall. A hash of those files, of the venv's Python version and of
# this checkout's path is kept per SPEC in $venv/deltadesk-install[-dev].sha256 after an install
# that built the native CPU kernels (engine/_native_cpu*.so, built into the checkout). An install
# runs when the venv is new (old stamps are dropped), the hash differs or the kernels are missing;
# an install that fails, or builds no kernels (no C compiler: the engine then uses its numpy
# fallback), writes no stamp, so the next launch installs again.

deltadesk_native_built() {
    compgen -G "engine/_native_cpu*.so" > /dev/null
}

deltadesk_venv() {
    local spec="$1"
    venv="${DELTADESK_VENV:-.venv}"
    if [ ! -x "$venv/bin/python" ]; then
        rm -f "$venv"/deltadesk-install*.sha256
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
    fi
    local tag="${spec//[^a-z]/}"
    local stamp="$venv/deltadesk-install${tag:+-$tag}.sha256"
    local want
    want="$("$venv/bin/python" - <<'PY'
import hashlib, os, pathlib, sys
h = hashlib.sha256(f"{sys.version}\0{os.getcwd()}\0".encode())
native = pathlib.Path("native/cpu")
for path in sorted([pathlib.Path("pyproject.toml"), pathlib.Path("setup.py"),
                    *native.rglob("*.py"), *native.rglob("*.c"), *native.rglob("*.h")]):
    h.update(f"{path}\0".encode() + path.read_bytes() + b"\0")
print(h.hexdigest())
PY
)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! deltadesk_native_built; then
        echo "DeltaDesk: installing into $venv and building the native CPU kernels (a few minutes; once)" >&2
        "$venv/bin/python" -m pip install -q -e "$spec"
        if deltadesk_native_built; then
            printf '%s\n' "$want" > "$stamp"
        else
            echo "warning: the native CPU kernels were not built (is a C compiler installed?): the engine" \
                 "uses its slower numpy fallback, and the next launch installs again" >&2
        fi
    fi
}
