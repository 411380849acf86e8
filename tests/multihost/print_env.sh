#!/bin/sh
# Worker for the launcher tests: one line with what the launcher gave this process.
echo "rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE local_world=$LOCAL_WORLD_SIZE node=$GROUP_RANK host=$(hostname) master=$MASTER_ADDR:$MASTER_PORT store=$COHORT_STORE_ADDR"
