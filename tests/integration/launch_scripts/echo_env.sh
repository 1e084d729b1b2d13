#!/bin/sh
# Worker for --no-python: write "RANK WORLD_SIZE SHMCACHE_SESSION args..." to $1/rank-$RANK.txt
out_dir=$1
shift
echo "$RANK $WORLD_SIZE $SHMCACHE_SESSION $*" > "$out_dir/rank-$RANK.txt"
