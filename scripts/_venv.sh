# Sourced by scripts/run and scripts/test (not run on its own): the project's venv, installed only
# when needed. Needs bash with `set -euo pipefail` and the repository root as the working dir.
#
# deltadesk_venv SPEC: make sure "${DELTADESK_VENV:-.venv}" exists and holds `pip install -e SPEC`
# (SPEC: "." or ".[dev]") for the current install-defining files; sets $venv to its path.
# The editable install serves Python edits as they are made; only the files that define the
# install (pyproject.toml, setup.py, native/cpu/: the cffi build script and the C sources and
# headers it compiles) need a reinstall. A hash of those files is kept per SPEC in
# $venv/deltadesk-install[-dev].sha256 after a successful install; an install runs when the venv
# is new or that hash differs. A failed or interrupted install writes no stamp, so the next
# launch installs again.

deltadesk_venv() {
    local spec="$1"
    venv="${DELTADESK_VENV:-.venv}"
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
        "$venv/bin/python" -m pip install -q --upgrade pip
    fi
    local tag="${spec//[^a-z]/}"
    local stamp="$venv/deltadesk-install${tag:+-$tag}.sha256"
    local want
    want="$("$venv/bin/python" - <<'PY'
import hashlib, pathlib
h = hashlib.sha256()
native = pathlib.Path("native/cpu")
for path in sorted([pathlib.Path("pyproject.toml"), pathlib.Path("setup.py"),
                    *native.glob("*.py"), *native.glob("*.c"), *native.glob("*.h")]):
    h.update(f"{path}\0".encode() + path.read_bytes() + b"\0")
print(h.hexdigest())
PY
)"
    if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        "$venv/bin/python" -m pip install -q -e "$spec"
        printf '%s\n' "$want" > "$stamp"
    fi
}
