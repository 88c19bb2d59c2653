#!/usr/bin/env bash
# A second version of the package beside the working tree, for timing two versions in one
# device command (the GPU machine has no git): `bash bench/ab_tree.sh COMMIT [DIR]` writes
# COMMIT's package and bench/ into DIR (default abtree/, untracked: the device tool copies
# it with the tree). On the GPU machine, after the working tree's own steps:
#
#   (cd abtree && TAG=ab STEPS="glabwd train" ... bash bench/gpu_session.sh)
#
# gpu_session.sh imports the folder it runs in as `linattn` and packs its results into
# $OUT/ab.tar.gz. Renderings of specs outside the registry are named by their text's hash
# in LINATTN_GEN_DIR, so the two versions may share it. Delete DIR when done.
set -eu
commit=$1; dir=${2:-abtree}
rm -rf "$dir" && mkdir -p "$dir"
git archive "$commit" __init__.py cli codegen dsl generated ops distributed.py pyproject.toml \
  bench tests | tar -x -C "$dir"
echo "$dir: $(git rev-parse --short "$commit")"
