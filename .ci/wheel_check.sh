#!/usr/bin/env bash
# The built wheel on its own (issue #36 point 8): build mixprec's wheel, install it into a bare
# venv (nothing but the wheel and the dependencies it declares), and run `mixprec test` (ddp and
# zero2 on 2 processes) and docs/quickstart.md's zero3 block there, outside the repository so
# the installed package is what runs. A dependency the code needs but the wheel does not
# declare (numpy, which torch's object collectives need) fails here, not on a user's machine.
#
#   bash .ci/wheel_check.sh          # PYTHON=... picks the interpreter that builds (default .venv's)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" -m pip wheel -q --no-build-isolation --no-deps "$ROOT" -w "$work/dist"
base="$("$PY" -c 'import sys; print(sys._base_executable)')"
"$base" -m venv "$work/bare"
"$work/bare/bin/python" -m pip install -q "$work"/dist/mixprec-*.whl
echo "bare venv holds: $("$work/bare/bin/python" -m pip list --format=freeze | tr '\n' ' ')"
cd "$work"
"$work/bare/bin/mixprec" test
"$work/bare/bin/mixprec" config --backend zero3 --mixed-precision bf16 -o mixprec.yaml
"$work/bare/bin/mixprec" launch --config-file mixprec.yaml --nproc-per-node 2 "$ROOT/examples/train_transformer.py" --steps 30
echo "wheel check: OK"
