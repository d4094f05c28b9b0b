#!/usr/bin/env bash
# Everything a lent GPU is for, in one run: build the extension against that machine's
# torch, run the GPU test suite, then the GPU benchmarks. The logs and benchmarks/results
# go to $OUT/session.tar (one file: the device tool brings back at most 8), written again
# after every step.
#
#   OUT=/tmp/gpu bash tools/gpu_session.sh [tests|host|bench|train|vit|moe|pipeline|pipeline-compiled|profile-pipeline|scale|op-errors|all]...
#
# tests: every test marked cuda but not slow (on $WORKERS pytest-xdist workers, default 4)
# and, at the same time, `dtp prune` on the GPU (tests/pipeline/test_pipeline_gpu.py, on 3
# more workers): neither times anything, so they share the GPU; host: the mask step's and
# the pruner's host cost; bench: the kernel benchmarks, the compensated bfloat16 optimizer
# step (bench_compensated_optim.py) and host; train: the training step
# (eager, CUDA graph, profiled; DTP with folded masks, each GPU backend); vit: a ViT step
# with head and neuron masks (bench_vit_step.py); moe: a Mixtral step with expert and head
# masks, grouped_mm and eager (bench_moe_step.py; transformers, in .whl if absent); scale: mask-step scaling, iterations,
# N:M steps with each kernel's share (profile_nm_step.py) and 2:4 semi-structured
# layers; pipeline: whole epochs with the data loader (bench_pipeline.py);
# pipeline-compiled: the same under torch.compile (not in all: its
# four compilations take minutes; on an H200, run 11, the ResNet-56 workload and part of
# ResNet-50's took 300 s; run 12's ResNet-56 alone at 5 rounds had not finished after
# 211 s); PIPELINE_WORKLOADS=resnet56 (or torchvision.resnet50) runs one
# workload in either, PIPELINE_ROUNDS sets the rounds (default 3);
# profile-pipeline: the CIFAR ResNet-56 step of `pipeline` profiled, eager and compiled
# (profile_training_step.py --workload resnet56 [--compile]); op-errors: the native
# backtrace (cuda-gdb, which runs host programs there) of a CUDA op called with a bad
# argument, which ends the process with SIGSEGV on the H200 (gpu_tests_cuda.md, run 13);
# all: every other one.
# Benchmarks run one at a time, after the tests.
#
# The build is skipped when csrc/ and setup.py are unchanged since the last build on the
# same machine (a second call on a warm machine starts at once). On an H200 (2026-11-27,
# run 10) `tests pipeline host train` took 410 s: build 64 s, tests 123 s (the unit GPU
# tests 92 s beside `dtp prune` 114 s), pipeline 129 s, host 25 s, train 53 s. With 15
# minutes of device time, name the steps in the order they matter; SECONDS_LEFT (below)
# keeps the call inside the tool's limit, and a second call on the warm machine (it
# waits only 30 s) can take the rest.
#
# The GPU machine has torch, Triton and nvcc but no package index: wheels it lacks travel
# in .whl/ and are installed to /tmp/site first. Of this project's needs, that machine
# lacked only Torch-Pruning (2026-11-27): fetch it here with
#   pip download --no-deps -d .whl torch-pruning==1.6.1
# (2026-12-04: it had torch 2.11.0, timm 1.0.31 and transformers 5.17.0, not the pinned
# 5.24.0; carrying transformers means carrying huggingface-hub, tokenizers and their
# dependencies too.) A fresh machine builds the extension in about 80 s.
# (others, if a later image lacks them: pyyaml==6.0.4 tqdm==4.70.1 scikit-learn==1.9.1,
# torchvision, pillow; timm, safetensors and huggingface-hub for `vit`).
set -u -o pipefail
start=$(date +%s)
names=()  # PIPELINE_WORKLOADS="resnet56 torchvision.resnet50": only these, in both pipeline steps
for name in ${PIPELINE_WORKLOADS:-}; do names+=(--workload "$name"); done
OUT=${OUT:-/tmp/gpu_session}
LOGS=$(mktemp -d)/logs
mkdir -p "$OUT" "$LOGS"
save() { tar -cf "$OUT/session.tar" -C "$(dirname "$LOGS")" logs -C "$PWD" benchmarks/results; }
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
steps=${*:-all}

if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
} 2>&1 | tee "$LOGS/env.txt"

