#!/usr/bin/env bash
# Builds the wheel twice, with the compiled module and pure Python (DTP_BUILD_EXTENSION=0),
# installs each into a directory of its own and checks it from outside the checkout with
# the virtual environment's torch: build_info(), the op on the CPU, DTPPruner on a small
# model and export, `dtp paper` listing the packaged recipes, and the `dtp` console script
# on the digits recipe. `make check-wheel` runs it; CI runs it after the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

wheel() {  # out dir; the environment chooses compiled or pure
  rm -rf build/lib.* build/bdist.*  # a stale build/lib would put the old module in the wheel
  "$PY" -m pip wheel --no-build-isolation --no-deps --quiet -w "$1" .
}

check() {  # wheel dir, 1 when the wheel must hold the compiled module
  local wheel_file site=$WORK/site_$2
  wheel_file=$(ls "$1"/dtp_kernels-*.whl)
  "$PY" - "$wheel_file" "$2" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
compiled = any(n.startswith("dtp_kernels/_C.") and not n.endswith(".pyi") for n in names)
assert compiled == (sys.argv[2] == "1"), f"compiled module in the wheel: {compiled}"
assert "dtp_kernels/_C.pyi" in names, "_C.pyi missing: the compiled module's hints"
assert "dtp_kernels/configs/paper/table1_resnet56_cifar10.yaml" in names, "recipes missing"
assert "dtp_kernels/py.typed" in names, "py.typed missing: type checkers would skip the hints"
EOF
  "$PY" -m pip install --quiet --no-deps --no-index --target "$site" "$wheel_file"
  cd "$WORK"
  PYTHONPATH=$site COMPILED=$2 "$PY" - <<'EOF'
import os

import torch

import dtp_kernels

compiled = os.environ["COMPILED"] == "1"
assert dtp_kernels.__file__.startswith(os.environ["PYTHONPATH"]), dtp_kernels.__file__
info = dtp_kernels.build_info()
assert info["extension_loaded"] == compiled, info
backends = dtp_kernels.available_backends("cpu")
assert ("cpu" in backends) == compiled and backends[-1] == ("cpu" if compiled else "torch")
state = dtp_kernels.TransportState([5, 3])
scores = torch.rand(8, requires_grad=True)
mask = dtp_kernels.transport_mask(scores, [2.0, 1.0], state)
mask.sum().backward()
assert abs(float(mask.detach().sum()) - 3.0) < 1e-4 and scores.grad is not None
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3)
)
small = dtp_kernels.DTPPruner(model, torch.randn(1, 3, 8, 8), 0.5).export()
assert small[0].out_channels == 4
print(f"wheel {dtp_kernels.__version__} ({'compiled' if compiled else 'pure Python'}):", backends)
EOF
  # the listing whole, then searched: `| grep -q` can close the pipe mid-listing, and the
  # writer's BrokenPipeError would fail the check under pipefail
  listing=$(PYTHONPATH=$site "$site/bin/dtp" paper)
  grep -q table1-resnet56 <<<"$listing"
  PYTHONPATH=$site "$site/bin/dtp" prune --no-progress --out "$WORK/run_$2" \
    --set pretrain.epochs=1 --set prune.epochs=1 --set finetune.epochs=1 >"$WORK/run_$2.log"
  test -f "$WORK/run_$2/summary.json"
  echo "dtp prune from the $([ "$2" = 1 ] && echo compiled || echo pure) wheel: ok"
  cd - >/dev/null
}

DTP_BUILD_EXTENSION=0 wheel "$WORK/pure"
wheel "$WORK/compiled"
check "$WORK/pure" 0
check "$WORK/compiled" 1
