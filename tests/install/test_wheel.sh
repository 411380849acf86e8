#!/usr/bin/env bash
# The cohort wheel (scripts/build_wheel.sh) in a fresh virtual environment that sees Debian's torch
# (python3 -m venv --system-site-packages), installed with the environment's own pip from the file
# alone (--no-index): the modules import from the environment, not from the build tree; `python -m
# cohort.launch` passes torch.distributed.launch's argument; a 2-rank backend="cohort" DDP job runs under
# the environment's `cohort run` and under torchrun.
#   tests/install/test_wheel.sh BUILD_DIR SOURCE_DIR
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
python=${COHORT_PYTHON:-/usr/bin/python3}
work=$(mktemp -d "${TMPDIR:-/tmp}/cohort-wheel.XXXXXX")
trap 'rm -rf "$work"' EXIT
failures=0
pass() { echo "PASS: $*"; }
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
"$python" -c 'import build, venv' 2>/dev/null ||
  { echo "SKIP: $python lacks the 'build' or 'venv' module (apt-get install python3-build python3-venv)"; exit 77; }

wheel=$(PYTHON=$python "$src/scripts/build_wheel.sh" "$build") || { echo "FAIL: the wheel did not build" >&2; exit 1; }
pass "built $(basename "$wheel")"
"$python" -m venv --system-site-packages "$work/venv"
venv=$work/venv
unset PYTHONPATH
"$venv/bin/pip" install -q --no-index "$wheel" || { echo "FAIL: pip install of the wheel" >&2; exit 1; }
pass "pip installed the wheel into a fresh venv"
where=$(cd "$work" && "$venv/bin/python" -c 'import cohort_torch, cohort_ps; print(cohort_torch.__file__)')
[[ $where == "$venv"/* ]] && pass "cohort_torch imports from the venv ($where)" || fail "cohort_torch came from $where"
# Horovod's API from the wheel: a script started alone is a world of one (docs/horovod.md).
out=$(cd "$work" && "$venv/bin/python" -c 'import torch, cohort.horovod.torch as hvd; hvd.init()
print(hvd.__file__, hvd.size(), hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist())' 2>&1) && rc=0 || rc=$?
[[ $rc == 0 && $out == "$venv"/*" 1 [1.0, 1.0]" ]] && pass "cohort.horovod.torch runs from the venv" ||
  fail "cohort.horovod.torch from the venv (exit $rc): $out"
# `import horovod.torch`: cohort's where no Horovod is installed (cohort-horovod.pth puts its folder at the
# end of sys.path), and an installed Horovod's once there is one, with no file of it overwritten.
out=$(cd "$work" && "$venv/bin/python" -c 'import horovod.torch as hvd; print(hvd.__name__, hvd.__file__)' 2>&1) && rc=0 || rc=$?
[[ $rc == 0 && $out == "cohort.horovod.torch $venv"/* ]] && pass "import horovod.torch is cohort's in the venv" ||
  fail "import horovod.torch in the venv (exit $rc): $out"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/horovod/torch"
echo "WHOSE = 'installed'" >"$site/horovod/__init__.py"
echo "import horovod; WHOSE = horovod.WHOSE" >"$site/horovod/torch/__init__.py"
out=$(cd "$work" && "$venv/bin/python" -c 'import horovod.torch as hvd; print(hvd.WHOSE)' 2>&1) && rc=0 || rc=$?
[[ $rc == 0 && $out == installed ]] && pass "an installed horovod is not shadowed" ||
  fail "with a horovod installed in the venv, import horovod.torch gave (exit $rc): $out"
rm -rf "$site/horovod"
[[ -x $venv/bin/cohort ]] && "$venv/bin/cohort" --version | grep -q "^cohort " && pass "the venv has bin/cohort" ||
  fail "no working bin/cohort in the venv"

# python3 -m cohort.launch: torch.distributed.launch's line; its workers run under the venv's python (its
# sys.executable) and get the local rank argument in that torch's spelling, before the script's own.
major=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split(".")[0])')
spelling=--local_rank
((major >= 2)) && spelling=--local-rank
printf 'import os, sys\nprint("launched", sys.executable, *sys.argv[1:], os.environ["RANK"])\n' >"$work/show.py"
# (COHORT_PYTHON, which ctest sets for this script, would name the workers' interpreter instead.)
out=$(cd "$work" && env -u COHORT_PYTHON timeout -k 5 60 "$venv/bin/python" -m cohort.launch --nproc_per_node 2 \
      --no-tag-output show.py --lr 1 2>&1) && rc=0 || rc=$?
[[ $rc == 0 && $out == *"launched $venv/bin/python $spelling=0 --lr 1 0"* &&
   $out == *"launched $venv/bin/python $spelling=1 --lr 1 1"* ]] &&
  pass "python -m cohort.launch passes $spelling=N and runs the venv's python" ||
  { fail "python -m cohort.launch (exit $rc)"; echo "$out" | tail -20 >&2; }

script=$src/tests/python/ddp_script.py
args=(--backend cohort --epochs 1 --samples 512)
out=$(cd "$work" && timeout -k 5 120 "$venv/bin/cohort" run --nproc-per-node 2 --python "$venv/bin/python" "$script" "${args[@]}" \
      --out "$work/run.pt" 2>&1) && rc=0 || rc=$?
[[ $rc == 0 && -s $work/run.pt ]] && pass "2 ranks under the venv's cohort run" ||
  { fail "2 ranks under the venv's cohort run (exit $rc)"; echo "$out" | tail -20 >&2; }

# torchrun: torch's own for torch 2.x; Debian 12's (torch 1.13 on Python 3.11) dies before starting
# workers, so there the project's fixed copy (bench/peers/torchrun311.py) is the torchrun.
major=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split(".")[0])')
port=$("$venv/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
if ((major >= 2)); then
  launcher=("$venv/bin/python" -m torch.distributed.run --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port")
elif [[ -e $src/bench/peers/torchrun311.py ]]; then
  launcher=("$venv/bin/python" "$src/bench/peers/torchrun311.py" --master_addr 127.0.0.1 --master_port "$port")
else
  launcher=()
  echo "SKIP: torchrun (torch 1.13's torchrun does not start on Python 3.11 and bench/peers/torchrun311.py is absent)"
fi
if ((${#launcher[@]})); then
  out=$(cd "$work" && timeout -k 5 120 "${launcher[@]}" --nproc_per_node 2 "$script" "${args[@]}" --out "$work/torchrun.pt" 2>&1) && rc=0 || rc=$?
  [[ $rc == 0 && -s $work/torchrun.pt ]] && pass "2 ranks under torchrun with the venv's cohort_torch" ||
    { fail "2 ranks under torchrun (exit $rc)"; echo "$out" | tail -20 >&2; }
fi
((failures == 0)) || { echo "$failures check(s) failed" >&2; exit 1; }