t0=$(date +%s)
stamp=build/gpu_session.stamp
sources=$(cat setup.py csrc/* | sha256sum | cut -d' ' -f1)
if [ "$(cat $stamp 2>/dev/null)" = "$sources" ] && ls dtp_kernels/_C*.so >/dev/null 2>&1; then
  echo "build: unchanged sources, skipped"
else
  MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} DTP_BUILD_CUDA=1 \
    $PY setup.py --quiet build_ext --inplace >"$LOGS/build.log" 2>&1 || {
    tail -60 "$LOGS/build.log"
    save
    exit 1
  }
  mkdir -p build && echo "$sources" >$stamp
  echo "build: $(($(date +%s) - t0)) s"
fi
$PY -c "import dtp_kernels as d; print(d.build_info()); print(d.available_backends('cuda'))"

# Every step ends by $SECONDS_LEFT seconds after the script started (default 570, inside
# the device tool's 600-second command limit): a step gets what is left, and one that
# would get under 20 s is skipped, so what ran is saved before the call is cut off.
deadline=$((start + ${SECONDS_LEFT:-570}))
run() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local t=$(date +%s)
  local left=$((deadline - t - 5))
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped, ${left} s left"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  # to a file, not through a pipe: a grandchild left running at the time limit (torchrun's
  # workers) would hold a pipe open and the step would never end
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 40 "$LOGS/$name.log"
  echo "$name: rc $rc, $(($(date +%s) - t)) s"
  save  # after every step: a call cut off keeps what ran
}

for step in $steps; do
  case $step in
  tests | all)
    run test_pipeline_gpu 300 $PY -m pytest -q -rs --tb=short -p no:cacheprovider -n 3 \
      tests/pipeline/test_pipeline_gpu.py >"$LOGS/test_pipeline_gpu.status" &
    run test_gpu 300 $PY -m pytest -q -rs --tb=short -p no:cacheprovider -n "${WORKERS:-4}" \
      -m "cuda and not slow" tests
    wait
    tail -3 "$LOGS/test_pipeline_gpu.status"
    ;;&
  host | bench | all)
    run bench_host_cost 120 $PY benchmarks/bench_host_cost.py --device cuda
    run bench_pruner_host 90 $PY benchmarks/bench_pruner_host.py --device cuda
    ;;&
  bench | all)
    run bench_transport 120 $PY benchmarks/bench_transport.py --device cuda
    run bench_epilogue 120 $PY benchmarks/bench_epilogue.py --device cuda
    run bench_compensated_optim 120 $PY benchmarks/bench_compensated_optim.py --device cuda
    ;;&
  train | all)
    fold=(--provider fold/cuda --provider fold/triton)
    # TRAIN_ROUNDS: the eager step's interleaved rounds (default 20; its spread on an H200
    # host needs about 100 to resolve 0.5%: 20 rounds took 23 s there)
    run bench_training_step 150 $PY benchmarks/bench_training_step.py --device cuda "${fold[@]}" \
      --rounds "${TRAIN_ROUNDS:-20}"
    run bench_training_graph 150 $PY -X faulthandler benchmarks/bench_training_step.py \
      --device cuda --graph "${fold[@]}"
    run profile_training_step 90 $PY benchmarks/profile_training_step.py --python
    ;;&
  vit | all)
    run bench_vit_step 200 $PY benchmarks/bench_vit_step.py --device cuda --rounds 50 --save
    ;;&
  moe | all)
    run bench_moe_step 200 $PY benchmarks/bench_moe_step.py --device cuda --rounds 30 --save
    ;;&
  pipeline | all)
    run bench_pipeline 400 $PY benchmarks/bench_pipeline.py --device cuda \
      --rounds "${PIPELINE_ROUNDS:-3}" "${names[@]}"
    ;;&
  pipeline-compiled)
    run bench_pipeline_compiled 500 $PY benchmarks/bench_pipeline.py --device cuda --compile \
      --rounds "${PIPELINE_ROUNDS:-3}" "${names[@]}"
    ;;&
  profile-pipeline)
    # where the CIFAR ResNet-56 epoch's DTP overhead goes, eager and compiled
    run profile_resnet56 120 $PY benchmarks/profile_training_step.py --workload resnet56
    run profile_resnet56_compiled 240 $PY benchmarks/profile_training_step.py \
      --workload resnet56 --compile
    ;;&
  op-errors)
    run op_error_backtrace 150 cuda-gdb -q -batch \
      -ex run -ex bt -ex "info registers rip" -ex "x/8i \$pc-16" --args $PY -c "
import torch, dtp_kernels
s = torch.rand(8, device='cuda'); o = torch.arange(3, device='cuda') * 4
k, e = torch.full((2,), 2.0, device='cuda'), torch.full((2,), 0.5, dtype=torch.float64, device='cuda')
try:
    torch.ops.dtp.transport_mask(s, o, k, e, torch.zeros(8, device='cuda'), torch.zeros(2, device='cuda'), 1, False, 0, 5)
except RuntimeError as error:
    print('raised:', error)"
    ;;
  scale | all)
    run bench_nm_step 120 $PY benchmarks/bench_nm_step.py --device cuda --rounds 5
    run profile_nm_step 90 $PY benchmarks/profile_nm_step.py --device cuda
    run bench_semi_structured 120 $PY benchmarks/bench_semi_structured.py --device cuda
    run bench_scaling 120 $PY benchmarks/bench_scaling.py --device cuda --rounds 5
    run bench_iterations 90 $PY benchmarks/bench_iterations.py --device cuda --rounds 5
    ;;
  esac
done
