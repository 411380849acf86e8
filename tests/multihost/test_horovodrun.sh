# horovodrun's line across the 4 hosts: `horovodrun -np 8 -H h0:2,h1:2,h2:2,h3:2 -p 22 --network-interface eth0
# python3 <a Horovod script>`, started on h0. Each rank's hvd.rank/size/local_*/cross_* must equal the
# HOROVOD_* variables it got (cross size 4: one rank of each local rank per host), HOROVOD_HOSTNAME its host,
# `import horovod.torch` cohort's (PYTHONPATH reaches the other hosts as horovodrun forwards its environment),
# and an allreduce over the 8 ranks must add up. Then no process of the job is left on any host.
source "$(dirname "$0")/lib.sh"
require_command horovodrun
MODULES=${COHORT_BUILD_DIR:-}/integrations/python
if ! ls "$MODULES"/cohort_torch*.so >/dev/null 2>&1; then echo "SKIP: cohort_torch not built (no torch)"; exit 77; fi
HOROVODRUN=$(dirname "$COHORT")/horovodrun
WORKER=$(cd "$MH_DIR/../python" && pwd)/hvd_launch_worker.py

out=$(on_host 0 timeout -k 5 150 env PYTHONPATH="$MODULES" OMP_NUM_THREADS=1 "$HOROVODRUN" -np 8 -H h0:2,h1:2,h2:2,h3:2 \
  --ssh-command "$COHORT_CLUSTER_SSH" -p 22 --network-interface eth0 --start-timeout 60 --gloo \
  /usr/bin/python3 "$WORKER" 2>&1) && rc=0 || rc=$?
echo "$out"
expect_eq "horovodrun -np 8 over 4 hosts: exit code" "$rc" 0
missing=""
for ((r = 0; r < 8; r++)); do
  grep -q "^\[h$((r / 2)):$r\] HVD OK rank=$r$" <<<"$out" || missing+=" rank $r"
done
if [[ -z $missing ]]; then pass "every rank's hvd topology is the HOROVOD_* it got, on its host, and the allreduce adds up"
else fail "no HVD OK line from:$missing"; fi
# The same variables, without Python: cross rank = host index, cross size = 4.
out=$(on_host 0 timeout -k 5 60 "$HOROVODRUN" -np 8 -H h0:2,h1:2,h2:2,h3:2 --ssh-command "$COHORT_CLUSTER_SSH" \
  sh -c 'echo "hvd $HOROVOD_RANK $HOROVOD_LOCAL_RANK/$HOROVOD_LOCAL_SIZE $HOROVOD_CROSS_RANK/$HOROVOD_CROSS_SIZE $HOROVOD_HOSTNAME $(hostname)"' 2>&1) && rc=0 || rc=$?
expect_eq "horovodrun's variables over 4 hosts: exit code" "$rc" 0
for ((r = 0; r < 8; r++)); do
  expect_contains "rank $r's HOROVOD_* variables" "$out" "[h$((r / 2)):$r] hvd $r $((r % 2))/2 $((r / 2))/4 h$((r / 2)) h$((r / 2))"
done
expect_no_job_processes 5
finish
