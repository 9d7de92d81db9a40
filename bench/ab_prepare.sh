#!/usr/bin/env bash
# Same-run baselines: puts revision REV's code (jaxspec/, pallas_kernels/, bench/) under .base/
# (git-ignored), so one device call can time REV and the working tree side by side.
# Usage (from the repo root):  bash bench/ab_prepare.sh [REV, default HEAD]
# Then the device call must carry ".base" (ignored paths travel only when named in carry), and
# each command runs from the tree it times (`bash bench/gpu_plan.sh ab` does it for jaxspec-bench): `python -m` puts the current directory first on
# sys.path, ahead of PYTHONPATH, so running the base's module from the repo root runs the
# working tree's code instead. For example:
#   for t in base new; do d=$PWD; [ $t = base ] && d=$PWD/.base
#     (cd $d && PYTHONPATH=$d python3 -m bench.bench_decode --only smollm2-135m) > $OUT/$t.txt
#   done
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
rev=${1:-HEAD}
mkdir -p .git/info
grep -qx '/.base/' .git/info/exclude 2>/dev/null || echo '/.base/' >> .git/info/exclude
rm -rf .base && mkdir .base
git archive "$rev" jaxspec pallas_kernels bench | tar -x -C .base
ln -s ../checkpoints .base/checkpoints     # the shipped head, found next to the package
echo "$(git rev-parse --short "$rev")" > .base/REV
echo ".base/ holds $(cat .base/REV) ($(du -sh .base | cut -f1)); carry [\".base\"] in the device call"
